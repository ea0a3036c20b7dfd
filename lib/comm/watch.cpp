#include "comm/watch.hpp"

#include <algorithm>
#include <charconv>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "launch/world.hpp"
#include "util/clock.hpp"  // unix_time: heartbeats compare wall-clock times across processes
#include "util/process.hpp"
#include "util/units.hpp"

namespace dtrain {
namespace {

using json = nlohmann::json;

// The store key of world rank `rank`'s heartbeat.
std::string heartbeat_key(int64_t rank) { return fmt::format("dtrain/heartbeat/{}", rank); }
std::string ended_key(int64_t rank) { return fmt::format("dtrain/ended/{}", rank); }
std::string process_key(int64_t rank) { return fmt::format("dtrain/process/{}", rank); }

// How often a rank beats for a threshold of `after`, and how old a heartbeat is when its
// rank is called silent (two and a half beats: a stopped rank's is at least the threshold
// old when a wait is judged, a live one's at most a beat and the store's latency).
std::chrono::milliseconds beat_period(std::chrono::milliseconds after) {
  return std::clamp<std::chrono::milliseconds>(after / 3, std::chrono::milliseconds(100),
                                               std::chrono::seconds(1));
}
double silent_after_s(std::chrono::milliseconds after) {
  return 2.5 * std::chrono::duration<double>(beat_period(after)).count();
}

// The values `keys` hold now, empty where none (dtrain sets no empty value in these).
std::vector<std::vector<uint8_t>> words_now(c10d::Store& store, const std::vector<std::string>& keys) {
  std::vector<std::vector<uint8_t>> values;
  values.reserve(keys.size());
  for (auto& v : values_now(store, keys)) values.push_back(v ? std::move(*v) : std::vector<uint8_t>{});
  return values;
}
std::vector<uint8_t> value_now(c10d::Store& store, const std::string& key) {
  return std::move(words_now(store, {key})[0]);
}

// "HOST PID", as leave_word writes it; nothing where the value is not that.
std::optional<std::pair<std::string, int64_t>> process_of(const std::vector<uint8_t>& v) {
  const std::string word(v.begin(), v.end());
  const auto space = word.rfind(' ');
  int64_t pid = 0;
  if (space == std::string::npos) return std::nullopt;
  const auto [end, error] = std::from_chars(word.data() + space + 1, word.data() + word.size(), pid);
  if (error != std::errc() || end != word.data() + word.size()) return std::nullopt;
  return std::pair{word.substr(0, space), pid};
}

// Every rank's heartbeat the store holds (a rank without one is left out); throws when the
// store does not answer.
std::map<int64_t, json> read_heartbeats(c10d::Store& store, const std::vector<int64_t>& ranks) {
  std::vector<std::string> keys;
  for (int64_t r : ranks) keys.push_back(heartbeat_key(r));
  const auto values = words_now(store, keys);
  std::map<int64_t, json> beats;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (values[i].empty()) continue;
    auto parsed = json::parse(values[i].begin(), values[i].end(), nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded()) beats[ranks[i]] = std::move(parsed);
  }
  return beats;
}

std::string what_it_waits_in(const json& beat, double now_s) {
  if (!beat.contains("waits") || beat["waits"].empty()) return "in no collective";
  const auto& w = beat["waits"][0];
  const double for_s = now_s - w.value("since", now_s);
  if (w.value("peer", int64_t(-1)) >= 0)
    return fmt::format("in {} with rank {} for {:.0f} s", w.value("op", ""), w["peer"].get<int64_t>(), for_s);
  return fmt::format("in {} #{} of the {} group for {:.0f} s", w.value("op", ""),
                     w.value("number", int64_t(0)), w.value("group", ""), for_s);
}

// How a rank of the job stands, from its heartbeat.
std::string standing(int64_t rank, const std::map<int64_t, json>& beats, double now_s,
                     double silent_after_s) {
  auto it = beats.find(rank);
  if (it == beats.end()) return fmt::format("rank {}: no heartbeat", rank);
  const json& b = it->second;
  const double age = now_s - b.value("at", 0.0);
  const int64_t step = b.value("step", int64_t(-1));
  const std::string at = step >= 0 ? fmt::format("at step {}, ", step) : "";
  if (age > silent_after_s)
    return fmt::format("rank {}: silent for {:.0f} s (last {}{})", rank, age, at,
                       what_it_waits_in(b, b.value("at", 0.0)));
  return fmt::format("rank {}: {}{}", rank, at, what_it_waits_in(b, now_s));
}

}  // namespace

std::string describe_hang(int64_t rank, const WaitedOp& wait, double waited_s,
                          const std::map<int64_t, json>& beats, double now_s, double silent_s,
                          bool store_silent) {
  const std::string what =
      wait.peer >= 0 ? fmt::format("{} with rank {}", wait.op, wait.peer)
                     : fmt::format("{} #{} of the {} group", wait.op, wait.number, wait.group);
  const std::string size = wait.bytes >= kMiB   ? fmt::format("{:.1f} MiB", double(wait.bytes) / kMiB)
                           : wait.bytes >= 1024 ? fmt::format("{:.1f} KiB", double(wait.bytes) / 1024)
                                                : fmt::format("{} B", wait.bytes);
  std::string line = fmt::format("dtrain: rank {}: {} ({}) has waited {:.0f} s", rank, what, size, waited_s);
  if (store_silent)
    return line + ": the store does not answer, so its host (rank 0, or the launcher) is silent";
  if (wait.peer >= 0) return line + "; " + standing(wait.peer, beats, now_s, silent_s);
  // The members that have not posted it, and those that have but fell silent inside it.
  std::vector<std::string> missing, silent;
  for (int64_t m : *wait.members) {
    if (m == rank) continue;
    auto it = beats.find(m);
    const int64_t posted = it == beats.end() ? 0
                           : it->second.contains("posted") ? it->second["posted"].value(wait.group, int64_t(0))
                                                           : 0;
    if (posted < wait.number)
      missing.push_back(standing(m, beats, now_s, silent_s));
    else if (now_s - it->second.value("at", 0.0) > silent_s)
      silent.push_back(standing(m, beats, now_s, silent_s));
  }
  const size_t others = wait.members->size() - 1;
  if (!missing.empty())
    line += fmt::format("; not posted by {} of {}: {}", missing.size(), others, fmt::join(missing, "; "));
  if (!silent.empty()) line += fmt::format("; posted, then silent: {}", fmt::join(silent, "; "));
  if (missing.empty() && silent.empty())
    line += "; every member has posted it and is alive (the transfer itself is slow)";
  return line;
}

std::string job_picture(const std::map<int64_t, json>& beats, int64_t world, double now_s,
                        double silent_s) {
  std::string out = "dtrain: the job now (from each rank's heartbeat):";
  for (int64_t r = 0; r < world; ++r) out += "\n  " + standing(r, beats, now_s, silent_s);
  return out;
}

void mark_ended(c10d::Store& store, int64_t rank) {
  store.set(ended_key(rank), std::vector<uint8_t>{'1'});
  store.deleteKey(heartbeat_key(rank));
}

void clear_ended(c10d::Store& store, int64_t rank) { store.deleteKey(ended_key(rank)); }

bool has_ended(c10d::Store& store, int64_t rank) { return !value_now(store, ended_key(rank)).empty(); }

void leave_word(TcpStore& store, int64_t rank) {
  store.on_close(ended_key(rank), std::vector<uint8_t>{'1'});
  store.on_close(heartbeat_key(rank), {});
  const std::string word = fmt::format("{} {}", host_name(), ::getpid());
  store.set(process_key(rank), std::vector<uint8_t>(word.begin(), word.end()));
}

std::optional<std::pair<std::string, int64_t>> its_process(c10d::Store& store, int64_t rank) {
  return process_of(value_now(store, process_key(rank)));
}

std::vector<RankWord> read_words(c10d::Store& store, const std::vector<int64_t>& ranks) {
  std::vector<std::string> keys;
  for (int64_t r : ranks)
    for (auto* key : {process_key, ended_key, heartbeat_key}) keys.push_back(key(r));
  auto values = words_now(store, keys);
  std::vector<RankWord> words(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    words[i].process = process_of(values[3 * i]);
    words[i].ended = !values[3 * i + 1].empty();
    words[i].beat = std::move(values[3 * i + 2]);
  }
  return words;
}

std::vector<int64_t> Liveness::dead_among(const std::vector<int64_t>& ranks) {
  std::vector<RankWord> words(ranks.size());
  try {  // what it judges by: each rank's end mark and heartbeat
    std::vector<std::string> keys;
    for (int64_t r : ranks) keys.push_back(ended_key(r)), keys.push_back(heartbeat_key(r));
    auto values = words_now(*store_, keys);
    for (size_t i = 0; i < ranks.size(); ++i)
      words[i].ended = !values[2 * i].empty(), words[i].beat = std::move(values[2 * i + 1]);
  } catch (...) {  // the store's host is gone: nobody's heartbeat can be read, judge by age
  }
  std::vector<int64_t> dead;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (!(*this)(ranks[i], words[i])) dead.push_back(ranks[i]);
  return dead;
}

bool Liveness::operator()(int64_t rank, const RankWord& word) {
  // The launcher's own view (none_alive) is of the processes it started: its mark is of an
  // earlier one.
  if (!none_alive_ && word.ended) return false;
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (none_alive_ && word.beat.empty()) {  // starting, or restarted: not judged until it beats
    seen_.erase(rank);
    return true;
  }
  auto [it, first] = seen_.try_emplace(rank, Seen{word.beat, now});
  if (!first && !word.beat.empty() && word.beat != it->second.beat) it->second = Seen{word.beat, now};
  return now - it->second.changed < silent_;
}

Watch::Watch(c10::intrusive_ptr<c10d::Store> store, int64_t rank, std::chrono::milliseconds after,
             std::function<void(const std::string&)> say)
    : store_(std::move(store)), rank_(rank), after_(after),
      every_(beat_period(after)),
      say_(std::move(say)), thread_([this] { loop(); }) {}

Watch::~Watch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

int64_t Watch::post(const std::string& group) {
  std::lock_guard<std::mutex> lock(mu_);
  return ++posted_[group];
}

void Watch::step(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = n;
}

Watch::Waiting::Waiting(Watch* watch, WaitedOp op) : watch_(watch) {
  if (!watch_) return;
  std::lock_guard<std::mutex> lock(watch_->mu_);
  id_ = ++watch_->next_id_;
  watch_->active_[id_] = Active{std::move(op), std::chrono::steady_clock::now(), unix_time()};
}

Watch::Waiting::~Waiting() {
  if (!watch_) return;
  std::lock_guard<std::mutex> lock(watch_->mu_);
  watch_->active_.erase(id_);
}

json Watch::beat() const {
  json waits = json::array();
  for (const auto& [id, a] : active_)
    waits.push_back({{"op", a.op.op}, {"group", a.op.group}, {"number", a.op.number},
                     {"peer", a.op.peer}, {"since", a.since_wall}});
  return {{"at", unix_time()}, {"step", step_}, {"posted", posted_}, {"waits", waits}};
}

void Watch::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const std::string value = beat().dump();
    lock.unlock();
    try {
      store_->set(heartbeat_key(rank_), std::vector<uint8_t>(value.begin(), value.end()));
    } catch (...) {  // the store's host is gone or stopped: check() says so
    }
    check();
    lock.lock();
    wake_.wait_for(lock, every_, [this] { return stop_; });
  }
}

// Each wait past the threshold, said once.
void Watch::check() {
  std::vector<std::pair<WaitedOp, double>> due;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (auto& [id, a] : active_)
      if (!a.said && now - a.since >= after_) {
        a.said = true;
        due.emplace_back(a.op, std::chrono::duration<double>(now - a.since).count());
      }
  }
  for (const auto& [op, waited] : due) {
    std::map<int64_t, json> beats;
    bool silent = false;
    try {
      beats = read_heartbeats(*store_, op.peer >= 0 ? std::vector<int64_t>{op.peer} : *op.members);
    } catch (...) {
      silent = true;
    }
    say_(describe_hang(rank_, op, waited, beats, unix_time(), silent_after_s(after_), silent));
  }
}

JobWatch::JobWatch(c10::intrusive_ptr<c10d::Store> store, int64_t world,
                   std::chrono::milliseconds after, std::function<void(const std::string&)> say)
    : store_(std::move(store)), world_(world), ranks_(world_ranks(world)), after_(after),
      say_(std::move(say)) {}

void JobWatch::tick() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_read_) return;
  next_read_ = now + beat_period(after_);
  std::map<int64_t, json> beats;
  try {
    beats = read_heartbeats(*store_, ranks_);
  } catch (...) {
    return;  // the store is this process's own: nothing to say of the ranks
  }
  const double now_s = unix_time(), after_s = std::chrono::duration<double>(after_).count();
  bool hung = false;
  for (const auto& [rank, beat] : beats)
    if (beat.contains("waits"))
      for (const auto& w : beat["waits"]) hung |= now_s - w.value("since", now_s) >= after_s;
  if (hung && !said_) say_(job_picture(beats, world_, now_s, silent_after_s(after_)));
  said_ = hung;
}

}  // namespace dtrain
