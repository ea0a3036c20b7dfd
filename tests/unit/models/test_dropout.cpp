// Seeded dropout: the masks one process draws are the masks any split of the rows (data
// ranks) or of a layer's units (tensor ranks) draws, and they depend on the step and site.
#include <doctest/doctest.h>

#include <stdexcept>

#include <torch/torch.h>

#include "models/dropout.hpp"

namespace unit_models_dropout {

using namespace dtrain;

namespace {
DropoutDraw draw(torch::Tensor positions, int64_t step = 7) {
  return DropoutDraw{1234, step, std::move(positions)};
}
torch::Tensor rows(std::vector<int64_t> r) { return torch::tensor(r, torch::kInt64); }
}  // namespace

TEST_CASE("dropout: outside a training step's scope is a logic error") {
  auto x = torch::ones({2, 4});
  CHECK_THROWS_AS(seeded_dropout(x, 0.5, 1), std::logic_error);
  DropoutScope scope(draw(rows({0, 1, 2})));  // three positions for two rows
  CHECK_THROWS_AS(seeded_dropout(x, 0.5, 1), std::logic_error);
  CHECK(torch::equal(seeded_dropout(x, 0.0, 1), x));  // p = 0 needs no draw
}

TEST_CASE("dropout: keeps about 1 - p of the units, scaled by 1 / (1 - p)") {
  auto x = torch::ones({64, 4096});
  DropoutScope scope(draw(torch::arange(64, torch::kInt64)));
  for (double p : {0.1, 0.5}) {
    auto y = seeded_dropout(x, p, 3);
    auto kept = (y != 0);
    const double fraction = kept.to(torch::kFloat64).mean().item<double>();
    CHECK(fraction == doctest::Approx(1 - p).epsilon(0.01));
    CHECK(torch::allclose(y.masked_select(kept), torch::full({}, 1.0 / (1 - p))));
    // Neither the rows nor the units share a mask: each row and each column keeps about
    // 1 - p too.
    auto per_row = kept.to(torch::kFloat64).mean(1);
    auto per_col = kept.to(torch::kFloat64).mean(0);
    CHECK((per_row - (1 - p)).abs().max().item<double>() < 0.05);
    CHECK(per_col.std().item<double>() < 0.1);
  }
}

TEST_CASE("dropout: the same masks on any split of the rows or of the layer") {
  auto x = torch::randn({4, 6, 5});
  torch::Tensor whole;
  {
    DropoutScope scope(draw(rows({0, 1, 2, 3})));
    whole = seeded_dropout(x, 0.3, 11);
  }
  // Two data ranks: rank r holds the global batch's samples r, r + 2.
  for (int64_t r = 0; r < 2; ++r) {
    auto mine = x.index({torch::tensor({r, r + 2})});
    DropoutScope scope(draw(rows({r, r + 2})));
    CHECK(torch::equal(seeded_dropout(mine, 0.3, 11), whole.index({torch::tensor({r, r + 2})})));
  }
  // Three tensor ranks, each holding two of dimension 1's six; and dimension 2 in five parts.
  DropoutScope scope(draw(rows({0, 1, 2, 3})));
  for (int64_t t = 0; t < 3; ++t)
    CHECK(torch::equal(seeded_dropout(x.narrow(1, 2 * t, 2), 0.3, 11, LayerSlice{1, t, 3}),
                       whole.narrow(1, 2 * t, 2)));
  for (int64_t t = 0; t < 5; ++t)
    CHECK(torch::equal(seeded_dropout(x.narrow(2, t, 1), 0.3, 11, LayerSlice{2, t, 5}),
                       whole.narrow(2, t, 1)));
  // Another step, another site, another seed: other masks; the same inputs: the same.
  CHECK(torch::equal(seeded_dropout(x, 0.3, 11), whole));
  CHECK(!torch::equal(seeded_dropout(x, 0.3, 12), whole));
  {
    DropoutScope later(draw(rows({0, 1, 2, 3}), 8));
    CHECK(!torch::equal(seeded_dropout(x, 0.3, 11), whole));
  }
  DropoutScope other(DropoutDraw{99, 7, rows({0, 1, 2, 3})});
  CHECK(!torch::equal(seeded_dropout(x, 0.3, 11), whole));
}

TEST_CASE("dropout: the gradient is the mask, and a scope restores the one it replaced") {
  auto x = torch::randn({3, 10}, torch::requires_grad());
  DropoutScope outer(draw(rows({0, 1, 2})));
  auto y = seeded_dropout(x, 0.5, 5);
  y.sum().backward();
  CHECK(torch::equal(x.grad(), (y != 0).to(torch::kFloat32) * 2.0));
  {
    DropoutScope inner(draw(rows({5, 6, 7}), 100));
    CHECK(current_dropout_draw()->step == 100);
  }
  CHECK(current_dropout_draw()->step == 7);
  CHECK(dropout_site("h.0.attn.out") != dropout_site("h.1.attn.out"));
}

TEST_CASE("dropout: the masks are the documented hash's, in the input's dtype") {
  // Worked out apart (Python, from the hash as models/dropout.hpp describes it): seed 1234,
  // step 7, site 5, p 0.5, rows at positions 0, 3 and 10 of a layer of 8 units.
  const std::vector<std::vector<float>> kept{{1, 1, 1, 1, 1, 0, 0, 1},
                                             {0, 1, 1, 0, 0, 0, 0, 0},
                                             {0, 1, 0, 1, 0, 0, 1, 1}};
  auto expected = torch::empty({3, 8});
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t j = 0; j < 8; ++j) expected[r][j] = 2 * kept[size_t(r)][size_t(j)];
  DropoutScope scope(draw(rows({0, 3, 10})));
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    CAPTURE(dtype);
    const auto y = seeded_dropout(torch::ones({3, 8}, dtype), 0.5, 5);
    CHECK((y.scalar_type() == dtype));
    CHECK(torch::equal(y.to(torch::kFloat32), expected));
    // A kept unit's scale as that dtype rounds 1 / (1 - p).
    const auto tenth = seeded_dropout(torch::ones({3, 8}, dtype), 0.1, 5);
    CHECK(tenth.max().item<float>() == torch::tensor(1 / 0.9f).to(dtype).item<float>());
  }
}

}  // namespace unit_models_dropout
