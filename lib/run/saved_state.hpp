// Checkpoints of a run: which one to resume from, writing one, restoring one. Tensors are
// saved at their full logical shapes (split ones gathered over the tensor group), so a
// checkpoint resumes on any layout.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "train/context.hpp"

namespace dtrain {

// Collective over the world: rank 0 runs `part` (which may throw) and every rank learns how
// it went: the value it returned, or its failure, which every rank then throws with rank
// 0's exit code (rank 0 with its message, the others pointing at rank 0; `what` completes
// "could not ..."). No rank is left waiting in a collective rank 0 will never enter.
int64_t root_does(Context& c, const std::string& what, const std::function<int64_t()>& part);

// Collective. Rank 0 creates and locks the run directory and decides which checkpoint (if
// any) the job resumes from; the others follow, or fail together with rank 0's exit code.
std::optional<std::string> open_run_dir(Context& c);
// What trainer.json holds, read and range-checked; CheckpointError names the file.
struct SavedTrainer {
  int64_t step = 0, best_step = 0, global_batch = 0, train_samples = 0;
  double best_metric = 0, last_loss = 0;  // NaN when not yet known
  torch::Tensor rng_cpu;                  // LibTorch's CPU generator state
  torch::Tensor rng_cuda;                 // the GPU's generator state: a run on CUDA
  nlohmann::json loss_scaler;             // fp16: the scaler's state (null otherwise)
  std::vector<int64_t> worker_pushes;     // async_ps: each worker's applied pushes
};
SavedTrainer read_trainer_state(const nlohmann::json& trainer, const std::string& folder);

// Every rank reads the checkpoint and takes its part.
void restore(Context& c, const std::string& folder);
// Collective over the world: rank 0 writes, nobody moves on before it is complete.
void save_checkpoint(Context& c, const std::optional<EvalResult>& eval);
// Every data-parallel rank starts from data rank 0's exact state.
void broadcast_state(Context& c);
// model.init_from: a fresh run's weights (parameters and buffers) from a checkpoint or a
// safetensors file, by name, each rank taking its part. Strict: every tensor of the model
// there with its full shape and nothing else (CheckpointError naming what is not);
// otherwise what matches is loaded and the rest listed in one warning.
void init_weights(Context& c);

}  // namespace dtrain
