// Hangs named while they happen (dist.hang_report_s): a rank whose collective has waited
// past the threshold says, once, which ranks of the group have not posted it and how long
// each has been silent, well before dist.timeout_s ends the job.
//
// Every rank posts a heartbeat to the job's store each second (each third of the
// threshold where that is shorter, so that a live rank's is never stale when a wait is
// judged): the time, its step, how many collectives it has posted in each of its groups,
// and the ones it waits in. A collective's number in its group is its place in that count
// (every member posts the group's collectives in the same order), so a member whose count
// is below it has not reached it yet; a member whose heartbeat stopped is silent (dead,
// stopped, its machine gone). The watch reads the store through a connection of its own
// with a short timeout: a store that does not answer is said too (its host is silent).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/tcp_store.hpp"

namespace dtrain {

// A collective (or a transfer with `peer`) a rank waits in.
struct WaitedOp {
  std::string op, group;         // all_reduce, ...; the group's name ("world", "data", ...)
  // The group's world ranks, in group order: the group's own list, shared (every
  // collective posted carries one, and copying it each time would allocate).
  std::shared_ptr<const std::vector<int64_t>> members;
  int64_t number = 0;            // its place in the group's posted count (0: a transfer)
  int64_t bytes = 0;
  int64_t peer = -1;             // a transfer's other world rank
};

// What one line says of a hang, from this rank's wait and its group's heartbeats (a rank
// without one: none read; `store_silent`: the store did not answer). Pure, for tests.
std::string describe_hang(int64_t rank, const WaitedOp& wait, double waited_s,
                          const std::map<int64_t, nlohmann::json>& beats, double now_s,
                          double silent_after_s, bool store_silent);

// The job's picture: one line per rank of a world of `world`, from the heartbeats the
// store holds (the supervisor prints it).
std::string job_picture(const std::map<int64_t, nlohmann::json>& beats, int64_t world,
                        double now_s, double silent_after_s);

class Watch {
 public:
  // `store`: the watch's own connection (a short timeout); `after`: the threshold; `say`:
  // where its lines go.
  Watch(c10::intrusive_ptr<c10d::Store> store, int64_t rank, std::chrono::milliseconds after,
        std::function<void(const std::string&)> say);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // The next collective's number in `group` (from 1): called as it is posted.
  int64_t post(const std::string& group);
  // The step this rank is in, for its heartbeat.
  void step(int64_t n);

  // A wait, registered while it lasts.
  class Waiting {
   public:
    Waiting(Watch* watch, WaitedOp op);
    ~Waiting();
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    Watch* watch_;
    int64_t id_ = 0;
  };

 private:
  struct Active {
    WaitedOp op;
    std::chrono::steady_clock::time_point since;
    double since_wall = 0;
    bool said = false;
  };
  void loop();
  nlohmann::json beat() const;  // under mu_
  void check();

  c10::intrusive_ptr<c10d::Store> store_;
  int64_t rank_;
  std::chrono::milliseconds after_, every_;
  std::function<void(const std::string&)> say_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  int64_t step_ = -1, next_id_ = 0;
  std::map<std::string, int64_t> posted_;
  std::map<int64_t, Active> active_;
  std::thread thread_;
};

// The launcher's word that job rank `rank`'s process has ended (Liveness reads it; its
// heartbeat is dropped), and a restarted process's that it runs again.
void mark_ended(c10d::Store& store, int64_t rank);
void clear_ended(c10d::Store& store, int64_t rank);
// What a launcher that did not start this process needs of it (the lighthouse, under
// torchrun or SLURM): the store marks rank `rank` ended when this connection closes, as
// the process ends however it ends, and holds its host and pid (its_process).
void leave_word(TcpStore& store, int64_t rank);
// The host and pid rank `rank`'s process left word of, if it did.
std::optional<std::pair<std::string, int64_t>> its_process(c10d::Store& store, int64_t rank);
// Whether the store marks rank `rank` ended.
bool has_ended(c10d::Store& store, int64_t rank);

// What the store holds of a rank now: its process's word (leave_word), whether it is
// marked ended, and its heartbeat (empty: none).
struct RankWord {
  std::optional<std::pair<std::string, int64_t>> process;
  bool ended = false;
  std::vector<uint8_t> beat;
};
// Every rank's of `ranks`, read together: one request where the store is dtrain's own
// (one per 16 MiB of words: tens of thousands of ranks), not one a key and rank (a
// launcher reads them all each tick).
std::vector<RankWord> read_words(c10d::Store& store, const std::vector<int64_t>& ranks);

// Whether job ranks are alive, from their heartbeats: a rank is alive while its heartbeat
// has changed within `silent`, timed by this process's clock (no clock is compared across
// machines); a rank with none yet, for `silent` from the first question about it (or, for
// the launcher that starts them, `none_alive`: until it beats). A rank the launcher has
// marked ended is dead at once.
class Liveness {
 public:
  Liveness(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds silent,
           bool none_alive = false)
      : store_(std::move(store)), silent_(silent), none_alive_(none_alive) {}
  // Those of `ranks` that are not alive, from one read of the store.
  std::vector<int64_t> dead_among(const std::vector<int64_t>& ranks);
  // Whether rank `rank` is, judged from its word (read with others' by read_words).
  bool operator()(int64_t rank, const RankWord& word);

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds silent_;
  bool none_alive_;
  struct Seen {
    std::vector<uint8_t> beat;
    std::chrono::steady_clock::time_point changed;
  };
  std::mutex mu_;
  std::map<int64_t, Seen> seen_;
};

// The whole job's view, where the store outlives the ranks (dtrain's --nproc supervisor):
// each tick reads every rank's heartbeat; when a rank has waited in a collective past the
// threshold, the job's picture is said, once until no rank has.
class JobWatch {
 public:
  JobWatch(c10::intrusive_ptr<c10d::Store> store, int64_t world, std::chrono::milliseconds after,
           std::function<void(const std::string&)> say);
  void tick();  // as often as it likes: it reads once a beat period

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t world_;
  std::vector<int64_t> ranks_;  // 0 .. world - 1
  std::chrono::milliseconds after_;
  std::function<void(const std::string&)> say_;
  std::chrono::steady_clock::time_point next_read_{};
  bool said_ = false;
};

}  // namespace dtrain
