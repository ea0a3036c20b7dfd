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

std::set<std::string> cast_by_autocast(const torch::nn::Module& model) {
  std::set<std::string> cast;
  for (const auto& m : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const auto* module = m.value().get();
    const auto* declares = dynamic_cast<const CastModule*>(module);
    const bool torch_weight = dynamic_cast<const torch::nn::LinearImpl*>(module) ||
                              dynamic_cast<const torch::nn::Conv2dImpl*>(module);
    for (const auto& p : module->named_parameters(/*recurse=*/false))
      if (declares ? declares->cast_by_autocast(p.key()) : torch_weight && p.key() == "weight")
        cast.insert(m.key().empty() ? p.key() : m.key() + "." + p.key());
  }
  return cast;
}

FlatSizes flat_sizes(const FlatOptions& opts, int64_t total) {
  const int64_t numel = (total + opts.pad_to - 1) / opts.pad_to * opts.pad_to;
  if (numel % opts.grad_ranks != 0 || numel % opts.param_ranks != 0)
    throw std::logic_error("FlatOptions: pad_to must make the buffers cut in equal shards");
  return {numel, numel / opts.param_ranks, numel / opts.grad_ranks};
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
  const FlatSizes sizes = flat_sizes(opts, total);
  numel_ = sizes.numel;
  data_held_ = {opts.param_rank * sizes.params, sizes.params};
  // Empty, not zeros: each page is first written by its own parameter, so a model that is
  // initialised here costs one copy of the weights, not two.
  data_ = torch::empty({data_held_.numel}, options);
  const int64_t held_end = data_held_.offset + data_held_.numel;
  const int64_t pad = std::clamp(total, data_held_.offset, held_end);  // the padding held here
  data_.narrow(0, pad - data_held_.offset, held_end - pad).zero_();
  grad_held_ = {opts.grad_rank * sizes.grads, sizes.grads};
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

namespace {
// The part of entry [offset, offset + numel) that `shard` holds: [first, last) of the
// buffer (empty when first >= last).
std::pair<int64_t, int64_t> overlap(const FlatParams::Entry& e, const Shard& shard) {
  const int64_t end = shard.numel < 0 ? e.offset + e.numel : shard.offset + shard.numel;
  return {std::max(e.offset, shard.offset), std::min(e.offset + e.numel, end)};
}
}  // namespace

// ZeRO-3's units: each listed module's parameters, consecutive entries, in buffers of
// their own; the values (when kept) go into this rank's shard.
void FlatParams::make_units(const std::vector<torch::nn::Module*>& modules, const FlatOptions& opts) {
  std::map<const c10::TensorImpl*, size_t> entry_of;
  for (size_t i = 0; i < entries_.size(); ++i) entry_of[params_[i].unsafeGetTensorImpl()] = i;
  if (opts.compute_dtype != opts.dtype &&
      (opts.compute_dtype == torch::kBFloat16 || opts.compute_dtype == torch::kHalf)) {
    // Held in the compute dtype where every name of the parameter is cast anyway.
    for (auto& e : entries_) e.low = true;
    for (auto* model : modules) {
      const auto cast = cast_by_autocast(*model);
      for (const auto& p : model->named_parameters(/*recurse=*/true))
        if (!cast.count(p.key())) entries_[entry_of.at(p.value().unsafeGetTensorImpl())].low = false;
    }
  }
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
      int64_t held[2] = {0, 0};  // the master dtype's, the compute dtype's
      for (size_t i = first; i < last; ++i) {
        auto& e = entries_[i];
        e.packed = held[e.low];
        held[e.low] += e.numel;
      }
      const int64_t offset = entries_[first].offset;
      const int64_t numel = entries_[last - 1].offset + entries_[last - 1].numel - offset;
      unit_at_[module] = units_.size();
      units_.push_back({first, last, offset, numel, m, torch::empty({held[0]}, data_.options()),
                        torch::empty({held[1]}, data_.options().dtype(opts.compute_dtype))});
    }
  for (size_t i = 0; i < entries_.size(); ++i)
    if (!unit_of[i])
      throw std::logic_error(fmt::format("ZeRO-3: '{}' belongs to no unit forward runs", entries_[i].name));
  for (auto& u : units_)
    for (size_t i = u.first; i < u.last; ++i) {
      const auto& e = entries_[i];
      const auto [lo, hi] = overlap(e, data_held_);
      if (opts.keep_values && lo < hi)  // this rank's part of it, into its shard
        data_.narrow(0, lo - data_held_.offset, hi - lo)
            .copy_(flatten(params_[i], i).narrow(0, lo - e.offset, hi - lo));
      params_[i].set_data(shaped((e.low ? u.low : u.buffer).narrow(0, e.packed, e.numel), i));
    }
  for (size_t u = 0; u < units_.size(); ++u) release(u);
}

std::optional<size_t> FlatParams::unit_of(const torch::nn::Module& module) const {
  const auto it = unit_at_.find(&module);
  return it == unit_at_.end() ? std::nullopt : std::optional<size_t>(it->second);
}

namespace {
// Pages of their own for a unit on the CPU, returned to the system when it is released:
// from LibTorch's allocator a freed unit would stay in the process (glibc's heap below
// 2 MiB, the block cache above: util/memory.cpp), which is what ZeRO-3 frees it for.
void* map_bytes(size_t bytes) {
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) throw std::bad_alloc();
  return at;
}
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
  void* at = map_bytes(bytes);
  return at::DataPtr(at, new Mapped{at, bytes}, &unmap, device);
}
// An empty tensor of `numel` values, on pages of its own on the CPU.
torch::Tensor own_pages(int64_t numel, const torch::TensorOptions& options) {
  const size_t bytes = size_t(numel) * options.dtype().itemsize();
  if (options.device().type() != c10::DeviceType::CPU || bytes == 0) return torch::empty({numel}, options);
  return torch::from_blob(map_bytes(bytes), {numel}, [bytes](void* at) { munmap(at, bytes); }, options);
}
}  // namespace

void FlatParams::allocate(size_t u) {
  if (resident(u)) return;
  const auto& unit = units_.at(u);
  // `low` first: resident() asks `buffer` where it has values, so a failure between the
  // two leaves the unit not resident.
  for (const auto* buffer : {&unit.low, &unit.buffer}) {
    const size_t bytes = size_t(buffer->numel()) * buffer->element_size();
    if (bytes == 0) continue;
    auto* storage = buffer->storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(buffer->is_cpu() ? map_pages(bytes, buffer->device())
                                                  : storage->allocator()->allocate(bytes));
    storage->set_nbytes(bytes);
  }
}

void FlatParams::release(size_t u) {
  const auto& unit = units_.at(u);
  for (const auto* buffer : {&unit.buffer, &unit.low}) {
    auto* storage = buffer->storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, buffer->device()));
    storage->set_nbytes(0);
  }
}

bool FlatParams::resident(size_t u) const {
  const auto& unit = units_.at(u);
  return (unit.buffer.numel() > 0 ? unit.buffer : unit.low).storage().nbytes() > 0;
}

std::vector<torch::Tensor> FlatParams::pieces(size_t u, const Shard& part) const {
  const auto& unit = units_.at(u);
  // A buffer's entries within `part` lie one after another in it: [from, to) of it.
  int64_t from[2] = {-1, -1}, to[2] = {0, 0};
  for (size_t i = unit.first; i < unit.last; ++i) {
    const auto& e = entries_[i];
    const auto [lo, hi] = overlap(e, part);
    if (lo >= hi) continue;
    if (from[e.low] < 0) from[e.low] = e.packed + lo - e.offset;
    to[e.low] = e.packed + hi - e.offset;
  }
  std::vector<torch::Tensor> out;
  for (int k : {0, 1})
    if (from[k] >= 0) out.push_back((k ? unit.low : unit.buffer).narrow(0, from[k], to[k] - from[k]));
  return out;
}

void FlatParams::fill(size_t u, const Shard& part) const {
  torch::NoGradGuard no_grad;
  const auto& unit = units_.at(u);
  for (size_t i = unit.first; i < unit.last; ++i) {
    const auto& e = entries_[i];
    const auto [lo, hi] = overlap(e, part);
    if (lo >= hi) continue;
    (e.low ? unit.low : unit.buffer).narrow(0, e.packed + lo - e.offset, hi - lo).copy_(data_of({lo, hi - lo}));
  }
}

void FlatParams::write_whole(const std::function<void(size_t first, size_t last)>& write) {
  if (!sharded()) return write(0, entries_.size());
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& unit = units_[u];
    // The unit's part in this rank's shard: in before (what `write` leaves alone keeps
    // its value), out after. The whole values are in the master dtype whatever the unit
    // holds while gathered.
    const int64_t lo = std::max(unit.offset, data_held_.offset);
    const int64_t hi = std::min(unit.offset + unit.numel, data_held_.offset + data_held_.numel);
    writing_ = u;
    written_ = own_pages(unit.numel, data_.options());
    if (lo < hi) written_.narrow(0, lo - unit.offset, hi - lo).copy_(data_of({lo, hi - lo}));
    try {
      write(unit.first, unit.last);
    } catch (...) {
      written_ = torch::Tensor();
      throw;
    }
    if (lo < hi) data_of({lo, hi - lo}).copy_(written_.narrow(0, lo - unit.offset, hi - lo));
    written_ = torch::Tensor();
  }
}

torch::Tensor FlatParams::value(size_t i) const {
  if (!sharded()) return view(data_, i);
  const auto& unit = units_.at(writing_);
  if (!written_.defined() || i < unit.first || i >= unit.last)
    throw std::logic_error("FlatParams::value: under ZeRO-3, only the unit write_whole writes");
  return shaped(written_.narrow(0, entries_[i].offset - unit.offset, entries_[i].numel), i);
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
  if (numel_ % ranks != 0)
    throw std::logic_error(fmt::format("a flat buffer of {} cannot be cut in {} equal shards",
                                       numel_, ranks));
  return {rank * (numel_ / ranks), numel_ / ranks};
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
                               int64_t tensor_rank, PartsOf& parts, bool every) const {
  NamedTensors out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (!e.placement.is_split() && tensor_rank != 0 && !every) continue;
    if (e.placement.is_split()) parts[e.name + suffix] = PartOf{e.placement, tensor_rank};
    out.emplace_back(e.name + suffix, view(flat, i));
  }
  return out;
}

NamedTensors FlatParams::owned_range(const torch::Tensor& shard_data, const Shard& shard,
                                     const std::string& suffix, int64_t tensor_rank,
                                     PartsOf& parts, RangesOf& ranges, bool every) const {
  NamedTensors out;
  for (const auto& e : entries_) {
    const auto [first, last] = overlap(e, shard);
    if (first >= last || (!e.placement.is_split() && tensor_rank != 0 && !every)) continue;
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
