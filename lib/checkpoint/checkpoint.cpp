#include "checkpoint/checkpoint.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "util/shape.hpp"
#include "util/strings.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

// The kind of tensors a checkpoint file holds, from its name: "model.pp1.tp0.safetensors"
// holds "model", "sync.dp1.safetensors" "sync.dp1", a ZeRO shard "optimizer.dp1.safetensors"
// "optimizer" (every data rank's shard makes up the one state; "model.dp1" under ZeRO-3
// "model"); "" for files that hold no tensors.
std::string kind_of(const std::string& file) {
  const std::string ext = ".safetensors";
  if (!ends_with(file, ext)) return "";
  std::string stem = file.substr(0, file.size() - ext.size());
  for (const char* axis : {".tp", ".pp"}) {  // the part's suffixes, last first
    const auto at = stem.rfind(axis);
    if (at != std::string::npos && at + 3 < stem.size() &&
        std::all_of(stem.begin() + long(at) + 3, stem.end(), ::isdigit))
      stem.resize(at);
  }
  for (const std::string kind : {"model", "optimizer"}) {  // a ZeRO shard of one
    const std::string head = kind + ".dp";
    if (stem.rfind(head, 0) == 0 && stem.size() > head.size() &&
        std::all_of(stem.begin() + long(head.size()), stem.end(), ::isdigit))
      return kind;
  }
  if (stem == "model" || stem == "optimizer" || stem.rfind("sync.dp", 0) == 0) return stem;
  return "";
}

// Where step's checkpoint is written before the rename that makes it one.
std::string temp_in(const std::string& checkpoints, int64_t step) {
  return (fs::path(checkpoints) / (".tmp-" + checkpoint_name(step))).string();
}

}  // namespace

CheckpointStore::CheckpointStore(std::string run_dir, const CheckpointConfig& cfg)
    : dir_((fs::path(run_dir) / "checkpoints").string()), cfg_(cfg), timeline_(dir_) {
  fs::create_directories(dir_);
}

void CheckpointStore::discard_partial() {
  // A crash mid-save leaves a temporary folder that never became a checkpoint.
  for (const auto& e : fs::directory_iterator(dir_))
    if (e.path().filename().string().rfind(".tmp-", 0) == 0) remove_tree(e.path().string());
}

std::string CheckpointStore::temp_folder(const std::string& run_dir, int64_t step) {
  return temp_in((fs::path(run_dir) / "checkpoints").string(), step);
}

void CheckpointStore::begin(int64_t step) {
  remove_tree(temp_in(dir_, step));
  fs::create_directories(temp_in(dir_, step));
}

namespace {

// A split tensor's part in a file's metadata: "part:NAME" = "dim,parts,blocks,rank"; a
// ZeRO shard's range of a tensor (or of its part): "range:NAME" = "offset;d0,d1,...;order"
// (the part's shape; order "rows", or "nhwc" for a channels-last 4-d weight).
constexpr const char* kPartKey = "part:";
constexpr const char* kRangeKey = "range:";

std::map<std::string, std::string> file_metadata(const std::string& format,
                                                 const NamedTensors& tensors,
                                                 const PartsOf& parts, const RangesOf& ranges = {}) {
  std::map<std::string, std::string> meta{{"format", format}};
  for (const auto& [name, t] : tensors) {
    if (auto it = parts.find(name); it != parts.end()) {
      const auto& p = it->second.placement;
      meta[kPartKey + name] = fmt::format("{},{},{},{}", p.dim, p.parts, p.blocks, it->second.rank);
    }
    if (auto it = ranges.find(name); it != ranges.end()) {
      const auto& r = it->second;
      meta[kRangeKey + name] = fmt::format("{};{};{}", r.offset, fmt::join(r.shape, ","),
                                           r.channels_last ? "nhwc" : "rows");
    }
  }
  return meta;
}

std::optional<RangeOf> range_of(const std::map<std::string, std::string>& meta,
                                const std::string& name, const std::string& file, int64_t numel) {
  auto it = meta.find(kRangeKey + name);
  if (it == meta.end()) return std::nullopt;
  const auto bad = [&] {
    return CheckpointError(fmt::format("{}: unreadable range record for '{}' ('{}')", file, name,
                                       it->second));
  };
  const auto& text = it->second;
  const auto a = text.find(';'), b = text.rfind(';');
  if (a == std::string::npos || a == b) throw bad();
  RangeOf r;
  try {
    r.offset = std::stoll(text.substr(0, a));
    std::stringstream dims(text.substr(a + 1, b - a - 1));
    for (std::string d; std::getline(dims, d, ',');) r.shape.push_back(std::stoll(d));
  } catch (const std::exception&) {
    throw bad();
  }
  const auto order = text.substr(b + 1);
  r.channels_last = order == "nhwc";
  const bool negative = std::any_of(r.shape.begin(), r.shape.end(), [](int64_t d) { return d < 0; });
  if ((order != "rows" && order != "nhwc") || (r.channels_last && r.shape.size() != 4) ||
      negative || r.offset < 0 || r.offset + numel > shape_numel(r.shape))
    throw bad();
  return r;
}

std::optional<PartOf> part_of(const std::map<std::string, std::string>& meta,
                              const std::string& name, const std::string& file) {
  auto it = meta.find(kPartKey + name);
  if (it == meta.end()) return std::nullopt;
  PartOf p;
  char tail = 0;
  if (std::sscanf(it->second.c_str(), "%ld,%ld,%ld,%ld%c", &p.placement.dim, &p.placement.parts,
                  &p.placement.blocks, &p.rank, &tail) != 4 ||
      !p.placement.is_split() || p.placement.blocks < 1 || p.rank < 0 ||
      p.rank >= p.placement.parts)
    throw CheckpointError(fmt::format("{}: unreadable part record for '{}' ('{}')", file, name,
                                      it->second));
  return p;
}

}  // namespace

void CheckpointStore::write_part(const std::string& temp, const std::string& part,
                                 const NamedTensors& model, const NamedTensors& optimizer,
                                 const PartsOf& parts, bool with_optimizer, bool with_model) {
  auto write = [&](const std::string& kind, const NamedTensors& tensors) {
    write_safetensors((fs::path(temp) / (kind + part + ".safetensors")).string(), tensors,
                      file_metadata("dtrain-" + kind, tensors, parts));
  };
  if (with_model) write("model", model);
  if (with_optimizer) write("optimizer", optimizer);
}

void CheckpointStore::write_shard(const std::string& temp, const std::string& kind,
                                  int64_t data_rank, const std::string& part,
                                  const NamedTensors& state, const PartsOf& parts,
                                  const RangesOf& ranges) {
  write_safetensors(
      (fs::path(temp) / fmt::format("{}.dp{}{}.safetensors", kind, data_rank, part)).string(),
      state, file_metadata("dtrain-" + kind, state, parts, ranges));
}

void CheckpointStore::abort(int64_t step) {
  try {  // never leave a partial folder filling the disk
    remove_tree(temp_in(dir_, step));
  } catch (const std::exception&) {  // the first error is the one to report
  }
}

std::string CheckpointStore::commit(const CheckpointState& state, int64_t step, int64_t epoch,
                                    const nlohmann::json& layout,
                                    const std::optional<Metric>& metric) {
  const std::string name = checkpoint_name(step);
  const fs::path tmp = temp_in(dir_, step), final_path = fs::path(dir_) / name;
  nlohmann::json scored;  // the manifest's metric, which `best` compares
  if (metric)
    scored = {{"name", metric->name}, {"value", metric->value},
              {"higher_is_better", metric->higher_is_better}};
  try {
    write_file_synced((tmp / "trainer.json").string(), state.trainer.dump(1) + "\n");
    write_file_synced((tmp / "config.yaml").string(), state.config_yaml);
    nlohmann::json manifest{{"format", "dtrain-checkpoint"}, {"version", kCheckpointVersion},
                            {"step", step}, {"epoch", epoch}, {"layout", layout},
                            {"created_unix", unix_time()}};
    if (metric) manifest["metric"] = scored;
    if (!state.run_id.empty()) manifest["run_id"] = state.run_id;
    // Every file the writers left, each part included: the manifest is the completion
    // record, so a part that is missing or damaged later fails verification.
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(tmp))
      if (e.is_regular_file()) files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    for (const auto& f : files)
      manifest["files"].push_back({{"name", f},
                                   {"bytes", fs::file_size(tmp / f)},
                                   {"crc32", crc32_of_file((tmp / f).string())}});
    write_file_synced((tmp / "manifest.json").string(), manifest.dump(1) + "\n");
    fsync_dir(tmp.string());

    remove_tree(final_path.string());  // a re-save of the same step (e.g. after a restart)
    fs::rename(tmp, final_path);
    fsync_dir(dir_);
  } catch (const std::exception& e) {
    abort(step);
    throw CheckpointError(fmt::format("cannot write the checkpoint of step {} in '{}': {}", step,
                                      dir_, first_line(e.what())));
  }
  try {
    timeline_.advance(name, scored, cfg_.keep_best);
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("cannot point {}/latest at the checkpoint of step {}: {}",
                                      dir_, step, first_line(e.what())));
  }
  prune();
  return final_path.string();
}

void CheckpointStore::prune() {
  const auto names = timeline_.line();
  std::optional<std::string> best;
  if (cfg_.keep_best) {
    try {
      best = timeline_.best();
    } catch (const CheckpointError&) {  // an unreadable pointer protects nothing
    }
  }
  const size_t keep = static_cast<size_t>(cfg_.keep_last);
  for (size_t i = 0; i + keep < names.size(); ++i) {
    const auto folder = (fs::path(dir_) / names[i]).string();
    if (!best || *best != folder) remove_tree(folder);
  }
}

nlohmann::json verify_checkpoint(const std::string& folder) {
  const fs::path dir(folder), manifest_path = dir / "manifest.json";
  std::error_code ec;
  fail_if<CheckpointError>(!fs::is_directory(dir, ec), "checkpoint '{}' does not exist", folder);
  if (!fs::exists(manifest_path, ec)) {
    // A folder dtrain wrote holds trainer.json from the start; one without it is something
    // else, e.g. a Hugging Face folder that lost its config.json.
    if (!fs::exists(dir / "trainer.json", ec))
      throw CheckpointError(fmt::format("'{}' has neither manifest.json (a dtrain checkpoint) nor "
                                        "config.json (a Hugging Face GPT-2 folder)", folder));
    throw CheckpointError(fmt::format("checkpoint '{}' has no manifest.json (incomplete)", folder));
  }
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_file(manifest_path.string()));
    fail_if<CheckpointError>(m.at("format") != "dtrain-checkpoint", "{}: not a dtrain checkpoint",
                             manifest_path.string());
    const int version = m.at("version").get<int>();
    fail_if<CheckpointError>(version > kCheckpointVersion, "{}: format version {} is newer than "
                             "this dtrain ({})", manifest_path.string(), version, kCheckpointVersion);
    for (const auto& f : m.at("files")) {
      const auto name = f.at("name").get<std::string>();
      const auto path = dir / name;
      fail_if<CheckpointError>(!fs::exists(path, ec), "checkpoint '{}' is missing {}", folder, name);
      fail_if<CheckpointError>(fs::file_size(path) != f.at("bytes").get<uint64_t>() ||
                                   crc32_of_file(path.string()) != f.at("crc32").get<uint32_t>(),
                               "checkpoint '{}': {} is corrupt (size or checksum differs from the "
                               "manifest)", folder, name);
    }
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: unreadable manifest ({})", manifest_path.string(),
                                      e.what()));
  } catch (const std::runtime_error& e) {
    if (dynamic_cast<const CheckpointError*>(&e)) throw;
    throw CheckpointError(e.what());
  }
  return m;
}

CheckpointReader::CheckpointReader(const std::string& folder)
    : folder_(folder), manifest_(verify_checkpoint(folder)) {
  const fs::path dir(folder);
  // Every writer's part, in the manifest's (name) order; a name two parts hold whole (the
  // optimizer's step count) is taken from the first, and a split tensor's parts (one per
  // tensor rank) are kept together, every one required.
  std::vector<std::string> kind_of_file;
  for (const auto& f : manifest_.at("files")) {
    const auto file = f.at("name").get<std::string>();
    const auto kind = kind_of(file);
    if (kind.empty()) continue;
    files_.push_back(index_safetensors((dir / file).string()));
    kind_of_file.push_back(kind);
  }
  for (size_t i = 0; i < files_.size(); ++i) {
    const auto& file = files_[i];
    Kind& kind = kinds_[kind_of_file[i]];
    for (const auto& e : file.entries) {
      const auto part = part_of(file.metadata, e.name, file.path);
      const auto range = range_of(file.metadata, e.name, file.path, shape_numel(e.shape));
      fail_if<CheckpointError>(range && e.shape.size() != 1,
                               "{}: '{}' is a range of a tensor but not 1-d", file.path, e.name);
      const auto local = range ? range->shape : e.shape;  // the tensor rank's part's shape
      auto [it, fresh] = kind.stored.try_emplace(e.name);
      Stored& st = it->second;
      if (fresh) {
        kind.order.push_back(e.name);
        st.placement = part ? part->placement : Placement::replicated();
        st.full_shape = st.placement.full_shape(local);
        if (range) st.ranged = RangeOf{0, range->shape, range->channels_last};
      } else if (!range && !st.ranged && (!part || !st.placement.is_split())) {
        continue;  // held whole by several parts: the first one
      }
      fail_if<CheckpointError>(
          bool(range) != bool(st.ranged) ||
              (range && (range->shape != st.ranged->shape ||
                         range->channels_last != st.ranged->channels_last)),
          "checkpoint '{}': the parts of '{}' disagree on its ranges", folder, e.name);
      fail_if<CheckpointError>(
          bool(part) != st.placement.is_split() ||
              (part && (st.placement.dim != part->placement.dim ||
                        st.placement.parts != part->placement.parts ||
                        st.placement.blocks != part->placement.blocks ||
                        st.placement.full_shape(local) != st.full_shape)),
          "checkpoint '{}': the parts of '{}' disagree on its split", folder, e.name);
      st.pieces.push_back(Piece{i, &e, part ? part->rank : 0, range ? range->offset : -1});
    }
  }
  for (const char* kind : {"model", "optimizer"})
    fail_if<CheckpointError>(!kinds_.count(kind), "checkpoint '{}' has no {} tensors", folder, kind);
  for (auto& [kind, held] : kinds_)
    for (auto& [name, st] : held.stored) check_pieces(name, st);
}

// Every tensor rank's part there once, and of one saved in ranges every element once.
void CheckpointReader::check_pieces(const std::string& name, Stored& st) const {
  std::sort(st.pieces.begin(), st.pieces.end(), [](const Piece& a, const Piece& b) {
    return std::tie(a.rank, a.offset) < std::tie(b.rank, b.offset);
  });
  const int64_t parts = st.placement.is_split() ? st.placement.parts : 1;
  auto it = st.pieces.begin();
  for (int64_t r = 0; r < parts; ++r) {
    fail_if<CheckpointError>(it == st.pieces.end() || it->rank != r,
                             "checkpoint '{}' lacks tensor rank {}'s part of '{}'", folder_, r, name);
    if (!st.ranged) {
      ++it;
      continue;
    }
    // The data ranks' shards, side by side: each range starts where the one before ends.
    const int64_t total = shape_numel(st.ranged->shape);
    int64_t at = 0;
    for (; it != st.pieces.end() && it->rank == r; ++it) {
      fail_if<CheckpointError>(it->offset != at,
                               "checkpoint '{}': elements [{}, {}) of '{}' are {} (a ZeRO shard's "
                               "file missing or foreign)", folder_, std::min(at, it->offset),
                               std::max(at, it->offset), name,
                               it->offset > at ? "in no file" : "in two files");
      at += it->entry->shape.at(0);
    }
    fail_if<CheckpointError>(at != total, "checkpoint '{}': elements [{}, {}) of '{}' are in no "
                             "file (a ZeRO shard's file missing)", folder_, at, total, name);
  }
  fail_if<CheckpointError>(!st.ranged && it != st.pieces.end(),
                           "checkpoint '{}' holds tensor rank {}'s part of '{}' twice", folder_,
                           it == st.pieces.end() ? 0 : it->rank, name);
}

nlohmann::json CheckpointReader::trainer() const {
  const auto path = (fs::path(folder_) / "trainer.json").string();
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: {}", path, e.what()));
  }
}

std::string CheckpointReader::config_yaml() const {
  return read_file((fs::path(folder_) / "config.yaml").string());
}

torch::Tensor CheckpointReader::read_part(const Stored& st, int64_t rank) const {
  auto piece = [&](const Piece& p) { return read_tensor(files_[p.file], *p.entry); };
  std::vector<torch::Tensor> ranges;
  for (const auto& p : st.pieces)
    if (p.rank == rank) {
      if (!st.ranged) return piece(p);
      ranges.push_back(piece(p));
    }
  // Side by side, in the order the flat buffer held them.
  const auto& shape = st.ranged->shape;
  auto flat = torch::cat(ranges);
  if (st.ranged->channels_last)
    return flat.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2}).contiguous();
  return flat.view(shape);
}

torch::Tensor CheckpointReader::read(const Kind& kind, const std::string& name,
                                     const Placement& want, int64_t rank) const {
  const Stored& st = kind.stored.at(name);
  const Placement& was = st.placement;
  if (!was.is_split()) {  // whole (in one part, or in ranges)
    auto full = read_part(st, 0);
    return want.is_split() ? want.shard(full, rank) : full;
  }
  if (want.dim == was.dim && want.parts == was.parts && want.blocks == was.blocks)
    return read_part(st, rank);  // saved with the split this rank has
  std::vector<torch::Tensor> parts;
  for (int64_t r = 0; r < was.parts; ++r) parts.push_back(read_part(st, r));
  torch::Tensor full;
  try {
    full = was.assemble(parts);
  } catch (const c10::Error& e) {
    throw CheckpointError(fmt::format("checkpoint '{}': the parts of '{}' do not fit together "
                                      "({})", folder_, name, first_line(e.what_without_backtrace())));
  }
  return want.is_split() ? want.shard(full, rank) : full;
}

SavedTensors CheckpointReader::tensors(const std::string& kind) const {
  const Kind& k = kinds_.at(kind);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, st] : k.stored) shapes[name] = st.full_shape;
  return SavedTensors(std::move(shapes),
                      [this, &k](const std::string& name, const Placement& want, int64_t rank) {
                        return read(k, name, want, rank);
                      },
                      folder_);
}

NamedTensors CheckpointReader::all(const std::string& kind) const {
  const Kind& k = kinds_.at(kind);
  NamedTensors out;
  for (const auto& name : k.order)
    out.emplace_back(name, read(k, name, Placement::replicated(), 0));
  return out;
}

CheckpointState load_checkpoint(const std::string& folder) {
  const CheckpointReader reader(folder);
  return {reader.all("model"), reader.all("optimizer"), reader.trainer(), reader.config_yaml(),
          /*run_id=*/""};
}

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  auto follow = [&](const fs::path& pointer) {
    auto folder = follow_pointer(pointer.string());
    fail_if<CheckpointError>(!folder, "'{}' does not name a checkpoint folder", pointer.string());
    return *folder;
  };
  fail_if<CheckpointError>(!fs::exists(p, ec), "checkpoint '{}' does not exist", path);
  if (!fs::is_directory(p, ec)) {
    const auto name = p.filename().string();
    if (name == "latest" || name == "best") return follow(p);
    throw CheckpointError(fmt::format("'{}' is a file; a checkpoint is a folder such as "
                                      "RUN_DIR/checkpoints/step-00000100", path));
  }
  if (fs::exists(p / "manifest.json", ec)) return path;
  if (fs::exists(p / "latest", ec)) return follow(p / "latest");
  if (fs::exists(p / "checkpoints" / "latest", ec)) return follow(p / "checkpoints" / "latest");
  return path;  // verify_checkpoint says what is missing
}

}  // namespace dtrain
