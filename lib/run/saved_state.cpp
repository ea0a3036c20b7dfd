#include "train/state.hpp"

#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <filesystem>
#include <functional>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "checkpoint/safetensors.hpp"
#include "config/schema.hpp"
#include "util/error.hpp"
#include "util/files.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

std::string to_hex(const torch::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  auto c = bytes.contiguous();
  const auto* p = c.data_ptr<uint8_t>();
  std::string s;
  for (int64_t i = 0; i < c.numel(); ++i) s += digits[p[i] >> 4], s += digits[p[i] & 15];
  return s;
}

torch::Tensor from_hex(const std::string& s) {
  auto t = torch::empty({int64_t(s.size() / 2)}, torch::kUInt8);
  auto* p = t.data_ptr<uint8_t>();
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < s.size(); i += 2) p[i / 2] = uint8_t(nibble(s[i]) << 4 | nibble(s[i + 1]));
  return t;
}

void set_generator_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

double number_or_nan(const nlohmann::json& j) { return j.is_number() ? j.get<double>() : std::nan(""); }

nlohmann::json layout_json(const ParallelDims& d) {
  return {{"data", d.data}, {"tensor", d.tensor}, {"pipeline", d.pipeline}};
}

}  // namespace

namespace {

// Rank 0's part of open_run_dir: claim the folder, then choose the checkpoint. Returns the
// step to resume (-1: start fresh); throws dtrain::Error when the job must not go on.
int64_t claim_and_choose(Context& c) {
  const auto& dir = c.cfg.run_dir;
  const auto& resume = c.opts.resume;
  // A read-only folder, a file in the way, a full disk: the file system's errors become
  // root_does' "cannot use run directory ...", exit 3.
  fs::create_directories(dir);
  std::string holder;
  c.run_dir_lock = DirLock::try_lock(dir, holder);
  fail_if<ConfigError>(!c.run_dir_lock, "run directory '{}' is in use by {} (lock {}/.lock): "
                       "wait for that job, or choose another --run-dir", dir, holder, dir);
  c.checkpoints = std::make_unique<CheckpointStore>(dir, c.cfg.checkpoint);
  int64_t step = -1;
  if (resume == "auto" || resume.empty()) {
    const auto scan = c.checkpoints->scan();
    // Under torchrun, a worker that finds the newest checkpoint written by its own elastic
    // run continues it: the agents restarted the workers for a new membership (a node
    // joined or left) or after a failure, and the job goes on at the new size.
    const bool same_run = !c.world.run_id.empty() && scan.newest_valid &&
                          scan.newest_manifest.value("run_id", "") == c.world.run_id;
    // Starting over would prune and overwrite an earlier run's checkpoints, readable or not.
    fail_if<ConfigError>(resume.empty() && scan.folders > 0 && !same_run,
                         "run directory '{}' already holds checkpoints: resume with --resume "
                         "auto, or choose another --run-dir", dir);
    if (!scan.newest_valid && scan.folders > 0)
      throw CheckpointError(fmt::format(
          "none of the {} checkpoint(s) in '{}' verifies (newest: {}); nothing was changed",
          scan.folders, c.checkpoints->dir(), scan.skipped.front().why));
    for (const auto& d : scan.skipped)
      std::cerr << fmt::format("dtrain: warning: resume: skipping {}\n",
                               first_line(d.why));
    if (scan.newest_valid) step = scan.newest_manifest.at("step").get<int64_t>();
  }
  c.checkpoints->discard_partial();  // the folder is this run's now
  return step;
}

}  // namespace

int64_t root_does(Context& c, const std::string& what, const std::function<int64_t()>& part) {
  auto outcome = torch::tensor({int64_t(0), int64_t(0)}, torch::kInt64);  // [value, exit code]
  std::string why;
  if (c.root()) {
    try {
      outcome[0] = part();
    } catch (const Error& e) {
      outcome[1] = int64_t(e.code);
      why = e.what();
    } catch (const std::exception& e) {  // the file system's or a JSON reader's own errors
      outcome[1] = int64_t(kExitBadData);
      why = fmt::format("cannot {}: {}", what, first_line(e.what()));
    }
  }
  c.mesh.world()->broadcast(outcome, 0);
  if (const auto code = outcome[1].item<int64_t>())
    throw Error(ExitCode(code), c.root() ? why : fmt::format("rank 0 could not {} (see rank 0)", what));
  return outcome[0].item<int64_t>();
}

std::optional<std::string> open_run_dir(Context& c) {
  const int64_t step = root_does(c, fmt::format("use run directory '{}'", c.cfg.run_dir),
                                 [&] { return claim_and_choose(c); });
  if (!c.opts.resume.empty() && c.opts.resume != "auto") return resolve_checkpoint(c.opts.resume);
  if (step < 0) return std::nullopt;
  return (fs::path(c.cfg.run_dir) / "checkpoints" / fmt::format("step-{:08d}", step)).string();
}

SavedTrainer read_trainer_state(const nlohmann::json& t, const std::string& folder) {
  const std::string file = folder + "/trainer.json";
  SavedTrainer out;
  try {
    out.step = t.at("step").get<int64_t>();
    out.best_step = t.at("best_step").get<int64_t>();
    out.global_batch = t.at("global_batch").get<int64_t>();
    out.train_samples = t.at("train_samples").get<int64_t>();
    out.best_metric = number_or_nan(t.at("best_metric"));
    out.last_loss = number_or_nan(t.at("last_loss"));
    auto hex = [&](const char* key) {
      const auto rng = t.at(key).get<std::string>();
      fail_if<CheckpointError>(rng.size() % 2 != 0 ||
                                   rng.find_first_not_of("0123456789abcdef") != std::string::npos,
                               "{}: {} is not a hex string", file, key);
      return from_hex(rng);
    };
    out.rng_cpu = hex("rng_torch_cpu");
    if (t.contains("rng_torch_cuda")) out.rng_cuda = hex("rng_torch_cuda");
    if (t.contains("loss_scaler")) out.loss_scaler = t.at("loss_scaler");
    if (t.contains("worker_pushes")) out.worker_pushes = t.at("worker_pushes").get<std::vector<int64_t>>();
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: {}", file, e.what()));
  }
  fail_if<CheckpointError>(out.step < 0 || out.best_step < 0 || out.best_step > out.step,
                           "{}: step {} and best_step {} are out of range", file, out.step,
                           out.best_step);
  for (int64_t pushes : out.worker_pushes)
    fail_if<CheckpointError>(pushes < 0, "{}: worker_pushes holds {}, a negative count", file, pushes);
  fail_if<CheckpointError>(out.global_batch < 1 || out.train_samples < 1,
                           "{}: global_batch {} and train_samples {} must be positive", file,
                           out.global_batch, out.train_samples);
  return out;
}

namespace {

// A resume continues the same model: the checkpoint's model keys (all but dropout, which
// changes no weight) and its tensor names must be the job's. Otherwise weights would be
// dropped or misread in silence (model.heads 4 -> 8 keeps every shape).
void check_same_model(const Context& c, const CheckpointReader& saved) {
  const std::string& folder = saved.folder();
  JobConfig theirs = c.cfg;
  try {
    theirs = parse_job(saved.config_yaml(), folder + "/config.yaml");
  } catch (const ConfigError& e) {
    throw CheckpointError(fmt::format("{}: cannot read the job that wrote it: {}", folder,
                                      first_line(e.what())));
  }
  JobConfig ours = c.cfg;
  auto a = fields_of(ours), b = fields_of(theirs);
  for (size_t i = 0; i < a.size(); ++i) {
    const bool architecture = a[i].key.rfind("model.", 0) == 0 && a[i].key != "model.dropout" &&
                              a[i].key.rfind("model.init_", 0) != 0;
    if (!architecture) continue;
    const auto mine = value_text(a[i]), saved_value = value_text(b[i]);
    fail_if<CheckpointError>(mine != saved_value,
                             "{}: the checkpoint's model has {} {}, this job has {}; resuming "
                             "needs the same model", folder, a[i].key, saved_value, mine);
  }
  std::set<std::string> names(c.model_names.begin(), c.model_names.end()), theirs_names;
  for (const auto& name : saved.names("model")) theirs_names.insert(name);
  std::vector<std::string> extra, missing;
  std::set_difference(theirs_names.begin(), theirs_names.end(), names.begin(), names.end(),
                      std::back_inserter(extra));
  std::set_difference(names.begin(), names.end(), theirs_names.begin(), theirs_names.end(),
                      std::back_inserter(missing));
  auto some = [](const std::vector<std::string>& v) {
    std::vector<std::string> head(v.begin(), v.begin() + long(std::min<size_t>(v.size(), 4)));
    return fmt::format("{}{}", fmt::join(head, ", "), v.size() > 4 ? ", ..." : "");
  };
  fail_if<CheckpointError>(!extra.empty(), "{}: the checkpoint holds {} tensor(s) this job's "
                           "model does not have ({}); resuming needs the same model", folder,
                           extra.size(), some(extra));
  fail_if<CheckpointError>(!missing.empty(), "{}: the checkpoint lacks {} tensor(s) of this "
                           "job's model ({})", folder, missing.size(), some(missing));
}

// A strategy state tensor's name in the checkpoint: a tied weight's copy (the head's, on
// the last stage) has its own residual, named apart from the embedding's.
std::string sync_key(const Context& c, const std::string& key) {
  if (!c.tied_copy) return key;
  for (size_t i : c.tied)
    if (key.rfind(c.params->entries()[i].name + ".", 0) == 0) return key + "_copy";
  return key;
}

// PowerSGD's Q of entry `e` in the checkpoint: a split parameter's is its tensor rank's own
// (the power iteration ran on that rank's part), a replicated one's the same on all.
std::string factor_key(const Context& c, const FlatParams::Entry& e, int64_t tensor_rank) {
  return sync_key(c, e.name + ".powersgd_q" +
                         (e.placement.is_split() ? fmt::format(".tp{}", tensor_rank) : ""));
}

// What each data rank keeps of its own, laid out like the flat gradient: compression's
// residuals (the gradient sync's) and local SGD's optimizer state of its replica (the
// mode's, under names of their own).
NamedTensors replica_state(const Context& c) {
  NamedTensors out = c.sync->state();
  for (auto& [name, t] : c.mode->replica_state()) out.emplace_back("local_" + name, t);
  return out;
}

// The data rank's own state from data rank D's files: compression's residuals and local
// SGD's optimizer state when the checkpoint was written at this data and pipeline size (a
// pipeline gives a tied weight's copy a residual of its own), PowerSGD's Q matrices when at
// this tensor size too; else they start afresh (local SGD's optimizer state from data rank
// 0's), with a warning.
void restore_sync_state(Context& c, const CheckpointReader& saved) {
  const auto state = replica_state(c);
  const auto factors = c.sync->factors();
  if (state.empty() && factors.empty()) return;
  const auto& dims = c.mesh.dims();
  const int64_t rank = c.mesh.coord().data;
  const auto& layout = saved.manifest().value("layout", nlohmann::json::object());
  const int64_t saved_data = layout.value("data", int64_t(1));
  const int64_t saved_pipeline = layout.value("pipeline", int64_t(1));
  const int64_t saved_tensor = layout.value("tensor", int64_t(1));
  const std::string kind = fmt::format("sync.dp{}", rank);
  const bool local = !c.mode->replica_state().empty();
  const std::string what =
      local ? "parallel.mode: local_sgd: each data replica's optimizer state starts from data "
              "rank 0's"
      : factors.empty()
          ? "parallel.compression: the residuals start from zero"
          : "parallel.compression: the residuals start from zero and PowerSGD's Q matrices afresh";
  if (saved_data != dims.data || saved_pipeline != dims.pipeline || !saved.has(kind)) {
    c.say(fmt::format("warning: {} ({})", what,
                      !saved.has("sync.dp0")
                          ? "the checkpoint holds none"
                          : fmt::format("the checkpoint was written at data size {} x pipeline "
                                        "{}, this run has {} x {}", saved_data, saved_pipeline,
                                        dims.data, dims.pipeline)));
    return;
  }
  const SavedTensors tensors = saved.tensors(kind);
  torch::NoGradGuard no_grad;
  for (const auto& [name, flat] : state)
    for (size_t i = 0; i < c.params->entries().size(); ++i) {
      const auto& e = c.params->entries()[i];
      c.params->view(flat, i).copy_(tensors.part(sync_key(c, e.name + "." + name), e.full_shape,
                                                 e.placement, c.mesh.coord().tensor));
    }
  if (factors.empty()) return;
  // Each Q is the power iteration's own state on its rank's matrix: another split, another
  // matrix. Another rank (powersgd_rank) has them shaped otherwise.
  std::string why = saved_tensor != dims.tensor
                        ? fmt::format("the checkpoint was written at tensor size {}, this run "
                                      "has {}", saved_tensor, dims.tensor)
                        : "";
  std::vector<torch::Tensor> got;
  for (const auto& [i, q] : factors) {
    if (!why.empty()) break;
    try {
      got.push_back(tensors.at(factor_key(c, c.params->entries()[i], c.mesh.coord().tensor),
                               q.sizes().vec()));
    } catch (const CheckpointError& e) {
      why = first_line(e.what());
    }
  }
  if (!why.empty()) {
    c.say(fmt::format("warning: parallel.compression: PowerSGD's Q matrices start afresh ({})", why));
    return;
  }
  for (size_t j = 0; j < factors.size(); ++j) factors[j].second.copy_(got[j]);
}

}  // namespace

void restore(Context& c, const std::string& folder) {
  // Headers first; each rank then reads only the tensors, and the parts of them, it holds.
  const CheckpointReader saved(folder);
  check_same_model(c, saved);
  const SavedTrainer t = read_trainer_state(saved.trainer(), folder);
  fail_if<ConfigError>(t.global_batch != c.cfg.data.batch_size,
                       "data.batch_size: {} differs from the checkpoint's {} ({}); an exact "
                       "resume needs the same global batch", c.cfg.data.batch_size,
                       t.global_batch, folder);
  fail_if<ConfigError>(t.train_samples != c.data.train->size(),
                       "data: the checkpoint {} was trained on {} samples, this job has {}",
                       folder, t.train_samples, c.data.train->size());
  auto& st = c.state;
  st.step = t.step;
  st.best_metric = t.best_metric;
  st.best_step = t.best_step;
  st.last_loss = t.last_loss;
  st.last_saved = st.step;
  st.worker_pushes = t.worker_pushes;
  try {
    const SavedTensors model = saved.tensors("model");
    const int64_t tensor_rank = c.mesh.coord().tensor;
    c.params->scatter_full(c.params->data(), "", model, tensor_rank);
    torch::NoGradGuard no_grad;
    for (const auto& [name, b] : c.named_buffers())  // replicated: every rank takes all of it
      b.copy_(model.at(name, b.sizes().vec()));
    load_optimizer_state(*c.optimizer, *c.params, saved.tensors("optimizer"), tensor_rank);
    restore_sync_state(c, saved);
    set_generator_state(at::detail::getDefaultCPUGenerator(), t.rng_cpu);
    // A run on a GPU resumes its generator (dropout) where it was; a checkpoint from
    // another device leaves this device's generator at the job's seed.
    if (c.device().is_cuda() && t.rng_cuda.defined())
      set_generator_state(at::globalContext().defaultGenerator(c.device()), t.rng_cuda);
    if (c.scaler && !t.loss_scaler.is_null()) c.scaler->load(t.loss_scaler, folder + "/trainer.json");
  } catch (const c10::Error& e) {  // e.g. a random state of the wrong size
    throw CheckpointError(fmt::format("{}: cannot restore: {}", folder,
                                      first_line(e.what_without_backtrace())));
  }
}

void broadcast_state(Context& c) {
  auto& data = *c.mesh.data();
  if (data.size() == 1) return;
  torch::NoGradGuard no_grad;
  data.broadcast(c.params->data(), 0);
  for (auto& [name, b] : c.named_buffers())
    if (b.is_floating_point()) data.broadcast(b, 0);
}

namespace {

// Collective over the world: every rank runs `part` (which may throw) and all learn whether
// every one succeeded; if one failed, every rank throws (the failed one with its message,
// the others naming it), rank 0 having first run `undo`.
void every_rank_does(Context& c, const std::string& what, const std::function<void()>& part,
                     const std::function<void()>& undo) {
  auto outcome = torch::tensor({int64_t(0), int64_t(-1)}, torch::kInt64);  // [exit code, rank]
  std::string why;
  try {
    part();
  } catch (const Error& e) {
    outcome[0] = int64_t(e.code), outcome[1] = c.mesh.rank(), why = e.what();
  } catch (const std::exception& e) {  // the file system's own errors
    outcome[0] = int64_t(kExitBadData), outcome[1] = c.mesh.rank();
    why = fmt::format("cannot {}: {}", what, first_line(e.what()));
  }
  c.mesh.world()->all_reduce(outcome, ReduceOp::kMax);
  const auto code = outcome[0].item<int64_t>();
  if (!code) return;
  if (c.root()) undo();
  throw Error(ExitCode(code), !why.empty() ? why
                                           : fmt::format("rank {} could not {} (see rank {})",
                                                         outcome[1].item<int64_t>(), what,
                                                         outcome[1].item<int64_t>()));
}

// `tensors` less the entries of a tied weight's copy (and their optimizer slots): the
// embedding's stage saves it.
NamedTensors without_copies(const Context& c, NamedTensors tensors) {
  if (!c.tied_copy) return tensors;
  std::vector<std::string> names;
  for (size_t i : c.tied) names.push_back(c.params->entries()[i].name);
  auto is_copy = [&](const std::pair<std::string, torch::Tensor>& t) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) {
      return t.first == n || t.first.rfind(n + ".", 0) == 0;
    });
  };
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), is_copy), tensors.end());
  return tensors;
}

}  // namespace

void save_checkpoint(Context& c, const std::optional<EvalResult>& eval) {
  // Rank 0 opens the temporary folder. Every rank of the first data-parallel replica
  // writes what it owns: its stage's tensors (".ppN"), of split tensors its tensor rank's
  // part (".tpT"), replicated ones on tensor rank 0; the model is never gathered, the
  // optimizer state only under ZeRO (its shards, over the data group). Every data rank
  // writes its own strategy state (compression's residuals, "sync.dpD"). Rank 0 commits
  // once every part is written. No rank moves on (or exits) before the checkpoint is
  // complete, and if a part could not be written every rank stops with the writer's reason.
  c.sync->settle();  // ZeRO's parameters, still on their way to every rank
  const int64_t step = c.state.step;
  const std::string what = fmt::format("write the checkpoint of step {}", step);
  root_does(c, what, [&] {
    c.checkpoints->begin(step);
    return int64_t(0);
  });
  CheckpointState state;
  PartsOf parts;
  const auto& at = c.mesh.coord();
  const bool writer = at.data == 0;
  // Under ZeRO every data rank holds a shard of the optimizer state: gathered (a collective
  // over the data group) for the writer, so the checkpoint holds it whole.
  if (writer || !c.sync->shard().whole())
    state.optimizer = without_copies(
        c, optimizer_state(*c.optimizer, *c.params, at.tensor, parts, *c.mesh.data()));
  // The strategy's state (compression's residuals): every data rank's own.
  NamedTensors sync_state;
  PartsOf sync_parts;
  for (const auto& [name, flat] : replica_state(c))
    for (auto& [key, t] : c.params->owned(flat, "." + name, at.tensor, sync_parts)) {
      const auto saved_as = sync_key(c, key);
      if (saved_as != key)  // a split part keeps its placement under its new name
        if (auto part = sync_parts.extract(key)) sync_parts[saved_as] = part.mapped();
      sync_state.emplace_back(saved_as, t);
    }
  for (const auto& [i, q] : c.sync->factors()) {  // a replicated parameter's on tensor rank 0
    const auto& e = c.params->entries()[i];
    if (e.placement.is_split() || at.tensor == 0)
      sync_state.emplace_back(factor_key(c, e, at.tensor), q);
  }
  if (writer) {
    state.model = c.params->owned(c.params->data(), "", at.tensor, parts);
    if (at.tensor == 0)
      for (auto& b : c.named_buffers()) state.model.push_back(std::move(b));
    state.model = without_copies(c, std::move(state.model));
  } else {
    state.optimizer.clear();
  }
  const auto& dims = c.mesh.dims();
  every_rank_does(
      c, what,
      [&] {
        const std::string part = (dims.pipeline > 1 ? fmt::format(".pp{}", at.pipeline) : "") +
                                 (dims.tensor > 1 ? fmt::format(".tp{}", at.tensor) : "");
        const auto temp = CheckpointStore::temp_folder(c.cfg.run_dir, step);
        if (!sync_state.empty())
          CheckpointStore::write_sync_state(temp, at.data, part, sync_state, sync_parts);
        if (!writer) return;
        CheckpointStore::write_part(temp, part, state.model, state.optimizer, parts);
      },
      [&] { c.checkpoints->abort(step); });
  root_does(c, what, [&] {
    const auto& st = c.state;
    const int64_t spe = c.steps_per_epoch();
    state.trainer = {{"step", st.step},
                     {"epoch", st.step / spe},
                     {"step_in_epoch", st.step % spe},
                     {"global_batch", c.cfg.data.batch_size},
                     {"train_samples", c.data.train->size()},
                     {"best_metric", finite_or_null(st.best_metric)},
                     {"best_step", st.best_step},
                     {"last_loss", finite_or_null(st.last_loss)},
                     {"rng_torch_cpu", to_hex(at::detail::getDefaultCPUGenerator().get_state())}};
    if (c.device().is_cuda())
      state.trainer["rng_torch_cuda"] =
          to_hex(at::globalContext().defaultGenerator(c.device()).get_state());
    if (c.scaler) state.trainer["loss_scaler"] = c.scaler->state();
    if (!st.worker_pushes.empty()) state.trainer["worker_pushes"] = st.worker_pushes;
    state.config_yaml = to_yaml(c.cfg);
    state.run_id = c.world.run_id;
    std::optional<Metric> metric;
    if (eval) metric = Metric{c.task->metric(), eval->metric, c.task->higher_is_better()};
    auto folder = c.checkpoints->commit(state, st.step, st.step / spe, layout_json(dims), metric);
    c.say(fmt::format("checkpoint {}", folder));
    return int64_t(0);
  });
  c.state.last_saved = c.state.step;
}

void init_weights(Context& c) {
  const auto& from = c.cfg.model.init_from;
  NamedTensors source;
  std::error_code ec;
  const bool file = fs::is_regular_file(from, ec) && from.size() > 12 &&
                    from.compare(from.size() - 12, 12, ".safetensors") == 0;
  source = file ? read_safetensors(from).tensors : load_checkpoint(resolve_checkpoint(from)).model;
  std::map<std::string, torch::Tensor> by_name(source.begin(), source.end());
  auto fits = [&](const std::string& name, const std::vector<int64_t>& full_shape) {
    auto it = by_name.find(name);
    return it != by_name.end() && it->second.sizes().vec() == full_shape;
  };
  // Every rank takes its part of what fits, and names what it holds that does not; the
  // whole model's names the source lacks, and the source's the model lacks, every rank sees.
  std::vector<std::string> skipped, unused;
  std::set<std::string> model(c.model_names.begin(), c.model_names.end());
  for (const auto& [name, t] : by_name)
    if (!model.count(name)) unused.push_back(name);
  for (const auto& name : c.model_names)
    if (!by_name.count(name)) skipped.push_back(name);
  torch::NoGradGuard no_grad;
  const auto& entries = c.params->entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (fits(e.name, e.full_shape))
      c.params->view(c.params->data(), i)
          .copy_(e.placement.shard(by_name.at(e.name), c.mesh.coord().tensor));
    else if (by_name.count(e.name))
      skipped.push_back(e.name + " (another shape)");
  }
  for (auto& [name, b] : c.named_buffers()) {
    if (fits(name, b.sizes().vec())) b.copy_(by_name.at(name));
    else if (by_name.count(name)) skipped.push_back(name + " (another shape)");
  }
  auto some = [](const std::vector<std::string>& v) {
    std::vector<std::string> head(v.begin(), v.begin() + long(std::min<size_t>(v.size(), 4)));
    return fmt::format("{}{}", fmt::join(head, ", "), v.size() > 4 ? ", ..." : "");
  };
  const std::string what = fmt::format("initialise the model from '{}'", from);
  if (c.cfg.model.init_strict) {
    // A shape that differs shows only on the rank holding that tensor: all stop together.
    every_rank_does(
        c, what,
        [&] {
          fail_if<CheckpointError>(!skipped.empty(), "model.init_from: '{}' lacks {} tensor(s) "
                                   "of the model or holds them at another shape ({}); set "
                                   "model.init_strict: false to load what matches", from,
                                   skipped.size(), some(skipped));
          fail_if<CheckpointError>(!unused.empty(), "model.init_from: '{}' holds {} tensor(s) "
                                   "the model does not have ({}); set model.init_strict: false "
                                   "to leave them", from, unused.size(), some(unused));
        },
        [] {});
  } else if (!skipped.empty() || !unused.empty()) {
    c.say(fmt::format("warning: model.init_from: {} tensor(s) left as initialised ({}); {} in "
                      "'{}' not used ({})", skipped.size(), some(skipped), unused.size(), from,
                      some(unused)));
  }
}

}  // namespace dtrain
