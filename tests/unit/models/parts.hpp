// The models' parts one at a time, for the tests that set a part's cost sheet against what
// LibTorch does when it runs (test_kernels: the kernels dispatched; test_activations: the
// memory its allocator holds).
#pragma once
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "models/model.hpp"
#include "models/task.hpp"

namespace dtrain::test {

// A model's spec and the data it is built for.
struct Model {
  ModelConfig cfg;
  Ints sample;
  int64_t classes = 0, vocab = 0;
  bool tokens() const { return vocab > 0; }
};

// A batch of `rows` random samples for `m` (token ids, or values and class labels), and
// the task whose loss its last part takes.
struct Samples {
  torch::Tensor x;
  Batch batch;
  const Task* task;
};
inline Samples random_samples(const Model& m, int64_t rows) {
  Ints shape{rows};
  shape.insert(shape.end(), m.sample.begin(), m.sample.end());
  torch::Tensor x = m.tokens() ? torch::randint(m.vocab, shape) : torch::randn(shape);
  Batch batch{x, m.tokens() ? torch::randint(m.vocab, shape) : torch::randint(m.classes, {rows})};
  return {x, batch, m.tokens() ? &language_model_task() : &classification_task()};
}

// Part `part` of `m` alone, on the rank of `tensor`, initialised and in training mode.
inline NetworkPtr build_part(const Model& m, int64_t part, std::shared_ptr<Comm> tensor) {
  ModelContext ctx;
  ctx.sample_shape = m.sample, ctx.classes = m.classes, ctx.vocab = m.vocab;
  ctx.tensor = std::move(tensor);
  ctx.first_part = part, ctx.last_part = part + 1;
  auto net = build_initialised(m.cfg, ctx, 3);
  net->train();
  return net;
}

// A rank of a tensor group whose collectives leave the values as they are, at once: the
// model runs what it runs on that rank, with the memory it takes and the kernels it
// launches, on this one thread (Gloo would free what it was handed on a thread of its own,
// which test_activations' memory reporter does not hear of).
class SilentComm : public Comm {
 public:
  SilentComm(int64_t rank, int64_t size) : rank_(rank), size_(size) {}
  int64_t all_reduces = 0;  // the all-reduces asked of it
  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  std::unique_ptr<Pending> all_reduce_async(torch::Tensor, ReduceOp) override {
    ++all_reduces;
    return done();
  }
  std::unique_ptr<Pending> reduce_async(torch::Tensor, int64_t) override { return done(); }
  std::unique_ptr<Pending> broadcast_async(torch::Tensor, int64_t) override { return done(); }
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t) override {
    return std::vector<torch::Tensor>(size_t(size_), t.clone());
  }
  std::unique_ptr<Pending> all_gather_async(torch::Tensor, const torch::Tensor&) override { return done(); }
  bool can_sum(torch::ScalarType) const override { return true; }
  void barrier() override {}
  std::unique_ptr<Pending> exchange_async(std::vector<P2POp>) override { return done(); }
  std::shared_ptr<Comm> new_group(const std::string&, const std::vector<int64_t>&) override {
    throw std::logic_error("SilentComm: no subgroups");
  }

 private:
  struct Done : Pending {
    void wait() override {}
  };
  static std::unique_ptr<Pending> done() { return std::make_unique<Done>(); }
  int64_t rank_, size_;
};

}  // namespace dtrain::test
