// What the data-parallel replicas of a fault-tolerant job agree on, through the job's store
// (hosted by the supervisor or the launcher, so it outlives any rank): which replicas train
// from which step (a quorum), and whether every member finished a step's reduction (the
// vote before the update, as TorchFT's should_commit). Each agreement is one store key that
// the first compareSet decides, so every reader sees the same answer however proposers
// race. A member that neither votes nor beats its heartbeat is voted "dead" for, by
// whoever sees it first; one "dead" or "failed" vote and every member discards the step,
// which the next quorum then trains again on the same global batch.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace dtrain {

struct Quorum {
  int64_t id = 0;                // its process group's name: ft/q<id>
  int64_t step = 0;              // the first step it trains
  std::vector<int64_t> members;  // replica indices, ascending
  std::vector<int64_t> joining;  // members without state: they take `source`'s
  int64_t source = -1;           // the lowest member with state (-1: nobody joins)
  // The member that writes the run directory: the last quorum's while it stays a member
  // with state, else the lowest member with state.
  int64_t writer = 0;
};

// A member's word on a step: it finished the reduction (and whether it saw a replica ask to
// join; whether a stop signal came to it, first at this step or already at an earlier
// vote), its reduction failed, or it was silent and voted for. Worse is later.
enum class Vote { kOk, kOkJoin, kLeave, kLeaving, kFailed, kDead };

// What every member concludes from the same votes: apply the step's update; whether the
// job stops after it (every member was asked to stop); which members leave after it (those
// asked at an earlier vote, while others go on); whether to form a new quorum before the
// next step (a join, a failure, a silence, a leaver).
//
// Why a stop leaves only at the vote after the one it was first asked at: a stop that
// reaches every rank (a preemption, the launcher's stop) reaches them a moment apart, and
// a step boundary may fall between. A step's notice lets them all be asked by the vote
// that stops the job, so that the job stops whole instead of losing replicas one by one.
struct Decision {
  bool commit = false, reform = false, stop = false;
  std::vector<int64_t> leaving;  // members, ascending; only where the step commits
};

// Where this rank sits in its replica: a replica of several ranks (tensor parallelism
// inside it) votes with each, and counts as failed when any of them did.
struct Place {
  int64_t index = 0, count = 1;
};

// Those of `replicas` that are not alive (a rank of theirs ended, or its heartbeat is
// stale), from one look at the store however many are asked about.
using DeadAmong = std::function<std::vector<int64_t>(const std::vector<int64_t>& replicas)>;

class ReplicaAgreement {
 public:
  // `replicas`: the most replicas the job can have (the join requests looked for).
  // `dead`: which replicas have gone. `timeout`: how long a quorum or a live member's vote
  // may take before DistError. `place`: this rank's in its replica (each of a replica's
  // ranks votes, asks to join and reads the same quorums; a replica is dead when any of
  // its ranks is). `starting`: the replicas in the first quorum (0: all); the others join
  // later, as one more (scale-up).
  ReplicaAgreement(c10d::Store& store, int64_t replica, int64_t replicas,
                   DeadAmong dead, std::chrono::milliseconds timeout,
                   std::chrono::milliseconds poll = std::chrono::milliseconds(5), Place place = {},
                   int64_t starting = 0);

  // The quorum the job starts in: replicas 0 to `starting` - 1, from `step` (nothing
  // stored).
  static Quorum first(int64_t starting, int64_t step);
  // That quorum for this job's starting replicas.
  Quorum starting_quorum(int64_t step) const { return first(starting_, step); }

  // This replica (restarted, or one more) asks to be in the next quorum; admitted() waits
  // for the first quorum that takes it, or returns nothing once the run has been ended
  // by the others (finished()) or `give_up` says so (a stop signal came: its request is
  // withdrawn).
  void ask_to_join();
  std::optional<Quorum> admitted(const std::function<bool()>& give_up = {});
  // A restarted replica, before it asks: waits until the newest quorum no longer holds its
  // former self (its peers have seen it gone). Until then a heartbeat of its own would
  // tell them the dead one lives. False when the run was ended meanwhile, or `give_up`.
  bool wait_until_left_out(const std::function<bool()>& give_up = {});
  // The run has ended, `how` ("completed", "stopped"): a replica still waiting to join has
  // nothing left to train. ended(): that word, or "" while the run goes on.
  void finished(const std::string& how = "completed");
  std::string ended();

  // This replica's vote on `step` under `q` (`ok`: its reduction finished; `stop`: a stop
  // signal came to this rank), then everyone's, and what they decide.
  Decision vote(const Quorum& q, int64_t step, bool ok, bool stop = false);
  // The quorum after `q` from `step`, formed when a vote said so: the members whose vote
  // was not kDead (nor kLeaving on a step that committed) and whose heartbeat is fresh, and
  // every replica asking to join. Each member proposes one; the first stored is everyone's.
  Quorum next(const Quorum& q, int64_t step);

 private:
  // Each member's vote on `step`: the worst of its places' (dead, failed, a join seen, ok).
  std::vector<Vote> votes_on(const Quorum& q, int64_t step);
  int64_t look_at_votes(const Quorum& q, const std::vector<std::string>& keys,
                        std::vector<std::optional<Vote>>& got);
  // The replicas every one of whose ranks has asked to join.
  std::vector<int64_t> asking_to_join();
  std::string get(const std::string& key);  // waits for it up to the timeout
  bool stored(const std::string& key);
  // The id of the newest quorum stored, looking from quorum `from` on (0: none stored).
  int64_t newest_quorum(int64_t from);

  c10d::Store& store_;
  int64_t replica_, replicas_, starting_;
  Place place_;
  DeadAmong dead_;
  std::chrono::milliseconds timeout_, poll_;
  std::vector<Vote> last_votes_;  // the members' votes on the last step voted
  bool asked_to_stop_ = false;    // this rank voted kLeave once: kLeaving from then on
  int64_t joins_seen_ = 0;        // the join requests counted when the quorum formed
  int64_t join_after_ = 0;        // a joiner: the newest quorum stored when it asked
};

}  // namespace dtrain
