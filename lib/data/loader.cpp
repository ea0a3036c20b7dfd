// Worker threads claim steps in order, build them out of order, and the consumer takes them
// in order from a reorder map; claims stop `prefetch` steps ahead of the consumer.
#include "data/loader.hpp"

#include "util/affinity.hpp"
#include "util/clock.hpp"

#include <ATen/Parallel.h>
#include <omp.h>

#include <chrono>
#include <stdexcept>

namespace dtrain {

Loader::Loader(const Dataset& data, ShardedSampler sampler, int64_t first, int64_t end,
               int64_t workers, int64_t prefetch, bool pin, Augment augment)
    : data_(data), sampler_(sampler), next_take_(first), end_(end), prefetch_(prefetch),
      pin_(pin), augment_(std::move(augment)), next_claim_(first) {
  for (int64_t i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  can_work_.notify_all();
  for (auto& t : threads_) t.join();
}

std::shared_ptr<const EpochOrder> Loader::order_for(int64_t epoch) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = orders_.find(epoch);
  if (it != orders_.end()) return it->second;
  lock.unlock();  // a permutation of 60k indices takes ~1 ms: not under the lock
  auto order = std::make_shared<const EpochOrder>(sampler_.epoch_order(epoch));
  lock.lock();
  // Epochs behind the consumer are finished with.
  const int64_t current = sampler_.at(next_take_).epoch;
  for (auto o = orders_.begin(); o != orders_.end();)
    o = o->first < current ? orders_.erase(o) : std::next(o);
  return orders_.emplace(epoch, order).first->second;
}

Batch Loader::make(int64_t global_step) {
  const BatchAt at = sampler_.at(global_step);
  auto order = order_for(at.epoch);
  const auto indices = sampler_.rank_indices(*order, at.position);
  Batch b = data_.gather(indices);
  if (!augment_.empty()) b.x = augment_.apply(b.x, indices, at.epoch);
  if (pin_) b = {b.x.pin_memory(), b.y.pin_memory()};
  return b;
}

void Loader::work() {
  // A gather big enough for ATen's parallel_for would start a second OpenMP team on this
  // thread. Its threads count against the cores, and libgomp, seeing more threads than
  // cores, then sends the training step's team to sleep between parallel regions instead
  // of spinning (measured on 2 cores: ~54 context switches a step, MLP steps 1.0 -> 2.1
  // ms). Loader threads gather serially: ATen first sets this thread's OpenMP thread count
  // once, lazily (at::get_num_threads does it, in LibTorch's own copy of the lazy flag,
  // which an inline call from here would not set where LibTorch hides its symbols), then
  // this thread keeps one.
  at::get_num_threads();
  omp_set_num_threads(1);
  unpin_this_thread();  // created by the (pinned) training thread: use any free CPU
  for (;;) {
    int64_t g;
    {
      std::unique_lock<std::mutex> lock(mu_);
      can_work_.wait(lock, [&] {
        return stop_ || error_ || next_claim_ >= end_ || next_claim_ < next_take_ + prefetch_;
      });
      if (stop_ || error_ || next_claim_ >= end_) return;
      g = next_claim_++;
    }
    try {
      Batch b = make(g);
      std::lock_guard<std::mutex> lock(mu_);
      ready_.emplace(g, std::move(b));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_ || g < error_step_) error_ = std::current_exception(), error_step_ = g;
    }
    ready_cv_.notify_all();
  }
}

Batch Loader::next(double* wait_ms) {
  if (next_take_ >= end_) throw std::logic_error("Loader::next past the end of its range");
  const auto t0 = Clock::now();
  Batch b;
  if (threads_.empty()) {
    b = make(next_take_++);
  } else {
    std::unique_lock<std::mutex> lock(mu_);
    ready_cv_.wait(lock, [&] {
      return ready_.count(next_take_) || (error_ && error_step_ <= next_take_);
    });
    // A batch that is ready is delivered even if a later one failed: the error belongs to
    // the step that needed it.
    auto it = ready_.find(next_take_);
    if (it == ready_.end()) std::rethrow_exception(error_);
    ++next_take_;
    b = std::move(it->second);
    ready_.erase(it);
  }
  can_work_.notify_all();
  if (wait_ms) *wait_ms = ms_since(t0);
  return b;
}

}  // namespace dtrain
