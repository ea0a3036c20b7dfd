#include "checkpoint/timeline.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/files.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

int64_t step_of_name(const std::string& name) { return int64_t(std::stoll(name.substr(5))); }

// A checkpoint's manifest as written, not verified (its step and metric are all that is
// read here); null when it cannot be read.
nlohmann::json manifest_of(const std::string& folder) {
  try {
    return nlohmann::json::parse(read_file((fs::path(folder) / "manifest.json").string()));
  } catch (const std::exception&) {
    return nullptr;
  }
}

// Whether manifest metric `a` ({value, higher_is_better}) is better than `b` (absent: any
// finite value is). NaN is never best.
bool beats(const nlohmann::json& a, const nlohmann::json& b) {
  if (!a.is_object() || !a.contains("value") || !a["value"].is_number()) return false;
  const double v = a["value"].get<double>();
  if (!std::isfinite(v)) return false;
  if (!b.is_object() || !b.contains("value") || !b["value"].is_number()) return true;
  const double w = b["value"].get<double>();
  return a.value("higher_is_better", true) ? v > w : v < w;
}

fs::path canonical(const std::string& path) { return fs::weakly_canonical(fs::absolute(path)); }

}  // namespace

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08d}", step); }

bool is_checkpoint_name(const std::string& name) {
  return name.size() == 13 && name.rfind("step-", 0) == 0 &&
         std::all_of(name.begin() + 5, name.end(), ::isdigit);
}

std::optional<std::string> follow_pointer(const std::string& pointer) {
  std::error_code ec;
  if (!fs::exists(pointer, ec)) return std::nullopt;
  auto text = read_file(pointer);
  text.erase(text.find_last_not_of(" \n") + 1);
  const fs::path named(text);
  if (!text.empty() && named.is_absolute()) return text;
  bool ok = !text.empty() && is_checkpoint_name(named.filename().string());
  for (const auto& part : named) ok = ok && part != ".." && part != ".";
  fail_if<CheckpointError>(!ok, "'{}' does not name a checkpoint folder", pointer);
  return (fs::path(pointer).parent_path() / named).string();
}

std::vector<std::string> Timeline::line() const {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (e.is_directory() && is_checkpoint_name(e.path().filename().string()))
      names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

CheckpointScan Timeline::resume_point() const {
  CheckpointScan out;
  const auto names = line();
  out.folders = names.size();
  // Which of the line's folders may stand in for a head that does not verify: those
  // older than it when it is on the line; none when it is another line's (the line's
  // folders are then what its branch had yet to set aside); any without a head.
  std::optional<int64_t> below;
  try {
    if (const auto head = this->head()) {
      const auto name = fs::path(*head).filename().string();
      const bool here = fs::path(*head).parent_path() == fs::path(dir_);  // in checkpoints/
      if (!here || !std::count(names.begin(), names.end(), name)) out.folders += 1;
      below = here && is_checkpoint_name(name) ? step_of_name(name) : 0;
      try {
        out.newest_manifest = verify_checkpoint(*head);
        out.newest_valid = *head;
        return out;
      } catch (const CheckpointError& e) {
        out.skipped.push_back({*head, fmt::format("{} (named by latest)", e.what())});
      }
    }
  } catch (const CheckpointError& e) {  // an unreadable `latest`: the line alone decides
    out.skipped.push_back({dir_ + "/latest", e.what()});
  }
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    if (below && step_of_name(*it) >= *below) continue;
    const auto path = (fs::path(dir_) / *it).string();
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

std::string Timeline::pointer_to(const std::string& folder) const {
  const auto path = canonical(folder), home = canonical(dir_);
  const auto rel = path.lexically_relative(home);
  if (!rel.empty() && *rel.begin() != ".." && *rel.begin() != ".") return rel.string();
  return path.string();
}

void Timeline::point(const char* pointer, const std::optional<std::string>& folder) const {
  const auto path = (fs::path(dir_) / pointer).string();
  if (folder) {
    write_file_atomic(path, pointer_to(*folder) + "\n");
  } else {
    fs::remove(path);
    fsync_dir(dir_);
  }
}

void Timeline::advance(const std::string& name, const nlohmann::json& metric, bool keep_best) {
  const auto folder = (fs::path(dir_) / name).string();
  point("latest", folder);
  if (!keep_best) return;
  std::optional<std::string> best;
  try {
    best = this->best();
  } catch (const CheckpointError&) {  // an unreadable pointer is simply replaced
  }
  const auto best_metric = best ? manifest_of(*best).value("metric", nlohmann::json()) : nullptr;
  if (beats(metric, best_metric)) point("best", folder);
}

std::optional<std::string> Timeline::best_of_line() const {
  std::optional<std::string> best;
  nlohmann::json best_metric;
  for (const auto& name : line()) {
    const auto folder = (fs::path(dir_) / name).string();
    const auto metric = manifest_of(folder).value("metric", nlohmann::json());
    if (beats(metric, best_metric)) best = folder, best_metric = metric;
  }
  return best;
}

std::optional<Branch> Timeline::continue_from(const std::string& folder) {
  const auto here = canonical(folder);
  const auto manifest = manifest_of(folder);
  fail_if<CheckpointError>(!manifest.is_object() || !manifest.contains("step"),
                           "checkpoint '{}' has no readable manifest.json", folder);
  const auto step = manifest["step"].get<int64_t>();
  const bool on_line = here.parent_path() == canonical(dir_);
  std::vector<std::string> aside;
  for (const auto& name : line())
    if (!on_line || (name != here.filename() && step_of_name(name) > step)) aside.push_back(name);
  std::optional<std::string> head, best;
  try {
    head = this->head(), best = this->best();
  } catch (const CheckpointError&) {  // unreadable pointers: replaced below
  }
  const bool is_head = head && canonical(*head) == here;
  if (aside.empty() && !is_head) point("latest", folder);
  if (aside.empty() && (is_head || on_line)) return std::nullopt;
  Branch branch{step, folder, on_line, "", {}};
  if (aside.empty()) return branch;  // another line's checkpoint, nothing here to set aside

  const fs::path abandoned = fs::path(dir_) / "abandoned";
  int64_t k = 1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(abandoned, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind("branch-", 0) == 0 && name.size() > 7 &&
        std::all_of(name.begin() + 7, name.end(), ::isdigit))
      k = std::max<int64_t>(k, std::stoll(name.substr(7)) + 1);
  }
  const fs::path kept = abandoned / fmt::format("branch-{}", k);
  fs::create_directories(kept);
  const nlohmann::json record{
      {"format", "dtrain-branch"},
      {"step", step},
      {"resumed", pointer_to(folder)},
      {"set_aside", aside},
      {"latest_was", head ? nlohmann::json(pointer_to(*head)) : nlohmann::json(nullptr)},
      {"best_was", best ? nlohmann::json(pointer_to(*best)) : nlohmann::json(nullptr)},
      {"created_unix", unix_time()}};
  write_file_synced((kept / "branch.json").string(), record.dump(1) + "\n");
  fsync_dir(abandoned.string());
  point("latest", folder);  // first: from here on a resume takes the new branch
  branch.kept_in = (fs::path("checkpoints") / "abandoned" / kept.filename()).string();
  for (const auto& name : aside) {
    fs::rename(fs::path(dir_) / name, kept / name);
    branch.set_aside.push_back(step_of_name(name));
  }
  fsync_dir(kept.string());
  fsync_dir(dir_);
  if (best && !fs::is_directory(*best, ec)) point("best", best_of_line());
  return branch;
}

}  // namespace dtrain
