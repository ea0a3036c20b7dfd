// The collectives: the one-process Comm, and ranks as threads over real Gloo.
#include <doctest/doctest.h>

#include <mutex>
#include <set>

#include <atomic>
#include <mutex>
#include <set>
#include <torch/torch.h>
#include "comm/comm.hpp"
#include "ranks.hpp"
#include "config/config.hpp"
#include "models/model.hpp"
#include "optim/clip.hpp"
#include "optim/optimizer.hpp"
#include "grad/compression.hpp"
#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/mesh.hpp"
#include "layers/tensor_parallel.hpp"
#include "layers/vocab_parallel.hpp"
#include "util/error.hpp"

namespace unit_comm_comm {

using namespace dtrain;
using test::quick;
using test::RankFailures;

TEST_CASE("comm: the one-process collectives are identities") {
  auto c = make_local_comm();
  auto t = torch::tensor({1.0f, 2.0f});
  c->all_reduce(t, ReduceOp::kAvg);
  CHECK(torch::equal(t, torch::tensor({1.0f, 2.0f})));
  auto out = torch::zeros({2});
  c->all_gather_into(out, t);
  CHECK(torch::equal(out, t));
  auto rs = torch::zeros({2});
  c->reduce_scatter(rs, t);
  CHECK(torch::equal(rs, t));
  CHECK(c->all_gather(t).size() == 1);
  CHECK(c->new_group("g", {0}).get() == c.get());
  CHECK_THROWS(c->send(t, 0));
}

TEST_CASE("comm: collectives over ranks as threads") {
  const int64_t n = 3;
  RankFailures failures;
  test::run_ranks_as_threads(n, [&](std::shared_ptr<Comm> c) {
    const int64_t r = c->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    // sum, avg, max
    auto s = torch::full({4}, double(r + 1), torch::kFloat64);
    c->all_reduce(s);
    if (!torch::equal(s, torch::full({4}, 6.0, torch::kFloat64))) fail("sum");
    auto a = torch::full({2}, double(r), torch::kFloat64);
    c->all_reduce(a, ReduceOp::kAvg);
    if (!torch::equal(a, torch::full({2}, 1.0, torch::kFloat64))) fail("avg");
    auto m = torch::tensor({double(r), double(-r)}, torch::kFloat64);
    c->all_reduce(m, ReduceOp::kMax);
    if (!torch::equal(m, torch::tensor({2.0, 0.0}, torch::kFloat64))) fail("max");
    // all-gather into one flat tensor: rank r's [r, r+10] at [2r, 2r+2)
    auto flat = torch::zeros({2 * n});
    c->all_gather_into(flat, torch::tensor({float(r), float(r + 10)}));
    if (!torch::equal(flat, torch::tensor({0.f, 10.f, 1.f, 11.f, 2.f, 12.f}))) fail("all_gather_into");
    // reduce-scatter: chunk r of the sum
    auto in = torch::arange(2 * n, torch::kFloat32) * float(r + 1);  // sum over ranks: 6 * arange
    auto out = torch::zeros({2});
    c->reduce_scatter(out, in);
    if (!torch::equal(out, torch::tensor({6.f * 2 * r, 6.f * (2 * r + 1)}))) fail("reduce_scatter");
    // a ring of sends and receives posted together: no deadlock, every value arrives
    auto got = torch::zeros({3});
    c->exchange_async({{P2POp::kSend, torch::full({3}, float(r)), (r + 1) % n},
                       {P2POp::kRecv, got, (r + n - 1) % n}})
        ->wait();
    if (!torch::equal(got, torch::full({3}, float((r + n - 1) % n)))) fail("exchange");
    // a sub-group of ranks {0, 2}; rank 1 alone gets a local group
    auto g = r == 1 ? c->new_group("solo-1", {1}) : c->new_group("pair", {0, 2});
    auto x = torch::full({1}, double(r), torch::kFloat64);
    g->all_reduce(x);
    if (x.item<double>() != (r == 1 ? 1.0 : 2.0)) fail("sub-group");
    if (g->size() != (r == 1 ? 1 : 2)) fail("sub-group size");
    c->barrier();
  }, quick());
  failures.check();
}

}  // namespace unit_comm_comm
