// Live recovery (checkpoint/handover.hpp) between replicas as threads over real Gloo: a
// joiner takes the source's weights, optimizer state and trainer entries, keeps its own
// replica state, and ends bit-identical (the hashes say so); a member that only takes part
// keeps its own; a joiner that loads wrong is told by the hashes; a tensor rank's part goes
// to the rank at its place.
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
    CHECK(in.config_yaml() == "job: source");  // the source's job, which a load checks
  }
  torch::Tensor weight, moment, residual;
  int64_t step = 0;

 private:
  bool corrupt_;
};

TEST_CASE("handover: joiners take the source's state over the group and end identical") {
  test::RankFailures fails;
  // Rank 1 is the source, 0 and 2 join, 3 is a member with state of its own that only
  // takes part.
  test::run_ranks_as_threads(4, [&](std::shared_ptr<Comm> group) {
    const int64_t r = group->rank();
    const double v = r == 1 ? 2.5 : r == 3 ? 7.0 : 0.0;
    Component c(v);
    const bool joins = r == 0 || r == 2;
    const Handover h = hand_over({&c}, *group, /*source=*/1, joins, ParallelDims{},
                                 r == 1 ? "job: source" : "job: joiner");
    const double want = joins ? 2.5 : v;
    if (!torch::equal(c.weight, torch::full({3, 4}, want))) fails.add(r, "weights");
    if (!torch::equal(c.moment, torch::full({7}, want, torch::kFloat64))) fails.add(r, "moments");
    if (c.step != int64_t(want * 10)) fails.add(r, "trainer entry");
    // What a replica keeps of its own stays its own.
    if (!torch::equal(c.residual, torch::full({2}, v))) fails.add(r, "residual moved");
    // The source and the joiners hash their state; a member that keeps its own does not.
    if (h.mine != (r == 3 ? 0 : state_hash({&c}))) fails.add(r, "the hash is not the state's");
    if (h.source != state_hash({&c}) && r != 3) fails.add(r, "the source's hash");
    if (h.identical() != (r != 3)) fails.add(r, "identical() is wrong");
  }, test::quick());
  fails.check();
}

TEST_CASE("handover: a joiner whose state does not hash as the source's is told by the hashes") {
  test::RankFailures fails;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> group) {
    const int64_t r = group->rank();
    Component c(r == 0 ? 1.0 : 0.0, /*corrupt_on_load=*/r == 1);
    const Handover h = hand_over({&c}, *group, 0, /*receive=*/r == 1, ParallelDims{}, "job: source");
    if (h.identical() != (r == 0)) fails.add(r, "a corrupted load hashed as its source");
  }, test::quick());
  fails.check();
}

// A tensor rank's part of a weight split in two, and a replicated bias that a checkpoint
// takes from tensor rank 0 only, as a replica's rank at `place` holds them.
class Part : public Stateful {
 public:
  Part(int64_t place, double v) : place_(place) {
    w = torch::full({2, 3}, v + double(place));
    b = torch::full({3}, -v);
  }
  void save(StateWriter& out) const override {
    PartsOf parts{{"w", PartOf{Placement::split(0, 2), place_}}};
    NamedTensors mine{{"w", w}};
    if (place_ == 0 || out.every_rank_whole()) mine.emplace_back("b", b);
    out.add(StateFile::kModel, mine, parts);
  }
  void load(const StateReader& in) override {
    const auto saved = in.tensors(StateFile::kModel);
    w.copy_(saved.part("w", {4, 3}, Placement::split(0, 2), place_));
    b.copy_(saved.at("b", {3}));
  }
  torch::Tensor w, b;

 private:
  int64_t place_;
};

TEST_CASE("handover: each place's part of a split state goes to the joiner's rank at that place") {
  // Two places in a replica, each with its group across the replicas: replica 0 the source,
  // replica 1 the joiner.
  for (int64_t place = 0; place < 2; ++place) {
    CAPTURE(place);
    test::RankFailures fails;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> group) {
      const int64_t r = group->rank();
      Part p(place, r == 0 ? 3.0 : 0.0);
      const Handover h = hand_over({&p}, *group, 0, /*receive=*/r == 1, ParallelDims{1, 2, 1},
                                   "job: source");
      if (!torch::equal(p.w, torch::full({2, 3}, 3.0 + double(place)))) fails.add(r, "its part");
      if (!torch::equal(p.b, torch::full({3}, -3.0))) fails.add(r, "the replicated bias");
      if (!h.identical()) fails.add(r, "not identical");
    }, test::quick());
    fails.check();
  }
}

TEST_CASE("handover: a state sharded inside a replica (ZeRO) is refused, not handed over wrong") {
  class Sharded : public Stateful {
   public:
    void save(StateWriter& out) const override {
      RangesOf ranges{{"w", RangeOf{0, {4}, false}}};
      out.add(StateFile::kOptimizerShard, {{"w", torch::zeros({2})}}, {}, ranges);
    }
    void load(const StateReader&) override {}
  } sharded;
  CHECK_THROWS_AS(state_hash({&sharded}), std::logic_error);
}

}  // namespace unit_checkpoint_handover
