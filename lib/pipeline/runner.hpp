// How a step's micro-batches go through this rank's share of the model: forward, loss and
// backward, the gradient sync's hooks firing on the last backward. One interface, two
// strategies:
//   WholeModel  every rank holds every part (data and tensor parallelism): the micro-batches
//               one after another (whole_model.cpp)
//   Pipeline    the parts split into stages over the pipeline ranks, the micro-batches run
//               by a schedule, activations and their gradients sent between neighbours
//               (executor.cpp)
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <torch/types.h>

#include "comm/comm.hpp"
#include "data/dataset.hpp"
#include "models/dropout.hpp"
#include "models/model.hpp"

namespace dtrain {

class GradSync;

// What the runners use: this rank's chunks of the model and how they are run.
struct RunnerParts {
  std::vector<NetworkPtr> chunks;  // one per stage this rank holds, in order
  int64_t stages = 1;              // global stages: pipeline x virtual_stages
  const Task* task = nullptr;
  std::shared_ptr<Comm> tensor, pipeline;
  c10::Device device = c10::Device(c10::kCPU);
  torch::MemoryFormat format = torch::MemoryFormat::Contiguous;
  GradSync* sync = nullptr;        // told which backward is the step's last
  int64_t grad_accum = 1;          // micro-batches per step
  std::string dtype = "fp32";      // precision.dtype (autocast)
  double label_smoothing = 0;
  std::string schedule = "1f1b";   // parallel.schedule
  int64_t virtual_stages = 1;
  // Dropout's draw: the job's seed, and where this data rank's rows sit in the global
  // batch (the sampler deals it round-robin: this rank's row i is sample r + D i).
  uint64_t seed = 0;
  bool dropout = false;
  int64_t data_rank = 0, data_ranks = 1;
};

// The phases' times of one step's micro-batches, milliseconds; a pipeline's share of the
// step spent waiting for its neighbours (the bubble) and the most memory its micro-batches
// in flight held (MiB above the step's start).
struct MicroBatchTimes {
  double forward_ms = 0, backward_ms = 0, bubble = 0, activation_mb = 0;
};

class MicroBatchRunner {
 public:
  virtual ~MicroBatchRunner() = default;
  // Forward and backward of every micro-batch of `batch` (this data rank's share of step
  // `step`'s global batch, from 1), each loss multiplied by `factor` before backward (what
  // makes the gradient a global mean, and fp16's scale). Returns each micro-batch's loss,
  // unscaled and detached, where this rank computes one (on a pipeline: the last stage),
  // else nothing. Adds its phase times to `t`; `settle` waits for the device (a logged
  // step on a GPU times its phases on the device).
  virtual std::vector<torch::Tensor> train(int64_t step, const Batch& batch, double factor,
                                           MicroBatchTimes& t,
                                           const std::function<void()>& settle) = 0;
  // The model's output for a batch of inputs `x`, without gradients (evaluation); undefined
  // where this rank does not hold the model's last part.
  virtual torch::Tensor infer(const torch::Tensor& x) = 0;
  // Whether this rank computes the loss (holds the model's last part).
  virtual bool holds_last() const = 0;
  // Where this rank's rows sit in the global batch from now on (RunnerParts::data_rank):
  // a fault-tolerant job's survivors deal it anew.
  virtual void deal(int64_t rank, int64_t ranks) = 0;
};

// The runner for these parts: Pipeline with more than one stage, else WholeModel.
std::unique_ptr<MicroBatchRunner> make_runner(RunnerParts parts);
std::unique_ptr<MicroBatchRunner> make_pipeline_runner(RunnerParts parts);

// Micro-batch `m` of `accum` in a batch of `rows` rows: equal ones, or where a
// fault-tolerant job's survivors dealt a share that does not split evenly, the first
// rows % accum one row larger. Its mean loss then counts by its rows (`weight`: its
// losses' sum over the share's, as even ones' would).
struct MicroSlice {
  int64_t first = 0, rows = 0;
  double weight = 1.0;
};
MicroSlice micro_slice(int64_t rows, int64_t accum, int64_t m);

// The dropout draw of step `step`'s micro-batch made of rows [first, first + rows) of this
// data rank's batch.
DropoutDraw micro_batch_draw(const RunnerParts& p, int64_t step, int64_t first, int64_t rows);

}  // namespace dtrain
