// The models' parts one at a time, for the tests that set a part's cost sheet against what
// LibTorch does when it runs (test_kernels: the kernels dispatched; test_activations: the
// memory its allocator holds).
#pragma once
#include <memory>
#include <string>

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

}  // namespace dtrain::test
