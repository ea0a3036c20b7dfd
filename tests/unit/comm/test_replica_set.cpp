// A fault-tolerant job's replicas (comm/replica_set.hpp) as threads over real Gloo: when
// replicas die mid-step, the survivors discard the step, form a new quorum and train it
// again on the same global batch, each taking a share. Their weights must end where
// full-batch gradient descent on one process ends (computed here, in one piece, from the
// epoch's order: none of the re-sharing, weighting or voting under test), and equal to
// each other's.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <functional>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include "comm/replica_set.hpp"
#include "data/sampler.hpp"
#include "ranks.hpp"
#include "util/error.hpp"

namespace unit_comm_replica_set {
using namespace dtrain;
using namespace std::chrono_literals;

constexpr int64_t kSamples = 140, kBatch = 14, kFeatures = 5, kSteps = 8;
constexpr double kLr = 0.05;

struct Problem {
  torch::Tensor x = torch::randn({kSamples, kFeatures}, torch::dtype(torch::kFloat64)
                                                            .requires_grad(false));
  torch::Tensor y = torch::randn({kSamples}, torch::kFloat64);
  ShardedSampler sampler{kSamples, kBatch, /*shuffle=*/true, /*seed=*/11};

  // The mean squared error's gradient at `w` over the samples `idx`.
  torch::Tensor grad(const torch::Tensor& w, const torch::Tensor& idx) const {
    auto v = w.clone().requires_grad_(true);
    auto err = x.index_select(0, idx).matmul(v) - y.index_select(0, idx);
    err.pow(2).mean().backward();
    return v.grad();
  }
  // One process, the whole global batch each step.
  torch::Tensor reference() const {
    const EpochOrder order = sampler.epoch_order(0);
    auto w = torch::zeros({kFeatures}, torch::kFloat64);
    for (int64_t n = 1; n <= kSteps; ++n) {
      auto idx = torch::empty({kBatch}, torch::kInt64);
      for (int64_t i = 0; i < kBatch; ++i) idx[i] = order.at((n - 1) * kBatch + i);
      w = w - kLr * grad(w, idx);
    }
    return w;
  }
};

// The options of replica `world->rank()` among `replicas`, its groups made within `world`,
// each replica dead where `alive` says it is not.
ReplicaSet::Options options_for(const std::shared_ptr<Comm>& world, int64_t replicas,
                                std::function<bool(int64_t)> alive) {
  ReplicaSet::Options o;
  o.replica = world->rank(), o.replicas = replicas;
  o.dead = test::dead_unless(std::move(alive));
  o.timeout = 30s, o.poll = 1ms;
  o.make_group = [world](const std::string& name, const std::vector<int64_t>& members) {
    return world->new_group(name, members);
  };
  return o;
}

// When a replica dies: at the start of a step (before its share of the reduction: the
// others' fails) or after the reduction, before its vote (theirs succeeded).
struct Death {
  int64_t replica, step;
  bool after_reduce;
};

// Trains kSteps on `replicas` threads with `deaths`; returns the survivors' weights (an
// undefined tensor for the dead) and the quorums' sizes each survivor ended in.
std::vector<torch::Tensor> train(const Problem& pb, int64_t replicas, std::vector<Death> deaths,
                                 std::vector<int64_t>* end_counts) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::array<std::atomic<bool>, 4> alive{true, true, true, true};
  std::vector<torch::Tensor> out(static_cast<size_t>(replicas));
  end_counts->assign(size_t(replicas), 0);
  test::RankFailures fails;
  test::run_ranks_as_threads(replicas, [&](std::shared_ptr<Comm> world) {
    const int64_t r = world->rank();
    const auto alive_now = [&](int64_t m) { return alive[size_t(m)].load(); };
    ReplicaSet set(*store, options_for(world, replicas, alive_now), /*step=*/1);
    auto dies = [&](int64_t n, bool after_reduce) {
      for (const auto& d : deaths)
        if (d.replica == r && d.step == n && d.after_reduce == after_reduce) return true;
      return false;
    };
    auto w = torch::zeros({kFeatures}, torch::kFloat64);
    for (int64_t n = 1; n <= kSteps; ++n) {
      for (int tries = 0;; ++tries) {
        if (tries > 3) return fails.add(r, fmt::format("step {} tried 4 times", n));
        if (dies(n, false)) return alive[size_t(r)].store(false);
        const ShardedSampler share = pb.sampler.reshared(set.index(), set.count());
        const auto idx = share.rank_indices(share.epoch_order(0), (n - 1) * kBatch);
        // This share's mean, weighted by its size: their sum is the global batch's mean.
        auto g = pb.grad(w, idx) * (double(idx.numel()) / kBatch);
        set.comm()->all_reduce(g);
        if (dies(n, true)) return alive[size_t(r)].store(false);
        if (set.commit(n)) {
          w = w - kLr * g;
          break;
        }
      }
    }
    out[size_t(r)] = w;
    (*end_counts)[size_t(r)] = set.count();
  }, test::quick());
  fails.check();
  return out;
}

TEST_SUITE("replica_set") {
  TEST_CASE("replicas: survivors of deaths before and after the reduction end where one process does") {
    torch::manual_seed(5);
    const Problem pb;
    const auto expected = pb.reference();
    std::vector<int64_t> counts;
    // Four replicas share 14 as 4, 4, 3, 3; after replica 3 dies at step 3, three share it
    // as 5, 5, 4; after replica 0 dies at step 6 (its reduction done), two as 7, 7.
    const auto w = train(pb, 4, {{3, 3, false}, {0, 6, true}}, &counts);
    CHECK(!w[0].defined());
    CHECK(!w[3].defined());
    for (size_t r : {1, 2}) {
      CAPTURE(r);
      REQUIRE(w[r].defined());
      CHECK(counts[r] == 2);
      CHECK(torch::allclose(w[r], expected, /*rtol=*/1e-12, /*atol=*/1e-14));
    }
    CHECK(torch::equal(w[1], w[2]));  // the same reduced gradient, the same update
  }

  TEST_CASE("replicas: without a failure every step commits and the quorum stays") {
    torch::manual_seed(6);
    const Problem pb;
    std::vector<int64_t> counts;
    const auto w = train(pb, 3, {}, &counts);
    for (size_t r = 0; r < 3; ++r) {
      CHECK(counts[r] == 3);
      CHECK(torch::allclose(w[r], pb.reference(), 1e-12, 1e-14));
    }
  }

  // Replica 2 stops answering with its connections open (a stopped process before its
  // launcher kills it; or a survivor held in a collective of its own, as Gloo's groups
  // hold one another when several buckets are in flight): the others, told by the liveness
  // that it has gone, stop waiting at once rather than at the group's timeout, and train
  // the step again without it. Their collectives given up on still run in Gloo and
  // complete when replica 2 posts late: what they write must not reach the tensors the
  // step was given (which the step trained again reuses: a gradient's buckets).
  TEST_CASE("replicas: a member the liveness says has gone is not waited for, and late results stay out") {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::atomic<int> reformed{0};
    std::atomic<bool> late_done{false};
    test::RankFailures fails;
    auto until = [](const std::function<bool()>& done) {
      for (int i = 0; i < 4000 && !done(); ++i) std::this_thread::sleep_for(5ms);
      return done();
    };
    test::run_ranks_as_threads(3, [&](std::shared_ptr<Comm> world) {
      const int64_t r = world->rank();
      ReplicaSet set(*store, options_for(world, 3, [](int64_t m) { return m != 2; }), 1);
      auto a = torch::full({1000}, double(r + 1), torch::kFloat64);
      auto b = torch::full({300}, double(10 * (r + 1)), torch::kFloat64);
      if (r == 2) {
        if (!until([&] { return reformed == 2; })) return fails.add(r, "the others never went on");
        set.comm()->all_reduce(a);  // with the others' collectives that gave up
        set.comm()->all_reduce(b);
        if (set.comm()->failed()) return fails.add(r, set.comm()->error());
        if (!torch::equal(a, torch::full({1000}, 6.0, torch::kFloat64)))
          fails.add(r, "the late all-reduce is not the three's sum");
        late_done = true;
        return;
      }
      const auto a0 = a.clone(), b0 = b.clone();
      auto pa = set.comm()->all_reduce_async(a, ReduceOp::kSum);
      auto pb = set.comm()->all_reduce_async(b, ReduceOp::kSum);
      pa->wait();
      pb->wait();
      const std::string error = set.comm()->error();
      if (error.find("replica(s) 2 gone") == std::string::npos)
        fails.add(r, "the wait did not end on the liveness' word: " + error);
      if (set.commit(1)) fails.add(r, "a failed step committed");
      if (set.count() != 2) fails.add(r, "replica 2 is still a member");
      auto c = torch::full({4}, double(r + 1), torch::kFloat64);
      set.comm()->all_reduce(c);  // the step again, in the new group
      if (!torch::equal(c, torch::full({4}, 3.0, torch::kFloat64))) fails.add(r, "the new group's sum");
      if (!set.commit(1)) fails.add(r, "the step trained again did not commit");
      ++reformed;
      if (!until([&] { return late_done.load(); })) return fails.add(r, "replica 2 never finished");
      for (int i = 0; i < 200; ++i, std::this_thread::sleep_for(5ms))
        if (!torch::equal(a, a0) || !torch::equal(b, b0))
          return fails.add(r, "a collective given up on wrote into the step's tensors");
    }, test::quick());
    fails.check();
  }

  // Waits of many slices (1 ms here) on a peer that is late, not gone: an all-reduce is
  // waited out slice by slice, a transfer whole (a timed wait on Gloo's send or recv fails
  // it), and neither fails the step.
  TEST_CASE("replicas: collectives and transfers outlasting a wait's slice complete") {
    test::RankFailures fails;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> world) {
      const int64_t r = world->rank();
      ReplicaComm comm(world, [] { return std::string(); }, 1ms);
      auto sum = torch::full({500}, double(r + 1), torch::kFloat64);
      auto moved = torch::full({20000}, double(r == 1 ? 7 : 0), torch::kFloat64);
      if (r == 1) std::this_thread::sleep_for(150ms);
      comm.all_reduce(sum, ReduceOp::kAvg);
      if (r == 0) std::this_thread::sleep_for(150ms);
      if (r == 1) comm.send(moved, 0);
      else comm.recv(moved, 1);
      if (comm.failed()) return fails.add(r, comm.error());
      if (!torch::equal(sum, torch::full({500}, 1.5, torch::kFloat64))) fails.add(r, "the mean");
      if (!torch::equal(moved, torch::full({20000}, 7.0, torch::kFloat64))) fails.add(r, "the transfer");
    }, test::quick());
    fails.check();
  }

  TEST_CASE("replicas: a replica its peers voted dead is told so, not left training alone") {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::atomic<bool> one_alive{true};
    test::RankFailures fails;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> world) {
      const int64_t r = world->rank();
      const auto alive = [&](int64_t m) { return m == 0 || one_alive.load(); };
      ReplicaSet set(*store, options_for(world, 2, alive), 1);
      if (r == 1) {
        // Seen silent (a stopped process, say) while it still runs: replica 0 votes for it.
        one_alive = false;
        set.comm()->fail("a peer's connection closed");
        try {
          set.commit(1);
          fails.add(r, "no error for a replica voted out");
        } catch (const DistError& e) {
          if (std::string(e.what()).find("voted it dead") == std::string::npos)
            fails.add(r, e.what());
        }
        return;
      }
      set.comm()->fail("replica 1 gone");
      if (set.commit(1)) fails.add(r, "a failed step committed");
      if (set.count() != 1 || set.index() != 0) fails.add(r, "replica 0 is not alone");
    }, test::quick());
    fails.check();
  }
}

}  // namespace unit_comm_replica_set
