// async_ps's servers: each applies the pushes to its range of the parameters; server 0
// (the sequencer) takes them in the order they arrive, orders the other servers (the
// followers), holds the replies of workers too far ahead, and runs the job's cadence at
// every step's end.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "optim/clip.hpp"
#include "optim/schedule.hpp"
#include "run/cadence.hpp"
#include "run/modes/async_ps/roles.hpp"
#include "run/signals.hpp"
#include "util/clock.hpp"

namespace dtrain::ps {
namespace {

// Orders in flight to the other servers before server 0 waits for the oldest: a follower
// takes them one by one, so more than a few means it is behind.
constexpr size_t kOrdersInFlight = 64;

// The workers' pushes, taken in the order they complete. A receive from any rank would be
// simpler, but Gloo's commits to the first sender it hears of and then waits for that
// sender's data, which only comes while the sender runs: a worker stopped just after it
// posted its push (SIGSTOP, a swapped-out process) held every other worker's. So each
// worker's next push is posted to it alone as it is told to go on (and its data flows as
// soon as it sends), waited for on a thread of its own, and handed over as it completes.
class Arrivals {
 public:
  explicit Arrivals(size_t workers) : threads_(workers) {}
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
  explicit ServerRange(ServerParts& parts)
      : parts_(parts), mine_(parts.roles.ranges(parts.params)[size_t(parts.mesh.coord().data)]), workers_(parts.roles.workers),
        buffers_(parts.buffers), buffer_numel_(pack(buffers_).numel()) {}

  // Push k (from 1) of the run, a worker's mean gradient whose whole norm is `norm`:
  // clipped as that worker's own gradient (each push's move stays within train's
  // grad_clip over the workers), then a step of the optimizer at the learning rate of the
  // push's step over the workers.
  void apply(const torch::Tensor& grad, double norm, int64_t k) {
    torch::NoGradGuard no_grad;
    range_of(parts_.params.grad(), mine_).copy_(grad);
    const int64_t step = (k - 1) / workers_ + 1;
    clip_grad(parts_.params, torch::full({}, norm, torch::kFloat32), parts_.cfg.optimizer.grad_clip,
              1.0, mine_);
    parts_.optimizer.step(lr_at(parts_.cfg.schedule, parts_.cfg.optimizer.lr, step, parts_.total_steps) /
                       double(workers_));
    ++applied_;
  }
  // Every server's range into every server's parameters, before an evaluation or a
  // checkpoint: a collective over the servers, once per version (every server applies
  // the same pushes, so all skip alike when an evaluation and a checkpoint share a step).
  void gather() {
    auto& servers = *parts_.mesh.world();
    if (servers.size() == 1 || gathered_ == applied_) return;
    gathered_ = applied_;
    servers.all_gather_into(parts_.params.data(), range_of(parts_.params.data(), mine_).clone());
    if (buffers_.empty()) return;
    auto flat = pack(buffers_);
    servers.broadcast(flat, 0);
    unpack(flat, buffers_);
  }
  // Server 0: a worker's buffers, with the push it applied.
  void take_buffers(const torch::Tensor& flat) { unpack(flat, buffers_); }
  int64_t buffer_numel() const { return buffer_numel_; }
  // This range's parameters as they are now (a reply's, which must not change in flight).
  torch::Tensor snapshot() const { return range_of(parts_.params.data(), mine_).clone(); }
  torch::Tensor new_grad() const { return torch::empty({mine_.numel}, parts_.params.grad().options()); }

 private:
  ServerParts& parts_;
  Shard mine_;
  int64_t workers_;
  std::vector<torch::Tensor> buffers_;
  int64_t buffer_numel_;
  int64_t applied_ = 0, gathered_ = 0;  // pushes applied here; as of the last gather
};

// A server past the first: server 0's orders, in order.
RunResult run_follower(ServerParts& parts) {
  auto& job = parts.job;
  ServerRange range(parts);
  auto order = f64(std::vector<double>(Order::kSize, 0.0));
  // Each worker's next push, posted when server 0 tells it to go on (so its data flows as
  // soon as it sends, whatever this server is doing), and the last reply to it, in flight
  // (done once the worker pushes again).
  std::vector<torch::Tensor> grads(size_t(parts.roles.workers));
  std::vector<std::unique_ptr<Pending>> pushes(size_t(parts.roles.workers)), replies(size_t(parts.roles.workers));
  for (auto& g : grads) g = range.new_grad();
  while (true) {
    wait_for(*job.exchange_async({{P2POp::kRecv, order, 0, kOrderTag}}),
             "async_ps server 0 (rank 0)", job.rank());
    const auto o = order.accessor<double, 1>();
    const auto kind = int64_t(o[Order::kKind]), w = int64_t(o[Order::kWorker]);
    const auto arg = int64_t(o[Order::kArg]);
    if (kind == Order::kApply || kind == Order::kDiscard) {
      auto p = std::move(pushes[size_t(w)]);
      if (!p) throw std::logic_error(fmt::format("async_ps: no push of worker {} was posted", w));
      wait_for(*p, parts.roles.worker_name(w), parts.job.rank());
      if (kind == Order::kApply) range.apply(grads[size_t(w)], o[Order::kNorm], arg);
    } else if (kind == Order::kReply) {
      auto& last = replies[size_t(w)];
      if (last) wait_for(*last, parts.roles.worker_name(w), parts.job.rank());
      last = job.exchange_async({{P2POp::kSend, range.snapshot(), parts.roles.rank_of_worker(w), kParamsTag}});
      if (double(arg) == kGoOn)
        pushes[size_t(w)] = job.exchange_async(
            {{P2POp::kRecv, grads[size_t(w)], parts.roles.rank_of_worker(w), kGradTag}});
    } else if (kind == Order::kEvaluate || kind == Order::kCheckpoint) {
      parts.log.state().step = arg;
      range.gather();
      if (kind == Order::kEvaluate) parts.evaluate(arg);
      else parts.save(arg, /*evaluated=*/false);
    } else {  // kEnd
      for (size_t v = 0; v < replies.size(); ++v)
        if (replies[v]) wait_for(*replies[v], parts.roles.worker_name(int64_t(v)), parts.job.rank());
      return {int(arg), nlohmann::json()};
    }
  }
}

// Server 0, the sequencer (the top says what it does).
class Sequencer {
 public:
  explicit Sequencer(ServerParts& parts)
      : parts_(parts), range_(parts), workers_(size_t(parts.roles.workers)),
        cadence_{parts.cfg, parts.steps_per_epoch, parts.total_steps} {
    for (auto& wk : workers_) {
      wk.header = torch::zeros({PushHeader::kSize}, torch::kFloat64);
      wk.grad = range_.new_grad();
      wk.buffers = torch::empty({range_.buffer_numel()});
    }
    const int64_t padded = parts.params.data().numel(), elt = parts.params.data().element_size();
    push_bytes_ = padded * elt + PushHeader::kSize * 8 + range_.buffer_numel() * 4;
    reply_bytes_ = padded * elt + ReplyHeader::kSize * 8;
    order_bytes_ = (parts.roles.servers - 1) * Order::kSize * 8;
    parts_.log.extend_summary([this](nlohmann::json& s) { add_to_summary(s); });
  }

  RunResult run() {
    auto& st = parts_.log.state();
    auto& pushes = parts_.worker_pushes;
    const auto n_workers = int64_t(workers_.size());
    if (pushes.size() != workers_.size()) {
      if (!pushes.empty())
        parts_.log.say(fmt::format("warning: the checkpoint was written by {} async_ps workers, this "
                               "job has {}: each worker starts at step {}'s data position",
                               pushes.size(), n_workers, st.step));
      pushes.assign(workers_.size(), st.step);
    }
    for (size_t w = 0; w < workers_.size(); ++w) workers_[w].pushes = pushes[w];
    version_ = st.step * n_workers;
    if (parts_.finished) {  // said by run_training
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
      parts_.log.failed(first_line(e.what()));
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

  int64_t peer(size_t w) const { return parts_.roles.rank_of_worker(int64_t(w)); }

  // Worker w was told to go on: its next push (header, gradient range, buffers) is posted.
  void expect_push(size_t w) {
    auto& wk = workers_[w];
    std::vector<P2POp> ops{{P2POp::kRecv, wk.header, peer(w), kHeaderTag},
                           {P2POp::kRecv, wk.grad, peer(w), kGradTag}};
    if (wk.buffers.numel() > 0) ops.push_back({P2POp::kRecv, wk.buffers, peer(w), kBufferTag});
    std::shared_ptr<Pending> p = parts_.job.exchange_async(std::move(ops));
    arrivals_.expect(w, [this, p, who = parts_.roles.worker_name(int64_t(w))] { wait_for(*p, who, parts_.job.rank()); });
  }

  // The next push from whichever worker's arrives first.
  size_t next_push() {
    const auto w = arrivals_.next();
    workers_[w].computing = false;
    return w;
  }

  // Tells the other servers what to do next (they act in this order).
  void order(Order::Kind kind, size_t w = 0, int64_t arg = 0, double norm = 0) {
    auto& job = parts_.job;
    for (int64_t s = 1; s < parts_.roles.servers; ++s)
      orders_.push_back(job.exchange_async(
          {{P2POp::kSend, f64({double(kind), double(w), double(arg), norm}), s, kOrderTag}}));
    bytes_ += order_bytes_;
    while (orders_.size() > kOrdersInFlight) {
      wait_for(*orders_.front(), "an async_ps server", parts_.job.rank());
      orders_.pop_front();
    }
  }

  // Answers worker w: go on (and its next push is posted), or end with an exit code.
  void reply(size_t w, double command) {
    order(Order::kReply, w, int64_t(command));
    auto& wk = workers_[w];
    if (wk.reply) wait_for(*wk.reply, parts_.roles.worker_name(int64_t(w)), parts_.job.rank());  // long done
    auto& job = parts_.job;
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
      if (workers_[w].awaiting && workers_[w].pushes <= slowest + parts_.cfg.parallel.staleness)
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
    Culprit culprit;
    culprit.what = fmt::format("a push at step {}", step);
    culprit.who = parts_.roles.worker_name(int64_t(w));
    culprit.rank = peer(w);
    culprit.unit = "pushes";
    if (auto end_of_run = parts_.log.nonfinite(step, culprit, /*meets=*/true)) {
      end(kExitBadData);
      parts_.log.diverge(*end_of_run);
    }
  }

  // Step n's pushes are all applied: its line, evaluation, checkpoint, and whether the run
  // ends here.
  std::optional<RunResult> end_of_step(int64_t n) {
    auto& st = parts_.log.state();
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
    const auto& cfg = parts_.cfg;
    s.lr = lr_at(cfg.schedule, cfg.optimizer.lr, n, parts_.total_steps);
    const bool log_now = cadence_.should_log(n);
    parts_.log.record(n, s, log_now, log_now ? window_fields() : nlohmann::json::object());
    const bool eval_now = cadence_.should_eval(n), save_now = cadence_.should_save(n);
    const int sig = stop_signal() ? stop_signal() : stop_votes_ ? SIGTERM : 0;
    const auto paused = Clock::now();
    if (eval_now) {
      order(Order::kEvaluate, 0, n);
      range_.gather();
      parts_.evaluate(n);
    }
    if (save_now || (sig && st.last_saved != n)) checkpoint(n, eval_now);
    mark_ += Clock::now() - paused;  // evaluations and checkpoints are not a step's time
    if (sig) {
      end(exit_code_for_signal(sig));
      return parts_.log.stopped(sig, parts_.requeue_job);
    }
    if (!cadence_.last(n)) return std::nullopt;
    end(0);
    return parts_.log.completed(fmt::format(" ({} pushes)", version_));
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
    for (size_t w = 0; w < workers_.size(); ++w) parts_.worker_pushes[w] = workers_[w].pushes;
    order(Order::kCheckpoint, 0, n);
    range_.gather();
    parts_.save(n, evaluated);
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
      if (wk.reply) wait_for(*wk.reply, "an async_ps worker", parts_.job.rank());
    for (auto& p : orders_) wait_for(*p, "an async_ps server", parts_.job.rank());
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

  ServerParts& parts_;
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

}  // namespace

RunResult run_server(ServerParts& parts) {
  if (parts.mesh.rank() != 0) return run_follower(parts);
  return Sequencer(parts).run();
}

}  // namespace dtrain::ps
