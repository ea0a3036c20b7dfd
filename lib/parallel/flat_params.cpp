#include "parallel/flat_params.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <new>
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
  numel_ = (total + opts.pad_to - 1) / opts.pad_to * opts.pad_to;
  if (numel_ % opts.grad_ranks != 0 || numel_ % opts.param_ranks != 0)
    throw std::logic_error("FlatOptions: pad_to must make the buffers cut in equal shards");
  data_held_ = {opts.param_rank * (numel_ / opts.param_ranks), numel_ / opts.param_ranks};
  // Empty, not zeros: each page is first written by its own parameter, so a model that is
  // initialised here costs one copy of the weights, not two.
  data_ = torch::empty({data_held_.numel}, options);
  const int64_t held_end = data_held_.offset + data_held_.numel;
  const int64_t pad = std::clamp(total, data_held_.offset, held_end);  // the padding held here
  data_.narrow(0, pad - data_held_.offset, held_end - pad).zero_();
  grad_held_ = {opts.grad_rank * (numel_ / opts.grad_ranks), numel_ / opts.grad_ranks};
  grad_ = torch::zeros({grad_held_.numel}, options);
  if (opts.param_ranks > 1) {
    make_units(modules, opts);
  } else {
    for (size_t i = 0; i < entries_.size(); ++i) {
      auto slot = view(data_, i);
      if (opts.keep_values) slot.copy_(params_[i]);
      params_[i].set_data(slot);
    }
  }
  // Backward accumulates straight into the flat gradient, unless it is a shard.
  if (opts.grad_ranks == 1)
    for (size_t i = 0; i < entries_.size(); ++i) params_[i].mutable_grad() = view(grad_, i);
}

// ZeRO-3's units: each listed module's parameters, consecutive entries, in a buffer of
// their own; the values (when kept) go through the units into this rank's shard.
void FlatParams::make_units(const std::vector<torch::nn::Module*>& modules, const FlatOptions& opts) {
  std::map<const c10::TensorImpl*, size_t> entry_of;
  for (size_t i = 0; i < entries_.size(); ++i) entry_of[params_[i].unsafeGetTensorImpl()] = i;
  std::vector<std::optional<size_t>> unit_of(entries_.size());
  for (size_t m = 0; m < opts.units.size() && m < modules.size(); ++m)
    for (const auto* module : opts.units[m]) {
      size_t first = entries_.size(), last = 0;
      for (const auto& p : module->parameters()) {
        auto it = entry_of.find(p.unsafeGetTensorImpl());
        if (it == entry_of.end() || unit_of[it->second]) continue;  // tied: the first unit's
        first = std::min(first, it->second), last = std::max(last, it->second + 1);
        unit_of[it->second] = units_.size();
      }
      if (first >= last) continue;  // no parameters of its own
      for (size_t i = first; i < last; ++i)
        if (unit_of[i] != units_.size())
          throw std::logic_error(fmt::format("ZeRO-3: the parameters of '{}''s unit are not "
                                             "consecutive", entries_[first].name));
      const int64_t offset = entries_[first].offset;
      const int64_t numel = entries_[last - 1].offset + entries_[last - 1].numel - offset;
      unit_at_[module] = units_.size();
      units_.push_back({first, last, offset, numel, m,
                        torch::empty({numel}, data_.options())});
    }
  for (size_t i = 0; i < entries_.size(); ++i)
    if (!unit_of[i])
      throw std::logic_error(fmt::format("ZeRO-3: '{}' belongs to no unit forward runs", entries_[i].name));
  for (auto& u : units_)
    for (size_t i = u.first; i < u.last; ++i) {
      auto slot = shaped(u.buffer.narrow(0, entries_[i].offset - u.offset, entries_[i].numel), i);
      if (opts.keep_values) slot.copy_(params_[i]);
      params_[i].set_data(slot);
    }
  if (opts.keep_values)
    for (const auto& unit : units_) {  // as write_whole() ends
      auto [mine, there] = shard_part(unit);
      if (mine.defined()) mine.copy_(there);
    }
  for (size_t u = 0; u < units_.size(); ++u) release(u);
}

std::pair<torch::Tensor, torch::Tensor> FlatParams::shard_part(const Unit& unit) const {
  const int64_t lo = std::max(unit.offset, data_held_.offset);
  const int64_t hi = std::min(unit.offset + unit.numel, data_held_.offset + data_held_.numel);
  if (lo >= hi) return {};
  return {data_.narrow(0, lo - data_held_.offset, hi - lo), unit.buffer.narrow(0, lo - unit.offset, hi - lo)};
}

std::optional<size_t> FlatParams::unit_of(const torch::nn::Module& module) const {
  auto it = unit_at_.find(&module);
  if (it == unit_at_.end()) return std::nullopt;
  return it->second;
}

namespace {
// Pages of their own for a unit on the CPU, returned to the system when it is released:
// from glibc's heap (below its 32 MiB mmap threshold, util/memory.cpp) a freed unit would
// stay in the process's memory, which is what ZeRO-3 frees it for.
struct Mapped {
  void* at;
  size_t bytes;
};
void unmap(void* ctx) {
  auto* m = static_cast<Mapped*>(ctx);
  munmap(m->at, m->bytes);
  delete m;
}
at::DataPtr map_pages(size_t bytes, const c10::Device& device) {
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) throw std::bad_alloc();
  return at::DataPtr(at, new Mapped{at, bytes}, &unmap, device);
}
}  // namespace

void FlatParams::allocate(size_t u) {
  if (resident(u)) return;
  auto& unit = units_.at(u);
  auto* storage = unit.buffer.storage().unsafeGetStorageImpl();
  const size_t bytes = size_t(unit.numel) * unit.buffer.element_size();
  storage->set_data_ptr_noswap(unit.buffer.is_cpu() && bytes > 0
                                   ? map_pages(bytes, unit.buffer.device())
                                   : storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

void FlatParams::release(size_t u) {
  auto* storage = units_.at(u).buffer.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, units_[u].buffer.device()));
  storage->set_nbytes(0);
}

bool FlatParams::resident(size_t u) const {
  return units_.at(u).buffer.storage().nbytes() > 0;
}

void FlatParams::write_whole(const std::function<void(size_t first, size_t last)>& write) {
  if (!sharded()) return write(0, entries_.size());
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& unit = units_[u];
    allocate(u);
    // The unit's part in this rank's shard: in before (what `write` leaves alone keeps
    // its value), out after.
    auto [mine, there] = shard_part(unit);
    if (mine.defined()) there.copy_(mine);
    try {
      write(unit.first, unit.last);
    } catch (...) {
      release(u);
      throw;
    }
    if (mine.defined()) mine.copy_(there);
    release(u);
  }
}

torch::Tensor FlatParams::value(size_t i) const {
  if (!sharded()) return view(data_, i);
  for (const auto& u : units_)
    if (i >= u.first && i < u.last)
      return shaped(u.buffer.narrow(0, entries_[i].offset - u.offset, entries_[i].numel), i);
  throw std::logic_error("FlatParams::value: an entry in no unit");
}

namespace {
// `part` of the flat layout within `buffer`, which holds `held` of it.
torch::Tensor held_part(const torch::Tensor& buffer, const Shard& held, const Shard& part,
                        int64_t total, const char* what) {
  const int64_t offset = part.offset, numel = part.numel < 0 ? total - offset : part.numel;
  const int64_t from = offset - held.offset;
  if (from < 0 || from + numel > held.numel)
    throw std::logic_error(fmt::format("the {} of [{}, {}) is not held here ([{}, {}))", what,
                                       offset, offset + numel, held.offset,
                                       held.offset + held.numel));
  return buffer.narrow(0, from, numel);
}
}  // namespace

torch::Tensor FlatParams::grad_of(const Shard& part) const {
  return held_part(grad_, grad_held_, part, numel_, "gradient");
}

torch::Tensor FlatParams::data_of(const Shard& part) const {
  return held_part(data_, data_held_, part, numel_, "parameters");
}

Shard FlatParams::shard(int64_t ranks, int64_t rank) const {
  const int64_t total = numel_;
  if (total % ranks != 0)
    throw std::logic_error(fmt::format("a flat buffer of {} cannot be cut in {} equal shards",
                                       total, ranks));
  return {rank * (total / ranks), total / ranks};
}

torch::Tensor FlatParams::view(const torch::Tensor& flat, size_t i) const {
  const auto& e = entries_[i];
  if (flat.numel() != numel_)
    throw std::logic_error(fmt::format("'{}': a buffer of {} values is not laid out like the "
                                       "parameters ({})", e.name, flat.numel(), numel_));
  return shaped(flat.narrow(0, e.offset, e.numel), i);
}

torch::Tensor FlatParams::shaped(const torch::Tensor& slot, size_t i) const {
  const auto& e = entries_[i];
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
