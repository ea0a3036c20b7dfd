// How a step's micro-batches go through this rank's share of the model: forward, loss and
// backward, the gradient sync's hooks firing on the last backward. One interface, two
// strategies:
//   WholeModel  every rank holds every part (data and tensor parallelism): the micro-batches
//               one after another (runner.cpp)
//   Pipeline    the parts split into stages over the pipeline ranks, the micro-batches run
//               by a schedule, activations and their gradients sent between neighbours
//               (pipeline.cpp)
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "data/dataset.hpp"
#include "models/dropout.hpp"

namespace dtrain {

struct Context;
struct StepStats;

class MicroBatchRunner {
 public:
  virtual ~MicroBatchRunner() = default;
  // Forward and backward of every micro-batch of `batch` (this data rank's share of the
  // global batch), each loss multiplied by `factor` before backward (what makes the
  // gradient a global mean, and fp16's scale). Returns each micro-batch's loss, unscaled
  // and detached, where this rank computes one (on a pipeline: the last stage), else
  // nothing. Adds its phase times to `s`; `settle` waits for the device (a logged step on a
  // GPU times its phases on the device).
  virtual std::vector<torch::Tensor> train(const Batch& batch, double factor, StepStats& s,
                                           const std::function<void()>& settle) = 0;
  // The model's output for a batch of inputs `x`, without gradients (evaluation); undefined
  // where this rank does not hold the model's last part.
  virtual torch::Tensor infer(const torch::Tensor& x) = 0;
};

// The runner for this job: Pipeline with more than one pipeline stage, else WholeModel.
std::unique_ptr<MicroBatchRunner> make_runner(Context& c);
std::unique_ptr<MicroBatchRunner> make_pipeline_runner(Context& c);

// The dropout draw of the micro-batch made of rows [first, first + rows) of this data rank's
// batch for the coming step: the sampler deals the global batch round-robin, so this
// rank's row i is the global batch's sample r + D i (data/sampler.hpp).
DropoutDraw micro_batch_draw(const Context& c, int64_t first, int64_t rows);

}  // namespace dtrain
