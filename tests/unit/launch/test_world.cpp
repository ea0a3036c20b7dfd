// Launcher environment discovery and the SLURM hostlist parser.
#include <doctest/doctest.h>

#include "launch/requeue.hpp"
#include "launch/world.hpp"
#include "util/error.hpp"

namespace unit_launch_world {

using namespace dtrain;

namespace {
std::string first_of(const std::string& list) { return expand_hostlist(list).front(); }
}  // namespace

TEST_CASE("expand_hostlist") {
  using V = std::vector<std::string>;
  CHECK(expand_hostlist("node1") == V{"node1"});
  CHECK(expand_hostlist("node[01-03,07],gpu-a1") == V{"node01", "node02", "node03", "node07", "gpu-a1"});
  CHECK(expand_hostlist("n[8-11]") == V{"n8", "n9", "n10", "n11"});
  CHECK(expand_hostlist("a[1-2]-b[3-4]") == V{"a1-b3", "a1-b4", "a2-b3", "a2-b4"});
  CHECK(expand_hostlist("x[009-011]") == V{"x009", "x010", "x011"});
  CHECK(expand_hostlist("rack1-n[2],rack2-n[5-6]") == V{"rack1-n2", "rack2-n5", "rack2-n6"});
  for (const char* bad : {"node[1-", "node]", "node[a-b]", "node[3-1]", "", "a,,b"}) {
    INFO(bad);
    CHECK_THROWS_AS(expand_hostlist(bad), ConfigError);
  }
}

TEST_CASE("no launcher: one process") {
  auto w = discover_world(map_env({}), 0, first_of);
  CHECK(w.launcher == "single");
  CHECK(w.world == 1);
  CHECK(w.rank == 0);
  CHECK(w.master_port == 29500);
}

TEST_CASE("torchrun-style variables win over everything else") {
  auto w = discover_world(map_env({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                   {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.5"},
                                   {"MASTER_PORT", "31000"}, {"SLURM_PROCID", "0"},
                                   {"SLURM_NTASKS", "1"}}),
                          0, first_of);
  CHECK(w.launcher == "env");
  CHECK(w.rank == 3);
  CHECK(w.world == 8);
  CHECK(w.local_rank == 1);
  CHECK(w.local_world == 2);
  CHECK(w.master_addr == "10.0.0.5");
  CHECK(w.master_port == 31000);
}

TEST_CASE("SLURM: ranks, first host of the node list, port from the job id") {
  auto w = discover_world(map_env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"},
                                   {"SLURM_LOCALID", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2)"},
                                   {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "123456"}}),
                          0, first_of);
  CHECK(w.launcher == "slurm");
  CHECK(w.rank == 5);
  CHECK(w.world == 6);
  CHECK(w.local_rank == 2);
  CHECK(w.local_world == 3);
  CHECK(w.master_addr == "gpu07");
  CHECK(w.master_port == 20000 + 123456 % 20000);
  // dist.port, when set, wins over the job-id port; MASTER_PORT wins over both.
  CHECK(discover_world(map_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "9"}}),
                       4242, first_of).master_port == 4242);
  CHECK(discover_world(map_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"MASTER_PORT", "777"}}),
                       4242, first_of).master_port == 777);
}

TEST_CASE("OpenMPI and PMI") {
  auto o = discover_world(map_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                          0, first_of);
  CHECK(o.launcher == "openmpi");
  CHECK(o.rank == 1);
  CHECK(o.world == 4);
  CHECK(o.local_world == 2);
  CHECK(o.master_addr == "127.0.0.1");
  auto p = discover_world(map_env({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MASTER_ADDR", "h0"}}), 0,
                          first_of);
  CHECK(p.launcher == "pmi");
  CHECK(p.rank == 2);
  CHECK(p.world == 3);
  CHECK(p.master_addr == "h0");
}

TEST_CASE("inconsistent launcher variables are errors") {
  CHECK_THROWS_AS(discover_world(map_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), 0, first_of), ConfigError);
  CHECK_THROWS_AS(discover_world(map_env({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), 0, first_of), ConfigError);
}

TEST_CASE("torchrun's agent store and restart count") {
  auto w = discover_world(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29600"},
                                   {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                   {"TORCHELASTIC_RESTART_COUNT", "2"}}),
                          0, first_of);
  CHECK(w.agent_store);
  CHECK(w.restart_count == 2);
  // Our own --nproc workers (and torchrun with another rendezvous backend) host the store.
  auto own = discover_world(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}}), 0, first_of);
  CHECK(!own.agent_store);
  CHECK(own.restart_count == 0);
  auto other = discover_world(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "False"}}), 0, first_of);
  CHECK(!other.agent_store);
  CHECK_THROWS_AS(discover_world(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"},
                                          {"TORCHELASTIC_RESTART_COUNT", "x"}}), 0, first_of),
                  ConfigError);
}

TEST_CASE("slurm_job_to_requeue: the job id, or ARRAYJOB_TASK for an array task") {
  CHECK(slurm_job_to_requeue(map_env({})) == "");
  CHECK(slurm_job_to_requeue(map_env({{"SLURM_JOB_ID", "812"}})) == "812");
  CHECK(slurm_job_to_requeue(map_env({{"SLURM_JOB_ID", "815"}, {"SLURM_ARRAY_JOB_ID", "812"},
                                      {"SLURM_ARRAY_TASK_ID", "3"}})) == "812_3");
}

}  // namespace unit_launch_world
