// What a component with state gives a checkpoint and takes back from one (torchtitan's
// Stateful). Every component that carries something from step to step (the weights, the
// optimizer, the gradient sync's residuals, the loss scaler, a training mode's own) saves
// it under names of its own and loads it back; the checkpointer (checkpointer.hpp) only
// collects, writes, verifies and reads the files, and names no component.
//
// The files stay those of docs/contract.md, so a component says which one each tensor
// goes to:
//   kModel      model{.ppN}{.tpT}.safetensors: parameters and buffers, written by the ranks
//               of the first data replica (each its stage's tensors, of a split tensor its
//               tensor rank's part)
//   kOptimizer  optimizer{.ppN}{.tpT}.safetensors: the optimizer state, written alike
//   kReplica    sync.dpD{.ppN}{.tpT}.safetensors: what data rank D keeps of its own (error
//               feedback's residuals, local SGD's optimizer state), written by every data
//               rank
//   kOptimizerShard  optimizer.dpD{.ppN}{.tpT}.safetensors: data rank D's shard of the
//               optimizer state (ZeRO), written by every data rank, nothing gathered;
//               read back as kOptimizer, every shard's ranges merged
//   kModelShard  model.dpD{.ppN}{.tpT}.safetensors: data rank D's shard of the parameters
//               (ZeRO-3), alike; read back as kModel
// and trainer.json's entries (step, random states, the loss scale...), written by rank 0.
#pragma once
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

enum class StateFile { kModel, kOptimizer, kReplica, kOptimizerShard, kModelShard };

class StateWriter {
 public:
  virtual ~StateWriter() = default;
  // Whether what this rank adds to `file` is written (a component whose state is spread
  // over ranks gathers it on every rank all the same: a collective).
  virtual bool writes(StateFile file) const = 0;
  // Tensors of `file`; those named in `parts` are this tensor rank's part of a split one,
  // those named in `ranges` a range of one's elements (the shards).
  virtual void add(StateFile file, const NamedTensors& tensors, const PartsOf& parts = {},
                   const RangesOf& ranges = {}) = 0;
  // An entry of trainer.json (rank 0's are written).
  virtual void set(const std::string& key, nlohmann::json value) = 0;
  // Whether every rank adds all it holds, the tensors replicated over its tensor group
  // too: a live recovery's state goes to the rank at the same place, not into files the
  // ranks share (where tensor rank 0 adds those).
  virtual bool every_rank_whole() const { return false; }
};

class StateReader {
 public:
  virtual ~StateReader() = default;
  virtual const std::string& folder() const = 0;
  // Whether the checkpoint holds `file` (kReplica: any, each data rank having written its
  // own), every tensor name in it, and its tensors read as this rank needs them (kReplica:
  // this data rank's; kOptimizer: the optimizer's, whole or in shards).
  virtual bool has(StateFile file) const = 0;
  virtual std::vector<std::string> names(StateFile file) const = 0;
  virtual SavedTensors tensors(StateFile file) const = 0;
  virtual const nlohmann::json& trainer() const = 0;
  // The resolved job that wrote it.
  virtual std::string config_yaml() const = 0;
  // The layout the checkpoint was written at, and this run's.
  virtual ParallelDims saved_layout() const = 0;
  virtual ParallelDims layout() const = 0;
  // A line for the user (rank 0 prints it): what could not be taken over, and why.
  virtual void warn(const std::string& line) const = 0;
  // Whether it holds only what this rank holds of the state (a live recovery's, from the
  // rank at the same place: its pipeline stage's tensors, its ZeRO shard's ranges), not
  // every rank's: a tensor of another stage or shard is absent, not missing.
  virtual bool this_rank_only() const { return false; }
  // Whether this data rank's kReplica state can be taken over: the checkpoint holds it and
  // was written at this data and pipeline size. If not, warns "`what` (why)".
  bool replica_fits(const std::string& what) const {
    const auto saved = saved_layout(), now = layout();
    if (!has(StateFile::kReplica))
      warn(what + " (the checkpoint holds none)");
    else if (saved.data != now.data || saved.pipeline != now.pipeline)
      warn(fmt::format("{} (the checkpoint was written at data size {} x pipeline {}, this run "
                       "has {} x {})", what, saved.data, saved.pipeline, now.data, now.pipeline));
    else
      return true;
    return false;
  }
};

class Stateful {
 public:
  virtual ~Stateful() = default;
  // Every rank calls it, in the same order (a component may gather over its ranks).
  virtual void save(StateWriter& out) const = 0;
  virtual void load(const StateReader& in) = 0;
};

}  // namespace dtrain
