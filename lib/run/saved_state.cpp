#include "run/saved_state.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "models/gpt_hf.hpp"
#include "util/safetensors.hpp"
#include "config/schema.hpp"
#include "run/run.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

std::string to_hex(const torch::Tensor& bytes) {
  const auto c = bytes.contiguous();
  const auto* p = c.data_ptr<uint8_t>();
  return fmt::format("{:02x}", fmt::join(p, p + c.numel(), ""));
}

torch::Tensor from_hex(const std::string& s) {
  auto t = torch::empty({int64_t(s.size() / 2)}, torch::kUInt8);
  auto* p = t.data_ptr<uint8_t>();
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < s.size(); i += 2) p[i / 2] = uint8_t(nibble(s[i]) << 4 | nibble(s[i + 1]));
  return t;
}

// The first few names of a list, for a message.
std::string first_few(const std::vector<std::string>& v) {
  std::vector<std::string> head(v.begin(), v.begin() + long(std::min<size_t>(v.size(), 4)));
  return fmt::format("{}{}", fmt::join(head, ", "), v.size() > 4 ? ", ..." : "");
}

void set_generator_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

double number_or_nan(const nlohmann::json& j) { return j.is_number() ? j.get<double>() : std::nan(""); }

}  // namespace

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
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: {}", file, e.what()));
  }
  fail_if<CheckpointError>(out.step < 0 || out.best_step < 0 || out.best_step > out.step,
                           "{}: step {} and best_step {} are out of range", file, out.step,
                           out.best_step);
  fail_if<CheckpointError>(out.global_batch < 1 || out.train_samples < 1,
                           "{}: global_batch {} and train_samples {} must be positive", file,
                           out.global_batch, out.train_samples);
  return out;
}

namespace {

// A resume continues the same model: the checkpoint's model keys (all but dropout, which
// changes no weight) and its tensor names must be the job's. Otherwise weights would be
// dropped or misread in silence (model.heads 4 -> 8 keeps every shape).
void check_same_model(const JobConfig& cfg, const std::vector<std::string>& model_names,
                      const StateReader& saved) {
  const std::string& folder = saved.folder();
  JobConfig theirs = cfg;
  try {
    theirs = parse_job(saved.config_yaml(), folder + "/config.yaml");
  } catch (const ConfigError& e) {
    throw CheckpointError(fmt::format("{}: cannot read the job that wrote it: {}", folder,
                                      first_line(e.what())));
  }
  JobConfig ours = cfg;
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
  std::set<std::string> names(model_names.begin(), model_names.end()), theirs_names;
  for (const auto& name : saved.names(StateFile::kModel)) theirs_names.insert(name);
  std::vector<std::string> extra, missing;
  for (const auto& name : theirs_names) if (!names.count(name)) extra.push_back(name);
  for (const auto& name : names) if (!theirs_names.count(name)) missing.push_back(name);
  fail_if<CheckpointError>(!extra.empty(), "{}: the checkpoint holds {} tensor(s) this job's "
                           "model does not have ({}); resuming needs the same model", folder,
                           extra.size(), first_few(extra));
  fail_if<CheckpointError>(!missing.empty() && !saved.this_rank_only(),
                           "{}: the checkpoint lacks {} tensor(s) of this job's model ({})",
                           folder, missing.size(), first_few(missing));
}

}  // namespace

// A live recovery's state goes to the joiner's rank at the same place: the last stage's
// copy too.
NamedTensors without_copies(const FlatParams& params, const Tied& tied, NamedTensors tensors,
                            const StateWriter& out) {
  if (!tied.copy || out.every_rank_whole()) return tensors;
  std::vector<std::string> names;
  for (size_t i : tied.entries) names.push_back(params.entries()[i].name);
  auto is_copy = [&](const std::pair<std::string, torch::Tensor>& t) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) {
      return t.first == n || t.first.rfind(n + ".", 0) == 0;
    });
  };
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), is_copy), tensors.end());
  return tensors;
}

namespace {

// The model's parameters (each rank its stage's, of split ones its tensor rank's part,
// replicated ones from tensor rank 0) and buffers. A resume continues the same model.
class WeightsSaver : public Stateful {
 public:
  explicit WeightsSaver(Run& run) : run_(run) {}
  void save(StateWriter& out) const override {
    // Under ZeRO-3 each data rank writes its shard (nothing gathered), the buffers with
    // data rank 0's.
    const auto& params = *run_.params;
    const auto file = params.sharded() ? StateFile::kModelShard : StateFile::kModel;
    if (!out.writes(file)) return;
    const int64_t tensor_rank = run_.mesh().coord().tensor;
    PartsOf parts;
    RangesOf ranges;
    const bool every = out.every_rank_whole();
    auto model = params.sharded() ? params.owned_range(params.data(), params.data_held(), "",
                                                       tensor_rank, parts, ranges, every)
                                  : params.owned(params.data(), "", tensor_rank, parts, every);
    if ((tensor_rank == 0 && run_.mesh().coord().data == 0) || every)
      for (auto& b : run_.model.buffers()) model.push_back(std::move(b));
    out.add(file, without_copies(params, run_.model.tied, std::move(model), out), parts, ranges);
  }
  void load(const StateReader& in) override {
    check_same_model(run_.cfg, run_.model.names, in);
    const SavedTensors model = in.tensors(StateFile::kModel);
    auto& params = *run_.params;
    if (params.sharded())
      params.scatter_range(params.data(), params.data_held(), "", model, run_.mesh().coord().tensor);
    else
      params.scatter_full(params.data(), "", model, run_.mesh().coord().tensor);
    torch::NoGradGuard no_grad;
    for (const auto& [name, b] : run_.model.buffers())  // replicated: every rank takes all of it
      b.copy_(model.at(name, b.sizes().vec()));
  }

 private:
  Run& run_;
};

// The optimizer's state: whole from the first data replica, or under ZeRO each data rank's
// shard from that rank (nothing gathered). Either loads at any layout.
class OptimizerSaver : public Stateful {
 public:
  explicit OptimizerSaver(Run& run) : run_(run) {}
  void save(StateWriter& out) const override {
    const bool shard = keeps_shard(*run_.optimizer, *run_.params);
    const auto file = shard ? StateFile::kOptimizerShard : StateFile::kOptimizer;
    if (!out.writes(file)) return;
    PartsOf parts;
    RangesOf ranges;
    auto state = optimizer_state(*run_.optimizer, *run_.params, run_.mesh().coord().tensor, parts,
                                 ranges, out.every_rank_whole());
    out.add(file, without_copies(*run_.params, run_.model.tied, std::move(state), out), parts, ranges);
  }
  void load(const StateReader& in) override {
    load_optimizer_state(*run_.optimizer, *run_.params, in.tensors(StateFile::kOptimizer),
                         run_.mesh().coord().tensor);
  }

 private:
  Run& run_;
};

// The counters: the step (the data position with it), the best evaluation, the last
// loss; a resume needs the same global batch and training data.
class RunStateSaver : public Stateful {
 public:
  explicit RunStateSaver(Run& run) : run_(run) {}
  void save(StateWriter& out) const override {
    const auto& st = run_.state();
    const int64_t spe = run_.steps_per_epoch;
    out.set("step", st.step);
    out.set("epoch", st.step / spe);
    out.set("step_in_epoch", st.step % spe);
    out.set("global_batch", run_.cfg.data.batch_size);
    out.set("train_samples", run_.data.train->size());
    out.set("best_metric", finite_or_null(st.best_metric));
    out.set("best_step", st.best_step);
    out.set("last_loss", finite_or_null(st.last_loss));
  }
  void load(const StateReader& in) override {
    const SavedTrainer t = read_trainer_state(in.trainer(), in.folder());
    fail_if<ConfigError>(t.global_batch != run_.cfg.data.batch_size,
                         "data.batch_size: {} differs from the checkpoint's {} ({}); an exact "
                         "resume needs the same global batch", run_.cfg.data.batch_size,
                         t.global_batch, in.folder());
    fail_if<ConfigError>(t.train_samples != run_.data.train->size(),
                         "data: the checkpoint {} was trained on {} samples, this job has {}",
                         in.folder(), t.train_samples, run_.data.train->size());
    auto& st = run_.state();
    st.step = t.step;
    st.best_metric = t.best_metric;
    st.best_step = t.best_step;
    st.last_loss = t.last_loss;
    st.last_saved = st.step;
  }

 private:
  Run& run_;
};

// The random generators (LibTorch's CPU one, and the GPU's on a GPU run). A checkpoint
// from another device leaves this device's generator at the job's seed.
class RngSaver : public Stateful {
 public:
  explicit RngSaver(const c10::Device& device) : device_(device) {}
  void save(StateWriter& out) const override {
    out.set("rng_torch_cpu", to_hex(at::detail::getDefaultCPUGenerator().get_state()));
    if (device_.is_cuda())
      out.set("rng_torch_cuda", to_hex(at::globalContext().defaultGenerator(device_).get_state()));
  }
  void load(const StateReader& in) override {
    const SavedTrainer t = read_trainer_state(in.trainer(), in.folder());
    set_generator_state(at::detail::getDefaultCPUGenerator(), t.rng_cpu);
    if (device_.is_cuda() && t.rng_cuda.defined())
      set_generator_state(at::globalContext().defaultGenerator(device_), t.rng_cuda);
  }

 private:
  c10::Device device_;
};

// fp16's dynamic loss scale.
class ScalerSaver : public Stateful {
 public:
  explicit ScalerSaver(LossScaler& scaler) : scaler_(scaler) {}
  void save(StateWriter& out) const override { out.set("loss_scaler", scaler_.state()); }
  void load(const StateReader& in) override {
    const auto& t = in.trainer();
    if (t.contains("loss_scaler") && !t.at("loss_scaler").is_null())
      scaler_.load(t.at("loss_scaler"), in.folder() + "/trainer.json");
  }

 private:
  LossScaler& scaler_;
};

}  // namespace

std::vector<std::unique_ptr<Stateful>> run_savers(Run& run) {
  std::vector<std::unique_ptr<Stateful>> out;
  out.push_back(std::make_unique<WeightsSaver>(run));
  out.push_back(std::make_unique<RunStateSaver>(run));
  out.push_back(std::make_unique<OptimizerSaver>(run));
  if (run.scaler) out.push_back(std::make_unique<ScalerSaver>(*run.scaler));
  out.push_back(std::make_unique<RngSaver>(run.device()));
  return out;
}

void init_from(Run& run) {
  const auto& from = run.cfg.model.init_from;
  NamedTensors source;
  std::error_code ec;
  const bool file = fs::is_regular_file(from, ec) && from.size() > 12 &&
                    from.compare(from.size() - 12, 12, ".safetensors") == 0;
  if (is_hf_folder(from))  // a Hugging Face GPT-2 (transformers' save_pretrained)
    source = hf_gpt2_for(read_hf_gpt2(from), run.cfg.model, from);
  else
    source = file ? read_safetensors(from).tensors : load_checkpoint(resolve_checkpoint(from)).model;
  std::map<std::string, torch::Tensor> by_name(source.begin(), source.end());
  auto fits = [&](const std::string& name, const std::vector<int64_t>& full_shape) {
    auto it = by_name.find(name);
    return it != by_name.end() && it->second.sizes().vec() == full_shape;
  };
  // Every rank takes its part of what fits, and names what it holds that does not; the
  // whole model's names the source lacks, and the source's the model lacks, every rank sees.
  std::vector<std::string> skipped, unused;
  std::set<std::string> model(run.model.names.begin(), run.model.names.end());
  for (const auto& [name, t] : by_name)
    if (!model.count(name)) unused.push_back(name);
  for (const auto& name : run.model.names)
    if (!by_name.count(name)) skipped.push_back(name);
  torch::NoGradGuard no_grad;
  const auto& entries = run.params->entries();
  run.params->write_whole([&](size_t first, size_t last) {
    for (size_t i = first; i < last; ++i) {
      const auto& e = entries[i];
      if (fits(e.name, e.full_shape))
        run.params->value(i).copy_(e.placement.shard(by_name.at(e.name), run.mesh().coord().tensor));
      else if (by_name.count(e.name))
        skipped.push_back(e.name + " (another shape)");
    }
  });
  for (auto& [name, b] : run.model.buffers()) {
    if (fits(name, b.sizes().vec())) b.copy_(by_name.at(name));
    else if (by_name.count(name)) skipped.push_back(name + " (another shape)");
  }
  if (run.cfg.model.init_strict) {
    // A shape that differs shows only on the rank holding that tensor: all stop together.
    every_rank_does(
        *run.mesh().world(), fmt::format("initialise the model from '{}'", from),
        [&] {
          fail_if<CheckpointError>(!skipped.empty(), "model.init_from: '{}' lacks {} tensor(s) "
                                   "of the model or holds them at another shape ({}); set "
                                   "model.init_strict: false to load what matches", from,
                                   skipped.size(), first_few(skipped));
          fail_if<CheckpointError>(!unused.empty(), "model.init_from: '{}' holds {} tensor(s) "
                                   "the model does not have ({}); set model.init_strict: false "
                                   "to leave them", from, unused.size(), first_few(unused));
        },
        [] {});
  } else if (!skipped.empty() || !unused.empty()) {
    run.say(fmt::format("warning: model.init_from: {} tensor(s) left as initialised ({}); {} in "
                      "'{}' not used ({})", skipped.size(), first_few(skipped), unused.size(), from,
                      first_few(unused)));
  }
}

}  // namespace dtrain
