// The training loop. A step reads top to bottom:
//   1. next batch  2. forward  3. backward (+ gradient all-reduce)  4. clip
//   5. optimizer step  6. account
// and everything around it (evaluation, checkpoints, resume) happens between steps.
// Data parallelism: each rank takes its shard of every global batch; gradients are averaged
// by a GradReducer during backward; rank 0 alone writes metrics and checkpoints.
#include "train/trainer.hpp"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.hpp"
#include "config/schema.hpp"
#include "data/dataset.hpp"
#include "data/loader.hpp"
#include "logging/metrics.hpp"
#include "models/models.hpp"
#include "parallel/reducer.hpp"
#include "train/flat_params.hpp"
#include "train/optimizer.hpp"
#include "train/schedule.hpp"
#include "train/signals.hpp"
#include "util/affinity.hpp"
#include "util/blas.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "util/memory.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

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

// Runs `f` with bf16 CPU autocast when asked; weights stay fp32.
template <class F>
auto autocast(bool bf16, F&& f) {
  at::autocast::set_cpu_enabled(bf16);
  auto out = f();
  at::autocast::set_cpu_enabled(false);
  if (bf16) at::autocast::clear_cache();
  return out;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

// Sums over one logging window of steps.
struct Window {
  int64_t steps = 0, samples = 0;
  double step_ms = 0, data_wait_ms = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0,
         optim_ms = 0;
};

class Trainer {
 public:
  Trainer(const JobConfig& cfg, const RunOptions& opts, const WorldInfo& world,
          std::shared_ptr<Comm> comm)
      : cfg_(cfg), opts_(opts), world_(world), comm_(std::move(comm)),
        root_(comm_->rank() == 0) {}
  RunResult run();

 private:
  void setup();
  std::optional<std::string> choose_checkpoint();
  void restore(const std::string& folder);
  void broadcast_state();
  double train_step(Window& w, double* grad_norm);
  EvalResult evaluate();
  void save_checkpoint(const std::optional<EvalResult>& eval);
  nlohmann::json summary(const std::string& status);
  void say(const std::string& line) {
    if (root_) progress_->print(line);
  }
  int64_t epoch_of(int64_t step) const { return step / sampler_->steps_per_epoch(); }

  JobConfig cfg_;
  RunOptions opts_;
  WorldInfo world_;
  std::shared_ptr<Comm> comm_;
  bool root_;
  Layout layout_;
  DataSplits data_;
  Model model_{nullptr};
  torch::MemoryFormat format_ = torch::MemoryFormat::Contiguous;  // of inputs and weights
  std::unique_ptr<FlatParams> params_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradReducer> reducer_;  // only with more than one data-parallel rank
  std::optional<ShardedSampler> sampler_;
  std::unique_ptr<CheckpointStore> checkpoints_;  // rank 0
  std::unique_ptr<MetricsLog> metrics_;           // rank 0
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<Loader> loader_;

  int64_t step_ = 0;         // optimizer steps done
  int64_t total_steps_ = 0;
  int64_t last_saved_ = -1;
  double last_loss_ = std::nan("");
  bool stop_requested_ = false;  // agreed by all ranks
  std::optional<EvalResult> last_eval_;
  double best_accuracy_ = -1;
  int64_t best_step_ = 0;
  std::vector<double> step_times_ms_;  // this process's steps, for the steady-state rate
  double data_wait_total_ms_ = 0;
};

void Trainer::setup() {
  tune_allocator();
  layout_ = derive_layout(cfg_, comm_->size());
  // Local processes share the machine's cores.
  const int64_t threads =
      cfg_.train.threads > 0
          ? cfg_.train.threads
          : std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency()) / world_.local_world);
  torch::set_num_threads(static_cast<int>(threads));
  const std::string pinning = cfg_.train.pin_threads
                                  ? pin_compute_threads(threads, world_.local_rank, world_.local_world)
                                  : "not pinned";
  torch::manual_seed(static_cast<uint64_t>(cfg_.seed));

  auto blas = loaded_blas();
  if (root_ && is_reference_blas(blas))
    std::cerr << "dtrain: warning: LibTorch is using the reference BLAS (" << blas
              << "), which is ~19x slower on Linear layers; install libopenblas0-openmp\n";

  data_ = load_data(cfg_.data, static_cast<uint64_t>(cfg_.seed));
  model_ = build_model(cfg_.model, {data_.sample_shape, data_.classes,
                                    cfg_.parallel.sync_batchnorm && layout_.data > 1
                                        ? comm_ : nullptr});
  format_ = preferred_format(cfg_.model);
  params_ = std::make_unique<FlatParams>(*model_, format_);
  optimizer_ = make_optimizer(cfg_.optimizer, *params_);
  sampler_.emplace(data_.train.size(), cfg_.data.batch_size, cfg_.data.shuffle,
                   static_cast<uint64_t>(cfg_.seed), /*rank=*/comm_->rank(),
                   /*ranks=*/layout_.data);
  total_steps_ = cfg_.train.max_steps > 0 ? cfg_.train.max_steps
                                          : cfg_.train.epochs * sampler_->steps_per_epoch();
  progress_ = std::make_unique<Progress>(root_ ? cfg_.logging.progress : "off", total_steps_);

  if (root_) {
    fs::create_directories(cfg_.run_dir);
    checkpoints_ = std::make_unique<CheckpointStore>(cfg_.run_dir, cfg_.checkpoint);
  }
  auto resume_from = choose_checkpoint();
  if (resume_from) restore(*resume_from);
  broadcast_state();  // every rank starts from rank 0's exact state
  if (layout_.data > 1)
    reducer_ = std::make_unique<GradReducer>(*model_, *params_, comm_, cfg_.parallel.bucket_mb);
  if (root_) {
    write_file_atomic((fs::path(cfg_.run_dir) / "config.yaml").string(), to_yaml(cfg_));
    metrics_ = std::make_unique<MetricsLog>(
        (fs::path(cfg_.run_dir) / "metrics.jsonl").string(),
        resume_from ? std::optional<int64_t>(step_) : std::nullopt);
  }
  say(fmt::format(
      "dtrain {}: job '{}', {} ({} parameters), {} ({} train / {} test), batch {}, {} steps "
      "({} per epoch), world {} (data {} x tensor {} x pipeline {}, launcher {}), {} thread(s) "
      "per rank ({}), BLAS {}{}; logs in {}",
      DTRAIN_VERSION, cfg_.name, cfg_.model.arch, params_->data().numel(), cfg_.data.dataset,
      data_.train.size(), data_.test.size(), cfg_.data.batch_size, total_steps_,
      sampler_->steps_per_epoch(), comm_->size(), layout_.data, layout_.tensor, layout_.pipeline,
      world_.launcher, threads, pinning, blas.empty() ? "unknown" : blas,
      resume_from ? fmt::format(", resumed at step {} from {}", step_, *resume_from) : "",
      cfg_.run_dir));
}

// Rank 0 decides which checkpoint (if any) the job resumes from; the others follow.
std::optional<std::string> Trainer::choose_checkpoint() {
  if (!opts_.resume.empty() && opts_.resume != "auto") return opts_.resume;
  auto decision = torch::full({1}, -1, torch::kInt64);  // the step to resume, -1 = fresh
  std::string refusal;
  if (root_) {
    auto newest = checkpoints_->newest_valid();
    if (newest && opts_.resume == "auto")
      decision.fill_(verify_checkpoint(*newest)["step"].get<int64_t>());
    else if (newest)  // starting over would mix a new run's checkpoints with the old ones
      refusal = fmt::format("run directory '{}' already holds checkpoints: resume with "
                            "--resume auto, or choose another --run-dir", cfg_.run_dir);
    if (!refusal.empty()) decision.fill_(-2);
  }
  comm_->broadcast(decision, 0);
  const int64_t step = decision.item<int64_t>();
  if (step == -2)
    throw ConfigError(root_ ? refusal
                            : fmt::format("run directory '{}' already holds checkpoints (see "
                                          "rank 0)", cfg_.run_dir));
  if (step < 0) return std::nullopt;
  return (fs::path(cfg_.run_dir) / "checkpoints" / fmt::format("step-{:08d}", step)).string();
}

void Trainer::restore(const std::string& folder) {
  auto state = load_checkpoint(folder);
  const auto& t = state.trainer;
  try {
    fail_if<ConfigError>(t.at("global_batch").get<int64_t>() != cfg_.data.batch_size,
                         "data.batch_size: {} differs from the checkpoint's {} ({}); an exact "
                         "resume needs the same global batch", cfg_.data.batch_size,
                         t["global_batch"].get<int64_t>(), folder);
    fail_if<ConfigError>(t.at("train_samples").get<int64_t>() != data_.train.size(),
                         "data: the checkpoint {} was trained on {} samples, this job has {}",
                         folder, t["train_samples"].get<int64_t>(), data_.train.size());
    step_ = t.at("step").get<int64_t>();
    best_accuracy_ = t.at("best_accuracy").get<double>();
    best_step_ = t.at("best_step").get<int64_t>();
    last_loss_ = t.at("last_loss").is_number() ? t["last_loss"].get<double>() : std::nan("");
    last_saved_ = step_;
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> saved(state.model.begin(), state.model.end());
    auto load_into = [&](const std::string& name, torch::Tensor dst) {
      auto it = saved.find(name);
      if (it == saved.end())
        throw CheckpointError(fmt::format("{}: the model has '{}', the checkpoint does not",
                                          folder, name));
      if (it->second.sizes() != dst.sizes())
        throw CheckpointError(fmt::format("{}: '{}' has shape {} in the checkpoint, {} in the "
                                          "model", folder, name, shape_str(it->second),
                                          shape_str(dst)));
      dst.copy_(it->second);
    };
    for (const auto& p : model_->named_parameters()) load_into(p.key(), p.value());
    for (const auto& b : model_->named_buffers()) load_into(b.key(), b.value());
    optimizer_->load_state(state.optimizer);
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(from_hex(t.at("rng_torch_cpu").get<std::string>()));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}/trainer.json: {}", folder, e.what()));
  }
}

void Trainer::broadcast_state() {
  if (comm_->size() == 1) return;
  torch::NoGradGuard no_grad;
  comm_->broadcast(params_->data(), 0);
  for (auto& b : model_->buffers())
    if (b.is_floating_point()) comm_->broadcast(b, 0);
}

double Trainer::train_step(Window& w, double* grad_norm) {
  const auto t_step = Clock::now();
  // 1. next batch (prepared ahead by the loader's threads): this rank's shard
  double wait_ms = 0;
  Batch batch = loader_->next(&wait_ms);
  const int64_t accum = cfg_.train.grad_accum;
  const int64_t micro = batch.y.size(0) / accum;
  const bool bf16 = cfg_.precision.dtype == "bf16";
  double loss_sum = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0;
  for (int64_t a = 0; a < accum; ++a) {
    auto x = (accum == 1 ? batch.x : batch.x.narrow(0, a * micro, micro)).contiguous(format_);
    auto y = accum == 1 ? batch.y : batch.y.narrow(0, a * micro, micro);
    // 2. forward (bf16 autocast keeps fp32 master weights; the loss is taken in fp32)
    auto t0 = Clock::now();
    auto logits = autocast(bf16, [&] { return model_->forward(x); });
    auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), y);
    loss_sum += loss.item<double>() / double(accum);
    // The gradient wanted is the mean over the global batch: scaling the loss by
    // 1 / (micro-batches x data-parallel ranks) gives it with the all-reduce a plain sum,
    // and costs nothing (the factor enters at the root of the graph, not as a pass).
    const double scale = 1.0 / double(accum * layout_.data);
    if (scale != 1.0) loss = loss * scale;
    forward_ms += ms_since(t0);
    // 3. backward: gradients accumulate into the flat buffer; on the last micro-batch the
    //    reducer all-reduces each bucket as soon as it is complete
    t0 = Clock::now();
    if (reducer_) reducer_->set_sync(a == accum - 1);
    loss.backward();
    backward_ms += ms_since(t0);
  }
  if (reducer_) {
    const auto t0 = Clock::now();
    reducer_->finalize();
    // The global batch's loss and whether any rank was asked to stop, in one small reduce.
    // (Launched during backward instead, it holds a Gloo thread waiting for the peer and
    // measured slower: 23-27k against 27-33k samples/s for the MLP at 2 ranks.)
    auto agree = torch::tensor({loss_sum, stop_signal() ? 1.0 : 0.0}, torch::kFloat64);
    comm_->all_reduce(agree);
    loss_sum = agree[0].item<double>() / double(layout_.data);
    stop_requested_ = agree[1].item<double>() > 0;
    comm_ms += ms_since(t0);
  } else {
    stop_requested_ = stop_signal() != 0;
  }
  const auto t_opt = Clock::now();
  // 4. clip by the global norm (after the all-reduce every rank holds the same gradient)
  const double clip = cfg_.optimizer.grad_clip;
  if (grad_norm || clip > 0) {
    const double norm = params_->grad().norm().item<double>();
    if (grad_norm) *grad_norm = norm;
    if (clip > 0 && norm > clip) params_->grad().mul_(clip / (norm + 1e-6));
  }
  // 5. optimizer step
  optimizer_->step(lr_at(cfg_.schedule, cfg_.optimizer.lr, step_ + 1, total_steps_));
  params_->zero_grad();
  ++step_;
  // 6. account the step's phases
  w.steps += 1;
  w.samples += cfg_.data.batch_size;
  w.data_wait_ms += wait_ms;
  w.forward_ms += forward_ms;
  w.backward_ms += backward_ms;
  w.comm_ms += comm_ms;
  w.optim_ms += ms_since(t_opt);
  const double step_ms = ms_since(t_step);
  w.step_ms += step_ms;
  step_times_ms_.push_back(step_ms);
  data_wait_total_ms_ += wait_ms;
  if (!std::isfinite(loss_sum) && root_)
    std::cerr << fmt::format("dtrain: warning: loss is {} at step {}\n", loss_sum, step_);
  return loss_sum;
}

// Each rank scores a contiguous slice of the test set; the sums are combined, so every
// sample counts exactly once whatever the number of ranks.
EvalResult Trainer::evaluate() {
  torch::NoGradGuard no_grad;
  model_->eval();
  const auto& test = data_.test;
  const int64_t ranks = layout_.data, r = comm_->rank();
  const int64_t lo = test.size() * r / ranks, hi = test.size() * (r + 1) / ranks;
  double loss_sum = 0;
  int64_t correct = 0;
  const bool bf16 = cfg_.precision.dtype == "bf16";
  for (int64_t start = lo; start < hi; start += cfg_.train.eval_batch_size) {
    const int64_t n = std::min(cfg_.train.eval_batch_size, hi - start);
    auto x = test.x.narrow(0, start, n).contiguous(format_), y = test.y.narrow(0, start, n);
    auto logits = autocast(bf16, [&] { return model_->forward(x); }).to(torch::kFloat32);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    correct += logits.argmax(1).eq(y).sum().item<int64_t>();
  }
  model_->train();
  auto sums = torch::tensor({loss_sum, double(correct)}, torch::kFloat64);
  comm_->all_reduce(sums);
  return {sums[0].item<double>() / double(test.size()), sums[1].item<double>() / double(test.size())};
}

void Trainer::save_checkpoint(const std::optional<EvalResult>& eval) {
  if (root_) {
    CheckpointState state;
    for (const auto& p : model_->named_parameters()) state.model.emplace_back(p.key(), p.value());
    for (const auto& b : model_->named_buffers()) state.model.emplace_back(b.key(), b.value());
    state.optimizer = optimizer_->state();
    const int64_t spe = sampler_->steps_per_epoch();
    state.trainer = {{"step", step_},
                     {"epoch", step_ / spe},
                     {"step_in_epoch", step_ % spe},
                     {"global_batch", cfg_.data.batch_size},
                     {"train_samples", data_.train.size()},
                     {"best_accuracy", best_accuracy_},
                     {"best_step", best_step_},
                     {"last_loss", std::isfinite(last_loss_) ? nlohmann::json(last_loss_) : nullptr},
                     {"rng_torch_cpu", to_hex(at::detail::getDefaultCPUGenerator().get_state())}};
    state.config_yaml = to_yaml(cfg_);
    nlohmann::json layout{{"data", layout_.data}, {"tensor", layout_.tensor},
                          {"pipeline", layout_.pipeline}};
    std::optional<Metric> metric;
    if (eval) metric = Metric{"accuracy", eval->accuracy};
    auto folder = checkpoints_->save(state, step_, step_ / spe, layout, metric);
    say(fmt::format("checkpoint {}", folder));
  }
  comm_->barrier();  // no rank moves on (or exits) before the checkpoint is complete
  last_saved_ = step_;
}

nlohmann::json Trainer::summary(const std::string& status) {
  // Steady state: leave out the first steps of this process (allocator and cache warm-up).
  const size_t n = step_times_ms_.size();
  const size_t warm = std::min<size_t>(20, n / 5);
  double ms = 0;
  for (size_t i = warm; i < n; ++i) ms += step_times_ms_[i];
  const double steady = ms > 0 ? double(n - warm) * double(cfg_.data.batch_size) / (ms / 1000) : 0;
  std::vector<double> sorted(step_times_ms_.begin() + long(warm), step_times_ms_.end());
  std::sort(sorted.begin(), sorted.end());
  nlohmann::json s{
      {"kind", "summary"},
      {"status", status},
      {"steps", step_},
      {"epochs", double(step_) / double(sampler_->steps_per_epoch())},
      {"final_loss", std::isfinite(last_loss_) ? nlohmann::json(last_loss_) : nullptr},
      {"samples_per_s", steady},
      {"step_ms_median", sorted.empty() ? 0.0 : sorted[sorted.size() / 2]},
      {"data_wait_ms_mean", n ? data_wait_total_ms_ / double(n) : 0.0},
      {"world_size", comm_->size()},
      {"layout", {{"data", layout_.data}, {"tensor", layout_.tensor}, {"pipeline", layout_.pipeline}}},
      {"time", unix_time()}};
  if (best_accuracy_ >= 0) {
    s["best_accuracy"] = best_accuracy_;
    s["best_step"] = best_step_;
  }
  if (last_eval_) {
    s["final_accuracy"] = last_eval_->accuracy;
    s["final_eval_loss"] = last_eval_->loss;
  }
  return s;
}

RunResult Trainer::run() {
  install_stop_signals();  // before setup: a stop during loading still ends with a checkpoint
  setup();
  loader_ = std::make_unique<Loader>(data_.train, *sampler_, step_, total_steps_,
                                     cfg_.data.workers, cfg_.data.prefetch);
  const int64_t spe = sampler_->steps_per_epoch();
  const int64_t comm_bytes = reducer_ ? reducer_->bytes_per_step() : 0;
  Window w;
  double last_rate = 0;
  while (step_ < total_steps_) {
    const bool log_now = (step_ + 1) % cfg_.train.log_every == 0 || step_ + 1 == total_steps_;
    double grad_norm = std::nan("");
    last_loss_ = train_step(w, log_now ? &grad_norm : nullptr);
    const double lr = lr_at(cfg_.schedule, cfg_.optimizer.lr, step_, total_steps_);  // just used
    if (log_now && root_) {
      last_rate = w.samples / (w.step_ms / 1000);
      const double n = double(w.steps);
      nlohmann::json line{{"kind", "train"},
                          {"step", step_},
                          {"epoch", epoch_of(step_ - 1)},
                          {"loss", last_loss_},
                          {"lr", lr},
                          {"grad_norm", grad_norm},
                          {"samples_per_s", last_rate},
                          {"step_ms", w.step_ms / n},
                          {"data_wait_ms", w.data_wait_ms / n},
                          {"forward_ms", w.forward_ms / n},
                          {"backward_ms", w.backward_ms / n},
                          {"optim_ms", w.optim_ms / n},
                          {"time", unix_time()}};
      if (reducer_) line["comm_ms"] = w.comm_ms / n, line["comm_bytes"] = comm_bytes;
      metrics_->write(line);
    }
    if (log_now) w = Window{};
    if (root_)
      progress_->step(step_, last_loss_, lr, last_rate, log_now);

    const bool epoch_end = step_ % spe == 0, last = step_ == total_steps_;
    const bool eval_now = (cfg_.train.eval_every > 0 ? step_ % cfg_.train.eval_every == 0
                                                     : epoch_end) || last;
    std::optional<EvalResult> eval;
    if (eval_now) {
      const auto t0 = Clock::now();
      eval = evaluate();
      last_eval_ = eval;
      if (eval->accuracy > best_accuracy_) best_accuracy_ = eval->accuracy, best_step_ = step_;
      if (root_)
        metrics_->write({{"kind", "eval"}, {"step", step_}, {"epoch", epoch_of(step_ - 1)},
                         {"loss", eval->loss}, {"accuracy", eval->accuracy},
                         {"eval_ms", ms_since(t0)}, {"time", unix_time()}});
      say(fmt::format("eval at step {}: loss {:.4f}, accuracy {:.4f}", step_, eval->loss,
                      eval->accuracy));
    }
    const bool save_now = (cfg_.checkpoint.every_steps > 0
                               ? step_ % cfg_.checkpoint.every_steps == 0 : epoch_end) || last;
    if (save_now) save_checkpoint(eval);

    if (stop_requested_) {
      if (last_saved_ != step_) save_checkpoint(std::nullopt);
      const int sig = stop_signal() ? stop_signal() : SIGTERM;  // a peer's signal
      auto s = summary("stopped");
      s["signal"] = sig;
      if (root_) metrics_->write(s);
      say(fmt::format("stopped by signal {} after step {}; checkpoint saved", sig, step_));
      return {exit_code_for_signal(sig), s};
    }
  }
  auto s = summary("completed");
  if (root_) {
    progress_->finish();
    metrics_->write(s);
  }
  say(fmt::format("done: {} steps, final loss {:.4f}, {:.0f} samples/s{}", step_, last_loss_,
                  s["samples_per_s"].get<double>(),
                  last_eval_ ? fmt::format(", test accuracy {:.4f} (best {:.4f} at step {})",
                                           last_eval_->accuracy, best_accuracy_, best_step_)
                             : ""));
  return {0, s};
}

}  // namespace

RunResult run_training(const JobConfig& cfg, const RunOptions& opts, const WorldInfo& world,
                       std::shared_ptr<Comm> comm) {
  Trainer t(cfg, opts, world, std::move(comm));
  return t.run();
}

}  // namespace dtrain
