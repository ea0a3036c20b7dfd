// The plan's step time where a machine's ranks outnumber its cores: the cores never idle
// while some rank has work (a stage's bubble is another's compute), and each pipeline
// hand-off and tensor all-reduce costs what the profile measured for one there. A made-up profile, so that the expected
// differences follow from counting alone.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "config/schema.hpp"
#include "plan/plan.hpp"
#include "plan/profile.hpp"

namespace unit_plan_crowded {

using namespace dtrain;

MachineProfile profile(int64_t cores, double handoff_s, double all_reduce_s = 0) {
  MachineProfile p;
  p.cores = cores;
  for (double size : {16.0, 64.0, 256.0}) p.matmul.push_back({size, 1e9, 1e9 * double(cores)});
  p.bmm = p.matmul;
  p.memory_one = 1e9;
  p.memory_all = 1e9 * double(cores);
  p.elementwise = {1e8, 1e8 * double(cores), 1e7, 1e7 * double(cores)};
  p.all_reduce = p.send = {{2, 1e-5, 1e10}};
  p.crowded = {2 * cores, handoff_s, all_reduce_s};
  return p;
}

double step_s(std::vector<std::string> overrides, int64_t world, const MachineProfile& p) {
  overrides.push_back("train.threads=1");
  JobConfig cfg = parse_job(
      "data: {dataset: synthetic_tokens, samples: 64, batch_size: 16}\n"
      "model: {arch: gpt, layers: 4, heads: 2, dim: 64, vocab: 128, seq_len: 32}\n",
      "crowded.yaml", overrides);
  resolve(cfg);
  const Plan plan = plan_job(cfg, world, &p);
  REQUIRE(plan.step_s.has_value());
  return *plan.step_s;
}

TEST_CASE("plan: where ranks outnumber the cores, hand-offs cost the profile's each") {
  // Two one-thread ranks on one core, then on two: the same plan but for the hand-offs,
  // 2 per micro-batch and chunk (its activations forward, their gradients back).
  struct Case {
    std::vector<std::string> sets;
    double handoffs;
  };
  for (const Case& c : {Case{{"parallel.pipeline=2", "train.grad_accum=2"}, 4},
                        Case{{"parallel.pipeline=2", "train.grad_accum=8"}, 16},
                        Case{{"parallel.pipeline=2", "parallel.schedule=interleaved_1f1b",
                              "parallel.virtual_stages=2", "train.grad_accum=4"}, 16},
                        Case{{"train.grad_accum=2"}, 0}}) {  // data 2
    CAPTURE(fmt::format("{}", fmt::join(c.sets, " ")));
    const double free = step_s(c.sets, 2, profile(1, 0));
    CHECK(step_s(c.sets, 2, profile(1, 0.01)) - free == doctest::Approx(0.01 * c.handoffs));
    // Each rank has a core: no hand-off waits for one.
    CHECK(step_s(c.sets, 2, profile(2, 0.01)) == doctest::Approx(step_s(c.sets, 2, profile(2, 0))));
  }
}

TEST_CASE("plan: where ranks outnumber the cores, tensor all-reduces cost the profile's each") {
  // The 4-layer GPT split over 2 ranks all-reduces, per micro-batch, the embeddings' sum,
  // each block's attention and MLP outputs and their inputs' gradients (4 a block), and
  // the loss's maxima, picks and sums and its input's gradient: 1 + 16 + 4 = 21.
  for (int64_t micro : {1, 2}) {
    const std::vector<std::string> sets = {"parallel.tensor=2", fmt::format("train.grad_accum={}", micro)};
    CAPTURE(micro);
    const double free = step_s(sets, 2, profile(1, 0.01, 0));
    CHECK(step_s(sets, 2, profile(1, 0.01, 0.001)) - free == doctest::Approx(0.001 * 21 * double(micro)));
    CHECK(step_s(sets, 2, profile(2, 0.01, 0.001)) == doctest::Approx(step_s(sets, 2, profile(2, 0, 0))));
  }
}

TEST_CASE("plan: where ranks outnumber the cores, a stage's bubble costs no time") {
  // Two stages on one core at 8 micro-batches: the core works the whole model's micro-
  // batches, one process's work, plus the stages' sends; stretching each stage by its
  // bubble (1/9) and sharing the core between the two would say 1.1-1.2x that.
  const MachineProfile one_core = profile(1, 0);
  const double alone = step_s({"train.grad_accum=8"}, 1, one_core);
  const double staged = step_s({"parallel.pipeline=2", "train.grad_accum=8"}, 2, one_core);
  CHECK(staged == doctest::Approx(alone).epsilon(0.03));
}

}  // namespace unit_plan_crowded
