#include "run/loop.hpp"

#include <chrono>
#include <csignal>
#include <deque>
#include <vector>

#include <fmt/format.h>

#include "run/signals.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

// Steps are read this many steps after they were queued (step.hpp): on a GPU their
// figures have reached the host by then, so reading them never empties the device's queue.
// Two, not one, leaves room for a step that the host queues faster than the one before.
constexpr size_t kReadLag = 2;

// The queued steps, read in order into the run log. A step's time runs from the previous
// step's finish to its own, evaluations and checkpoints left out, so over a run the times
// add up to the training's wall time. A step finishes when the host first sees it done: on
// the CPU as train_step returns, on a GPU when its figures' event has fired (looked at,
// without waiting, each time a step is queued; at the latest when it is read).
class StepReader {
 public:
  StepReader(LoopBody& body, RunLog& log, const Cadence& cadence)
      : body_(body), log_(log), cadence_(cadence), holds_(body.may_go_back()) {}

  void queue(PendingStep p) {
    pending_.push_back(std::move(p));
    const auto now = Clock::now();
    for (auto& q : pending_)
      if (!q.finished_at && q.finished()) q.finished_at = now;
    while (pending_.size() > kReadLag) read_oldest();
  }
  // Every step is read before anything that must not see a non-finite one: an
  // evaluation, a checkpoint, the end.
  void read_all() {
    while (!pending_.empty()) read_oldest();
  }
  // The steps after `step` discarded (the ranks went back to it): forgotten, read or not.
  // Their time is the next recorded step's, as a step trained again carries its first try.
  void go_back(int64_t step) {
    while (!pending_.empty() && pending_.back().step > step) pending_.pop_back();
    if (held_.empty() || held_.front().step <= step) return;
    mark_ = held_mark_;
    held_.clear();
  }
  // Runs `what` (an evaluation, a checkpoint) outside every step's time.
  template <class F>
  void not_training(F&& what) {
    const auto t0 = Clock::now();
    what();
    mark_ += Clock::now() - t0;
  }

 private:
  void read_oldest() {
    PendingStep p = std::move(pending_.front());
    pending_.pop_front();
    StepStats s = body_.read(p);
    const auto finished = p.finished_at.value_or(Clock::now());
    s.step_ms = std::chrono::duration<double, std::milli>(finished - mark_).count();
    const auto previous_mark = mark_;
    mark_ = finished;
    if (s.nonfinite)
      if (auto end = log_.nonfinite(p.step, body_.culprit(p.step, s), cadence_.meets(p.step)))
        log_.diverge(*end);
    if (holds_ && !cadence_.meets(p.step)) {  // recorded once the next meeting stands
      if (held_.empty()) held_mark_ = previous_mark;
      held_.push_back({p.step, s});
      return;
    }
    for (const auto& h : held_) log_.record(h.step, h.stats, cadence_.should_log(h.step));
    held_.clear();
    log_.record(p.step, s, cadence_.should_log(p.step));
  }

  struct Held {
    int64_t step;
    StepStats stats;
  };

  LoopBody& body_;
  RunLog& log_;
  const Cadence& cadence_;
  const bool holds_;
  std::deque<PendingStep> pending_;  // queued, not read yet: oldest first
  std::vector<Held> held_;           // read, not recorded yet (holds_): oldest first
  Clock::time_point mark_ = Clock::now();  // the last step's finish, moved on past the rest
  Clock::time_point held_mark_;            // mark_ before the first held step was read
};

// The signal a stop is acted on for: this process's, or SIGTERM where only a peer's vote
// asked for it.
int stop_acted_on() { return stop_signal() ? stop_signal() : SIGTERM; }

// This replica leaves the job (fault tolerance: a stop signal; the others go on): its lines
// up to here read (where it writes them, its successor takes over after them) and its
// checkpoint in flight written; no evaluation (the others' group is without it) and no
// checkpoint of its own.
RunResult leave_job(StepReader& reader, LoopBody& body, bool in_flight) {
  reader.read_all();
  if (in_flight) body.finish_save();
  return {exit_code_for_signal(stop_acted_on()), nlohmann::json()};
}

}  // namespace

RunResult lockstep_loop(LoopBody& body, RunLog& log, const Cadence& cadence, int64_t total,
                        const JobConfig& cfg) {
  auto& st = log.state();
  StepReader reader(body, log, cadence);
  bool in_flight = false;  // a background checkpoint was started: one may be in flight
  try {
    while (st.step < total) {
      const int64_t n = st.step + 1;
      const bool eval_now = cadence.should_eval(n), save_now = cadence.should_save(n);
      if (cadence.rejoins(n)) reader.read_all();
      PendingStep p = body.step(n, cadence.should_log(n), eval_now || save_now);
      if (p.back_to >= 0) {  // discarded back to an earlier meeting: train from there again
        reader.go_back(p.back_to);
        log.went_back(p.back_to);
        continue;
      }
      const bool leaves = p.leaves, stops = p.stats.stop;
      reader.queue(std::move(p));
      st.step = n;
      if (leaves) return leave_job(reader, body, in_flight);
      if (eval_now || save_now || stops || log.stop_voted() || cadence.parts(n)) reader.read_all();
      if (eval_now) reader.not_training([&] { body.evaluate(n); });
      if (cadence.meets(n) && in_flight) reader.not_training([&] { body.poll_save(n); });
      if (save_now) {
        const bool background = cfg.checkpoint.async && !cadence.last(n);
        reader.not_training([&] { body.save(n, eval_now, background); });
        in_flight = in_flight || background;
      }
      if (log.stop_voted()) {
        // A stop signal (here or on a peer; under fault tolerance, on every member), acted
        // on at a step boundary where every rank is: a checkpoint first, once the one in
        // flight is written.
        if (in_flight) body.finish_save();
        if (st.last_saved != st.step) body.save(st.step, false, false);
        return body.stop(stop_acted_on());
      }
    }
    if (in_flight) body.finish_save();
  } catch (const DivergedError&) {
    // Voted on by every rank at the same step, before anything of it was saved: the
    // checkpoint in flight is of an earlier step, and is kept.
    try {
      if (in_flight) body.finish_save();
    } catch (const Error& e) {  // the divergence is what the run ends with
      log.say(fmt::format("warning: {}", first_line(e.what())));
    }
    throw;  // its summary is written
  } catch (const Error& e) {
    log.failed(first_line(e.what()));
    throw;
  }
  return log.completed();
}

}  // namespace dtrain
