// fault_tolerance: replicas under parallel.mode: local_sgd (docs/fault-tolerance.md): each
// replica steps alone between averages, taken over the replicas' set; the synchronous
// start's steps are the sync mode's over the set (replicas.hpp).
//
// The replicas do not talk between averages, so they vote where they meet, once the
// average is taken, not at every step (TorchFT's local SGD does the same). A replica that
// failed since the last average took its steps since then with it: every survivor
// discards its own too, puts back the state it kept at that average (DiLoCo's outer copy:
// the parameters, the buffers, the optimizer's state) and trains the interval again, its
// global batches dealt among the survivors. So no sample is lost or seen twice, and the
// interval is local SGD's over the survivors: what a run of the smaller world from that
// average gives. A replica that joins does so where the others meet, with their average.
// DiLoCo's outer step (OuterStep) starts from that same kept copy.
#include <optional>

#include <fmt/format.h>
#include <torch/torch.h>

#include "optim/optimizer.hpp"
#include "run/model_parts.hpp"
#include "run/modes/local_sgd.hpp"
#include "run/modes/replicas.hpp"

namespace dtrain {
namespace {

// What a replica holds at an average, to go back to; its parameters are DiLoCo's outer
// copy, which the outer step starts from.
struct OuterCopy {
  int64_t step = -1;  // the average's step (-1: none kept)
  torch::Tensor params;
  std::vector<torch::Tensor> buffers, slots;
  NamedTensors scalars;
  torch::Tensor momentum;  // the outer step's
};

class LocalReplicas : public Replicas, public Stateful {
 public:
  using Replicas::Replicas;

  bool meets(int64_t n) const override { return local_sgd_meets(cfg_.parallel, n, total_steps_); }
  bool may_go_back() const override { return true; }
  std::string apart() const override {
    return "between averages of the replicas (parallel.mode: local_sgd)";
  }
  std::string describe() const override {
    return Replicas::describe() +
           fmt::format(", local SGD averaged every {} steps", cfg_.parallel.average_every);
  }

  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches,
                                      int64_t total_steps, Tied tied) const override {
    auto local = make_no_sync(params, micro_batches, tied);
    return make_local_sync(cfg_.parallel,
                           Replicas::make_sync(params, micro_batches, total_steps, std::move(tied)),
                           std::move(local));
  }
  void bind(const TrainParts& parts) override {
    Replicas::bind(parts);
    params_ = &parts.params;
    optimizer_ = &parts.optimizer;
    total_steps_ = parts.total_steps;
    float_buffers_ = parts.model.float_buffers();
    for (const auto& [name, b] : parts.model.buffers()) buffers_.push_back(b);
    tied_ = &parts.model.tied;
    outer_.emplace(cfg_.parallel, parts.params.data());
  }
  // The outer step's momentum, with the optimizer's state (the same on every replica), and
  // under shrink the data's course.
  Stateful* state() override {
    return outer_->buffer().defined() || course_state() ? this : nullptr;
  }
  void save(StateWriter& out) const override {
    if (outer_->buffer().defined()) outer_->save(out, *params_, *tied_, mesh().coord().tensor);
    if (const auto* course = course_state()) course->save(out);
  }
  void load(const StateReader& in) override {
    if (outer_->buffer().defined()) outer_->load(in, *params_, mesh().coord().tensor);
    if (auto* course = course_state()) course->load(in);
  }

  // Where they meet the replicas hold the same weights; between averages each its own.
  EvalSplit eval_split(int64_t n) const override {
    return meets(n) ? Replicas::eval_split(n) : Lockstep::eval_split(n);
  }

  // Between averages each replica's figures are its own.
  void agree(int64_t n, torch::Tensor figures, ReduceOp op) override {
    if (meets(n)) return Replicas::agree(n, std::move(figures), op);
    if (mesh().world()->size() > 1) mesh().world()->all_reduce(figures, op);
  }
  int64_t replicas(int64_t n) const override {
    return meets(n) ? Replicas::replicas(n) : mesh().dims().data;
  }
  double loss_weight() const override { return meets(now_) ? Replicas::loss_weight() : 1.0; }
  // Under fault_tolerance.batch: shrink a local step is on the replica's own share, whose
  // size a failure does not change: its rate stays (the synchronous start's scales).
  double lr_scale() const override {
    return steps_locally(cfg_.parallel, now_) ? 1.0 : Replicas::lr_scale();
  }

  // An interval starts from the last average's state: kept, once a joiner has its own.
  void before_step(int64_t n) override {
    Replicas::before_step(n);
    now_ = n;
    if (starts_interval(cfg_.parallel, n, total_steps_) && kept_.step != n - 1) keep(n - 1);
  }
  // The synchronous start votes as the sync mode does; an interval where its replicas meet.
  bool commit(int64_t n) override { return steps_locally(cfg_.parallel, n) || vote(n, n); }
  AfterUpdate after_update(int64_t n) override {
    if (!steps_locally(cfg_.parallel, n) || !meets(n)) return {};
    const auto& s = set();
    int64_t bytes = 0;
    if (s.count() > 1)
      bytes = average_over(*s.comm(), averaged_state(cfg_.parallel, *params_, float_buffers_, *optimizer_),
                           batch_share(), even_shares());
    if (outer_->active()) outer_->step(params_->data(), kept_.params);
    if (vote(n, kept_.step + 1)) return {bytes};
    restore();
    log().say(fmt::format("steps {} to {} discarded: a replica failed before the replicas met "
                          "(local SGD); the {} left train them again from step {}'s average",
                          kept_.step + 1, n, s.count(), kept_.step));
    return {0, kept_.step};
  }

 private:
  void keep(int64_t step) {
    torch::NoGradGuard no_grad;
    kept_.step = step;
    kept_.params = params_->data().clone();
    kept_.buffers.clear(), kept_.slots.clear();
    for (const auto& b : buffers_) kept_.buffers.push_back(b.clone());
    for (const auto& [name, slot] : optimizer_->slots()) kept_.slots.push_back(slot.clone());
    kept_.scalars.clear();
    for (const auto& [name, t] : optimizer_->scalars()) kept_.scalars.emplace_back(name, t.clone());
    if (outer_->buffer().defined()) kept_.momentum = outer_->buffer().clone();
  }
  void restore() {
    torch::NoGradGuard no_grad;
    params_->data().copy_(kept_.params);
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(kept_.buffers[i]);
    const auto slots = optimizer_->slots();
    for (size_t i = 0; i < slots.size(); ++i) slots[i].second.copy_(kept_.slots[i]);
    optimizer_->load_scalars(kept_.scalars);
    if (kept_.momentum.defined()) outer_->buffer().copy_(kept_.momentum);
  }

  FlatParams* params_ = nullptr;
  Optimizer* optimizer_ = nullptr;
  int64_t total_steps_ = 0;
  std::vector<torch::Tensor> buffers_, float_buffers_;
  const Tied* tied_ = nullptr;
  int64_t now_ = 0;  // the step being trained
  std::optional<OuterStep> outer_;
  OuterCopy kept_;
};

}  // namespace

std::unique_ptr<Mode> make_local_replicas_mode(const JobConfig& cfg, const ParallelDims& dims,
                                               std::shared_ptr<Comm> world,
                                               std::shared_ptr<ReplicaSet> set,
                                               std::vector<int64_t> job_ranks) {
  return std::make_unique<LocalReplicas>(cfg, dims, std::move(world), std::move(set),
                                         std::move(job_ranks));
}

}  // namespace dtrain
