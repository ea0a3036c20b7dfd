#include "parallel/flat_params.hpp"

#include <unordered_set>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "util/error.hpp"
#include "util/shape.hpp"

namespace dtrain {

SavedTensors::SavedTensors(const NamedTensors& tensors, std::string origin)
    : origin_(std::move(origin)) {
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  for (const auto& [name, t] : by_name) shapes_[name] = t.sizes().vec();
  read_ = [by_name = std::move(by_name)](const std::string& name, const Placement& placement,
                                         int64_t rank) {
    const auto& full = by_name.at(name);
    return placement.is_split() ? placement.shard(full, rank) : full;
  };
}

SavedTensors::SavedTensors(std::map<std::string, std::vector<int64_t>> shapes, Read read,
                           std::string origin)
    : shapes_(std::move(shapes)), read_(std::move(read)), origin_(std::move(origin)) {}

void SavedTensors::check(const std::string& name, const std::vector<int64_t>& shape) const {
  auto it = shapes_.find(name);
  if (it == shapes_.end())
    throw CheckpointError(fmt::format("{}: the model has '{}', the checkpoint does not", origin_,
                                      name));
  if (it->second != shape)
    throw CheckpointError(fmt::format("{}: '{}' has shape {} in the checkpoint, {} in the model",
                                      origin_, name, shape_str(it->second), shape_str(shape)));
}

torch::Tensor SavedTensors::at(const std::string& name, const std::vector<int64_t>& shape) const {
  check(name, shape);
  return read_(name, Placement::replicated(), 0);
}

torch::Tensor SavedTensors::part(const std::string& name, const std::vector<int64_t>& full_shape,
                                 const Placement& placement, int64_t rank) const {
  check(name, full_shape);
  return read_(name, placement, rank);
}

std::vector<int64_t> Placement::full_shape(std::vector<int64_t> local) const {
  if (is_split()) local[size_t(dim)] *= parts;
  return local;
}

torch::Tensor Placement::shard(const torch::Tensor& full, int64_t rank) const {
  if (!is_split()) return full.clone();
  std::vector<torch::Tensor> pieces;
  for (const auto& block : full.chunk(blocks, dim)) pieces.push_back(block.chunk(parts, dim)[rank]);
  return torch::cat(pieces, dim);
}

torch::Tensor Placement::assemble(const std::vector<torch::Tensor>& ranks) const {
  if (!is_split()) return ranks.at(0);
  std::vector<torch::Tensor> pieces;  // block by block, rank by rank within a block
  for (int64_t b = 0; b < blocks; ++b)
    for (const auto& part : ranks) pieces.push_back(part.chunk(blocks, dim)[b]);
  return torch::cat(pieces, dim);
}

std::map<std::string, Placement> placements_of(const torch::nn::Module& model) {
  std::map<std::string, Placement> placements;
  for (const auto& m : model.named_modules(/*name_prefix=*/"", /*include_self=*/true))
    if (auto* placed = dynamic_cast<const PlacedModule*>(m.value().get()))
      for (const auto& p : m.value()->named_parameters(/*recurse=*/false))
        placements[m.key().empty() ? p.key() : m.key() + "." + p.key()] = placed->placement_of(p.key());
  return placements;
}

FlatParams::FlatParams(torch::nn::Module& model, const FlatOptions& opts)
    : FlatParams(std::vector<torch::nn::Module*>{&model}, opts) {}

FlatParams::FlatParams(const std::vector<torch::nn::Module*>& modules, const FlatOptions& opts)
    : format_(opts.format) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t total = 0;
  for (auto* model : modules) {
    const auto placements = placements_of(*model);
    for (const auto& p : model->named_parameters(/*recurse=*/true)) {
      if (!seen.insert(p.value().unsafeGetTensorImpl()).second) continue;  // a tied parameter
      auto it = placements.find(p.key());
      Placement place = it == placements.end() ? Placement::replicated() : it->second;
      auto shape = p.value().sizes().vec();
      entries_.push_back({p.key(), total, p.value().numel(), shape, place.full_shape(shape), place});
      params_.push_back(p.value());
      total += p.value().numel();
    }
  }
  torch::NoGradGuard no_grad;
  auto options = torch::TensorOptions().dtype(opts.dtype).device(opts.device);
  const int64_t padded = (total + opts.pad_to - 1) / opts.pad_to * opts.pad_to;
  // Empty, not zeros: each page is first written by its own parameter, so a model that is
  // initialised here costs one copy of the weights, not two.
  data_ = torch::empty({padded}, options);
  data_.narrow(0, total, padded - total).zero_();
  if (padded % opts.grad_ranks != 0)
    throw std::logic_error("FlatOptions: pad_to must make the buffers cut in grad_ranks shards");
  grad_held_ = {opts.grad_rank * (padded / opts.grad_ranks), padded / opts.grad_ranks};
  grad_ = torch::zeros({grad_held_.numel}, options);
  for (size_t i = 0; i < entries_.size(); ++i) {
    auto& p = params_[i];
    auto slot = view(data_, i);
    if (opts.keep_values) slot.copy_(p);
    p.set_data(slot);
    // Backward accumulates straight into the flat gradient, unless it is a shard.
    if (opts.grad_ranks == 1) p.mutable_grad() = view(grad_, i);
  }
}

torch::Tensor FlatParams::grad_of(const Shard& part) const {
  const int64_t offset = part.offset, numel = part.numel < 0 ? data_.numel() - offset : part.numel;
  const int64_t from = offset - grad_held_.offset;
  if (from < 0 || from + numel > grad_held_.numel)
    throw std::logic_error(fmt::format("the gradient of [{}, {}) is not held here ([{}, {}))",
                                       offset, offset + numel, grad_held_.offset,
                                       grad_held_.offset + grad_held_.numel));
  return grad_.narrow(0, from, numel);
}

Shard FlatParams::shard(int64_t ranks, int64_t rank) const {
  const int64_t total = data_.numel();
  if (total % ranks != 0)
    throw std::logic_error(fmt::format("a flat buffer of {} cannot be cut in {} equal shards",
                                       total, ranks));
  return {rank * (total / ranks), total / ranks};
}

torch::Tensor FlatParams::view(const torch::Tensor& flat, size_t i) const {
  const auto& e = entries_[i];
  if (flat.numel() != data_.numel())
    throw std::logic_error(fmt::format("'{}': a buffer of {} values is not laid out like the "
                                       "parameters ({})", e.name, flat.numel(), data_.numel()));
  auto slot = flat.narrow(0, e.offset, e.numel);
  if (format_ == torch::MemoryFormat::ChannelsLast && e.shape.size() == 4)  // stored N,H,W,C
    return slot.view({e.shape[0], e.shape[2], e.shape[3], e.shape[1]}).permute({0, 3, 1, 2});
  return slot.view(e.shape);
}

torch::Tensor FlatParams::flatten(const torch::Tensor& t, size_t i) const {
  const auto& e = entries_[i];
  if (format_ == torch::MemoryFormat::ChannelsLast && e.shape.size() == 4)
    return t.permute({0, 2, 3, 1}).contiguous().view(-1);
  return t.contiguous().view(-1);
}

NamedTensors FlatParams::owned(const torch::Tensor& flat, const std::string& suffix,
                               int64_t tensor_rank, PartsOf& parts) const {
  NamedTensors out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (e.placement.is_split()) {
      parts[e.name + suffix] = PartOf{e.placement, tensor_rank};
      out.emplace_back(e.name + suffix, view(flat, i));
    } else if (tensor_rank == 0) {
      out.emplace_back(e.name + suffix, view(flat, i));
    }
  }
  return out;
}

namespace {
// The part of entry [offset, offset + numel) that `shard` holds: [first, last) of the
// buffer (empty when first >= last).
std::pair<int64_t, int64_t> overlap(const FlatParams::Entry& e, const Shard& shard) {
  const int64_t end = shard.numel < 0 ? e.offset + e.numel : shard.offset + shard.numel;
  return {std::max(e.offset, shard.offset), std::min(e.offset + e.numel, end)};
}
}  // namespace

NamedTensors FlatParams::owned_range(const torch::Tensor& shard_data, const Shard& shard,
                                     const std::string& suffix, int64_t tensor_rank,
                                     PartsOf& parts, RangesOf& ranges) const {
  NamedTensors out;
  for (const auto& e : entries_) {
    const auto [first, last] = overlap(e, shard);
    if (first >= last || (!e.placement.is_split() && tensor_rank != 0)) continue;
    const auto name = e.name + suffix;
    if (e.placement.is_split()) parts[name] = PartOf{e.placement, tensor_rank};
    ranges[name] = RangeOf{first - e.offset, e.shape,
                           format_ == torch::MemoryFormat::ChannelsLast && e.shape.size() == 4};
    out.emplace_back(name, shard_data.narrow(0, first - shard.offset, last - first));
  }
  return out;
}

void FlatParams::scatter_range(torch::Tensor shard_data, const Shard& shard,
                               const std::string& suffix, const SavedTensors& saved,
                               int64_t tensor_rank) const {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    const auto [first, last] = overlap(e, shard);
    if (first >= last) continue;
    const auto mine = flatten(saved.part(e.name + suffix, e.full_shape, e.placement, tensor_rank), i);
    shard_data.narrow(0, first - shard.offset, last - first)
        .copy_(mine.narrow(0, first - e.offset, last - first));
  }
}

void FlatParams::scatter_full(torch::Tensor flat, const std::string& suffix,
                              const SavedTensors& saved, int64_t tensor_rank) const {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    view(flat, i).copy_(saved.part(e.name + suffix, e.full_shape, e.placement, tensor_rank));
  }
}

}  // namespace dtrain
