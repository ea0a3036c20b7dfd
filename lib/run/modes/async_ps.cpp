// parallel.mode: async_ps, the asynchronous parameter server (Dean et al. 2012's Downpour;
// MXNet's kvstore, Marian's asynchronous training), with bounded staleness (stale
// synchronous parallel, Ho et al. 2013).
//
// The job's first parallel.servers ranks are servers; they hold the parameters, each
// updating one contiguous range of the flat buffer with the job's optimizer, whose state
// is therefore sharded over them. The other ranks are workers: each pulls the parameters,
// computes the gradient of its shard of a global batch (as a data-parallel rank would), and
// pushes it: to every server its range, to server 0 a header (the version the gradient was
// computed on, its loss and norm, a stop vote). Workers never wait for one another; a
// server applies each push as it arrives, then answers the worker with the parameters.
//
//   versions   every push applied is one version; a "step" is one push per worker (a
//              global batch's worth of samples), so train.max_steps, epochs and the
//              evaluation and checkpoint cadence keep their meaning. A push is applied at
//              the learning rate of its step over the number of workers: W pushes of one
//              lock-step round move the weights as far as one synchronous step, and with
//              plain SGD exactly as far (the test's reference).
//   staleness  a worker's reply is held while it is more than parallel.staleness pushes
//              ahead of the slowest worker, so a gradient is never computed on parameters
//              more than about (staleness + 1) x workers versions old; 0 is lock-step.
//              The staleness each applied gradient had (versions between the one it was
//              computed on and the one it was applied to) is reported.
//   order      server 0 sequences: it tells the other servers, in order, which push to
//              apply, which worker to answer, when to evaluate and checkpoint, so every
//              server's range is at the same version at each of those: a checkpoint or an
//              evaluation sees one consistent model.
//   the run    server 0 is the job's rank 0: it writes metrics.jsonl and the checkpoints
//              (the servers' parameters and optimizer state, and each worker's pushes: its
//              data position) and evaluates with the other servers at step boundaries.
//
// Every wait is bounded by dist.timeout_s; a worker or server that dies ends the job with
// exit 4 naming it, and --max-restarts resumes it from the newest checkpoint.
//
// Here: the mode (roles, their groups, the flat buffers' ranges), a worker's loop, server
// 0's (the sequencer, which runs the job's cadence through the run log) and the other
// servers' (which follow server 0's orders).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/loader.hpp"
#include "grad/zero.hpp"
#include "optim/clip.hpp"
#include "optim/schedule.hpp"
#include "run/cadence.hpp"
#include "run/evaluator.hpp"
#include "run/run.hpp"
#include "run/signals.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

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
  // worker's push, dropped. kReply: answer the worker with command kArg (kGoOn: it pushes
  // again). kEvaluate / kCheckpoint: at step kArg. kEnd: exit with code kArg.
  enum Kind : int64_t { kApply = 1, kDiscard, kReply, kEvaluate, kCheckpoint, kEnd };
};

torch::Tensor f64(std::vector<double> v) { return torch::tensor(v, torch::kFloat64); }

// What every role's code shares: the run, and how many of the job's ranks are servers (its
// first ones) and workers (the rest).
struct Ps {
  Run& run;
  int64_t servers, workers;
  // Each worker's applied pushes (its data position): restored from a checkpoint, saved
  // with one (WorkerPushes), kept by server 0.
  std::vector<int64_t>& worker_pushes;
};

int64_t rank_of_worker(const Ps& c, int64_t w) { return c.servers + w; }
std::string worker_name(const Ps& c, int64_t w) {
  return fmt::format("async_ps worker {} (rank {})", w, rank_of_worker(c, w));
}

// Each server's range of the flat buffers: equal, contiguous, in server order (the
// buffers are padded for it: shard_flat).
std::vector<Shard> server_ranges(const Ps& c) {
  std::vector<Shard> out;
  for (int64_t s = 0; s < c.servers; ++s) out.push_back(c.run.params->shard(c.servers, s));
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
std::vector<torch::Tensor> float_buffers(const Ps& c) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, b] : c.run.model.buffers())
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
void wait_for(Pending& p, const std::string& who, const Ps& c) {
  try {
    p.wait();
  } catch (const DistError& e) {
    throw DistError(fmt::format("rank {}: lost {}: {}", c.run.job->rank(), who, e.what()));
  }
}

// The workers' pushes, taken in the order they complete. A receive from any rank would be
// simpler, but Gloo's commits to the first sender it hears of and then waits for that
// sender's data, which only comes while the sender runs: a worker stopped just after it
// posted its push (SIGSTOP, a swapped-out process) held every other worker's. So each
// worker's next push is posted to it alone as it is told to go on (and its data flows as
// soon as it sends), waited for on a thread of its own, and handed over as it completes.
class Arrivals {
 public:
  explicit Arrivals(size_t workers) : threads_(workers) {}
  Arrivals(const Arrivals&) = delete;
  Arrivals& operator=(const Arrivals&) = delete;
  ~Arrivals() {  // a failed run leaves waits behind: each ends by dist.timeout_s at worst
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  // Worker w's next push is posted: `wait` completes it (and names w if it fails).
  void expect(size_t w, std::function<void()> wait) {
    if (threads_[w].joinable()) threads_[w].join();  // its last push, already taken
    ++expected_;
    threads_[w] = std::thread([this, w, wait = std::move(wait)] {
      std::exception_ptr error;
      try {
        wait();
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      done_.emplace_back(w, error);
      arrived_.notify_one();
    });
  }
  // The worker whose push completed first; a failed wait's error is thrown here.
  size_t next() {
    if (expected_ == 0) throw std::logic_error("async_ps: waiting for a push none was told to send");
    std::unique_lock<std::mutex> lock(mutex_);
    arrived_.wait(lock, [&] { return !done_.empty(); });
    const auto [w, error] = done_.front();
    done_.pop_front();
    --expected_;
    if (error) std::rethrow_exception(error);
    return w;
  }

 private:
  std::vector<std::thread> threads_;  // per worker: its pending push's wait
  int64_t expected_ = 0;              // posted, not yet taken (the caller's thread only)
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<std::pair<size_t, std::exception_ptr>> done_;
};

// What every server does with its range.
class ServerRange {
 public:
  explicit ServerRange(Ps& c)
      : c_(c), mine_(server_ranges(c)[size_t(c.run.mesh().coord().data)]), workers_(c.workers),
        buffers_(float_buffers(c)), buffer_numel_(pack(buffers_).numel()) {}

  // Push k (from 1) of the run, a worker's mean gradient whose whole norm is `norm`:
  // clipped as that worker's own gradient (each push's move stays within train's
  // grad_clip over the workers), then a step of the optimizer at the learning rate of the
  // push's step over the workers.
  void apply(const torch::Tensor& grad, double norm, int64_t k) {
    torch::NoGradGuard no_grad;
    range_of(c_.run.params->grad(), mine_).copy_(grad);
    const int64_t step = (k - 1) / workers_ + 1;
    clip_grad(*c_.run.params, torch::full({}, norm, torch::kFloat32), c_.run.cfg.optimizer.grad_clip,
              1.0, mine_);
    c_.run.optimizer->step(lr_at(c_.run.cfg.schedule, c_.run.cfg.optimizer.lr, step, c_.run.total_steps) /
                       double(workers_));
    ++applied_;
  }
  // Every server's range into every server's parameters, before an evaluation or a
  // checkpoint: a collective over the servers, once per version (every server applies
  // the same pushes, so all skip alike when an evaluation and a checkpoint share a step).
  void gather() {
    auto& servers = *c_.run.mesh().world();
    if (servers.size() == 1 || gathered_ == applied_) return;
    gathered_ = applied_;
    servers.all_gather_into(c_.run.params->data(), range_of(c_.run.params->data(), mine_).clone());
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
  torch::Tensor snapshot() const { return range_of(c_.run.params->data(), mine_).clone(); }
  torch::Tensor new_grad() const { return torch::empty({mine_.numel}, c_.run.params->grad().options()); }

 private:
  Ps& c_;
  Shard mine_;
  int64_t workers_;
  std::vector<torch::Tensor> buffers_;
  int64_t buffer_numel_;
  int64_t applied_ = 0, gathered_ = 0;  // pushes applied here; as of the last gather
};

// A worker: pull, then push and pull until told to end.
RunResult run_worker(Ps& c) {
  auto& job = *c.run.job;
  const auto ranges = server_ranges(c);
  const auto servers = int64_t(ranges.size());
  auto data = c.run.params->data(), grad = c.run.params->grad();
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
  Loader loader(*c.run.data.train, *c.run.sampler, pushes, c.run.total_steps + c.run.cfg.parallel.staleness + 2,
                c.run.cfg.data.workers, c.run.cfg.data.prefetch, /*pin=*/c.run.device().is_cuda(),
                Augment{c.run.cfg.data.augment, c.run.cfg.data.crop_padding, uint64_t(c.run.cfg.seed)});
  auto header = f64(std::vector<double>(PushHeader::kSize, 0.0));
  const auto buffers = float_buffers(c);
  while (r[ReplyHeader::kCommand] == kGoOn) {
    if (c.run.cfg.train.debug_slow_rank == c.run.job->rank())  // a slow worker, for benchmarks
      std::this_thread::sleep_for(std::chrono::milliseconds(c.run.cfg.train.debug_slow_ms));
    StepStats s;
    Batch batch = to_device(loader.next(&s.data_wait_ms), c.run.device());
    // Its dropout draws are the data rank's of the step its push counts for, as in sync.
    MicroBatchTimes times;
    const auto losses = c.run.runner->train(pushes + 1, batch, c.run.sync->loss_factor(), times, [] {});
    s.forward_ms = times.forward_ms, s.backward_ms = times.backward_ms;
    c.run.sync->finish();
    double loss = 0;
    for (const auto& l : losses) loss += l.item<double>() / double(losses.size());
    const double norm = global_grad_norm(*c.run.params, *c.run.mesh().tensor(), *c.run.mesh().pipeline()).item<double>();
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
    c.run.params->zero_grad();
    pushes = int64_t(r[ReplyHeader::kPushes]);
  }
  return {int(r[ReplyHeader::kCommand]), nlohmann::json()};
}

// A server past the first: server 0's orders, in order.
RunResult run_follower(Ps& c) {
  auto& job = *c.run.job;
  ServerRange range(c);
  auto order = f64(std::vector<double>(Order::kSize, 0.0));
  // Each worker's next push, posted when server 0 tells it to go on (so its data flows as
  // soon as it sends, whatever this server is doing), and the last reply to it, in flight
  // (done once the worker pushes again).
  std::vector<torch::Tensor> grads(size_t(c.workers));
  std::vector<std::unique_ptr<Pending>> pushes(size_t(c.workers)), replies(size_t(c.workers));
  for (auto& g : grads) g = range.new_grad();
  while (true) {
    {
      auto p = job.exchange_async({{P2POp::kRecv, order, 0, kOrderTag}});
      wait_for(*p, "async_ps server 0 (rank 0)", c);
    }
    const auto o = order.accessor<double, 1>();
    const auto kind = int64_t(o[Order::kKind]), w = int64_t(o[Order::kWorker]);
    const auto arg = int64_t(o[Order::kArg]);
    if (kind == Order::kApply || kind == Order::kDiscard) {
      auto p = std::move(pushes[size_t(w)]);
      if (!p) throw std::logic_error(fmt::format("async_ps: no push of worker {} was posted", w));
      wait_for(*p, worker_name(c, w), c);
      if (kind == Order::kApply) range.apply(grads[size_t(w)], o[Order::kNorm], arg);
    } else if (kind == Order::kReply) {
      auto& last = replies[size_t(w)];
      if (last) wait_for(*last, worker_name(c, w), c);
      last = job.exchange_async({{P2POp::kSend, range.snapshot(), rank_of_worker(c, w), kParamsTag}});
      if (double(arg) == kGoOn)
        pushes[size_t(w)] = job.exchange_async(
            {{P2POp::kRecv, grads[size_t(w)], rank_of_worker(c, w), kGradTag}});
    } else if (kind == Order::kEvaluate || kind == Order::kCheckpoint) {
      c.run.state().step = arg;
      range.gather();
      if (kind == Order::kEvaluate) evaluate_and_report(c.run, arg);
      else save_checkpoint(c.run, arg, /*evaluated=*/false);
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
  explicit Sequencer(Ps& c)
      : c_(c), range_(c), workers_(size_t(c.workers)),
        cadence_{c.run.cfg, c.run.steps_per_epoch, c.run.total_steps} {
    for (auto& wk : workers_) {
      wk.header = torch::zeros({PushHeader::kSize}, torch::kFloat64);
      wk.grad = range_.new_grad();
      wk.buffers = torch::empty({range_.buffer_numel()});
    }
    const int64_t padded = c.run.params->data().numel(), elt = c.run.params->data().element_size();
    push_bytes_ = padded * elt + PushHeader::kSize * 8 + range_.buffer_numel() * 4;
    reply_bytes_ = padded * elt + ReplyHeader::kSize * 8;
    order_bytes_ = (c.servers - 1) * Order::kSize * 8;
    log().extend_summary([this](nlohmann::json& s) { add_to_summary(s); });
  }

  RunResult run() {
    auto& st = c_.run.state();
    auto& pushes = c_.worker_pushes;
    const auto n_workers = int64_t(workers_.size());
    if (pushes.size() != workers_.size()) {
      if (!pushes.empty())
        c_.run.say(fmt::format("warning: the checkpoint was written by {} async_ps workers, this "
                               "job has {}: each worker starts at step {}'s data position",
                               pushes.size(), n_workers, st.step));
      pushes.assign(workers_.size(), st.step);
    }
    for (size_t w = 0; w < workers_.size(); ++w) workers_[w].pushes = pushes[w];
    version_ = st.step * n_workers;
    if (c_.run.finished) {  // said by run_training
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
      log().failed(first_line(e.what()));
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

  // Worker w was told to go on: its next push (header, gradient range, buffers) is posted.
  void expect_push(size_t w) {
    auto& wk = workers_[w];
    std::vector<P2POp> ops{{P2POp::kRecv, wk.header, peer(w), kHeaderTag},
                           {P2POp::kRecv, wk.grad, peer(w), kGradTag}};
    if (wk.buffers.numel() > 0) ops.push_back({P2POp::kRecv, wk.buffers, peer(w), kBufferTag});
    std::shared_ptr<Pending> p = c_.run.job->exchange_async(std::move(ops));
    arrivals_.expect(w, [this, p, who = worker_name(c_, int64_t(w))] { wait_for(*p, who, c_); });
  }

  // The next push from whichever worker's arrives first.
  size_t next_push() {
    const auto w = arrivals_.next();
    workers_[w].computing = false;
    return w;
  }

  // Tells the other servers what to do next (they act in this order).
  void order(Order::Kind kind, size_t w = 0, int64_t arg = 0, double norm = 0) {
    auto& job = *c_.run.job;
    for (int64_t s = 1; s < c_.servers; ++s)
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
    order(Order::kReply, w, int64_t(command));
    auto& wk = workers_[w];
    if (wk.reply) wait_for(*wk.reply, worker_name(c_, int64_t(w)), c_);  // long done
    auto& job = *c_.run.job;
    wk.reply = job.exchange_async(
        {{P2POp::kSend, f64({double(version_), command, double(wk.pushes)}), peer(w), kReplyTag},
         {P2POp::kSend, range_.snapshot(), peer(w), kParamsTag}});
    bytes_ += reply_bytes_;
    wk.awaiting = false;
    wk.computing = command == kGoOn;
    if (wk.computing) expect_push(w);
  }

  // Bounded staleness: every held reply whose worker is within parallel.staleness pushes
  // of the slowest goes out.
  void release() {
    int64_t slowest = workers_.front().pushes;
    for (const auto& wk : workers_) slowest = std::min(slowest, wk.pushes);
    for (size_t w = 0; w < workers_.size(); ++w)
      if (workers_[w].awaiting && workers_[w].pushes <= slowest + c_.run.cfg.parallel.staleness)
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

  // A push with a non-finite loss or gradient was dropped (never applied): the run log's
  // rule says whether the run goes on.
  void nonfinite(int64_t step, size_t w) {
    Culprit c;
    c.what = fmt::format("a push at step {}", step);
    c.who = worker_name(c_, int64_t(w));
    c.rank = peer(w);
    c.unit = "pushes";
    if (auto end_of_run = log().nonfinite(step, c, /*meets=*/true)) {
      end(kExitBadData);
      log().diverge(*end_of_run);
    }
  }

  // Step n's pushes are all applied: its line, evaluation, checkpoint, and whether the run
  // ends here.
  std::optional<RunResult> end_of_step(int64_t n) {
    auto& st = c_.run.state();
    st.step = n;
    StepStats s;
    const double pushes = double(sums_.pushes);
    s.nonfinite = sums_.finite < sums_.pushes;
    s.loss = sums_.finite ? sums_.loss / double(sums_.finite) : std::nan("");
    s.grad_norm = sums_.finite ? sums_.norm / double(sums_.finite) : std::nan("");
    s.data_wait_ms = sums_.data_wait_ms / pushes;
    s.forward_ms = sums_.forward_ms / pushes;
    s.backward_ms = sums_.backward_ms / pushes;
    s.step_ms = ms_since(mark_);
    s.comm_bytes = bytes_;
    mark_ = Clock::now();
    bytes_ = 0;
    sums_ = StepSums{};
    const auto& cfg = c_.run.cfg;
    const double lr = lr_at(cfg.schedule, cfg.optimizer.lr, n, c_.run.total_steps);
    const bool log_now = cadence_.should_log(n);
    log().record(n, s, lr, log_now, log_now ? window_fields() : nlohmann::json::object());
    const bool eval_now = cadence_.should_eval(n), save_now = cadence_.should_save(n);
    const int sig = stop_signal() ? stop_signal() : stop_votes_ ? SIGTERM : 0;
    const auto paused = Clock::now();
    if (eval_now) {
      order(Order::kEvaluate, 0, n);
      range_.gather();
      evaluate_and_report(c_.run, n);
    }
    if (save_now || (sig && st.last_saved != n)) checkpoint(n, eval_now);
    mark_ += Clock::now() - paused;  // evaluations and checkpoints are not a step's time
    if (sig) {
      end(exit_code_for_signal(sig));
      return log().stopped(sig, c_.run.opts.requeue_job);
    }
    if (!cadence_.last(n)) return std::nullopt;
    end(0);
    return log().completed(fmt::format(" ({} pushes)", version_));
  }

  // The train line's own fields: the staleness of the pushes applied since the last line
  // and each worker's pushes per second.
  nlohmann::json window_fields() {
    nlohmann::json line;
    line["staleness_mean"] = window_applied_ ? window_staleness_ / double(window_applied_) : 0.0;
    line["staleness_max"] = window_stale_max_;
    const double seconds = ms_since(window_start_) / 1000;
    std::vector<double> rates;
    for (auto& wk : workers_) rates.push_back(double(std::exchange(wk.window_pushes, 0)) / seconds);
    line["pushes_per_s"] = rates;
    window_staleness_ = 0, window_applied_ = 0, window_stale_max_ = 0;
    window_start_ = Clock::now();
    return line;
  }

  void checkpoint(int64_t n, bool evaluated) {
    for (size_t w = 0; w < workers_.size(); ++w) c_.worker_pushes[w] = workers_[w].pushes;
    order(Order::kCheckpoint, 0, n);
    range_.gather();
    save_checkpoint(c_.run, n, evaluated);
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

  // What the summary holds of async_ps's own: the staleness of every applied gradient
  // (its histogram: versions -> pushes) and each worker's pushes.
  void add_to_summary(nlohmann::json& s) const {
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
  }
  RunLog& log() { return *c_.run.log; }

  Ps& c_;
  ServerRange range_;
  std::vector<Worker> workers_;
  Arrivals arrivals_{workers_.size()};
  Cadence cadence_;
  int64_t version_ = 0;          // pushes applied (or dropped) since the run began
  int64_t push_bytes_ = 0, reply_bytes_ = 0, order_bytes_ = 0;
  int64_t bytes_ = 0;            // moved in this step, by every rank
  std::deque<std::unique_ptr<Pending>> orders_;  // in flight to the other servers
  bool stop_votes_ = false;
  StepSums sums_;
  std::map<int64_t, int64_t> histogram_;  // staleness -> applied pushes, this process's
  double window_staleness_ = 0;
  int64_t window_applied_ = 0, window_stale_max_ = 0;
  Clock::time_point mark_, window_start_;
};


// The mode: this rank's role, the groups of its role, the flat buffers cut into one range
// per server.
class AsyncPs : public Mode, public Stateful {
 public:
  AsyncPs(const JobConfig& cfg, std::shared_ptr<Comm> job)
      : cfg_(cfg), servers_(cfg.parallel.servers), workers_(job->size() - servers_),
        server_(job->rank() < servers_), mesh_(role_mesh(job)) {}

  const Mesh& mesh() const override { return *mesh_; }
  bool holds_run() const override { return server_; }
  bool reads_data() const override { return !server_; }
  // Servers and workers cut the buffers alike, in one range per server (one server's is
  // the whole buffer, laid out as one process's).
  void shape_flat(FlatOptions& opts) const override {
    if (servers_ > 1) opts.pad_to = servers_ * kShardAlign;
  }
  Shard update_shard(const FlatParams& params) const override {
    return server_ ? params.shard(servers_, mesh_->coord().data) : Shard{};
  }
  // A worker's gradient is its own (pushed to the servers); a server computes none.
  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches, int64_t,
                                      Tied tied) const override {
    return make_no_sync(params, micro_batches, std::move(tied), update_shard(params));
  }
  std::string describe() const override {
    return fmt::format("async_ps: {} server(s), {} worker(s), staleness {}", servers_, workers_,
                       cfg_.parallel.staleness);
  }
  nlohmann::json layout() const override {
    return {{"data", workers_}, {"tensor", 1}, {"pipeline", 1}, {"servers", servers_}};
  }
  Stateful* state() override { return this; }
  // Each worker's data position (its applied pushes), in trainer.json.
  void save(StateWriter& out) const override {
    if (!pushes_.empty()) out.set("worker_pushes", pushes_);
  }
  void load(const StateReader& in) override {
    const auto& t = in.trainer();
    if (!t.contains("worker_pushes")) return;
    try {
      pushes_ = t.at("worker_pushes").get<std::vector<int64_t>>();
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointError(fmt::format("{}/trainer.json: {}", in.folder(), e.what()));
    }
    for (int64_t pushes : pushes_)
      fail_if<CheckpointError>(pushes < 0, "{}/trainer.json: worker_pushes holds {}, a negative "
                               "count", in.folder(), pushes);
  }

  RunResult run(Run& run) override {
    Ps c{run, servers_, workers_, pushes_};
    if (!server_) return run_worker(c);
    if (mesh_->rank() != 0) return run_follower(c);
    return Sequencer(c).run();
  }

 private:
  // Collective over the job: this rank's role's group (both roles create theirs at once),
  // its ranks on the data axis.
  std::unique_ptr<Mesh> role_mesh(const std::shared_ptr<Comm>& job) const {
    std::vector<int64_t> members;
    for (int64_t r = 0; r < job->size(); ++r)
      if ((r < servers_) == server_) members.push_back(r);
    auto group = job->new_group(server_ ? "servers" : "workers", members);
    ParallelDims dims;
    dims.data = int64_t(members.size());
    return std::make_unique<Mesh>(dims, std::move(group), /*replica_group=*/false, members);
  }

  JobConfig cfg_;
  int64_t servers_, workers_;
  bool server_;
  std::unique_ptr<Mesh> mesh_;
  std::vector<int64_t> pushes_;  // each worker's applied pushes (server 0's are saved)
};

// The world must hold a worker past the servers, and each worker computes on a whole model
// with a plain fp32/bf16 gradient.
void validate_async_ps(const JobConfig& c, int64_t world_size) {
  const auto& p = c.parallel;
  fail_if<ConfigError>(world_size <= p.servers,
                       "parallel.servers: {} server(s) leave no worker in a world of {} "
                       "process(es); async_ps needs at least parallel.servers + 1 (e.g. "
                       "--nproc {})", p.servers, world_size, p.servers + 1);
  auto refuse = [](bool bad, const std::string& what, const std::string& why) {
    refuse_with_mode("async_ps", bad, what, why);
  };
  refuse(p.tensor > 1 || p.pipeline > 1,
         fmt::format("parallel.tensor {} x parallel.pipeline {}", p.tensor, p.pipeline),
         "each worker computes the whole model's gradient");
  refuse(p.zero > 0, fmt::format("parallel.zero {}", p.zero),
         "the servers already shard the optimizer state (parallel.servers)");
  refuse(p.compression != "none", "parallel.compression " + p.compression,
         "pushes carry the gradient as it is");
  refuse(p.sync_batchnorm, "parallel.sync_batchnorm",
         "its statistics span every worker at every step");
  refuse(c.precision.dtype == "fp16", "precision.dtype fp16",
         "each worker's loss scale would move apart from the servers' (use bf16)");
  refuse(c.checkpoint.async, "checkpoint.async",
         "its servers checkpoint when their leader orders, outside any step the workers share");
}

}  // namespace

ModeSpec async_ps_spec() {
  ModeSpec s;
  s.validate = validate_async_ps;
  // The data-parallel ranks are the workers: the world past the servers.
  s.trainers = [](const JobConfig& cfg, int64_t world) { return world - cfg.parallel.servers; };
  s.any_source = "parallel.mode async_ps's servers take pushes from whichever worker sends first";
  s.unrepeatable = "its workers run ahead of one another";
  s.role = [](const JobConfig& cfg, int64_t rank) {
    const int64_t servers = cfg.parallel.servers;
    return rank < servers ? fmt::format("async_ps server {}", rank)
                          : fmt::format("async_ps worker {}", rank - servers);
  };
  s.make = [](const JobConfig& cfg, const ParallelDims&,
              std::shared_ptr<Comm> job) -> std::unique_ptr<Mode> {
    return std::make_unique<AsyncPs>(cfg, std::move(job));
  };
  return s;
}

}  // namespace dtrain
