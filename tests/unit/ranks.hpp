// Ranks as threads of the test process: runs body(comm) on `n` threads, each with the world
// Comm of its rank (an in-memory store, real Gloo on loopback). Rethrows the first exception
// a rank threw, after all threads have ended.
#pragma once
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "comm/comm.hpp"

namespace dtrain::test {

// A DeadAmong (comm/quorum.hpp) from a test's own word on each replica.
inline std::function<std::vector<int64_t>(const std::vector<int64_t>&)> dead_unless(
    std::function<bool(int64_t)> alive) {
  return [alive = std::move(alive)](const std::vector<int64_t>& replicas) {
    std::vector<int64_t> dead;
    for (int64_t r : replicas)
      if (!alive(r)) dead.push_back(r);
    return dead;
  };
}

inline void run_ranks_as_threads(int64_t n, const std::function<void(std::shared_ptr<Comm>)>& body,
                                 const CommOptions& opts = {}) {
  static std::atomic<int> calls{0};
  const std::string rendezvous = "threads-" + std::to_string(calls++);  // a store per call
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(make_in_process_comm(rendezvous, r, n, opts));
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Failures seen on rank threads, reported from the test's own thread.
class RankFailures {
 public:
  void add(int64_t rank, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    list_.push_back(fmt::format("rank {}: {}", rank, what));
  }
  void check() const {
    for (const auto& f : list_) FAIL_CHECK(f);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> list_;
};

// Short timeouts and one Gloo thread: what the tests' small tensors need.
inline CommOptions quick() {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  o.gloo_threads = 1;
  return o;
}

}  // namespace dtrain::test
