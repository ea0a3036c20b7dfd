// The asynchronous parameter server (async_ps.hpp): a worker's loop, server 0's (the
// sequencer, which also runs the job's cadence) and the other servers' (which follow
// server 0's orders).
#include "train/async_ps.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <deque>
#include <map>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/loader.hpp"
#include "optim/clip.hpp"
#include "optim/schedule.hpp"
#include "train/cadence.hpp"
#include "train/evaluator.hpp"
#include "train/report.hpp"
#include "train/signals.hpp"
#include "train/state.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// The job group's point-to-point streams; each is matched in posting order per pair.
enum Tag : int { kHeaderTag = 21, kGradTag, kBufferTag, kReplyTag, kParamsTag, kOrderTag };

// A push's header, worker -> server 0 (fp64).
struct PushHeader {
  enum : int64_t { kBase, kLoss, kNorm, kStop, kDataWaitMs, kForwardMs, kBackwardMs, kSize };
};
// A reply's header, server 0 -> worker: the version its parameters are at, what to do next,
// and the pushes of this worker applied so far (its data position).
struct ReplyHeader {
  enum : int64_t { kVersion, kCommand, kPushes, kSize };
};
constexpr double kGoOn = -1;  // a reply's command: push again; else the exit code to end with
// Orders in flight to the other servers before server 0 waits for the oldest: a follower
// takes them one by one, so more than a few means it is behind.
constexpr size_t kOrdersInFlight = 64;
// An order, server 0 -> the other servers.
struct Order {
  enum : int64_t { kKind, kWorker, kArg, kNorm, kSize };
  // kApply: push kArg (from 1) of worker kWorker, its gradient's norm kNorm. kDiscard: the
  // worker's push, dropped. kReply: answer the worker. kEvaluate / kCheckpoint: at step
  // kArg. kEnd: exit with code kArg.
  enum Kind : int64_t { kApply = 1, kDiscard, kReply, kEvaluate, kCheckpoint, kEnd };
};

torch::Tensor f64(std::vector<double> v) { return torch::tensor(v, torch::kFloat64); }

int64_t rank_of_worker(const Context& c, int64_t w) { return c.mesh.servers() + w; }
std::string worker_name(const Context& c, int64_t w) {
  return fmt::format("async_ps worker {} (rank {})", w, rank_of_worker(c, w));
}

// Each server's range of the flat buffers: equal, contiguous, in server order (the
// buffers are padded for it: shard_flat).
std::vector<Shard> server_ranges(const Context& c) {
  std::vector<Shard> out;
  for (int64_t s = 0; s < c.mesh.servers(); ++s) out.push_back(c.params->shard(c.mesh.servers(), s));
  return out;
}
torch::Tensor range_of(const torch::Tensor& flat, const Shard& r) {
  return flat.narrow(0, r.offset, r.numel);
}

// The model's floating-point buffers (BatchNorm's running statistics), which no gradient
// moves: a worker sends its own with each push to server 0, whose model takes the latest
// applied one's, and server 0 gives them to the other servers before an evaluation or a
// checkpoint. So the servers' model is evaluated and saved with statistics of the data its
// parameters were trained on.
std::vector<torch::Tensor> float_buffers(const Context& c) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, b] : c.named_buffers())
    if (b.is_floating_point()) out.push_back(b);
  return out;
}
torch::Tensor pack(const std::vector<torch::Tensor>& buffers) {
  std::vector<torch::Tensor> flat;
  for (const auto& b : buffers) flat.push_back(b.reshape(-1).to(torch::kFloat32));
  return flat.empty() ? torch::empty({0}) : torch::cat(flat);
}
void unpack(const torch::Tensor& flat, const std::vector<torch::Tensor>& buffers) {
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (const auto& b : buffers) {
    b.copy_(flat.narrow(0, at, b.numel()).view(b.sizes()));
    at += b.numel();
  }
}

// Waits for a transfer with `who`, naming it if it fails (it died, or stalled past
// dist.timeout_s).
void wait_for(Pending& p, const std::string& who, const Context& c) {
  try {
    p.wait();
  } catch (const DistError& e) {
    throw DistError(fmt::format("rank {}: lost {}: {}", c.mesh.rank(), who, e.what()));
  }
}

// What every server does with its range.
class ServerRange {
 public:
  explicit ServerRange(Context& c)
      : c_(c), mine_(server_ranges(c)[size_t(c.mesh.coord().data)]), workers_(c.mesh.workers()),
        buffers_(float_buffers(c)), buffer_numel_(pack(buffers_).numel()) {}

  // Push k (from 1) of the run, a worker's mean gradient whose whole norm is `norm`:
  // clipped as that worker's own gradient (each push's move stays within train's
  // grad_clip over the workers), then a step of the optimizer at the learning rate of the
  // push's step over the workers.
  void apply(const torch::Tensor& grad, double norm, int64_t k) {
    torch::NoGradGuard no_grad;
    range_of(c_.params->grad(), mine_).copy_(grad);
    const int64_t step = (k - 1) / workers_ + 1;
    clip_grad(*c_.params, torch::full({}, norm, torch::kFloat32), c_.cfg.optimizer.grad_clip,
              1.0, mine_);
    c_.optimizer->step(lr_at(c_.cfg.schedule, c_.cfg.optimizer.lr, step, c_.total_steps) /
                       double(workers_));
    ++applied_;
  }
  // Every server's range into every server's parameters, before an evaluation or a
  // checkpoint: a collective over the servers, once per version (every server applies
  // the same pushes, so all skip alike when an evaluation and a checkpoint share a step).
  void gather() {
    auto& servers = *c_.mesh.world();
    if (servers.size() == 1 || gathered_ == applied_) return;
    gathered_ = applied_;
    servers.all_gather_into(c_.params->data(), range_of(c_.params->data(), mine_).clone());
    if (buffers_.empty()) return;
    auto flat = pack(buffers_);
    servers.broadcast(flat, 0);
    unpack(flat, buffers_);
  }
  // Server 0: a worker's buffers, with the push it applied.
  void take_buffers(const torch::Tensor& flat) {
    if (!buffers_.empty()) unpack(flat, buffers_);
  }
  int64_t buffer_numel() const { return buffer_numel_; }
  // This range's parameters as they are now (a reply's, which must not change in flight).
  torch::Tensor snapshot() const { return range_of(c_.params->data(), mine_).clone(); }
  torch::Tensor new_grad() const { return torch::empty({mine_.numel}, c_.params->grad().options()); }

 private:
  Context& c_;
  Shard mine_;
  int64_t workers_;
  std::vector<torch::Tensor> buffers_;
  int64_t buffer_numel_;
  int64_t applied_ = 0, gathered_ = 0;  // pushes applied here; as of the last gather
};

// A worker: pull, then push and pull until told to end.
RunResult run_worker(Context& c) {
  auto& job = *c.mesh.job();
  const auto ranges = server_ranges(c);
  const auto servers = int64_t(ranges.size());
  auto data = c.params->data(), grad = c.params->grad();
  auto reply = f64(std::vector<double>(ReplyHeader::kSize, 0.0));
  // The reply: server 0's header, and every server's range of the parameters, in place.
  auto pull = [&] {
    std::vector<P2POp> ops{{P2POp::kRecv, reply, 0, kReplyTag}};
    for (int64_t s = 0; s < servers; ++s)
      ops.push_back({P2POp::kRecv, range_of(data, ranges[size_t(s)]), s, kParamsTag});
    return ops;
  };
  auto exchange = [&](std::vector<P2POp> ops) {
    auto p = job.exchange_async(std::move(ops));
    wait_for(*p, "the servers", c);
  };
  exchange(pull());
  auto r = reply.accessor<double, 1>();
  if (r[ReplyHeader::kCommand] != kGoOn) return {int(r[ReplyHeader::kCommand]), nlohmann::json()};
  int64_t pushes = int64_t(r[ReplyHeader::kPushes]);
  // A worker is at most parallel.staleness pushes past the slowest, which ends at the last
  // step; one more push may be computed and dropped at the end.
  Loader loader(*c.data.train, *c.sampler, pushes, c.total_steps + c.cfg.parallel.staleness + 2,
                c.cfg.data.workers, c.cfg.data.prefetch, /*pin=*/c.device().is_cuda(),
                Augment{c.cfg.data.augment, c.cfg.data.crop_padding, uint64_t(c.cfg.seed)});
  auto header = f64(std::vector<double>(PushHeader::kSize, 0.0));
  const auto buffers = float_buffers(c);
  while (r[ReplyHeader::kCommand] == kGoOn) {
    c.state.step = pushes;  // its dropout draws are the data rank's of that step, as in sync
    if (c.cfg.train.debug_slow_rank == c.mesh.rank())  // a slow worker, for benchmarks
      std::this_thread::sleep_for(std::chrono::milliseconds(c.cfg.train.debug_slow_ms));
    StepStats s;
    Batch batch = to_device(loader.next(&s.data_wait_ms), c.device());
    const auto losses = c.runner->train(batch, c.sync->loss_factor(), s, [] {});
    c.sync->finish();
    double loss = 0;
    for (const auto& l : losses) loss += l.item<double>() / double(losses.size());
    const double norm = global_grad_norm(*c.params, *c.mesh.tensor(), *c.mesh.pipeline()).item<double>();
    auto h = header.accessor<double, 1>();
    h[PushHeader::kBase] = r[ReplyHeader::kVersion];
    h[PushHeader::kLoss] = loss;
    h[PushHeader::kNorm] = norm;
    h[PushHeader::kStop] = stop_signal() != 0 ? 1.0 : 0.0;
    h[PushHeader::kDataWaitMs] = s.data_wait_ms;
    h[PushHeader::kForwardMs] = s.forward_ms;
    h[PushHeader::kBackwardMs] = s.backward_ms;
    auto ops = pull();
    ops.push_back({P2POp::kSend, header, 0, kHeaderTag});
    if (!buffers.empty()) ops.push_back({P2POp::kSend, pack(buffers), 0, kBufferTag});
    for (int64_t sv = 0; sv < servers; ++sv)
      ops.push_back({P2POp::kSend, range_of(grad, ranges[size_t(sv)]), sv, kGradTag});
    exchange(std::move(ops));
    c.params->zero_grad();
    pushes = int64_t(r[ReplyHeader::kPushes]);
  }
  return {int(r[ReplyHeader::kCommand]), nlohmann::json()};
}

// A server past the first: server 0's orders, in order.
RunResult run_follower(Context& c) {
  auto& job = *c.mesh.job();
  ServerRange range(c);
  auto order = f64(std::vector<double>(Order::kSize, 0.0));
  auto grad = range.new_grad();
  // The last reply to each worker, in flight (done once the worker pushes again).
  std::vector<std::unique_ptr<Pending>> replies(size_t(c.mesh.workers()));
  while (true) {
    {
      auto p = job.exchange_async({{P2POp::kRecv, order, 0, kOrderTag}});
      wait_for(*p, "async_ps server 0 (rank 0)", c);
    }
    const auto o = order.accessor<double, 1>();
    const auto kind = int64_t(o[Order::kKind]), w = int64_t(o[Order::kWorker]);
    const auto arg = int64_t(o[Order::kArg]);
    if (kind == Order::kApply || kind == Order::kDiscard) {
      auto p = job.exchange_async({{P2POp::kRecv, grad, rank_of_worker(c, w), kGradTag}});
      wait_for(*p, worker_name(c, w), c);
      if (kind == Order::kApply) range.apply(grad, o[Order::kNorm], arg);
    } else if (kind == Order::kReply) {
      auto& last = replies[size_t(w)];
      if (last) wait_for(*last, worker_name(c, w), c);
      last = job.exchange_async({{P2POp::kSend, range.snapshot(), rank_of_worker(c, w), kParamsTag}});
    } else if (kind == Order::kEvaluate || kind == Order::kCheckpoint) {
      c.state.step = arg;
      range.gather();
      if (kind == Order::kEvaluate) evaluate_and_report(c);
      else save_checkpoint(c, std::nullopt);
    } else {  // kEnd
      for (size_t v = 0; v < replies.size(); ++v)
        if (replies[v]) wait_for(*replies[v], worker_name(c, int64_t(v)), c);
      return {int(arg), nlohmann::json()};
    }
  }
}

// Server 0: applies the pushes in the order they arrive, sequences the other servers, holds
// the replies of workers too far ahead, and runs the job's cadence at every step's end.
class Sequencer {
 public:
  explicit Sequencer(Context& c)
      : c_(c), range_(c), workers_(size_t(c.mesh.workers())),
        cadence_{c.cfg, *c.mode, c.steps_per_epoch(), c.total_steps} {
    for (auto& wk : workers_) {
      wk.header = torch::zeros({PushHeader::kSize}, torch::kFloat64);
      wk.grad = range_.new_grad();
      wk.buffers = torch::empty({range_.buffer_numel()});
    }
    const int64_t padded = c.params->data().numel(), elt = c.params->data().element_size();
    push_bytes_ = padded * elt + PushHeader::kSize * 8 + range_.buffer_numel() * 4;
    reply_bytes_ = padded * elt + ReplyHeader::kSize * 8;
    order_bytes_ = (c.mesh.servers() - 1) * Order::kSize * 8;
  }

  RunResult run() {
    auto& st = c_.state;
    const auto n_workers = int64_t(workers_.size());
    if (st.worker_pushes.size() != workers_.size()) {
      if (!st.worker_pushes.empty())
        c_.say(fmt::format("warning: the checkpoint was written by {} async_ps workers, this job "
                           "has {}: each worker starts at step {}'s data position",
                           st.worker_pushes.size(), n_workers, st.step));
      st.worker_pushes.assign(workers_.size(), st.step);
    }
    for (size_t w = 0; w < workers_.size(); ++w) workers_[w].pushes = st.worker_pushes[w];
    version_ = st.step * n_workers;
    if (c_.finished) {  // said by run_training
      for (auto& wk : workers_) wk.awaiting = true;  // each waits for its first reply
      end(0);
      return {0, nlohmann::json()};
    }
    try {
      for (size_t w = 0; w < workers_.size(); ++w) reply(w, kGoOn);
      mark_ = window_start_ = Clock::now();
      while (true)
        if (auto result = applied(next_push())) return *result;
    } catch (const DivergedError&) {
      throw;  // its summary is written
    } catch (const Error& e) {
      auto summary = summary_of("failed");
      summary["reason"] = first_line(e.what());
      write_summary(c_, summary);
      throw;
    }
  }

 private:
  struct Worker {
    int64_t pushes = 0;      // applied (or skipped): its data position
    bool computing = false;  // answered "go on": its next push is coming
    bool awaiting = false;   // its push is in and its reply held
    torch::Tensor header, grad, buffers;  // its last push
    std::unique_ptr<Pending> reply;  // the last reply, in flight
    int64_t window_pushes = 0;       // since the last train line
  };
  // One step's pushes, added up.
  struct StepSums {
    int64_t pushes = 0, finite = 0;
    double loss = 0, norm = 0, data_wait_ms = 0, forward_ms = 0, backward_ms = 0;
  };

  int64_t peer(size_t w) const { return rank_of_worker(c_, int64_t(w)); }

  std::string computing() const {
    std::string out;
    for (size_t w = 0; w < workers_.size(); ++w)
      if (workers_[w].computing) out += (out.empty() ? "" : ", ") + worker_name(c_, int64_t(w));
    return out.empty() ? "none" : out;
  }

  // The next push from whichever worker sends first: its header, then its gradient range.
  size_t next_push() {
    auto& job = *c_.mesh.job();
    int64_t from = 0;
    try {
      from = job.recv_any(incoming_, kHeaderTag);
    } catch (const DistError& e) {
      throw DistError(fmt::format("rank 0: no push from {}: {}", computing(), e.what()));
    }
    const auto w = size_t(from - c_.mesh.servers());
    auto& wk = workers_[w];
    wk.header.copy_(incoming_);
    std::vector<P2POp> ops{{P2POp::kRecv, wk.grad, from, kGradTag}};
    if (wk.buffers.numel() > 0) ops.push_back({P2POp::kRecv, wk.buffers, from, kBufferTag});
    auto p = job.exchange_async(std::move(ops));
    wait_for(*p, worker_name(c_, int64_t(w)), c_);
    wk.computing = false;
    return w;
  }

  // Tells the other servers what to do next (they act in this order).
  void order(Order::Kind kind, size_t w = 0, int64_t arg = 0, double norm = 0) {
    auto& job = *c_.mesh.job();
    for (int64_t s = 1; s < c_.mesh.servers(); ++s)
      orders_.push_back(job.exchange_async(
          {{P2POp::kSend, f64({double(kind), double(w), double(arg), norm}), s, kOrderTag}}));
    bytes_ += order_bytes_;
    // A follower takes its orders one by one; more than a few in flight means it is behind.
    while (orders_.size() > kOrdersInFlight) {
      wait_for(*orders_.front(), "an async_ps server", c_);
      orders_.pop_front();
    }
  }

  // Answers worker w: go on (and its next push is posted), or end with an exit code.
  void reply(size_t w, double command) {
    order(Order::kReply, w);
    auto& wk = workers_[w];
    if (wk.reply) wait_for(*wk.reply, worker_name(c_, int64_t(w)), c_);  // long done
    auto& job = *c_.mesh.job();
    wk.reply = job.exchange_async(
        {{P2POp::kSend, f64({double(version_), command, double(wk.pushes)}), peer(w), kReplyTag},
         {P2POp::kSend, range_.snapshot(), peer(w), kParamsTag}});
    bytes_ += reply_bytes_;
    wk.awaiting = false;
    wk.computing = command == kGoOn;
  }

  // Bounded staleness: every held reply whose worker is within parallel.staleness pushes
  // of the slowest goes out.
  void release() {
    int64_t slowest = workers_.front().pushes;
    for (const auto& wk : workers_) slowest = std::min(slowest, wk.pushes);
    for (size_t w = 0; w < workers_.size(); ++w)
      if (workers_[w].awaiting && workers_[w].pushes <= slowest + c_.cfg.parallel.staleness)
        reply(w, kGoOn);
  }

  // Worker w's push is in: applied (or, non-finite, dropped) as the next version.
  std::optional<RunResult> applied(size_t w) {
    auto& wk = workers_[w];
    const auto h = wk.header.accessor<double, 1>();
    const int64_t k = ++version_, n_workers = int64_t(workers_.size());
    const int64_t step = (k - 1) / n_workers + 1;
    const double loss = h[PushHeader::kLoss], norm = h[PushHeader::kNorm];
    const bool finite = std::isfinite(loss) && std::isfinite(norm);
    const auto staleness = int64_t(k - 1 - int64_t(h[PushHeader::kBase]));
    bytes_ += push_bytes_;
    stop_votes_ = stop_votes_ || h[PushHeader::kStop] > 0;
    if (finite) {
      order(Order::kApply, w, k, norm);
      range_.apply(wk.grad, norm, k);
      range_.take_buffers(wk.buffers);
      sums_.finite += 1, sums_.loss += loss, sums_.norm += norm;
      histogram_[staleness] += 1;
      window_staleness_ += double(staleness), window_applied_ += 1;
      window_stale_max_ = std::max(window_stale_max_, staleness);
    } else {
      order(Order::kDiscard, w);
    }
    sums_.pushes += 1;
    sums_.data_wait_ms += h[PushHeader::kDataWaitMs];
    sums_.forward_ms += h[PushHeader::kForwardMs];
    sums_.backward_ms += h[PushHeader::kBackwardMs];
    wk.pushes += 1, wk.window_pushes += 1;
    wk.awaiting = true;
    if (!finite) nonfinite(step, w);
    if (k % n_workers == 0)
      if (auto result = end_of_step(step)) return result;
    release();
    return std::nullopt;
  }

  // A push with a non-finite loss or gradient was dropped. train.on_nonfinite: stop ends
  // the run (nothing from it on is checkpointed: it was never applied); skip goes on until
  // train.max_skipped in a row.
  void nonfinite(int64_t step, size_t w) {
    auto& st = c_.state;
    const bool skip = c_.cfg.train.on_nonfinite == "skip";
    if (skip) {
      ++st.skipped, ++st.skipped_in_a_row;
      c_.say(fmt::format("warning: a push of {} skipped at step {}: non-finite loss or gradient; "
                         "{} in a row", worker_name(c_, int64_t(w)), step, st.skipped_in_a_row));
      if (st.skipped_in_a_row < c_.cfg.train.max_skipped) return;
    }
    const std::string why =
        skip ? fmt::format("{} pushes in a row had a non-finite loss or gradient "
                           "(train.max_skipped), the last from {} at step {}",
                           st.skipped_in_a_row, worker_name(c_, int64_t(w)), step)
             : fmt::format("non-finite loss or gradient from {} at step {}; it was not applied "
                           "and nothing from it on was checkpointed", worker_name(c_, int64_t(w)),
                           step);
    auto summary = summary_of("diverged");
    summary["diverged_step"] = step;
    summary["diverged_rank"] = peer(w);
    summary["reason"] = why;
    end(kExitBadData);
    write_summary(c_, summary);
    throw DivergedError("training diverged: " + why);
  }

  // Step n's pushes are all applied: its line, evaluation, checkpoint, and whether the run
  // ends here.
  std::optional<RunResult> end_of_step(int64_t n) {
    auto& st = c_.state;
    st.step = n;
    if (sums_.finite == sums_.pushes) st.skipped_in_a_row = 0;
    StepStats s;
    const double pushes = double(sums_.pushes);
    s.loss = sums_.finite ? sums_.loss / double(sums_.finite) : std::nan("");
    s.grad_norm = sums_.finite ? sums_.norm / double(sums_.finite) : std::nan("");
    s.data_wait_ms = sums_.data_wait_ms / pushes;
    s.forward_ms = sums_.forward_ms / pushes;
    s.backward_ms = sums_.backward_ms / pushes;
    s.step_ms = ms_since(mark_);
    s.comm_bytes = bytes_;
    mark_ = Clock::now();
    if (std::isfinite(s.loss)) st.last_loss = s.loss;
    st.bytes_sent += bytes_;
    bytes_ = 0;
    sums_ = StepSums{};
    window_.add(s);
    step_ms_.push_back(s.step_ms);
    data_wait_ms_ += s.data_wait_ms;
    const auto& cfg = c_.cfg;
    const double lr = lr_at(cfg.schedule, cfg.optimizer.lr, n, c_.total_steps);
    const bool log_now = cadence_.should_log(n);
    if (log_now) {
      auto line = train_line(c_, n, s, window_, lr);
      line["comm_bytes"] = window_.comm_bytes / window_.steps;
      line["staleness_mean"] = window_applied_ ? window_staleness_ / double(window_applied_) : 0.0;
      line["staleness_max"] = window_stale_max_;
      const double seconds = ms_since(window_start_) / 1000;
      std::vector<double> rates;
      for (auto& wk : workers_) rates.push_back(double(std::exchange(wk.window_pushes, 0)) / seconds);
      line["pushes_per_s"] = rates;
      rate_ = line["samples_per_s"].get<double>();
      c_.metrics->write(line);
      window_ = Window{};
      window_staleness_ = 0, window_applied_ = 0, window_stale_max_ = 0;
      window_start_ = Clock::now();
    }
    c_.progress->step(n, st.last_loss, lr, rate_, log_now);
    const bool eval_now = cadence_.should_eval(n), save_now = cadence_.should_save(n);
    const int sig = stop_signal() ? stop_signal() : stop_votes_ ? SIGTERM : 0;
    const auto paused = Clock::now();
    if (eval_now) {
      order(Order::kEvaluate, 0, n);
      range_.gather();
      evaluate_and_report(c_);
    }
    if (save_now || (sig && st.last_saved != n)) checkpoint(n, eval_now);
    mark_ += Clock::now() - paused;  // evaluations and checkpoints are not a step's time
    if (sig) {
      auto summary = summary_of("stopped");
      summary["signal"] = sig;
      c_.say(fmt::format("stopped by signal {} after step {}; checkpoint saved", sig, n));
      end(exit_code_for_signal(sig));
      c_.metrics->write(summary);
      return RunResult{exit_code_for_signal(sig), summary};
    }
    if (!cadence_.last(n)) return std::nullopt;
    auto summary = summary_of("completed");
    end(0);
    write_summary(c_, summary);
    c_.say(fmt::format("done: {} steps ({} pushes), final loss {:.4f}, {:.0f} samples/s{}", n,
                       version_, st.last_loss, summary["samples_per_s"].get<double>(),
                       st.last_eval ? fmt::format(", eval {} {:.4f} (best {:.4f} at step {})",
                                                  c_.task->metric(), st.last_eval->metric,
                                                  st.best_metric, st.best_step)
                                    : ""));
    return RunResult{0, summary};
  }

  void checkpoint(int64_t n, bool evaluated) {
    auto& st = c_.state;
    for (size_t w = 0; w < workers_.size(); ++w) st.worker_pushes[w] = workers_[w].pushes;
    order(Order::kCheckpoint, 0, n);
    range_.gather();
    save_checkpoint(c_, evaluated ? st.last_eval : std::nullopt);
  }

  // Every worker is answered with `code` (one still computing first has its push taken
  // and dropped), then the other servers; nothing is left in flight.
  void end(int code) {
    while (std::any_of(workers_.begin(), workers_.end(), [](const Worker& wk) { return wk.computing; })) {
      const size_t w = next_push();
      order(Order::kDiscard, w);
      workers_[w].awaiting = true;
    }
    for (size_t w = 0; w < workers_.size(); ++w)
      if (workers_[w].awaiting) reply(w, double(code));
    order(Order::kEnd, 0, code);
    for (auto& wk : workers_)
      if (wk.reply) wait_for(*wk.reply, "an async_ps worker", c_);
    for (auto& p : orders_) wait_for(*p, "an async_ps server", c_);
    orders_.clear();
  }

  // The summary, with what is async_ps's own: the staleness of every applied gradient (its
  // histogram: versions -> pushes), each worker's pushes, the layout by role.
  nlohmann::json summary_of(const std::string& status) const {
    auto s = summary_line(c_, status, step_ms_, data_wait_ms_);
    const auto n_workers = int64_t(workers_.size());
    s["layout"] = {{"data", n_workers}, {"tensor", 1}, {"pipeline", 1},
                   {"servers", c_.mesh.servers()}};
    int64_t applied = 0, most = 0;
    double sum = 0;
    nlohmann::json histogram = nlohmann::json::object();
    for (const auto& [versions, count] : histogram_) {
      applied += count, sum += double(versions * count), most = std::max(most, versions);
      histogram[std::to_string(versions)] = count;
    }
    s["staleness_mean"] = applied ? sum / double(applied) : 0.0;
    s["staleness_max"] = most;
    s["staleness_histogram"] = histogram;
    std::vector<int64_t> pushes;
    for (const auto& wk : workers_) pushes.push_back(wk.pushes);
    s["worker_pushes"] = pushes;
    return s;
  }

  Context& c_;
  ServerRange range_;
  std::vector<Worker> workers_;
  Cadence cadence_;
  torch::Tensor incoming_ = torch::zeros({PushHeader::kSize}, torch::kFloat64);  // a header
  int64_t version_ = 0;          // pushes applied (or dropped) since the run began
  int64_t push_bytes_ = 0, reply_bytes_ = 0, order_bytes_ = 0;
  int64_t bytes_ = 0;            // moved in this step, by every rank
  std::deque<std::unique_ptr<Pending>> orders_;  // in flight to the other servers
  bool stop_votes_ = false;
  StepSums sums_;
  std::map<int64_t, int64_t> histogram_;  // staleness -> applied pushes, this process's
  Window window_;
  double window_staleness_ = 0;
  int64_t window_applied_ = 0, window_stale_max_ = 0;
  std::vector<double> step_ms_;
  double data_wait_ms_ = 0, rate_ = 0;
  Clock::time_point mark_, window_start_;
};

}  // namespace

RunResult run_async_ps(Context& c) {
  if (c.worker()) return run_worker(c);
  if (!c.root()) return run_follower(c);
  return Sequencer(c).run();
}

}  // namespace dtrain
