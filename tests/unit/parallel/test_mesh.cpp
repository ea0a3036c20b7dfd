// ParallelDims arithmetic, the Mesh's groups over ranks as threads, and Placement.
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

namespace unit_parallel_mesh {

using namespace dtrain;
using test::quick;
using test::RankFailures;

TEST_CASE("dims: coordinates and groups for several layouts") {
  ParallelConfig p;
  p.tensor = 2;
  p.pipeline = 2;
  auto d = ParallelDims::resolve(p, 8);
  CHECK(d.data == 2);
  CHECK(d.str() == "data 2 x tensor 2 x pipeline 2");
  // Tensor fastest, then data, then pipeline.
  for (int64_t r = 0; r < 8; ++r) {
    auto c = d.coord_of(r);
    CHECK(c.tensor == r % 2);
    CHECK(c.data == (r / 2) % 2);
    CHECK(c.pipeline == r / 4);
    CHECK(d.rank_of(c) == r);
  }
  CHECK(d.group_of(5, Axis::kTensor) == std::vector<int64_t>{4, 5});
  CHECK(d.group_of(5, Axis::kData) == std::vector<int64_t>{5, 7});
  CHECK(d.group_of(5, Axis::kPipeline) == std::vector<int64_t>{1, 5});
  // Every axis's groups partition the world.
  for (Axis a : {Axis::kData, Axis::kTensor, Axis::kPipeline}) {
    std::set<std::vector<int64_t>> groups;
    for (int64_t r = 0; r < 8; ++r) groups.insert(d.group_of(r, a));
    CHECK(int64_t(groups.size()) == 8 / d.size(a));
  }
  // data 0 takes the rest; explicit sizes must multiply to the world.
  ParallelConfig only_tensor;
  only_tensor.tensor = 4;
  auto t = ParallelDims::resolve(only_tensor, 4);
  CHECK(t.data == 1);
  CHECK(t.group_of(2, Axis::kTensor) == std::vector<int64_t>{0, 1, 2, 3});
  CHECK(t.group_of(2, Axis::kData) == std::vector<int64_t>{2});
  only_tensor.data = 2;
  CHECK_THROWS_AS(ParallelDims::resolve(only_tensor, 4), ConfigError);
  CHECK_THROWS_AS(ParallelDims::resolve(only_tensor, 6), ConfigError);
}

TEST_CASE("mesh: each rank gets the groups its coordinates name") {
  RankFailures failures;
  // world 4 = data 2 x tensor 2: rank r has tensor peers {r^1}, data peers {r^2}.
  test::run_ranks_as_threads(4, [&](std::shared_ptr<Comm> world) {
    ParallelConfig p;
    p.tensor = 2;
    Mesh mesh(ParallelDims::resolve(p, 4), world);
    const int64_t r = world->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    if (mesh.coord().tensor != r % 2 || mesh.coord().data != r / 2) fail("coordinates");
    if (mesh.tensor()->size() != 2 || mesh.tensor()->rank() != r % 2) fail("tensor group");
    if (mesh.data()->size() != 2 || mesh.data()->rank() != r / 2) fail("data group");
    if (mesh.pipeline()->size() != 1) fail("pipeline group");
    // Sum of world ranks over each group identifies its members.
    auto t = torch::full({1}, double(r), torch::kFloat64);
    mesh.tensor()->all_reduce(t);
    if (t.item<double>() != double((r / 2) * 4 + 1)) fail("tensor members");
    auto d = torch::full({1}, double(r), torch::kFloat64);
    mesh.data()->all_reduce(d);
    if (d.item<double>() != double(2 * (r % 2) + 2)) fail("data members");
  }, quick());
  failures.check();
}

TEST_CASE("placement: shard and assemble are inverse, blocks split separately") {
  auto full = torch::arange(24, torch::kFloat32).view({6, 4});
  auto rows = Placement::split(0, 2);
  CHECK(torch::equal(rows.shard(full, 1), full.narrow(0, 3, 3)));
  CHECK(torch::equal(rows.assemble({rows.shard(full, 0), rows.shard(full, 1)}), full));
  // Three blocks of two rows (Q, K, V): rank 0 holds row 0 of each block.
  auto qkv = Placement::split(0, 2, 3);
  auto r0 = qkv.shard(full, 0);
  CHECK(torch::equal(r0, torch::stack({full[0], full[2], full[4]})));
  CHECK(torch::equal(qkv.assemble({r0, qkv.shard(full, 1)}), full));
  auto cols = Placement::split(1, 4);
  CHECK(cols.full_shape({6, 1}) == std::vector<int64_t>{6, 4});
  CHECK(!Placement::replicated().is_split());
}

namespace {
// The unsplit two-layer block: column then row, as in a transformer MLP.
struct Reference {
  torch::nn::Linear a{nullptr}, b{nullptr};
};
}  // namespace

}  // namespace unit_parallel_mesh
