// The collectives: the one-process Comm, and ranks as threads over real Gloo.
#include <doctest/doctest.h>

#include <mutex>
#include <set>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/torch.h>
#include "comm/comm.hpp"
#include "ranks.hpp"
#include "config/config.hpp"
#include "models/model.hpp"
#include "optim/clip.hpp"
#include "optim/optimizer.hpp"
#include "grad/compression.hpp"
#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/mesh.hpp"
#include "layers/tensor_parallel.hpp"
#include "layers/vocab_parallel.hpp"
#include "util/error.hpp"

namespace unit_comm_comm {

using namespace dtrain;
using test::quick;
using test::RankFailures;

TEST_CASE("comm: the one-process collectives are identities") {
  auto c = make_local_comm();
  auto t = torch::tensor({1.0f, 2.0f});
  c->all_reduce(t, ReduceOp::kAvg);
  CHECK(torch::equal(t, torch::tensor({1.0f, 2.0f})));
  auto out = torch::zeros({2});
  c->all_gather_into(out, t);
  CHECK(torch::equal(out, t));
  CHECK(c->all_gather(t).size() == 1);
  CHECK(c->new_group("g", {0}).get() == c.get());
  CHECK_THROWS(c->send(t, 0));
}

TEST_CASE("comm: collectives over ranks as threads") {
  const int64_t n = 3;
  RankFailures failures;
  test::run_ranks_as_threads(n, [&](std::shared_ptr<Comm> c) {
    const int64_t r = c->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    // sum, avg, max
    auto s = torch::full({4}, double(r + 1), torch::kFloat64);
    c->all_reduce(s);
    if (!torch::equal(s, torch::full({4}, 6.0, torch::kFloat64))) fail("sum");
    auto a = torch::full({2}, double(r), torch::kFloat64);
    c->all_reduce(a, ReduceOp::kAvg);
    if (!torch::equal(a, torch::full({2}, 1.0, torch::kFloat64))) fail("avg");
    auto m = torch::tensor({double(r), double(-r)}, torch::kFloat64);
    c->all_reduce(m, ReduceOp::kMax);
    if (!torch::equal(m, torch::tensor({2.0, 0.0}, torch::kFloat64))) fail("max");
    // all-gather into one flat tensor: rank r's [r, r+10] at [2r, 2r+2)
    auto flat = torch::zeros({2 * n});
    c->all_gather_into(flat, torch::tensor({float(r), float(r + 10)}));
    if (!torch::equal(flat, torch::tensor({0.f, 10.f, 1.f, 11.f, 2.f, 12.f}))) fail("all_gather_into");
    // a ring of sends and receives posted together: no deadlock, every value arrives
    auto got = torch::zeros({3});
    c->exchange_async({{P2POp::kSend, torch::full({3}, float(r)), (r + 1) % n},
                       {P2POp::kRecv, got, (r + n - 1) % n}})
        ->wait();
    if (!torch::equal(got, torch::full({3}, float((r + n - 1) % n)))) fail("exchange");
    // a sub-group of ranks {0, 2}; rank 1 alone gets a local group
    auto g = r == 1 ? c->new_group("solo-1", {1}) : c->new_group("pair", {0, 2});
    auto x = torch::full({1}, double(r), torch::kFloat64);
    g->all_reduce(x);
    if (x.item<double>() != (r == 1 ? 1.0 : 2.0)) fail("sub-group");
    if (g->size() != (r == 1 ? 1 : 2)) fail("sub-group size");
    c->barrier();
  }, quick());
  failures.check();
}

TEST_CASE("comm: a timed wait says whether the collective has completed, and finishes it once") {
  RankFailures failures;
  std::atomic<bool> waited{false};
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> c) {
    const int64_t r = c->rank();
    auto t = torch::full({5}, double(r + 1), torch::kFloat64);
    if (r == 1) {  // posts only once rank 0 has seen its collective still running
      for (int i = 0; i < 3000 && !waited; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      c->all_reduce(t, ReduceOp::kAvg);
      return;
    }
    auto op = c->all_reduce_async(t, ReduceOp::kAvg);
    if (op->wait_for(std::chrono::milliseconds(20))) failures.add(r, "completed before its peer posted");
    waited = true;
    int slices = 0;
    while (!op->wait_for(std::chrono::milliseconds(20)))
      if (++slices > 1500) return failures.add(r, "never completed");
    op->wait();  // already finished: not divided again
    if (!torch::equal(t, torch::full({5}, 1.5, torch::kFloat64))) failures.add(r, "not the mean");
  }, quick());
  failures.check();
}

// Each thread of this process and its nice value (field 19 of /proc's stat).
std::map<std::string, int> threads_nice() {
  std::map<std::string, int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto end_of_name = stat.rfind(')');
    if (end_of_name == std::string::npos) continue;  // the thread ended meanwhile
    std::istringstream fields(stat.substr(end_of_name + 2));  // from field 3, the state
    std::string field;
    for (int i = 3; i <= 19 && fields >> field; ++i)
      if (i == 19) out[e.path().filename().string()] = std::stoi(field);
  }
  return out;
}

TEST_CASE("comm: Gloo's threads run above compute only where every compute thread has a core") {
  const id_t tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int mine = ::getpriority(PRIO_PROCESS, tid);
  REQUIRE(errno == 0);
  const bool can_raise = ::setpriority(PRIO_PROCESS, tid, mine - 1) == 0;
  if (can_raise) ::setpriority(PRIO_PROCESS, tid, mine);
  for (bool first : {true, false}) {
    CAPTURE(first);
    const auto before = threads_nice();
    std::map<std::string, int> during;
    std::mutex mu;
    auto opts = quick();
    opts.comm_first = first;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
      comm->barrier();  // both ranks' groups, and so their threads, exist
      {
        std::lock_guard<std::mutex> lock(mu);
        if (during.empty()) during = threads_nice();
      }
      comm->barrier();
    }, opts);
    std::set<int> made;  // the nice values of the threads made meanwhile
    for (const auto& [task, nice] : during)
      if (!before.count(task)) made.insert(nice);
    REQUIRE(!made.empty());
    // The ranks' own threads run at the test's priority; Gloo's at 10 above it, or the same.
    if (first && can_raise) CHECK(made == std::set<int>{mine, mine - 10});
    else CHECK(made == std::set<int>{mine});
  }
}

}  // namespace unit_comm_comm
