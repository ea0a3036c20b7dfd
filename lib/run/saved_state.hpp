// The run's own Stateful components (checkpoint/stateful.hpp): what a checkpoint holds of
// the model's weights, the optimizer, the loss scaler, the run's counters and the random
// generators, each saved under the names of docs/contract.md and loaded back (a gradient
// sync and a training mode save their own). And model.init_from, which loads weights
// alone.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "checkpoint/stateful.hpp"
#include "grad/grad_sync.hpp"

namespace dtrain {

struct Run;

// What trainer.json holds of the run, read and range-checked; CheckpointError names the
// file.
struct SavedTrainer {
  int64_t step = 0, best_step = 0, global_batch = 0, train_samples = 0;
  double best_metric = 0, last_loss = 0;  // NaN when not yet known
  torch::Tensor rng_cpu;                  // LibTorch's CPU generator state
  torch::Tensor rng_cuda;                 // the GPU's generator state: a run on CUDA
  nlohmann::json loss_scaler;             // fp16: the scaler's state (null otherwise)
};
SavedTrainer read_trainer_state(const nlohmann::json& trainer, const std::string& folder);

// The run's savers, in the order they save and load: the weights (a resume continues the
// same model: checked first), the counters (the same global batch and data), the
// optimizer, the loss scaler, the random generators. They refer to `run`'s components.
std::vector<std::unique_ptr<Stateful>> run_savers(Run& run);

// `tensors` less the entries of a tied weight's copy (and their slots): the embedding's
// stage saves it. Not for `out` where every rank adds all it holds (a live recovery's).
NamedTensors without_copies(const FlatParams& params, const Tied& tied, NamedTensors tensors,
                            const StateWriter& out);

// model.init_from: a fresh run's weights (parameters and buffers) from a checkpoint or a
// safetensors file, by name, each rank taking its part. Strict: every tensor of the model
// there with its full shape and nothing else (CheckpointError naming what is not);
// otherwise what matches is loaded and the rest listed in one warning.
void init_from(Run& run);

}  // namespace dtrain
