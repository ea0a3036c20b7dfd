// The plan of fault-tolerant replicas with ZeRO inside each (HSDP): a rank's optimizer
// state is its shard of the replica's data ranks, not of every data rank, and it sends the
// replica's ZeRO traffic plus its shard's all-reduce across the replicas.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config/schema.hpp"
#include "plan/plan.hpp"

namespace unit_plan_replicas {

using namespace dtrain;

JobConfig job(std::vector<std::string> overrides) {
  overrides.push_back("train.threads=1");
  JobConfig cfg = parse_job(
      "data: {dataset: synthetic, samples: 256, input_shape: [1, 8, 8], classes: 4, batch_size: 32}\n"
      "model: {arch: mlp, hidden: [64, 32]}\n"
      "optimizer: {name: sgd, lr: 0.1, momentum: 0.9}\n",
      "replicas.yaml", overrides);
  resolve(cfg);
  return cfg;
}

RankPlan planned(std::vector<std::string> overrides, int64_t world) {
  return plan_rank(job(std::move(overrides)), world, /*rank=*/1);
}

TEST_CASE("plan: ZeRO inside fault-tolerant replicas shards over a replica and adds the shard's all-reduce across them") {
  // Two replicas of two data ranks against one group of two data ranks (the replica alone).
  const RankPlan hsdp = planned({"parallel.zero=1", "fault_tolerance.mode=replicas",
                                 "fault_tolerance.replica_data=2"}, 4);
  const RankPlan one = planned({"parallel.zero=1"}, 2);
  const RankPlan flat = planned({"parallel.zero=1"}, 4);  // ZeRO over all four
  CHECK(hsdp.memory.optimizer == doctest::Approx(one.memory.optimizer));
  CHECK(hsdp.memory.optimizer > flat.memory.optimizer);
  // Momentum is one fp32 value per element of the shard: the all-reduce of the shard's
  // gradient over 2 replicas sends 2 x B x (2 - 1) / 2 = B of it.
  REQUIRE(hsdp.comm_bytes);
  REQUIRE(one.comm_bytes);
  CHECK(*hsdp.comm_bytes - *one.comm_bytes == doctest::Approx(one.memory.optimizer));
}

TEST_CASE("plan: the table's first line names the replicas, and what each holds") {
  auto first_line = [](const JobConfig& cfg, int64_t world) {
    const auto table = plan_table(cfg, plan_job(cfg, world));
    return table.substr(0, table.find('\n'));
  };
  CHECK(first_line(job({"fault_tolerance.mode=replicas"}), 3).find(
            "data 3 x tensor 1 x pipeline 1 (3 fault-tolerant replicas)") != std::string::npos);
  CHECK(first_line(job({"parallel.zero=1", "fault_tolerance.mode=replicas",
                        "fault_tolerance.replica_data=2"}), 4)
            .find("(2 fault-tolerant replicas of data 2)") != std::string::npos);
  CHECK(first_line(job({}), 2).find("replicas") == std::string::npos);
}

}  // namespace unit_plan_replicas
