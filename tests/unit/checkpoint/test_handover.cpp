// Live recovery (checkpoint/handover.hpp) between replicas as threads over real Gloo: a
// joiner takes the source's weights, optimizer state and trainer entries, keeps its own
// replica state, and ends bit-identical (the hashes say so); a member that only takes part
// keeps its own; a joiner that loads wrong is told by the hashes; a tensor rank's part, and
// a data rank's shard, go to the rank at its place.
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
    const auto w = in.tensors(StateFile::kModel).at("w", {3, 4});
    const auto m = in.tensors(StateFile::kOptimizer).at("w.m", {7});
    loaded_in_place = w.is_alias_of(weight) && m.is_alias_of(moment);
    weight.copy_(w);
    moment.copy_(m);
    step = in.trainer().at("step").get<int64_t>();
    if (corrupt_) weight[0][0] += 1;
    CHECK(!in.has(StateFile::kReplica));
    CHECK(in.config_yaml() == "job: source");  // the source's job, which a load checks
  }
  torch::Tensor weight, moment, residual;
  int64_t step = 0;
  bool loaded_in_place = false;  // what it loaded was its own tensors' memory

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
    // A joiner counts what it took: the weights' 12 floats and the moments' 7 doubles.
    if (h.bytes != (joins ? 12 * 4 + 7 * 8 : 0)) fails.add(r, "the bytes taken");
    // ... straight into its own tensors' memory, which the load then reads: no second copy.
    if (h.in_place != h.bytes) fails.add(r, "not all taken in place");
    if (c.loaded_in_place != joins) fails.add(r, "the load did not read its own memory");
  }, test::quick());
  fails.check();
}

// A component whose state is not its own tensors' until loaded (a weight the joiner keeps
// transposed, a moment it has not made yet): the joiner takes those into new memory.
class Unlike : public Stateful {
 public:
  explicit Unlike(double v, bool source) {
    // Distinct values: a transfer into the transposed memory would put them out of order.
    weight = source ? torch::arange(12, torch::kFloat32).view({3, 4}) + v
                    : torch::full({4, 3}, v).t();
    if (source) moment = torch::full({7}, v);
  }
  void save(StateWriter& out) const override {
    out.add(StateFile::kModel, {{"w", weight}});
    if (moment.defined()) out.add(StateFile::kOptimizer, {{"w.m", moment}});
  }
  void load(const StateReader& in) override {
    weight.copy_(in.tensors(StateFile::kModel).at("w", {3, 4}));
    moment = in.tensors(StateFile::kOptimizer).at("w.m", {7}).clone();
  }
  torch::Tensor weight, moment;
};

TEST_CASE("handover: state the joiner does not hold alike is taken into new memory") {
  test::RankFailures fails;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> group) {
    const int64_t r = group->rank();
    Unlike u(r == 0 ? 1.5 : 0.0, /*source=*/r == 0);
    const Handover h = hand_over({&u}, *group, 0, /*receive=*/r == 1, ParallelDims{}, "job: source");
    if (!torch::equal(u.weight, torch::arange(12, torch::kFloat32).view({3, 4}) + 1.5))
      fails.add(r, "weights");
    if (!u.moment.defined() || !torch::equal(u.moment, torch::full({7}, 1.5))) fails.add(r, "moments");
    if (h.in_place != 0) fails.add(r, "taken in place into a tensor unlike the source's");
    if (r == 1 && h.bytes != 12 * 4 + 7 * 4) fails.add(r, "the bytes taken");
    if (!h.identical()) fails.add(r, "not identical");
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

// A data rank's shard of the optimizer's state (ZeRO inside a replica): its ranges of a
// plain weight's and of a channels-last convolution's elements, in the flat layout's order
// (NHWC for the latter), and a step count that is not a range.
class ZeroShard : public Stateful {
 public:
  static constexpr int64_t kHalf = 6;  // each data rank holds half of each tensor's 12
  ZeroShard(int64_t data_rank, double v) : at_(data_rank * kHalf) {
    w = torch::arange(kHalf, torch::kFloat32) + v;
    c = torch::arange(kHalf, torch::kFloat32) * 2 + v;
    step = torch::full({}, v);
  }
  void save(StateWriter& out) const override {
    RangesOf ranges{{"w.m", RangeOf{at_, {3, 4}, false}}, {"c.m", RangeOf{at_, {2, 3, 1, 2}, true}}};
    out.add(StateFile::kOptimizerShard, {{"w.m", w}, {"c.m", c}, {"step", step}}, {}, ranges);
  }
  // As FlatParams::scatter_range reads them: the whole tensor's elements in the flat
  // layout's order, this rank's range of them.
  void load(const StateReader& in) override {
    const auto saved = in.tensors(StateFile::kOptimizer);
    w.copy_(saved.at("w.m", {3, 4}).reshape({-1}).narrow(0, at_, kHalf));
    c.copy_(saved.at("c.m", {2, 3, 1, 2}).permute({0, 2, 3, 1}).contiguous().view({-1}).narrow(0, at_, kHalf));
    step.copy_(saved.at("step", {}));
  }
  torch::Tensor w, c, step;

 private:
  int64_t at_;
};

TEST_CASE("handover: each data rank's shard (ZeRO inside a replica) goes to the joiner's rank at its place") {
  for (int64_t data_rank = 0; data_rank < 2; ++data_rank) {
    CAPTURE(data_rank);
    test::RankFailures fails;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> group) {
      const int64_t r = group->rank();
      ZeroShard mine(data_rank, r == 0 ? 5.0 : -1.0);
      const ZeroShard source(data_rank, 5.0);
      const Handover h = hand_over({&mine}, *group, 0, /*receive=*/r == 1, ParallelDims{2, 1, 1},
                                   "job: source");
      if (!torch::equal(mine.w, source.w)) fails.add(r, "the weight's range");
      if (!torch::equal(mine.c, source.c)) fails.add(r, "the channels-last range");
      if (!torch::equal(mine.step, source.step)) fails.add(r, "the step count");
      if (!h.identical()) fails.add(r, "not identical");
      // A shard's pieces are the joiner's own at the same ranges: taken in place.
      if (h.in_place != h.bytes || (r == 1 && h.bytes == 0)) fails.add(r, "not taken in place");
    }, test::quick());
    fails.check();
  }
}

}  // namespace unit_checkpoint_handover
