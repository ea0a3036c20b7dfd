// What the gradient syncs declare they keep and send (grad/sync_cost.hpp), against the
// arithmetic worked by hand and against the buffers FlatParams allocates for the same
// layout: the planner's figures come from the code a run allocates by.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "grad/sync_cost.hpp"
#include "grad/zero.hpp"
#include "util/units.hpp"

namespace unit_grad_sync_cost {

using namespace dtrain;

namespace {

// Two Linear layers, 20 -> 30 -> 10, as FlatParams lays them out: 630 + 310 = 940 values,
// the largest parameter 600; one unit each, forward then backward once.
FlatShape two_layers() {
  FlatShape s;
  s.entries = {{"0.weight", {30, 20}, 600, 0}, {"0.bias", {30}, 30, 600},
               {"1.weight", {10, 30}, 300, 630}, {"1.bias", {10}, 10, 930}};
  s.units = {{0, 630, 0, {0, 1}, 4 * 630.0, {4}}, {630, 310, 0, {2, 3}, 4 * 310.0, {4}}};
  s.uses = {{{0}, {1}}};
  s.total = 940;
  return s;
}

DataGroup two_ranks(int64_t rank) {
  DataGroup g;
  g.ranks = 2;
  g.rank = rank;
  g.passes = {{0, true}, {0, false}};
  return g;
}

}  // namespace

TEST_CASE("one data rank keeps the whole buffers and sends nothing") {
  const SyncCost c = grad_sync_cost(ParallelConfig{}, two_layers(), DataGroup{});
  CHECK(c.numel == 940);
  CHECK(c.shard == 940);
  CHECK(c.params == 4 * 940.0);
  CHECK(c.grads == 4 * 940.0);
  CHECK(c.buffers == 4 * 600.0);  // autograd's gradient of the largest weight
  CHECK(*c.bytes == 0);
}

TEST_CASE("all-reduce and compression at two ranks: a ring's bytes, a residual where kept") {
  ParallelConfig p;
  const SyncCost plain = grad_sync_cost(p, two_layers(), two_ranks(0));
  CHECK(*plain.bytes == doctest::Approx(4 * 940.0));  // 2 (D-1)/D of the buffer
  CHECK(plain.ops == 1);                              // one bucket
  p.compression = "sign";
  const SyncCost sign = grad_sync_cost(p, two_layers(), two_ranks(0));
  CHECK(sign.buffers == plain.buffers + 4 * 940.0);  // error feedback's residual
  CHECK(*sign.bytes < *plain.bytes / 10);
}

TEST_CASE("ZeRO's shards, bytes and buffers by stage") {
  ParallelConfig p;
  p.bucket_mb = 1;
  // Padded to 2 x 16: 960 values, shards of 480.
  p.zero = 1;
  const SyncCost z1 = grad_sync_cost(p, two_layers(), two_ranks(1));
  CHECK(z1.numel == 960);
  CHECK(z1.shard == 480);
  CHECK(z1.params == 4 * 960.0);
  CHECK(z1.grads == 4 * 960.0);
  // The reduction to the owners, half of the rest and half off the owner, then the shard
  // broadcast back: 1.25x an all-reduce's 3840 bytes.
  CHECK(*z1.bytes == doctest::Approx(4 * 960.0 * 1.25));
  p.zero = 2;
  const SyncCost z2 = grad_sync_cost(p, two_layers(), two_ranks(1));
  CHECK(z2.grads == 4 * 480.0);
  CHECK(z2.buffers == doctest::Approx(z1.buffers + double(kZeroInFlight) * kMiB));
  CHECK(*z2.bytes == *z1.bytes);
  p.zero = 3;
  const SyncCost z3 = grad_sync_cost(p, two_layers(), two_ranks(1));
  CHECK(z3.params == 4 * 480.0);
  // No shard broadcast back; instead rank 1 sends its part of each unit it gathers: of
  // the first (values 480-630 of [0, 630)) in forward and again in backward, of the
  // second (all 310 of [630, 940)) once: it stays gathered from its forward to its
  // backward.
  CHECK(*z3.bytes == doctest::Approx(*z2.bytes - 4 * 480.0 + 4 * (2 * 150.0 + 310.0)));
  // At most both units at once.
  CHECK(z3.buffers == doctest::Approx(z2.buffers + 4 * 940.0));
}

TEST_CASE("the declared buffers are the ones FlatParams allocates") {
  auto net = std::make_shared<torch::nn::Module>();
  auto l1 = net->register_module("0", torch::nn::Linear(20, 30));
  auto l2 = net->register_module("1", torch::nn::Linear(30, 10));
  for (int64_t zero = 0; zero <= 3; ++zero) {
    CAPTURE(zero);
    ParallelConfig p;
    p.zero = zero;
    ParallelDims dims;
    dims.data = 2;
    Coord at;
    at.data = 1;
    FlatOptions opts;
    shard_flat(p, dims, at, opts);
    opts.units = {{l1.get(), l2.get()}};  // the one model's units
    FlatParams flat(*net, opts);
    const SyncCost c = grad_sync_cost(p, two_layers(), two_ranks(1));
    CHECK(c.numel == flat.numel());
    CHECK(c.params == 4 * double(flat.data().numel()));
    CHECK(c.grads == 4 * double(flat.grad().numel()));
    if (zero > 0) CHECK(c.shard == flat.shard(2, 1).numel);
  }
}

}  // namespace unit_grad_sync_cost
