#include "util/affinity.hpp"

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace dtrain {
namespace {

cpu_set_t& original_mask() {
  static cpu_set_t mask = [] {
    cpu_set_t m;
    CPU_ZERO(&m);
    sched_getaffinity(0, sizeof m, &m);
    return m;
  }();
  return mask;
}

}  // namespace

int64_t usable_cpus() { return std::max(1, CPU_COUNT(&original_mask())); }

int64_t intra_op_threads(int64_t configured, int64_t cpus, int64_t local_processes) {
  if (configured > 0) return configured;
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env && *env) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (n > 0 && (*end == 0 || *end == ',')) return n;  // libgomp warns of anything else itself
  }
  return std::max<int64_t>(1, cpus / std::max<int64_t>(1, local_processes));
}

std::string pin_compute_threads(int64_t threads, int64_t local_rank, int64_t local_world) {
  const cpu_set_t& allowed = original_mask();
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  const int64_t per_rank = int64_t(cpus.size()) / std::max<int64_t>(1, local_world);
  if (per_rank < threads || threads < 1) return "not pinned (fewer CPUs than threads)";
  if (per_rank > threads) return fmt::format("not pinned ({} of {} CPUs)", threads, per_rank);
  std::vector<int> mine(cpus.begin() + local_rank * per_rank,
                        cpus.begin() + local_rank * per_rank + threads);
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(mine[size_t(omp_get_thread_num()) % mine.size()], &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
  }
  return fmt::format("pinned to CPU {}", fmt::join(mine, ","));
}

void unpin_this_thread() {
  pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &original_mask());
}

}  // namespace dtrain
