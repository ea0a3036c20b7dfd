// The cadence of a run: which steps are logged, evaluated, checkpointed; decided here
// only (the lock-step loop's and the parameter server's).
#pragma once
#include <cstdint>
#include <functional>

#include "config/config.hpp"

namespace dtrain {

// What happens after step n (from 1): the cadence of the job, decided here only. An
// evaluation or a checkpoint due where the ranks do not meet (between local SGD's averages)
// waits for the next meeting, where every replica holds the same parameters.
struct Cadence {
  const JobConfig& cfg;
  int64_t steps_per_epoch, total_steps;
  // Whether every rank meets after step n (Lockstep::meets; always, but for local SGD).
  std::function<bool(int64_t)> meets = [](int64_t) { return true; };

  bool last(int64_t n) const { return n == total_steps; }
  bool epoch_end(int64_t n) const { return n % steps_per_epoch == 0; }
  bool should_log(int64_t n) const { return n % cfg.train.log_every == 0 || last(n); }
  bool should_eval(int64_t n) const { return due(n, cfg.train.eval_every); }
  bool should_save(int64_t n) const { return due(n, cfg.checkpoint.every_steps); }
  // The first step where the ranks meet after some steps apart (local SGD): the steps
  // before it are read first, so that a replica's divergence among them is voted on there.
  bool rejoins(int64_t n) const { return n > 1 && meets(n) && !meets(n - 1); }
  // The last step where the ranks meet before some steps apart: it is read at once, so
  // that a stop voted there is acted on there, where every replica is the same.
  bool parts(int64_t n) const { return !last(n) && meets(n) && !meets(n + 1); }

 private:
  // Whether the ranks meet after step n and, since they last met, a step was due by
  // `every` (0: each epoch's end), or n is the last.
  bool due(int64_t n, int64_t every) const {
    if (!meets(n)) return false;
    if (last(n)) return true;
    for (int64_t m = n;; --m) {
      if (every > 0 ? m % every == 0 : epoch_end(m)) return true;
      if (m == 1 || meets(m - 1)) return false;
    }
  }
};

}  // namespace dtrain
