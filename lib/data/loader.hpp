// Prepares one rank's batches on background threads, in step order and a bounded number
// ahead of the training loop, so that in steady state the step never waits for data.
// Positions are global steps g = epoch * steps_per_epoch + step, so a resumed run starts
// the stream exactly where the checkpoint left it.
#pragma once
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "data/augment.hpp"
#include "data/dataset.hpp"
#include "data/sampler.hpp"

namespace dtrain {

class Loader {
 public:
  // Streams global steps [first, end); workers == 0 loads on the caller's thread. `pin`:
  // batches in page-locked memory, which a GPU copies from without blocking (CUDA only).
  // `augment`: applied to each batch's images in the loader's threads.
  Loader(const Dataset& data, ShardedSampler sampler, int64_t first, int64_t end,
         int64_t workers, int64_t prefetch, bool pin = false, Augment augment = {});
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next step's batch; `wait_ms` gets how long the caller was blocked.
  Batch next(double* wait_ms);

 private:
  Batch make(int64_t global_step);
  std::shared_ptr<const EpochOrder> order_for(int64_t epoch);
  void work();

  const Dataset& data_;
  ShardedSampler sampler_;
  int64_t next_take_, end_, prefetch_;
  bool pin_;
  Augment augment_;

  std::mutex mu_;
  std::condition_variable can_work_, ready_cv_;
  int64_t next_claim_;
  std::map<int64_t, Batch> ready_;
  std::map<int64_t, std::shared_ptr<const EpochOrder>> orders_;  // by epoch
  std::exception_ptr error_;  // the failure of step error_step_ (the earliest that failed)
  int64_t error_step_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace dtrain
