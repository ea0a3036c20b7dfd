// parallel.mode: local_sgd, local SGD with a synchronous start (docs/modes.md). Gloo's
// ring all-reduce leaves the same bits on every rank, so after an average the replicas are
// equal, not just close: where they meet, a checkpoint resumes exactly.
#include <algorithm>
#include <optional>

#include <fmt/format.h>
#include <torch/torch.h>

#include "optim/optimizer.hpp"
#include "run/mode.hpp"
#include "run/model_parts.hpp"
#include "run/modes/local_sgd.hpp"
#include "run/saved_state.hpp"
#include "util/strings.hpp"

namespace dtrain {

bool steps_locally(const ParallelConfig& cfg, int64_t n) { return n > cfg.local_after; }

bool local_sgd_meets(const ParallelConfig& cfg, int64_t n, int64_t total) {
  return !steps_locally(cfg, n) || (n - cfg.local_after) % cfg.average_every == 0 || n == total;
}

bool starts_interval(const ParallelConfig& cfg, int64_t n, int64_t total) {
  return steps_locally(cfg, n) && local_sgd_meets(cfg, n - 1, total);
}

namespace {

class LocalSync : public GradSync {
 public:
  LocalSync(const ParallelConfig& cfg, std::unique_ptr<GradSync> sync,
            std::unique_ptr<GradSync> local)
      : cfg_(cfg), sync_(std::move(sync)), local_(std::move(local)), active_(sync_.get()) {}
  double loss_factor() const override { return active_->loss_factor(); }
  void begin_step(int64_t step) override {
    active_ = steps_locally(cfg_, step) ? local_.get() : sync_.get();
    active_->begin_step(step);
  }
  void begin_micro_batch(bool last) override {
    if (active_ == local_.get()) sync_->begin_micro_batch(false);
    active_->begin_micro_batch(last);
  }
  void finish() override { active_->finish(); }
  void after_update(const torch::Tensor& skip) override { active_->after_update(skip); }
  void discard() override { active_->discard(); }
  int64_t bytes_per_step() const override { return active_->bytes_per_step(); }

 private:
  ParallelConfig cfg_;
  std::unique_ptr<GradSync> sync_, local_;
  GradSync* active_;
};

}  // namespace

std::unique_ptr<GradSync> make_local_sync(const ParallelConfig& cfg, std::unique_ptr<GradSync> sync,
                                          std::unique_ptr<GradSync> local) {
  return std::make_unique<LocalSync>(cfg, std::move(sync), std::move(local));
}

std::vector<torch::Tensor> averaged_state(const ParallelConfig& cfg, const FlatParams& params,
                                          const std::vector<torch::Tensor>& buffers,
                                          const Optimizer& optimizer) {
  std::vector<torch::Tensor> all{params.data()};
  for (const auto& b : buffers) all.push_back(b);
  if (cfg.average_optimizer)
    for (const auto& [name, slot] : optimizer.slots()) all.push_back(slot);
  return all;
}

OuterStep::OuterStep(const ParallelConfig& cfg, const torch::Tensor& like)
    : lr_(cfg.outer_lr), momentum_(cfg.outer_momentum) {
  if (momentum_ > 0) buffer_ = torch::zeros_like(like);
}

void OuterStep::step(const torch::Tensor& params, const torch::Tensor& outer) {
  torch::NoGradGuard no_grad;
  auto delta = outer - params;  // the pseudo-gradient
  if (momentum_ > 0) {
    buffer_.mul_(momentum_).add_(delta);
    delta.add_(buffer_, momentum_);  // Nesterov's look-ahead
  }
  params.copy_(outer).sub_(delta, lr_);
}

void OuterStep::save(StateWriter& out, const FlatParams& params, const Tied& tied,
                     int64_t tensor_rank) const {
  if (!buffer_.defined() || !out.writes(StateFile::kOptimizer)) return;
  PartsOf parts;
  auto named = params.owned(buffer_, ".outer_momentum", tensor_rank, parts, out.every_rank_whole());
  out.add(StateFile::kOptimizer, without_copies(params, tied, std::move(named), out), parts);
}

void OuterStep::load(const StateReader& in, const FlatParams& params, int64_t tensor_rank) {
  if (!buffer_.defined()) return;
  const auto names = in.names(StateFile::kOptimizer);
  const std::string suffix = ".outer_momentum";
  const bool held = std::any_of(names.begin(), names.end(),
                                [&](const std::string& n) { return ends_with(n, suffix); });
  if (!held) {
    in.warn("warning: parallel.outer_momentum: " + in.folder() + " holds no outer momentum "
            "(written without it): it starts at 0");
    return;
  }
  params.scatter_full(buffer_, suffix, in.tensors(StateFile::kOptimizer), tensor_rank);
}

int64_t average_over(Comm& group, const std::vector<torch::Tensor>& tensors, double weight,
                     bool even) {
  torch::NoGradGuard no_grad;
  int64_t bytes = 0;
  auto pending = std::make_unique<PendingAll>();
  for (const auto& t : tensors) {
    bytes += ring_all_reduce_bytes(t.numel() * t.element_size(), group.size());
    if (!even) t.mul_(weight);
    pending->parts.push_back(group.all_reduce_async(t, even ? ReduceOp::kAvg : ReduceOp::kSum));
  }
  pending->wait();
  return bytes;
}

namespace {

class LocalSgd : public Lockstep, public Stateful {
 public:
  LocalSgd(const JobConfig& cfg, const ParallelDims& dims, std::shared_ptr<Comm> world)
      : Lockstep(cfg, dims, std::move(world), /*replica_group=*/true) {}

  bool meets(int64_t n) const override { return local_sgd_meets(cfg_.parallel, n, total_steps_); }
  Comm& figures_group(int64_t n) const override {
    return meets(n) ? *mesh_.world() : *mesh_.replica();
  }
  int64_t replicas(int64_t n) const override { return meets(n) ? mesh_.dims().data : 1; }
  std::string apart() const override {
    return "between averages of the data replicas (parallel.mode: local_sgd)";
  }

  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches, int64_t,
                                      Tied tied) const override {
    return make_local_sync(
        cfg_.parallel, make_all_reduce_sync(cfg_.parallel, mesh_, params, micro_batches, tied),
        make_no_sync(params, micro_batches, tied));
  }

  void bind(const TrainParts& run) override {
    params_ = &run.params;
    optimizer_ = &run.optimizer;
    tied_ = &run.model.tied;
    total_steps_ = run.total_steps;
    buffers_ = run.model.float_buffers();
    outer_.emplace(cfg_.parallel, run.params.data());
  }

  // Under DiLoCo's outer step an interval starts from a copy of where the replicas met.
  void before_step(int64_t n) override {
    if (!outer_->active() || !starts_interval(cfg_.parallel, n, total_steps_)) return;
    if (outer_copy_.defined()) outer_copy_.copy_(params_->data());
    else outer_copy_ = params_->data().clone();
  }
  // Where the replicas meet after local steps: the average of the parameters, the
  // buffers and, when asked, the optimizer's slots; then the outer step, if any.
  AfterUpdate after_update(int64_t n) override {
    if (!steps_locally(cfg_.parallel, n) || !meets(n)) return {};
    const int64_t bytes = average_over(
        *mesh_.data(), averaged_state(cfg_.parallel, *params_, buffers_, *optimizer_), 1.0,
        /*even=*/true);
    if (outer_->active()) outer_->step(params_->data(), outer_copy_);
    return {bytes};
  }

  Stateful* state() override {
    return cfg_.parallel.average_optimizer && !outer_->buffer().defined() ? nullptr : this;
  }
  // Each data replica's own optimizer state, per data rank ("local_" + slot), restored at
  // the same data and pipeline size; else every replica starts from data rank 0's. And
  // the outer step's momentum, the same on every replica.
  void save(StateWriter& out) const override {
    outer_->save(out, *params_, *tied_, mesh_.coord().tensor);
    if (cfg_.parallel.average_optimizer || optimizer_->slots().empty()) return;  // plain SGD
    NamedTensors tensors;
    PartsOf parts;
    for (const auto& [slot, flat] : optimizer_->slots())
      for (auto& named : tied_->owned(*params_, flat, ".local_" + slot,
                                                mesh_.coord().tensor, parts))
        tensors.push_back(std::move(named));
    out.add(StateFile::kReplica, tensors, parts);
  }
  void load(const StateReader& in) override {
    outer_->load(in, *params_, mesh_.coord().tensor);
    if (cfg_.parallel.average_optimizer || optimizer_->slots().empty()) return;
    if (!in.replica_fits("warning: parallel.mode: local_sgd: each data replica's optimizer "
                         "state starts from data rank 0's"))
      return;
    const SavedTensors tensors = in.tensors(StateFile::kReplica);
    for (const auto& [slot, flat] : optimizer_->slots())
      tied_->load(*params_, flat, ".local_" + slot, tensors, mesh_.coord().tensor);
  }

 private:
  FlatParams* params_ = nullptr;
  Optimizer* optimizer_ = nullptr;
  const Tied* tied_ = nullptr;
  int64_t total_steps_ = 0;
  std::vector<torch::Tensor> buffers_;
  std::optional<OuterStep> outer_;
  torch::Tensor outer_copy_;  // where the replicas last met (under an outer step)
};

// What needs every data replica at every step.
void validate_local_sgd(const JobConfig& c, int64_t /*world*/) {
  const auto& p = c.parallel;
  const ModeRefusal refuse{"local_sgd"};
  refuse(p.zero > 0, fmt::format("parallel.zero {}", p.zero),
         "each data replica steps on its own whole optimizer state");
  refuse(p.compression != "none", "parallel.compression " + p.compression,
         "local SGD sends parameters every parallel.average_every steps, not gradients");
  refuse(p.sync_batchnorm, "parallel.sync_batchnorm",
         "its statistics span every data replica at every step");
  refuse(c.precision.dtype == "fp16", "precision.dtype fp16",
         "each replica's loss scale would move apart from the others'");
}

}  // namespace

ModeSpec local_sgd_spec() {
  ModeSpec s;
  s.validate = validate_local_sgd;
  // The synchronous start's all-reduce aside, a step sends a share of an average: of the
  // parameters, and of the optimizer's slots under parallel.average_optimizer.
  s.cost = [](const JobConfig& cfg, const FlatShape& shape, const DataGroup& group, int64_t) {
    const auto& p = cfg.parallel;
    RankCost c{grad_sync_cost(p, shape, group), true, ""};
    const double averaged = 1 + (p.average_optimizer ? double(slot_names(cfg.optimizer).size()) : 0);
    c.sync.bytes = ring_all_reduce_share(4 * double(c.sync.numel) * averaged, group.ranks) /
                   double(p.average_every);
    c.sync.ops = (group.ranks > 1 ? averaged : 0) / double(p.average_every);
    return c;
  };
  s.make = [](const JobConfig& cfg, const ParallelDims& dims,
              std::shared_ptr<Comm> world) -> std::unique_ptr<Mode> {
    if (dims.data == 1) return std::make_unique<Lockstep>(cfg, dims, std::move(world));  // sync
    return std::make_unique<LocalSgd>(cfg, dims, std::move(world));
  };
  return s;
}

}  // namespace dtrain
