// Who this process is in the job: rank, world size, the rendezvous address. Discovered from
// the launcher's environment, in this order: torchrun-style variables, SLURM, OpenMPI, PMI;
// none of them means a single process.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtrain {

struct WorldInfo {
  int64_t rank = 0, world = 1;
  int64_t local_rank = 0, local_world = 1;  // processes on this machine
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;                  // 0 until resolved
  std::string launcher = "single";          // single | env | slurm | openmpi | pmi
  // torchrun: its agent already hosts a store at master_addr:master_port and says so
  // (TORCHELASTIC_USE_AGENT_STORE=True); every rank, rank 0 too, joins it as a client.
  bool agent_store = false;
  // dtrain's --nproc supervisor hosts the store (DTRAIN_STORE_HOSTED=1), which then
  // outlives any rank and lets it read every rank's heartbeat; rank 0 joins as a client.
  bool store_hosted = false;
  // torchrun's TORCHELASTIC_RESTART_COUNT: > 0 when the agent restarted the workers, who
  // then resume from the run's newest valid checkpoint.
  int64_t restart_count = 0;
  // torchrun's TORCHELASTIC_RUN_ID (its --rdzv_id): one elastic job, across its restarts
  // and membership changes. A worker that finds checkpoints this run wrote resumes from
  // them, whatever the restart count ("" outside torchrun).
  std::string run_id;
};

using Env = std::function<std::optional<std::string>(const std::string&)>;
Env process_env();  // getenv
Env map_env(std::map<std::string, std::string> vars);  // for tests

// The launcher whose variables are set: env | slurm | openmpi | pmi, or single.
std::string detect_launcher(const Env& env);

// Job ranks 0 .. world - 1, in order.
std::vector<int64_t> world_ranks(int64_t world);

// Unsets every launcher's rank and world variables (and torchrun's elastic ones) in this
// process, so that a dtrain it starts is a world of its own (`dtrain verify`'s runs).
void clear_launcher_env();

// Expands a SLURM hostlist ("node[01-03,07],gpu-a1") into host names, in order.
// Throws ConfigError on malformed input.
std::vector<std::string> expand_hostlist(const std::string& list);

// The first host of a SLURM node list: through `scontrol show hostnames` when scontrol
// exists, else expand_hostlist.
std::string first_slurm_host(const std::string& nodelist);

// The port: MASTER_PORT when the launcher sets it, else `config_port` (dist.port) when > 0,
// else under SLURM one derived from SLURM_JOB_ID (two jobs sharing a node do not collide),
// else 29500.
// `first_host` resolves SLURM node lists (tests pass expand_hostlist's first element).
WorldInfo discover_world(const Env& env, int64_t config_port,
                         const std::function<std::string(const std::string&)>& first_host =
                             first_slurm_host);

}  // namespace dtrain
