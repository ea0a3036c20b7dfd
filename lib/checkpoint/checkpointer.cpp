#include "checkpoint/checkpointer.hpp"

#include <filesystem>
#include <iostream>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "util/affinity.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

// How `part` failed, as every collective here reports it: a dtrain::Error's exit code and
// message, or the file system's or a JSON reader's own error as exit 3 "cannot WHAT: ..."
// ({0, ""} when it did not).
struct Failure {
  int64_t code = 0;
  std::string why;
};
Failure failure_of(const std::function<void()>& part, const std::string& what) {
  try {
    part();
  } catch (const Error& e) {
    return {int64_t(e.code), e.what()};
  } catch (const std::exception& e) {
    return {int64_t(kExitBadData), fmt::format("cannot {}: {}", what, first_line(e.what()))};
  }
  return {};
}

}  // namespace

int64_t root_does(Comm& group, const std::string& what, const std::function<int64_t()>& part) {
  auto outcome = torch::tensor({int64_t(0), int64_t(0)}, torch::kInt64);  // [value, exit code]
  Failure failed;
  const bool root = group.rank() == 0;
  if (root) {
    failed = failure_of([&] { outcome[0] = part(); }, what);
    outcome[1] = failed.code;
  }
  group.broadcast(outcome, 0);
  if (const auto code = outcome[1].item<int64_t>())
    throw Error(ExitCode(code),
                root ? failed.why : fmt::format("rank 0 could not {} (see rank 0)", what));
  return outcome[0].item<int64_t>();
}

void every_rank_does(Comm& group, const std::string& what, const std::function<void()>& part,
                     const std::function<void()>& undo) {
  const Failure failed = failure_of(part, what);
  // [exit code, rank]
  auto outcome = torch::tensor({failed.code, failed.code ? int64_t(group.rank()) : int64_t(-1)},
                               torch::kInt64);
  group.all_reduce(outcome, ReduceOp::kMax);
  const auto code = outcome[0].item<int64_t>();
  if (!code) return;
  if (group.rank() == 0) undo();
  const auto rank = outcome[1].item<int64_t>();
  throw Error(ExitCode(code), !failed.why.empty() ? failed.why
                                                  : fmt::format("rank {} could not {} (see rank {})",
                                                                rank, what, rank));
}

// Rank 0's part of open(): claim the folder, then choose the checkpoint. Returns the step
// to resume (-1: start fresh); throws dtrain::Error when the job must not go on.
int64_t Checkpointer::claim_and_choose() {
  const auto& dir = opts_.run_dir;
  const auto& resume = opts_.resume;
  // A read-only folder, a file in the way, a full disk: the file system's errors become
  // root_does' "cannot use run directory ...", exit 3.
  if (opts_.writer) {
    fs::create_directories(dir);
    std::string holder;
    lock_ = DirLock::try_lock(dir, holder);
    fail_if<ConfigError>(!lock_, "run directory '{}' is in use by {} (lock {}/.lock): wait for "
                         "that job, or choose another --run-dir", dir, holder, dir);
  }
  store_ = std::make_unique<CheckpointStore>(dir, opts_.cfg);
  int64_t step = -1;
  if (resume == "auto" || resume.empty()) {
    const auto scan = store_->scan();
    // Under torchrun, a worker that finds the newest checkpoint written by its own elastic
    // run continues it: the agents restarted the workers for a new membership (a node
    // joined or left) or after a failure, and the job goes on at the new size.
    const bool same_run = !opts_.run_id.empty() && scan.newest_valid &&
                          scan.newest_manifest.value("run_id", "") == opts_.run_id;
    // Starting over would prune and overwrite an earlier run's checkpoints, readable or not.
    fail_if<ConfigError>(resume.empty() && scan.folders > 0 && !same_run,
                         "run directory '{}' already holds checkpoints: resume with --resume "
                         "auto, or choose another --run-dir", dir);
    if (!scan.newest_valid && scan.folders > 0)
      throw CheckpointError(fmt::format(
          "none of the {} checkpoint(s) in '{}' verifies (newest: {}); nothing was changed",
          scan.folders, store_->dir(), scan.skipped.front().why));
    for (const auto& d : scan.skipped)
      std::cerr << fmt::format("dtrain: warning: resume: skipping {}\n", first_line(d.why));
    if (scan.newest_valid) step = scan.newest_manifest.at("step").get<int64_t>();
  }
  if (opts_.writer) store_->discard_partial();  // the folder is this run's now
  return step;
}

void Checkpointer::take_over(std::chrono::seconds wait) {
  if (opts_.writer) return;
  opts_.writer = true;
  if (group_->rank() != 0) return;  // rank 0 holds the folder for its replica, as in open()
  const auto until = std::chrono::steady_clock::now() + wait;
  std::string holder;
  while (!(lock_ = DirLock::try_lock(opts_.run_dir, holder))) {
    fail_if<CheckpointError>(std::chrono::steady_clock::now() > until,
                             "run directory '{}': the failed replica's lock is still held by {} "
                             "after {} s; this replica cannot take over its checkpoints",
                             opts_.run_dir, holder, wait.count());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!store_) store_ = std::make_unique<CheckpointStore>(opts_.run_dir, opts_.cfg);  // a joiner's
  store_->discard_partial();  // the failed writer's unfinished save
}

std::optional<std::string> Checkpointer::open() {
  const int64_t step = root_does(*group_, fmt::format("use run directory '{}'", opts_.run_dir),
                                 [&] { return claim_and_choose(); });
  const auto& resume = opts_.resume;
  if (!resume.empty() && resume != "auto") return resolve_checkpoint(resume);
  if (step < 0) return std::nullopt;
  return (fs::path(opts_.run_dir) / "checkpoints" / fmt::format("step-{:08d}", step)).string();
}

namespace {

// The manifest's "layout", which PartReader reads back.
nlohmann::json layout_of(const ParallelDims& dims) {
  return {{"data", dims.data}, {"tensor", dims.tensor}, {"pipeline", dims.pipeline}};
}

// A rank's files' suffix: ".ppN" for its stage, ".tpT" for its tensor rank.
std::string part_suffix(const ParallelDims& dims, const Coord& at) {
  return (dims.pipeline > 1 ? fmt::format(".pp{}", at.pipeline) : "") +
         (dims.tensor > 1 ? fmt::format(".tp{}", at.tensor) : "");
}

// What the components give one rank's part of a checkpoint.
class PartWriter : public StateWriter {
 public:
  explicit PartWriter(bool first_replica) : first_replica_(first_replica) {}
  bool writes(StateFile file) const override {
    return file == StateFile::kReplica || is_shard(file) || first_replica_;
  }
  void add(StateFile file, const NamedTensors& tensors, const PartsOf& parts,
           const RangesOf& ranges) override {
    if (!writes(file)) return;
    File& to = file == StateFile::kModel            ? model
               : file == StateFile::kOptimizer      ? optimizer
               : file == StateFile::kOptimizerShard ? optimizer_shard
               : file == StateFile::kModelShard     ? model_shard
                                                    : replica;
    to.used = true;
    to.tensors.insert(to.tensors.end(), tensors.begin(), tensors.end());
    for (const auto& [name, part] : parts) to.parts[name] = part;
    for (const auto& [name, range] : ranges) to.ranges[name] = range;
  }
  void set(const std::string& key, nlohmann::json value) override { trainer[key] = std::move(value); }

  // This rank's files into the temporary folder `temp` (`part`: its ".ppN.tpT" suffix).
  void write(const std::string& temp, const std::string& part, int64_t data_rank) const {
    if (!replica.tensors.empty())
      CheckpointStore::write_shard(temp, "sync", data_rank, part, replica.tensors, replica.parts, {});
    for (const auto* shard : {&model_shard, &optimizer_shard})
      if (shard->used)
        CheckpointStore::write_shard(temp, shard == &model_shard ? "model" : "optimizer",
                                     data_rank, part, shard->tensors, shard->parts, shard->ranges);
    if (!first_replica_) return;
    PartsOf parts = model.parts;  // one map for both files (their tensors' names differ)
    parts.insert(optimizer.parts.begin(), optimizer.parts.end());
    CheckpointStore::write_part(temp, part, model.tensors, optimizer.tensors, parts,
                                /*with_optimizer=*/!optimizer_shard.used,
                                /*with_model=*/!model_shard.used);
  }
  // Every tensor replaced by a copy in host memory (pinned where it comes from a GPU,
  // whose copy then is a plain DMA), which the run can no longer change.
  void copy_to_host() {
    for (auto* file : {&model, &optimizer, &replica, &optimizer_shard, &model_shard})
      for (auto& [name, t] : file->tensors) {
        if (t.is_cuda()) {
          auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
          host.copy_(t);
          t = host;
        } else {
          t = t.clone(at::MemoryFormat::Contiguous);
        }
      }
  }

  // What the components gave for one file: its tensors, and which are parts or ranges.
  struct File {
    bool used = false;
    NamedTensors tensors;
    PartsOf parts;
    RangesOf ranges;
  };
  File model, optimizer, replica, model_shard, optimizer_shard;
  nlohmann::json trainer = nlohmann::json::object();

 private:
  static bool is_shard(StateFile file) {
    return file == StateFile::kOptimizerShard || file == StateFile::kModelShard;
  }
  bool first_replica_;
};

class PartReader : public StateReader {
 public:
  PartReader(const CheckpointReader& saved, ParallelDims now, const Coord& at,
             std::function<void(const std::string&)> say)
      : saved_(saved), now_(now), replica_(fmt::format("sync.dp{}", at.data)), say_(std::move(say)) {
    trainer_ = saved.trainer();
    const auto& layout = saved.manifest().value("layout", nlohmann::json::object());
    then_.data = layout.value("data", int64_t(1));
    then_.tensor = layout.value("tensor", int64_t(1));
    then_.pipeline = layout.value("pipeline", int64_t(1));
  }
  const std::string& folder() const override { return saved_.folder(); }
  // kReplica: whether the checkpoint holds any (every data rank wrote its own).
  bool has(StateFile file) const override {
    return file == StateFile::kReplica ? saved_.has("sync.dp0") : saved_.has(kind(file));
  }
  SavedTensors tensors(StateFile file) const override { return saved_.tensors(kind(file)); }
  const nlohmann::json& trainer() const override { return trainer_; }
  std::string config_yaml() const override { return saved_.config_yaml(); }
  std::vector<std::string> names(StateFile file) const override { return saved_.names(kind(file)); }
  ParallelDims saved_layout() const override { return then_; }
  ParallelDims layout() const override { return now_; }
  void warn(const std::string& line) const override { say_(line); }

 private:
  std::string kind(StateFile file) const {
    if (file == StateFile::kModel) return "model";
    if (file == StateFile::kReplica) return replica_;
    return "optimizer";  // whole or in shards, merged
  }
  const CheckpointReader& saved_;
  ParallelDims now_, then_;
  std::string replica_;
  nlohmann::json trainer_;
  std::function<void(const std::string&)> say_;
};

}  // namespace

void Checkpointer::save(int64_t step, int64_t epoch, const std::optional<Metric>& metric,
                        const std::string& config_yaml, const std::vector<Stateful*>& parts,
                        bool background) {
  finish();  // at most one save in flight
  const std::string what = fmt::format("write the checkpoint of step {}", step);
  root_does(*group_, what, [&] {
    store_->begin(step);
    return int64_t(0);
  });
  const auto& at = opts_.at;
  PartWriter out(/*first_replica=*/at.data == 0);
  for (auto* part : parts) part->save(out);  // collective where a part is spread over ranks
  CheckpointState state;
  state.trainer = out.trainer;
  state.config_yaml = config_yaml;
  state.run_id = opts_.run_id;
  const auto temp = CheckpointStore::temp_folder(opts_.run_dir, step);
  const auto part = part_suffix(opts_.layout, at);
  if (!background) {
    every_rank_does(*group_, what, [&] { out.write(temp, part, at.data); },
                    [&] { store_->abort(step); });
    root_does(*group_, what, [&] {
      const auto folder = store_->commit(state, step, epoch, layout_of(opts_.layout), metric);
      if (opts_.say) opts_.say(fmt::format("checkpoint {}", folder));
      return int64_t(0);
    });
    return;
  }
  // The state as it is now: the components' tensors are the live ones (views of the flat
  // buffers, the optimizer's slots), which the next steps change under the writer.
  out.copy_to_host();
  flight_ = std::make_unique<Flight>();
  auto& f = *flight_;
  f.step = step, f.epoch = epoch, f.metric = metric, f.state = std::move(state);
  const auto delay = std::chrono::milliseconds(opts_.cfg.debug_write_delay_ms);
  launch(f, [out = std::move(out), temp, part, data = at.data, delay] {
    std::this_thread::sleep_for(delay);
    out.write(temp, part, data);
  });
}

Checkpointer::~Checkpointer() {
  if (flight_ && flight_->thread.joinable()) flight_->thread.join();
}

void Checkpointer::launch(Flight& f, std::function<void()> work) {
  f.done = false;
  f.thread = std::thread([&f, work = std::move(work)] {
    unpin_this_thread();  // created by the (pinned) training thread: not on its CPU
    auto failed = failure_of(work, fmt::format("write the checkpoint of step {}", f.step));
    f.code = int(failed.code), f.why = std::move(failed.why);
    f.done = true;
  });
}

// The flight's agreement, one round: [some rank still busy, the highest failure's exit
// code, a rank that failed] over the group. Writing: every rank's thread; committing: rank
// 0's. All ranks see the same outcome, so they change phase (or throw) together.
void Checkpointer::advance(bool wait) {
  if (!flight_) return;
  auto& f = *flight_;
  const bool root = group_->rank() == 0;
  const bool mine = !f.committing || root;  // whose thread this phase waits for
  if (wait && mine && f.thread.joinable()) f.thread.join();
  const bool done = !mine || f.done;
  auto outcome = torch::tensor({int64_t(!done), int64_t(done && mine ? f.code : 0),
                                int64_t(done && mine && f.code ? group_->rank() : -1)},
                               torch::kInt64);
  group_->all_reduce(outcome, ReduceOp::kMax);
  if (outcome[0].item<int64_t>() && !outcome[1].item<int64_t>()) return;  // not yet
  if (f.thread.joinable()) f.thread.join();
  const std::string what = fmt::format("write the checkpoint of step {}", f.step);
  if (const auto code = outcome[1].item<int64_t>()) {
    const auto rank = outcome[2].item<int64_t>();
    const std::string why = f.code ? f.why
                                   : fmt::format("rank {} could not {} (see rank {})", rank, what, rank);
    if (root) store_->abort(f.step);
    flight_.reset();
    throw Error(ExitCode(code), why);
  }
  if (!f.committing) {  // every part is written: rank 0 commits, in the background too
    f.committing = true;
    if (root) launch(f, [this, &f] {
      f.folder = store_->commit(f.state, f.step, f.epoch, layout_of(opts_.layout), f.metric);
    });
    return;
  }
  if (root && opts_.say) opts_.say(fmt::format("checkpoint {}", f.folder));
  flight_.reset();
}

void Checkpointer::restore(const std::string& folder, const std::vector<Stateful*>& parts) {
  // Headers first; each rank then reads only the tensors, and the parts of them, it holds.
  const CheckpointReader saved(folder);
  const PartReader in(saved, opts_.layout, opts_.at, [this](const std::string& line) {
    if (opts_.say) opts_.say(line);
  });
  try {
    for (auto* part : parts) part->load(in);
  } catch (const c10::Error& e) {  // e.g. a random state of the wrong size
    throw CheckpointError(fmt::format("{}: cannot restore: {}", folder,
                                      first_line(e.what_without_backtrace())));
  }
}

}  // namespace dtrain
