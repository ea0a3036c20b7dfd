// A model's parameters as views into one contiguous buffer, and their gradients as views
// into another (llm.c's design). backward() then accumulates straight into the flat
// gradient, so zeroing, the global norm, the optimizer update and the bucketed all-reduce
// are a few large operations instead of a loop of small ones per tensor, and a shard (ZeRO)
// is an offset and a length.
//
// Each entry is one parameter, listed once however often the model uses it (a tied weight
// registered under two names is one entry, the first name), with its local shape and its
// Placement across the tensor group, so checkpoints can hold every tensor at its full
// logical shape whatever the layout.
#pragma once
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

namespace dtrain {

class Comm;
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct Placement;

// Saved tensors by name (a checkpoint's model or optimizer state), for restoring them:
// held in memory, or read on demand (checkpoint.hpp's CheckpointReader reads only the
// parts a rank needs).
class SavedTensors {
 public:
  // `origin` names where they came from in errors (the checkpoint folder).
  SavedTensors(const NamedTensors& tensors, std::string origin);
  // `read(name, placement, rank)`: rank's part of the tensor under `placement` (the whole
  // for a replicated placement). `shapes`: every tensor's full shape.
  using Read = std::function<torch::Tensor(const std::string&, const Placement&, int64_t)>;
  SavedTensors(std::map<std::string, std::vector<int64_t>> shapes, Read read, std::string origin);
  // The whole tensor `name`, which must have `shape`; throws CheckpointError naming the
  // origin when it is missing or shaped otherwise.
  torch::Tensor at(const std::string& name, const std::vector<int64_t>& shape) const;
  // Rank `rank`'s part of it under `placement`, the same checks on its full shape.
  torch::Tensor part(const std::string& name, const std::vector<int64_t>& full_shape,
                     const Placement& placement, int64_t rank) const;

 private:
  void check(const std::string& name, const std::vector<int64_t>& shape) const;
  std::map<std::string, std::vector<int64_t>> shapes_;
  Read read_;
  std::string origin_;
};

// How one parameter is laid out over the ranks of the tensor group.
struct Placement {
  int64_t dim = -1;    // the split dimension; -1 = replicated (every rank holds all of it)
  int64_t parts = 1;   // ranks it is split over
  // The dimension is `blocks` equal blocks, each split in `parts` (a fused QKV weight is 3
  // blocks: rank r holds its heads' rows of Q, of K and of V).
  int64_t blocks = 1;

  static Placement replicated() { return {}; }
  static Placement split(int64_t dim, int64_t parts, int64_t blocks = 1) {
    return {dim, parts, blocks};
  }
  bool is_split() const { return dim >= 0 && parts > 1; }
  std::vector<int64_t> full_shape(std::vector<int64_t> local) const;
  // Rank `rank`'s part of the full tensor (a copy).
  torch::Tensor shard(const torch::Tensor& full, int64_t rank) const;
  // The full tensor from every rank's part, in rank order.
  torch::Tensor assemble(const std::vector<torch::Tensor>& parts) const;
};

// Which part of a split tensor a checkpoint file holds: its placement, and the tensor rank
// whose part it is. Keyed by the tensor's name in the file.
struct PartOf {
  Placement placement;
  int64_t rank = 0;
};
using PartsOf = std::map<std::string, PartOf>;

// Which elements of a tensor a checkpoint file holds where a ZeRO shard cut it: `numel`
// elements from `offset` of the tensor (of a split one, its tensor rank's part, whose
// shape is `shape`) in the order a flat buffer lays them out: row-major, or for a
// channels-last 4-d weight N,H,W,C (`channels_last`). Keyed by the tensor's name in the file.
struct RangeOf {
  int64_t offset = 0;
  std::vector<int64_t> shape;
  bool channels_last = false;
};
using RangesOf = std::map<std::string, RangeOf>;

// Implemented by modules whose own parameters are split across the tensor group.
class PlacedModule {
 public:
  virtual ~PlacedModule() = default;
  virtual Placement placement_of(const std::string& param_name) const = 0;
};

// The placements the modules of `model` declare for their own parameters (PlacedModule),
// by the parameters' names in `model`; a parameter not listed is replicated.
std::map<std::string, Placement> placements_of(const torch::nn::Module& model);

// Implemented by modules some of whose own parameters forward passes only to ops that
// autocast runs in the compute dtype (a linear layer's weight), so that under mixed
// precision holding them in that dtype changes nothing forward or backward computes.
class CastModule {
 public:
  virtual ~CastModule() = default;
  virtual bool cast_by_autocast(const std::string& param_name) const = 0;
};

// The parameters of `model` (by their names in it) that its forward reads only through
// autocast's cast to the compute dtype: those CastModule says, and the weights of torch's
// Linear and Conv2d (not their biases: Linear adds its own outside autocast's cast for a
// 3-D input). A tied parameter counts only where every name of it is listed. Held in the
// compute dtype, such a weight's gradients from two uses in one forward would be summed
// in that dtype, where fp32's cast-per-use sums them in fp32: the models use each once.
std::set<std::string> cast_by_autocast(const torch::nn::Module& model);

// A contiguous part of the flat buffers: what one data-parallel rank updates under ZeRO,
// [offset, offset + numel). The whole buffer by default.
struct Shard {
  int64_t offset = 0;
  int64_t numel = -1;  // -1 = to the end of the buffer
  bool whole() const { return offset == 0 && numel < 0; }
};

struct FlatOptions {
  torch::ScalarType dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  // With ChannelsLast, 4-d parameters (conv weights) are laid out channels-last in the
  // buffer, which LibTorch's oneDNN convolutions run ~1.4x faster on CPU.
  torch::MemoryFormat format = torch::MemoryFormat::Contiguous;
  // The buffers' length is rounded up to a multiple of this (zeros past the last entry), so
  // that they cut into equal shards (ZeRO's all-gather takes equal parts).
  int64_t pad_to = 1;
  // ZeRO-2: the gradient buffer holds shard `grad_rank` of `grad_ranks` only, and the
  // parameters' gradients are autograd's own tensors, which the gradient sync copies out
  // and frees as backward makes them (grad_sync.cpp).
  int64_t grad_ranks = 1, grad_rank = 0;
  // ZeRO-3: the parameter buffer holds shard `param_rank` of `param_ranks` only (the
  // values this rank updates). Each unit's parameters are then views into a buffer of
  // its own, which holds their values only while it is gathered (FlatParams::Unit).
  int64_t param_ranks = 1, param_rank = 0;
  // ZeRO-3 under mixed precision (bf16, fp16): the parameters autocast would cast anyway
  // (cast_by_autocast) are gathered and held in this dtype while gathered, the shard of
  // `dtype` staying their master; the others stay in `dtype`. Equal to `dtype`: none.
  torch::ScalarType compute_dtype = torch::kFloat32;
  // The modules forward runs as one (Network::units), a list per module given to
  // FlatParams: under ZeRO-3 every parameter must belong to one, and a unit's parameters
  // must be consecutive entries.
  std::vector<std::vector<const torch::nn::Module*>> units;
  // Whether the parameters' values are copied in. A model built to be initialised in the
  // buffer (models/init.hpp) skips it: its parameters were never written, and copying
  // them would only cost time.
  bool keep_values = true;
};

// The buffers' lengths for `total` values under `opts`: the padded length, and the values
// this rank's parameter and gradient buffers hold. FlatParams allocates by it and the
// planner (plan/) counts by it.
struct FlatSizes {
  int64_t numel = 0, params = 0, grads = 0;
};
FlatSizes flat_sizes(const FlatOptions& opts, int64_t total);

class FlatParams {
 public:
  struct Entry {
    std::string name;
    int64_t offset, numel;
    std::vector<int64_t> shape;        // this rank's part
    std::vector<int64_t> full_shape;   // the logical tensor
    Placement placement;
    // ZeRO-3: held in the compute dtype (FlatOptions::compute_dtype), and where in its
    // unit's buffer of that dtype (Unit::low) or else of the master dtype (Unit::buffer).
    bool low = false;
    int64_t packed = 0;
  };

  explicit FlatParams(torch::nn::Module& model, const FlatOptions& opts = {});
  // The parameters of several modules in order, each named as in its own module: the
  // chunks of one model a pipeline rank holds (their names never collide).
  explicit FlatParams(const std::vector<torch::nn::Module*>& modules, const FlatOptions& opts = {});

  // A unit of ZeRO-3: the parameters of entries [first, last), at [offset, offset + numel)
  // of the flat layout, views into `buffer` (the master dtype) or, for the entries held in
  // the compute dtype, into `low`: each buffer holds its entries one after another
  // (Entry::packed), and has storage only while the unit is gathered (allocate/release).
  // `module`: the index of the module (FlatParams' list) it belongs to.
  struct Unit {
    size_t first, last;
    int64_t offset, numel;
    size_t module;
    torch::Tensor buffer, low;
  };

  // The parameter buffer: laid out like the flat parameters over data_held() (all of it,
  // but for ZeRO-3, whose units hold the rest while gathered).
  torch::Tensor& data() { return data_; }
  const torch::Tensor& data() const { return data_; }
  Shard data_held() const { return data_held_; }
  // The values of `part` of the flat layout, which data() must hold.
  torch::Tensor data_of(const Shard& part) const;
  // The flat layout's length (padded).
  int64_t numel() const { return numel_; }
  // ZeRO-3: whether the parameters are sharded (then units() is not empty), the units,
  // and the unit that holds `module`'s parameters (none for a module without any).
  bool sharded() const { return !units_.empty(); }
  const std::vector<Unit>& units() const { return units_; }
  std::optional<size_t> unit_of(const torch::nn::Module& module) const;
  // Unit u's buffers given storage (values undefined) / their storage freed. The
  // parameters and every view of them (autograd's saved ones too) share it, so one release
  // frees the unit whoever still refers to it, and a gather before backward refills it.
  void allocate(size_t u);
  void release(size_t u);
  bool resident(size_t u) const;
  // Where unit u (allocated) holds `part` of the flat layout: a view of each of its buffers
  // that has some of it (one, or two where entries of both dtypes fall in `part`).
  std::vector<torch::Tensor> pieces(size_t u, const Shard& part) const;
  // This rank's values of `part` (which it must hold) copied into unit u's buffers, each
  // in its dtype.
  void fill(size_t u, const Shard& part) const;
  // `write(first, last)` sets the whole values of entries [first, last) (initialisation,
  // model.init_from) through value(): once for every entry, or under ZeRO-3 once per unit,
  // in a buffer of the unit's whole values around it that holds this rank's shard, of
  // which only the shard is kept afterwards (so no more than one unit is whole at a time).
  void write_whole(const std::function<void(size_t first, size_t last)>& write);
  // Entry i's values as a tensor of its shape, in the master dtype: a view into data(), or
  // under ZeRO-3 (within write_whole only) into the values being written.
  torch::Tensor value(size_t i) const;
  // The gradient buffer: laid out like data() over grad_held() (all of it, but for ZeRO-2).
  torch::Tensor& grad() { return grad_; }
  const torch::Tensor& grad() const { return grad_; }
  Shard grad_held() const { return grad_held_; }
  // The gradient of `part` of the flat layout (the whole by default), which the buffer
  // must hold.
  torch::Tensor grad_of(const Shard& part) const;
  const std::vector<Entry>& entries() const { return entries_; }
  // The parameter tensors autograd sees, one per entry.
  const std::vector<torch::Tensor>& params() const { return params_; }
  // The slice of a flat buffer laid out like the whole parameters that belongs to entry i.
  torch::Tensor view(const torch::Tensor& flat, size_t i) const;
  // The reverse: `t`, shaped like entry i, as a flat buffer lays it out (1-D).
  torch::Tensor flatten(const torch::Tensor& t, size_t i) const;
  void zero_grad() { grad_.zero_(); }
  // Rank `rank`'s equal, contiguous part of the buffers cut in `ranks` (FlatOptions::pad_to
  // must have made them divisible).
  Shard shard(int64_t ranks, int64_t rank) const;

  // What tensor rank `tensor_rank` writes of `flat` into a checkpoint, without gathering:
  // each split entry's local part (named entry.name + suffix, noted in `parts`), and the
  // replicated entries on tensor rank 0 only, or on every one where `every` (a live
  // recovery's state, which goes to the rank at the same place, not into a shared file).
  NamedTensors owned(const torch::Tensor& flat, const std::string& suffix, int64_t tensor_rank,
                     PartsOf& parts, bool every = false) const;
  // The reverse: each entry takes its part of the full tensor `entry.name + suffix` of
  // `saved` (CheckpointError on a missing or misshapen one).
  void scatter_full(torch::Tensor flat, const std::string& suffix, const SavedTensors& saved,
                    int64_t tensor_rank) const;
  // owned() as far as `shard` of the flat layout holds it: `shard_data` (that part of a
  // buffer: a ZeRO rank's optimizer slot) cut at the entries' bounds into 1-D pieces, each
  // one's place in its tensor noted in `ranges`; entries outside the shard are left out.
  NamedTensors owned_range(const torch::Tensor& shard_data, const Shard& shard,
                           const std::string& suffix, int64_t tensor_rank, PartsOf& parts,
                           RangesOf& ranges, bool every = false) const;
  // The reverse: `shard_data` takes its elements of each tensor `entry.name + suffix` of
  // `saved`, read one tensor at a time (never the whole buffer).
  void scatter_range(torch::Tensor shard_data, const Shard& shard, const std::string& suffix,
                     const SavedTensors& saved, int64_t tensor_rank) const;

 private:
  torch::Tensor shaped(const torch::Tensor& slot, size_t i) const;
  void make_units(const std::vector<torch::nn::Module*>& modules, const FlatOptions& opts);
  torch::Tensor data_, grad_;
  int64_t numel_ = 0;
  Shard data_held_, grad_held_;
  std::vector<Entry> entries_;
  std::vector<Unit> units_;
  std::map<const torch::nn::Module*, size_t> unit_at_;
  std::vector<torch::Tensor> params_;
  torch::MemoryFormat format_;
  // write_whole's unit and its whole values, while it runs.
  size_t writing_ = 0;
  torch::Tensor written_;
};

}  // namespace dtrain
