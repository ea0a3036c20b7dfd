// Live recovery (checkpoint/handover.hpp) between replicas as threads over real Gloo: a
// joiner takes the source's weights, optimizer state and trainer entries, keeps its own
// replica state, and ends bit-identical (the hash every member checks); a joiner that
// does not is told so.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "checkpoint/handover.hpp"
#include "ranks.hpp"
#include "util/error.hpp"

namespace unit_checkpoint_handover {
using namespace dtrain;

// A component with something in each kind of file.
class Component : public Stateful {
 public:
  explicit Component(double v, bool corrupt_on_load = false) : corrupt_(corrupt_on_load) {
    weight = torch::full({3, 4}, v);
    moment = torch::full({7}, v, torch::kFloat64);
    residual = torch::full({2}, v);
    step = int64_t(v * 10);
  }
  void save(StateWriter& out) const override {
    out.add(StateFile::kModel, {{"w", weight}});
    out.add(StateFile::kOptimizer, {{"w.m", moment}});
    if (out.writes(StateFile::kReplica)) out.add(StateFile::kReplica, {{"r", residual}});
    out.set("step", step);
  }
  void load(const StateReader& in) override {
    weight.copy_(in.tensors(StateFile::kModel).at("w", {3, 4}));
    moment.copy_(in.tensors(StateFile::kOptimizer).at("w.m", {7}));
    step = in.trainer().at("step").get<int64_t>();
    if (corrupt_) weight[0][0] += 1;
    CHECK(!in.has(StateFile::kReplica));
    CHECK(in.config_yaml() == "job: source");
  }
  torch::Tensor weight, moment, residual;
  int64_t step = 0;

 private:
  bool corrupt_;
};

TEST_CASE("handover: joiners take the source's state over the group and end identical") {
  test::RankFailures fails;
  test::run_ranks_as_threads(3, [&](std::shared_ptr<Comm> group) {
    const int64_t r = group->rank();
    Component c(r == 1 ? 2.5 : 0.0);
    const uint64_t h = hand_over({&c}, *group, /*source=*/1, ParallelDims{},
                                 r == 1 ? "job: source" : "job: joiner");
    if (!torch::equal(c.weight, torch::full({3, 4}, 2.5))) fails.add(r, "weights differ");
    if (!torch::equal(c.moment, torch::full({7}, 2.5, torch::kFloat64))) fails.add(r, "moments differ");
    if (c.step != 25) fails.add(r, "trainer entry differs");
    // What a replica keeps of its own stays its own.
    if (!torch::equal(c.residual, torch::full({2}, r == 1 ? 2.5 : 0.0))) fails.add(r, "residual moved");
    if (h != state_hash({&c})) fails.add(r, "the returned hash is not the state's");
  }, test::quick());
  fails.check();
}

TEST_CASE("handover: a joiner whose state does not hash as the source's fails, naming it") {
  test::RankFailures fails;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> group) {
    const int64_t r = group->rank();
    Component c(r == 0 ? 1.0 : 0.0, /*corrupt_on_load=*/r == 1);
    try {
      hand_over({&c}, *group, 0, ParallelDims{}, "job: source");
      if (r == 1) fails.add(r, "no error");
    } catch (const DistError& e) {
      if (r == 0 || std::string(e.what()).find("not identical to its source") == std::string::npos)
        fails.add(r, e.what());
    }
  }, test::quick());
  fails.check();
}

TEST_CASE("handover: a state split inside a replica is refused, not handed over wrong") {
  class Split : public Stateful {
   public:
    void save(StateWriter& out) const override {
      PartsOf parts{{"w", PartOf{Placement::split(0, 2), 0}}};
      out.add(StateFile::kModel, {{"w", torch::zeros({2})}}, parts);
    }
    void load(const StateReader&) override {}
  } split;
  CHECK_THROWS_AS(state_hash({&split}), std::logic_error);
}

}  // namespace unit_checkpoint_handover
