#include "checkpoint/checkpoint.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "util/error.hpp"
#include "util/files.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

std::string folder_name(int64_t step) { return fmt::format("step-{:08d}", step); }

bool starts_ends(const std::string& s, const std::string& head, const std::string& tail) {
  return s.size() >= head.size() + tail.size() && s.rfind(head, 0) == 0 &&
         s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool is_checkpoint_name(const std::string& name) {
  return name.size() == 13 && name.rfind("step-", 0) == 0 &&
         std::all_of(name.begin() + 5, name.end(), ::isdigit);
}

// Checkpoint folders, oldest first (zero-padded names sort by step).
std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory() && is_checkpoint_name(e.path().filename().string()))
      names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::optional<std::string> read_pointer(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  auto s = read_file(path);
  s.erase(s.find_last_not_of(" \n") + 1);
  return s;
}
}  // namespace

CheckpointStore::CheckpointStore(std::string run_dir, const CheckpointConfig& cfg)
    : dir_((fs::path(run_dir) / "checkpoints").string()), cfg_(cfg) {
  fs::create_directories(dir_);
}

void CheckpointStore::discard_partial() {
  // A crash mid-save leaves a temporary folder that never became a checkpoint.
  for (const auto& e : fs::directory_iterator(dir_))
    if (e.path().filename().string().rfind(".tmp-", 0) == 0) remove_tree(e.path().string());
}

std::string CheckpointStore::save(const CheckpointState& state, int64_t step, int64_t epoch,
                                  const nlohmann::json& layout,
                                  const std::optional<Metric>& metric) {
  try {
    begin(step);
    write_part(temp_folder(fs::path(dir_).parent_path().string(), step), "", state.model,
               state.optimizer);
  } catch (const std::exception& e) {
    abort(step);
    throw CheckpointError(fmt::format("cannot write the checkpoint of step {} in '{}': {}", step,
                                      dir_, first_line(e.what())));
  }
  return commit(state, step, epoch, layout, metric);
}

std::string CheckpointStore::temp_folder(const std::string& run_dir, int64_t step) {
  return (fs::path(run_dir) / "checkpoints" / (".tmp-" + folder_name(step))).string();
}

void CheckpointStore::begin(int64_t step) {
  const auto tmp = fs::path(dir_) / (".tmp-" + folder_name(step));
  remove_tree(tmp.string());
  fs::create_directories(tmp);
}

namespace {

// A split tensor's part in a file's metadata: "part:NAME" = "dim,parts,blocks,rank".
constexpr const char* kPartKey = "part:";

std::map<std::string, std::string> file_metadata(const std::string& format,
                                                 const NamedTensors& tensors,
                                                 const PartsOf& parts) {
  std::map<std::string, std::string> meta{{"format", format}};
  for (const auto& [name, t] : tensors)
    if (auto it = parts.find(name); it != parts.end()) {
      const auto& p = it->second.placement;
      meta[kPartKey + name] = fmt::format("{},{},{},{}", p.dim, p.parts, p.blocks, it->second.rank);
    }
  return meta;
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
                                 const PartsOf& parts) {
  const fs::path tmp(temp);
  write_safetensors((tmp / ("model" + part + ".safetensors")).string(), model,
                    file_metadata("dtrain-model", model, parts));
  write_safetensors((tmp / ("optimizer" + part + ".safetensors")).string(), optimizer,
                    file_metadata("dtrain-optimizer", optimizer, parts));
}

void CheckpointStore::abort(int64_t step) {
  try {  // never leave a partial folder filling the disk
    remove_tree((fs::path(dir_) / (".tmp-" + folder_name(step))).string());
  } catch (const std::exception&) {  // the first error is the one to report
  }
}

std::string CheckpointStore::commit(const CheckpointState& state, int64_t step, int64_t epoch,
                                    const nlohmann::json& layout,
                                    const std::optional<Metric>& metric) {
  const std::string name = folder_name(step);
  const fs::path tmp = fs::path(dir_) / (".tmp-" + name), final_path = fs::path(dir_) / name;
  try {
    write_file_synced((tmp / "trainer.json").string(), state.trainer.dump(1) + "\n");
    write_file_synced((tmp / "config.yaml").string(), state.config_yaml);
    nlohmann::json manifest{{"format", "dtrain-checkpoint"}, {"version", kCheckpointVersion},
                            {"step", step}, {"epoch", epoch}, {"layout", layout},
                            {"created_unix", std::chrono::duration<double>(
                                                 std::chrono::system_clock::now().time_since_epoch())
                                                 .count()}};
    if (metric)
      manifest["metric"] = {{"name", metric->name}, {"value", metric->value},
                            {"higher_is_better", metric->higher_is_better}};
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
    write_file_atomic((fs::path(dir_) / "latest").string(), name + "\n");
  } catch (const std::exception& e) {
    abort(step);
    throw CheckpointError(fmt::format("cannot write the checkpoint of step {} in '{}': {}", step,
                                      dir_, first_line(e.what())));
  }

  if (cfg_.keep_best && metric && std::isfinite(metric->value)) {  // NaN is never best
    auto current = best();
    std::optional<double> best_value;
    if (current) {
      try {
        best_value = verify_checkpoint((fs::path(dir_) / *current).string())["metric"]["value"]
                         .get<double>();
      } catch (const std::exception&) {  // a vanished or damaged best is simply replaced
      }
    }
    const bool better = !best_value || (metric->higher_is_better ? metric->value > *best_value
                                                                 : metric->value < *best_value);
    if (better) write_file_atomic((fs::path(dir_) / "best").string(), name + "\n");
  }
  prune();
  return final_path.string();
}

std::optional<std::string> CheckpointStore::best() const {
  return read_pointer((fs::path(dir_) / "best").string());
}

void CheckpointStore::prune() {
  auto names = list_checkpoints(dir_);
  auto keep_best = cfg_.keep_best ? best() : std::nullopt;
  const size_t keep = static_cast<size_t>(cfg_.keep_last);
  for (size_t i = 0; i + keep < names.size(); ++i)
    if (!keep_best || names[i] != *keep_best) remove_tree((fs::path(dir_) / names[i]).string());
}

CheckpointScan CheckpointStore::scan() const {
  CheckpointScan out;
  auto names = list_checkpoints(dir_);
  out.folders = names.size();
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    auto path = (fs::path(dir_) / *it).string();
    try {
      out.newest_manifest = verify_checkpoint(path);
      out.newest_valid = path;
      break;
    } catch (const CheckpointError& e) {  // damaged: fall back to an older one, and say so
      out.skipped.push_back({path, e.what()});
    }
  }
  return out;
}

nlohmann::json verify_checkpoint(const std::string& folder) {
  const fs::path dir(folder), manifest_path = dir / "manifest.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw CheckpointError(fmt::format("checkpoint '{}' does not exist", folder));
  if (!fs::exists(manifest_path, ec))
    throw CheckpointError(fmt::format("checkpoint '{}' has no manifest.json (incomplete)", folder));
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_file(manifest_path.string()));
    if (m.at("format") != "dtrain-checkpoint")
      throw CheckpointError(fmt::format("{}: not a dtrain checkpoint", manifest_path.string()));
    if (m.at("version").get<int>() > kCheckpointVersion)
      throw CheckpointError(fmt::format("{}: format version {} is newer than this dtrain ({})",
                                        manifest_path.string(), m["version"].get<int>(),
                                        kCheckpointVersion));
    for (const auto& f : m.at("files")) {
      const auto path = dir / f.at("name").get<std::string>();
      if (!fs::exists(path, ec))
        throw CheckpointError(fmt::format("checkpoint '{}' is missing {}", folder,
                                          f["name"].get<std::string>()));
      if (fs::file_size(path) != f.at("bytes").get<uint64_t>() ||
          crc32_of_file(path.string()) != f.at("crc32").get<uint32_t>())
        throw CheckpointError(fmt::format("checkpoint '{}': {} is corrupt (size or checksum "
                                          "differs from the manifest)", folder,
                                          f["name"].get<std::string>()));
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

CheckpointState load_checkpoint(const std::string& folder) {
  const fs::path dir(folder);
  const auto manifest = verify_checkpoint(folder);
  CheckpointState s;
  // Every writer's part, in the manifest's (name) order; a name two parts hold (the
  // optimizer's step count) is taken once, and a split tensor's parts (one per tensor rank)
  // are assembled whole, every one required.
  auto merge = [&](NamedTensors& into, const std::string& kind) {
    std::set<std::string> seen;
    struct Pieces {
      size_t at;  // its place in `into`
      Placement placement;
      std::map<int64_t, torch::Tensor> by_rank;
    };
    std::map<std::string, Pieces> split;
    bool any = false;
    for (const auto& f : manifest.at("files")) {
      const auto file = f.at("name").get<std::string>();
      if (!starts_ends(file, kind, ".safetensors")) continue;
      any = true;
      auto read = read_safetensors((dir / file).string());
      for (auto& [name, t] : read.tensors) {
        if (auto part = part_of(read.metadata, name, file)) {
          auto [it, fresh] = split.try_emplace(name, Pieces{into.size(), part->placement, {}});
          if (fresh && seen.insert(name).second) into.emplace_back(name, torch::Tensor());
          const auto& p = it->second.placement;
          fail_if<CheckpointError>(p.dim != part->placement.dim || p.parts != part->placement.parts ||
                                       p.blocks != part->placement.blocks,
                                   "checkpoint '{}': the parts of '{}' disagree on its split",
                                   folder, name);
          it->second.by_rank[part->rank] = std::move(t);
        } else if (seen.insert(name).second) {
          into.emplace_back(name, std::move(t));
        }
      }
    }
    fail_if<CheckpointError>(!any, "checkpoint '{}' has no {} tensors", folder, kind);
    for (auto& [name, pieces] : split) {
      std::vector<torch::Tensor> ordered;
      for (int64_t r = 0; r < pieces.placement.parts; ++r) {
        auto it = pieces.by_rank.find(r);
        fail_if<CheckpointError>(it == pieces.by_rank.end(),
                                 "checkpoint '{}' lacks tensor rank {}'s part of '{}'", folder, r,
                                 name);
        ordered.push_back(std::move(it->second));
      }
      try {
        into[pieces.at].second = pieces.placement.assemble(ordered);
      } catch (const c10::Error& e) {
        throw CheckpointError(fmt::format("checkpoint '{}': the parts of '{}' do not fit "
                                          "together ({})", folder, name,
                                          first_line(e.what_without_backtrace())));
      }
    }
  };
  merge(s.model, "model");
  merge(s.optimizer, "optimizer");
  try {
    s.trainer = nlohmann::json::parse(read_file((dir / "trainer.json").string()));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}/trainer.json: {}", folder, e.what()));
  }
  s.config_yaml = read_file((dir / "config.yaml").string());
  return s;
}

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  auto follow = [&](const fs::path& pointer) {
    auto name = read_pointer(pointer.string());
    if (!name || !is_checkpoint_name(*name))
      throw CheckpointError(fmt::format("'{}' does not name a checkpoint folder", pointer.string()));
    return (pointer.parent_path() / *name).string();
  };
  if (!fs::exists(p, ec))
    throw CheckpointError(fmt::format("checkpoint '{}' does not exist", path));
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
