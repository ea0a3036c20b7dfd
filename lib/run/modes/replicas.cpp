// fault_tolerance: replicas: the sync mode's step over the replicas' set (replicas.hpp).
#include "run/modes/replicas.hpp"

#include <algorithm>
#include <csignal>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "grad/zero.hpp"
#include "run/signals.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/process.hpp"

namespace dtrain {

Replicas::Replicas(const JobConfig& cfg, const ParallelDims& dims, std::shared_ptr<Comm> world,
                   std::shared_ptr<ReplicaSet> set, std::vector<int64_t> job_ranks)
    : Lockstep(cfg, dims, std::move(world), false, std::move(job_ranks)),
      set_(std::move(set)),
      restarted_(set_->joining()) {}

std::unique_ptr<GradSync> Replicas::make_sync(FlatParams& params, int64_t micro_batches,
                                              int64_t total_steps, Tied tied) const {
  auto share = [this] { return double(share_size()) / double(batch()); };  // a data rank's
  if (cfg_.parallel.zero > 0)
    return make_zero_sync(cfg_.parallel, mesh(), params, micro_batches, std::move(tied),
                          {set_->comm(), share});
  return make_replica_sync(cfg_.parallel, set_->comm(), params, micro_batches, total_steps,
                           mesh().coord().tensor, share, std::move(tied));
}

void Replicas::bind(const TrainParts& parts) {
  take_over_ = parts.take_over;
  hand_over_ = parts.hand_over;
  log_ = &parts.log;
  course_.emplace(parts.sampler);
  const auto& o = set_->options();
  rank_batch_ = batch() / ((o.starting > 0 ? o.starting : o.replicas) * mesh().dims().data);
}

bool Replicas::writes_files() const {
  return !set_->joining() && set_->quorum().writer == replica();
}

RunResult Replicas::run(TrainParts& parts) {
  if (set_->joining()) {
    const double built = process_age_s();
    const auto asked = Clock::now();
    // Admitted from a step past the last (the others saw its request in the last step's
    // vote): they end without a step to hand it their state at.
    if (!set_->join() || set_->quorum().step > parts.total_steps) {
      if (const int sig = stop_signal()) {
        std::cerr << fmt::format("dtrain: replica {} was stopped before it joined\n", replica());
        return {exit_code_for_signal(sig), nlohmann::json()};
      }
      const auto how = set_->ended();
      std::cerr << fmt::format("dtrain: replica {}: the others {} the run before it could "
                               "join\n", replica(), how.empty() ? "completed" : how);
      return {0, nlohmann::json()};
    }
    const double waited = ms_since(asked) / 1e3;
    const Handover h = receive_or_send_state();
    log_->joined_at(set_->quorum().step);
    // Where a rejoin's time goes (docs/fault-tolerance.md): the start and build, the wait
    // for the step boundary the others admit it at, the state's transfer and its check.
    if (mesh().rank() == 0)
      std::cerr << fmt::format("dtrain: replica {} joined at step {}, {:.2f} s after its "
                               "process began: built in {:.2f} s, admitted {:.2f} s later "
                               "(the others' next vote), took {:.2f} GB of state ({}) in "
                               "{:.2f} s, hashed it in {:.2f} s\n", replica(),
                               set_->quorum().step, process_age_s(), built, waited,
                               double(h.bytes) / 1e9,
                               h.in_place == h.bytes ? "all in place"
                                   : fmt::format("{:.2f} GB in place", double(h.in_place) / 1e9),
                               h.seconds, h.hash_seconds);
  }
  RunResult r = Lockstep::run(parts);
  // A replica still waiting to join then has nothing left to train.
  if (r.exit_code == 0) set_->finished("completed");
  else if (set_->stops()) set_->finished("stopped");
  return r;
}

std::string Replicas::describe() const {
  const auto& d = mesh().dims();
  return fmt::format("data {} fault-tolerant replicas{}{}{}", set_->count(),
                     d.data > 1 ? fmt::format(" of data {} (ZeRO-{} within)", d.data,
                                              cfg_.parallel.zero) : "",
                     d.tensor > 1 ? fmt::format(" x tensor {}", d.tensor) : "",
                     d.pipeline > 1 ? fmt::format(" x pipeline {}", d.pipeline) : "");
}

nlohmann::json Replicas::layout() const {
  return {{"data", data_ranks()}, {"tensor", mesh().dims().tensor},
          {"pipeline", mesh().dims().pipeline}};
}

void Replicas::agree(int64_t /*n*/, torch::Tensor figures, ReduceOp op) {
  if (mesh().world()->size() > 1) mesh().world()->all_reduce(figures, op);
  if (set_->count() > 1) set_->comm()->all_reduce(figures, op);
}

Lockstep::RankInJob Replicas::rank_in_job() const {
  const auto& o = set_->options();
  const int64_t ranks = o.replicas * o.place.count;
  return {ranks > 1 ? ranks : 0, o.world_rank(replica())};
}

int64_t Replicas::replicas(int64_t n) const {
  const auto it = trained_by_.find(n);
  return it != trained_by_.end() ? it->second * mesh().dims().data : data_ranks();
}

double Replicas::loss_weight() const {
  return double(share_size() * data_ranks()) / double(batch());
}

double Replicas::batch_scale() const {
  return double(batch()) / double(cfg_.data.batch_size);
}

Stateful* Replicas::state() { return course_state(); }

void Replicas::CourseState::save(StateWriter& out) const {
  const Course& c = r_.course_->course();
  out.set("data_course", {{"step", c.step}, {"epoch", c.at.epoch}, {"position", c.at.position},
                          {"global_batch", r_.batch()}});
}

// A checkpoint of a job that kept its batch has none: its batches lie where a job's do.
void Replicas::CourseState::load(const StateReader& in) {
  const auto& t = in.trainer();
  if (!t.contains("data_course")) return;
  const auto& c = t.at("data_course");
  r_.course_ = r_.course_->on_course(
      Course{c.at("step").get<int64_t>(), {c.at("epoch").get<int64_t>(), c.at("position").get<int64_t>()}},
      c.at("global_batch").get<int64_t>());
}

// Under shrink the sampler's course is the job's until the quorum changes: it goes on in
// the members' batches from there.
ShardedSampler Replicas::share(const ShardedSampler& job) const {
  return (shrinks() ? *course_ : job)
      .reshared(mesh().coord().data * set_->count() + set_->index(), data_ranks());
}

bool Replicas::dies_at(int64_t n, const std::string& in) const {
  const auto& ft = cfg_.fault_tolerance;
  return !restarted_ && ft.debug_kill_in == in && n == ft.debug_kill_step &&
         ft.debug_kill_rank == set_->options().world_rank(replica());
}

void Replicas::before_step(int64_t n) {
  if (dies_at(n, "step"))  // a failure, or a stop (its replica leaves)
    std::raise(cfg_.fault_tolerance.debug_kill_signal == "TERM" ? SIGTERM : SIGKILL);
  if (set_->quorum().step == n) receive_or_send_state();  // a quorum with joiners starts
  if (dies_at(n, "reduce")) set_->comm()->die_after_posts(1);
  // The members' batch from this step on (a joiner's course is its source's, so each
  // member continues the same one alike).
  const int64_t members_batch = data_ranks() * rank_batch_;
  if (shrinks() && batch() != members_batch) course_ = course_->continued(n - 1, members_batch);
}

EvalSplit Replicas::eval_split(int64_t n) const {
  if (set_->count() == 1 || joiners_wait()) return Lockstep::eval_split(n);
  const int64_t d = mesh().dims().data;
  return {set_->index() * d + mesh().coord().data, set_->count() * d,
          [comm = set_->comm(), dies = dies_at(n, "eval")](torch::Tensor& sums) {
            if (dies) std::raise(SIGKILL);
            comm->all_reduce(sums);
            return !comm->failed();
          }};
}

bool Replicas::vote(int64_t n, int64_t again) {
  const bool wrote = writes_files();
  trained_by_[n] = set_->count();
  trained_by_.erase(trained_by_.begin(), trained_by_.lower_bound(n - 8));  // long read
  const bool ok = set_->commit(n, again);
  if (set_->leaves()) {
    if (!set_->stops() && mesh().rank() == 0)
      std::cerr << fmt::format("dtrain: replica {} leaves the job after step {} (a stop "
                               "signal came to it); the others go on without it\n",
                               replica(), n);
    return ok;
  }
  if (!wrote && writes_files() && take_over_) take_over_();
  if (!set_->leaving().empty())
    log_->say(fmt::format("replica(s) {} left the job after step {} (a stop signal came to "
                          "them); {} replica(s) go on", fmt::join(set_->leaving(), ", "), n,
                          set_->count()));
  return ok;
}

Lockstep::Ending Replicas::ending_after(int64_t /*n*/) const {
  return set_->stops() ? Ending::kJob : set_->leaves() ? Ending::kReplica : Ending::kNone;
}

// A failure on the way (a member gone) fails the joiners, which cannot train without the
// state (and must not: they take it straight into their own, which a failed hand-over
// leaves part theirs, part the source's); the others go on, and the next step's vote forms
// a quorum without the dead.
Handover Replicas::receive_or_send_state() {
  if (!joiners_wait()) return {};
  const Quorum& q = set_->quorum();
  handed_ = q.id;
  const auto& m = q.members;
  const int64_t source = std::find(m.begin(), m.end(), q.source) - m.begin();
  const bool joins = std::find(q.joining.begin(), q.joining.end(), replica()) != q.joining.end();
  const auto& comm = *set_->comm();
  Handover h;
  try {
    h = hand_over_(*set_->comm(), source, joins);
  } catch (const std::exception&) {  // a garbled header, where the group failed
    if (!comm.failed()) throw;
  }
  if (comm.failed()) {
    fail_if<DistError>(joins, "live recovery: replica {} could not take its state from "
                       "replica {}: {}", replica(), q.source, comm.error());
    return {};
  }
  fail_if<DistError>(joins && !h.identical(),
                     "live recovery: the state replica {} took from replica {} hashes to "
                     "{:016x} here, {:016x} there: it is not identical to its source",
                     replica(), q.source, h.mine, h.source);
  log_->say(fmt::format("replica(s) {} joined at step {}: state from replica {} over the "
                        "group, no checkpoint read (hash {:016x})",
                        fmt::join(q.joining, ", "), q.step, q.source, h.source));
  return h;
}

std::unique_ptr<Mode> make_replicas_mode(const JobConfig& cfg, const ParallelDims& dims,
                                         std::shared_ptr<Comm> world,
                                         std::shared_ptr<ReplicaSet> set) {
  auto job_ranks = set->options().ranks;
  if (cfg.parallel.mode == "local_sgd")
    return make_local_replicas_mode(cfg, dims, std::move(world), std::move(set),
                                    std::move(job_ranks));
  return std::make_unique<Replicas>(cfg, dims, std::move(world), std::move(set),
                                    std::move(job_ranks));
}

}  // namespace dtrain
