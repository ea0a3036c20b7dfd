// A fault-tolerant job's rendezvous (docs/fault-tolerance.md): the job's store and groups
// among any of its ranks, but no group over the whole job, which a replica restarted later
// could not enter; and whether a rank is alive, from its heartbeat (comm/watch.hpp).
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/comm.hpp"

namespace dtrain {

struct JobLink {
  c10::intrusive_ptr<c10d::Store> store;
  // The group of job ranks `members` (this one among them) named `name`: only the members
  // call it, and a name serves one group for the whole job.
  std::function<std::shared_ptr<Comm>(const std::string& name, const std::vector<int64_t>& members)> group;
  // A world of job ranks `members` (this one among them) whose own groups (Comm::new_group)
  // are named under `scope`: a replica's ranks, whose groups' names every replica uses.
  std::function<std::shared_ptr<Comm>(const std::string& scope, const std::vector<int64_t>& members)> world;
  // Those of job ranks `ranks` that have ended or whose heartbeat has not moved within the
  // last `silent`, from one read of the store.
  std::function<std::vector<int64_t>(const std::vector<int64_t>& ranks)> dead;
};

// Connects to the job's store as make_c10d_comm does; `opts.hang_after` must be set (the
// heartbeats come from its watch).
JobLink link_job(const WorldInfo& world, const CommOptions& opts, std::chrono::milliseconds silent);

}  // namespace dtrain
