// The training modes' specs and their lock-step arithmetic, without a run: what each
// refuses, how many ranks train, what it asks of the backend, how a rank is named, and
// where local SGD's replicas meet.
#include <doctest/doctest.h>

#include <string>

#include "run/mode.hpp"
#include "ranks.hpp"
#include "util/error.hpp"

namespace unit_run_modes {

using namespace dtrain;
using test::quick;

namespace {
std::string refusal(const std::string& mode, const JobConfig& cfg, int64_t world) {
  try {
    mode_spec(mode).validate(cfg, world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("modes: each spec's refusals, trainers, backend needs and rank names") {
  JobConfig cfg;
  CHECK_THROWS_AS(mode_spec("hogwild"), ConfigError);
  CHECK(refusal("sync", cfg, 4).empty());
  CHECK(mode_spec("sync").trainers(cfg, 4) == 4);
  CHECK(mode_spec("sync").any_source.empty());
  CHECK(mode_spec("sync").role(cfg, 1).empty());

  cfg.parallel.zero = 1;
  CHECK(refusal("local_sgd", cfg, 2).find("local_sgd with parallel.zero 1") != std::string::npos);
  CHECK(refusal("async_ps", cfg, 3).find("async_ps with parallel.zero 1") != std::string::npos);
  cfg.parallel.zero = 0;
  CHECK(refusal("local_sgd", cfg, 2).empty());

  cfg.parallel.servers = 2;
  CHECK(refusal("async_ps", cfg, 2).find("leave no worker") != std::string::npos);
  CHECK(refusal("async_ps", cfg, 3).empty());
  CHECK(mode_spec("async_ps").trainers(cfg, 5) == 3);  // the workers
  CHECK(!mode_spec("async_ps").any_source.empty());   // NCCL is refused for it
  CHECK(mode_spec("async_ps").role(cfg, 1) == "async_ps server 1");
  CHECK(mode_spec("async_ps").role(cfg, 4) == "async_ps worker 2");
}

TEST_CASE("modes: local SGD's replicas meet after the synchronous steps and every average") {
  JobConfig cfg;
  cfg.parallel.local_after = 2;
  cfg.parallel.average_every = 3;
  ParallelDims dims;
  dims.data = 2;
  // Rank threads record; the checks run on the test's thread.
  std::string met[2], always[2];
  int64_t replicas_apart[2] = {}, replicas_met[2] = {}, sync_replicas[2] = {};
  bool own_group[2] = {}, says_apart[2] = {};
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> world) {
    const auto r = size_t(world->rank());
    auto mode = mode_spec("local_sgd").make(cfg, dims, world);
    auto sync = mode_spec("sync").make(cfg, dims, world);
    auto* local = dynamic_cast<Lockstep*>(mode.get());
    auto* every = dynamic_cast<Lockstep*>(sync.get());
    if (!local || !every) return;
    for (int64_t n = 1; n <= 9; ++n) met[r] += local->meets(n) ? 'M' : '.';
    for (int64_t n = 1; n <= 9; ++n) always[r] += every->meets(n) ? 'M' : '.';
    replicas_apart[r] = local->replicas(3), replicas_met[r] = local->replicas(5);
    own_group[r] = &local->figures_group(3) == local->mesh().replica().get();
    says_apart[r] = !local->apart().empty();
    sync_replicas[r] = every->replicas(3);
  }, quick());
  for (size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(met[r] == "MM..M..M.");  // steps 1-2 synchronous; apart, meeting after 5 and 8
    CHECK(always[r] == "MMMMMMMMM");
    CHECK(replicas_apart[r] == 1);
    CHECK(replicas_met[r] == 2);
    CHECK(own_group[r]);
    CHECK(says_apart[r]);
    CHECK(sync_replicas[r] == 2);
  }
}

}  // namespace unit_run_modes
