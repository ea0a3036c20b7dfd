// This rank's share of the model, as the run holds it and its modes see it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/model.hpp"
#include "grad/grad_sync.hpp"

namespace dtrain {

// This rank's share of the model: one network per chunk it holds (several only under
// interleaved_1f1b), each of one stage's parts under the whole model's names.
struct ModelParts {
  const ModelSpec* spec = nullptr;
  std::vector<NetworkPtr> chunks;
  std::vector<int64_t> chunk_stage;  // each chunk's global stage: chunk x pipeline + pipeline rank
  int64_t stages = 1;                // global stages: pipeline x virtual_stages
  // Entries of the flat parameters that another stage holds a copy of (GPT's token
  // embedding and its head), kept equal by summing their gradients over the mesh's
  // embedding group; `tied.copy` on the rank holding the head's copy, which the norm and
  // checkpoints leave to the embedding's.
  Tied tied;
  // Every parameter and buffer name of the whole model, whatever this rank holds: what a
  // checkpoint to resume from must hold, no more, no less.
  std::vector<std::string> names;

  const Task& task() const { return *spec->task; }
  bool holds_first() const { return chunk_stage.front() == 0; }
  bool holds_last() const { return chunk_stage.back() == stages - 1; }
  // The buffers this rank holds (BatchNorm's statistics), by their names in the model.
  NamedTensors buffers() const;
  // Of them the floating-point ones (running statistics, not counts), which no gradient
  // moves: what the data ranks start from alike and what replicas share.
  std::vector<torch::Tensor> float_buffers() const;
  void set_training(bool on) const {
    for (const auto& chunk : chunks) chunk->train(on);
  }
};

}  // namespace dtrain
