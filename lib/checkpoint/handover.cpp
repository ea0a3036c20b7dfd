#include "checkpoint/handover.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "util/clock.hpp"
#include "util/hash.hpp"

namespace dtrain {
namespace {

using json = nlohmann::json;

struct Held {
  StateFile file;
  std::string name;
  torch::Tensor tensor;
  std::optional<PartOf> part;    // of a tensor split over the replica's tensor ranks
  std::optional<RangeOf> range;  // of a tensor's elements (a ZeRO shard's piece of it)
};

json placement_record(const std::optional<PartOf>& part) {
  if (!part) return nullptr;
  const auto& p = part->placement;
  return {p.dim, p.parts, p.blocks, part->rank};
}

std::optional<PartOf> part_from(const json& j) {
  if (j.is_null()) return std::nullopt;
  return PartOf{Placement::split(j.at(0).get<int64_t>(), j.at(1).get<int64_t>(), j.at(2).get<int64_t>()),
                j.at(3).get<int64_t>()};
}

json range_record(const std::optional<RangeOf>& range) {
  if (!range) return nullptr;
  return {range->offset, range->shape, range->channels_last};
}

std::optional<RangeOf> range_from(const json& j) {
  if (j.is_null()) return std::nullopt;
  return RangeOf{j.at(0).get<int64_t>(), j.at(1).get<std::vector<int64_t>>(), j.at(2).get<bool>()};
}

// Where a file's tensors are read back: a shard's with the whole's (the checkpoint's
// merge of every data rank's ranges).
StateFile read_as(StateFile file) {
  if (file == StateFile::kOptimizerShard) return StateFile::kOptimizer;
  if (file == StateFile::kModelShard) return StateFile::kModel;
  return file;
}

// A range's piece as its tensor (`range.shape`, this tensor rank's part of it), the piece
// at its place in the flat layout's order of the elements and zeros elsewhere: the
// joiner's shard is the source's, so the scatter takes exactly the piece back.
torch::Tensor placed(const torch::Tensor& piece, const RangeOf& range) {
  const auto& shape = range.shape;
  auto whole = torch::zeros({c10::multiply_integers(shape)}, piece.options());
  whole.narrow(0, range.offset, piece.numel()).copy_(piece.reshape({-1}));
  if (!range.channels_last) return whole.view(shape);
  return whole.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2});  // NHWC's order
}

// A replica's state in memory. What a data rank keeps of its own (kReplica: error
// feedback's residuals, local SGD's own optimizer) is that replica's, lost with it: a
// joiner starts those afresh, as a component's constructor leaves them.
class MemoryWriter : public StateWriter {
 public:
  bool writes(StateFile file) const override { return file != StateFile::kReplica; }
  void add(StateFile file, const NamedTensors& tensors, const PartsOf& parts,
           const RangesOf& ranges) override {
    if (!writes(file)) return;
    for (const auto& [name, t] : tensors) {
      const auto part = parts.find(name);
      const auto range = ranges.find(name);
      held.push_back({file, name, t.detach(),
                      part != parts.end() ? std::optional<PartOf>(part->second) : std::nullopt,
                      range != ranges.end() ? std::optional<RangeOf>(range->second) : std::nullopt});
    }
  }
  void set(const std::string& key, json value) override { trainer[key] = std::move(value); }
  bool every_rank_whole() const override { return true; }

  std::vector<Held> held;
  json trainer = json::object();
  std::string job;  // the resolved job spec
};

class MemoryReader : public StateReader {
 public:
  MemoryReader(const MemoryWriter& state, ParallelDims layout, int64_t source)
      : state_(state), layout_(layout), origin_(fmt::format("replica {}'s state", source)) {}
  const std::string& folder() const override { return origin_; }
  bool has(StateFile file) const override { return !names(file).empty(); }
  std::vector<std::string> names(StateFile file) const override {
    std::vector<std::string> out;
    for (const auto& h : state_.held)
      if (read_as(h.file) == file) out.push_back(h.name);
    return out;
  }
  // Each member at the same place in its replica: a split tensor's part is this rank's,
  // and a shard's range (ZeRO inside the replica) this data rank's.
  SavedTensors tensors(StateFile file) const override {
    std::map<std::string, std::vector<int64_t>> shapes;
    std::map<std::string, const Held*> by_name;
    for (const auto& h : state_.held) {
      if (read_as(h.file) != file) continue;
      const auto local = h.range ? h.range->shape : h.tensor.sizes().vec();
      shapes[h.name] = h.part ? h.part->placement.full_shape(local) : local;
      by_name[h.name] = &h;
    }
    auto read = [by_name](const std::string& name, const Placement& placement, int64_t rank) {
      const Held& h = *by_name.at(name);
      const auto t = h.range ? placed(h.tensor, *h.range) : h.tensor;
      if (!h.part) return placement.is_split() ? placement.shard(t, rank) : t;
      const auto& p = h.part->placement;
      if (p.dim != placement.dim || p.parts != placement.parts || p.blocks != placement.blocks ||
          h.part->rank != rank)
        throw std::logic_error("live recovery: '" + name + "' is split otherwise in the source");
      return t;
    };
    return SavedTensors(shapes, read, origin_);
  }
  const json& trainer() const override { return state_.trainer; }
  std::string config_yaml() const override { return state_.job; }
  ParallelDims saved_layout() const override { return layout_; }
  ParallelDims layout() const override { return layout_; }
  void warn(const std::string&) const override {}  // kReplica's absence is by design
  bool this_rank_only() const override { return true; }

 private:
  const MemoryWriter& state_;
  ParallelDims layout_;
  std::string origin_;
};

MemoryWriter saved(const std::vector<Stateful*>& parts) {
  MemoryWriter out;
  for (auto* p : parts) p->save(out);
  return out;
}

// A tensor's bytes from `h`, hashed in pieces of 4 MiB side by side on the intra-op
// threads and the pieces' hashes folded in order: the same value whatever the threads.
uint64_t tensor_hash(const torch::Tensor& tensor, uint64_t h) {
  const auto t = tensor.to(torch::kCPU).contiguous();
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  const size_t n = size_t(t.numel()) * t.element_size();
  constexpr size_t kPiece = size_t(4) << 20;
  std::vector<uint64_t> pieces((n + kPiece - 1) / kPiece);
  at::parallel_for(0, int64_t(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (auto k = size_t(begin); k < size_t(end); ++k)
      pieces[k] = bytes_hash(bytes + k * kPiece, std::min(kPiece, n - k * kPiece), k);
  });
  for (uint64_t piece : pieces) h = splitmix64_mix(h ^ piece);
  return splitmix64_mix(h ^ n);
}

uint64_t hash_of(const MemoryWriter& state) {
  uint64_t h = fnv1a(state.trainer.dump());
  for (const auto& held : state.held)
    h = tensor_hash(held.tensor, splitmix64_mix(h ^ fnv1a(held.name)));
  return h;
}

// A held tensor's header entry: its file, name, type, shape, split and range, and whether
// it is on a GPU (last).
json entry_of(const Held& held) {
  return {int(held.file), held.name, int(held.tensor.scalar_type()), held.tensor.sizes().vec(),
          placement_record(held.part), range_record(held.range), held.tensor.is_cuda()};
}

// `source`'s header (every tensor's file, name, type, shape and split, and whether it is on
// a GPU; the trainer entries) on every member.
json header_from(Comm& group, int64_t source, const MemoryWriter& mine) {
  std::string text;
  if (group.rank() == source) {
    json h;
    h["trainer"] = mine.trainer;
    h["job"] = mine.job;
    for (const auto& held : mine.held) h["tensors"].push_back(entry_of(held));
    text = h.dump();
  }
  auto length = torch::tensor({int64_t(text.size())}, torch::kInt64);
  group.broadcast(length, source);
  auto bytes = torch::zeros({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == source) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  group.broadcast(bytes, source);
  const auto* p = static_cast<const char*>(bytes.data_ptr());
  return json::parse(std::string(p, p + bytes.numel()));
}

// The group ranks that take the state: the tensors go to them alone, from the source,
// each its own copy (a member that keeps its own state neither receives nor hashes
// gigabytes).
std::vector<int64_t> takers(Comm& group, bool takes) {
  const auto flags = group.all_gather(torch::tensor({int64_t(takes)}, torch::kInt64));
  std::vector<int64_t> out;
  for (size_t r = 0; r < flags.size(); ++r)
    if (flags[r].item<int64_t>() != 0) out.push_back(int64_t(r));
  return out;
}

// Where a joiner takes a header entry's tensor: into the tensor its own save gave for it
// where that is the same tensor (its file, name, type, shape, split and range alike,
// contiguous, on the device the source's is taken to): a view of its live state where the
// component saves one (the weights', the optimizer's flat buffers), so a join needs no
// second copy of the state on the device (a GPU filled by a large model's state would not
// hold one) and the load's copies are onto themselves. Elsewhere (a channels-last weight,
// a tensor a component makes as it saves) a new tensor where the source keeps it, a GPU's
// state straight onto this rank's GPU. (Over Gloo a GPU's state still passes through host
// memory, every tensor's at once; a ZeRO shard's piece is placed in a whole tensor of its
// own as it loads, one at a time.)
torch::Tensor landing(const json& entry, c10::Device device, const Held* own) {
  const bool on_device = entry.at(6).get<bool>() && device.is_cuda();
  if (own != nullptr && own->tensor.is_contiguous() && own->tensor.is_cuda() == on_device) {
    const json mine = entry_of(*own);  // the same entry but for the device it lies on
    if (std::equal(mine.begin(), mine.end() - 1, entry.begin())) return own->tensor;
  }
  return torch::empty(entry.at(3).get<std::vector<int64_t>>(),
                      torch::dtype(torch::ScalarType(entry.at(2).get<int>()))
                          .device(on_device ? device : torch::kCPU));
}

// The source's transfers: each tensor once for all joiners, on the device it is on (a
// group stages it where it must).
void add_sends(const MemoryWriter& state, const std::vector<int64_t>& joiners,
               std::vector<P2POp>& transfers) {
  if (joiners.empty()) return;
  for (const auto& held : state.held) {
    const auto t = held.tensor.contiguous();
    for (int64_t j : joiners) transfers.push_back({P2POp::kSend, t, j});
  }
}

// A joiner's transfers from `source`, of every tensor the header lists, each into the
// tensor landing() picks (its own state's, as it stands, where that is the same): what it
// takes goes into `got` as the source saved it, its bytes counted in `out`.
void add_receives(const json& header, const std::vector<Stateful*>& parts, int64_t source,
                  c10::Device device, MemoryWriter& got, Handover& out,
                  std::vector<P2POp>& transfers) {
  const MemoryWriter own = saved(parts);
  std::map<std::pair<int, std::string>, const Held*> places;
  for (const auto& h : own.held) places[{int(h.file), h.name}] = &h;
  for (const auto& entry : header.value("tensors", json::array())) {
    const auto file = StateFile(entry.at(0).get<int>());
    const auto name = entry.at(1).get<std::string>();
    const auto place = places.find({int(file), name});
    const Held* mine = place != places.end() ? place->second : nullptr;
    auto t = landing(entry, device, mine);
    transfers.push_back({P2POp::kRecv, t, source});
    out.bytes += t.nbytes();
    if (mine != nullptr && t.is_same(mine->tensor)) out.in_place += t.nbytes();
    got.held.push_back({file, name, t, part_from(entry.at(4)), range_from(entry.at(5))});
  }
}

}  // namespace

uint64_t state_hash(const std::vector<Stateful*>& parts) { return hash_of(saved(parts)); }

Handover hand_over(const std::vector<Stateful*>& parts, Comm& group, int64_t source,
                   bool receive, const ParallelDims& layout, const std::string& config_yaml,
                   c10::Device device) {
  const bool sends = group.rank() == source, takes = receive && !sends;
  const auto joiners = takers(group, takes);
  MemoryWriter state = sends ? saved(parts) : MemoryWriter();
  state.job = config_yaml;
  const json header = header_from(group, source, state);
  MemoryWriter got;
  got.trainer = header.at("trainer");
  got.job = header.at("job").get<std::string>();
  Handover out;
  std::vector<P2POp> transfers;
  if (sends) add_sends(state, joiners, transfers);
  if (takes) add_receives(header, parts, source, device, got, out, transfers);
  const auto started = Clock::now();
  std::unique_ptr<Pending> moving;
  if (!transfers.empty()) moving = group.exchange_async(std::move(transfers));
  // The joiners' state as loaded, against the source's (0 where it is neither): the
  // source hashes what it sends while it goes (nothing changes it meanwhile).
  if (sends) out.mine = hash_of(state);
  if (moving) moving->wait();
  if (takes) {
    const MemoryReader reader(got, layout, source);
    for (auto* p : parts) p->load(reader);
    out.seconds = ms_since(started) / 1e3;
    const auto hashing = Clock::now();
    out.mine = state_hash(parts);
    out.hash_seconds = ms_since(hashing) / 1e3;
  }
  const auto all = group.all_gather(torch::tensor({int64_t(out.mine)}, torch::kInt64));
  out.source = uint64_t(all[size_t(source)].item<int64_t>());
  return out;
}

}  // namespace dtrain
