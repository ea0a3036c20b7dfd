// data.augment: each augmented image is its original shifted by at most the padding
// (found here by trying every shift and mirror, not by asking the augmenter), drawn from
// (seed, epoch, index) only, so a sample comes out the same in any batch, on any rank.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "data/augment.hpp"

namespace unit_data_augment {

using namespace dtrain;

namespace {
// `img` [c, h, w] shifted by (dy, dx), the edge filled with `fill`, mirrored if `flip`.
torch::Tensor shifted(const torch::Tensor& img, int64_t dy, int64_t dx, bool flip, float fill) {
  const int64_t h = img.size(1), w = img.size(2);
  auto out = torch::full_like(img, fill);
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      const int64_t sy = y + dy, sx = x + dx;
      if (sy >= 0 && sy < h && sx >= 0 && sx < w) out.select(1, y).select(1, x).copy_(img.select(1, sy).select(1, sx));
    }
  return flip ? out.flip({2}) : out;
}
}  // namespace

TEST_CASE("augment: random_crop and hflip are shifts within the padding and mirrors") {
  const auto batch = torch::arange(6 * 2 * 9 * 9, torch::kFloat32).reshape({6, 2, 9, 9}) + 1;
  const auto indices = torch::tensor({10, 11, 12, 13, 14, 15}, torch::kInt64);
  Augment aug{{"random_crop", "hflip"}, 2, 77};
  const auto out = aug.apply(batch, indices, /*epoch=*/3);
  int moved = 0, mirrored = 0;
  for (int64_t i = 0; i < 6; ++i) {
    const auto img = batch[i];
    const float black = img.min().item<float>();
    bool found = false;
    for (int64_t dy = -2; dy <= 2 && !found; ++dy)
      for (int64_t dx = -2; dx <= 2 && !found; ++dx)
        for (bool flip : {false, true})
          if (torch::equal(out[i], shifted(img, dy, dx, flip, black))) {
            found = true;
            moved += (dy != 0 || dx != 0), mirrored += flip;
            break;
          }
    CHECK_MESSAGE(found, "sample " << i << " is no shift of at most 2 and mirror of its original");
  }
  CHECK(moved > 0);
  CHECK(mirrored > 0);
  CHECK(mirrored < 6);
}

TEST_CASE("augment: a sample's draws depend on seed, epoch and index, not on its batch") {
  const auto batch = torch::randn({4, 1, 8, 8});
  batch[3].copy_(batch[1]);  // index 1 twice: the same image
  const auto before = batch.clone();
  const auto indices = torch::tensor({3, 1, 4, 1}, torch::kInt64);
  Augment aug{{"random_crop", "hflip", "erase"}, 2, 5};
  const auto all = aug.apply(batch, indices, 2);
  const auto alone = aug.apply(batch.narrow(0, 2, 1), indices.narrow(0, 2, 1), 2);
  CHECK(torch::equal(all[2], alone[0]));
  CHECK(torch::equal(all[1], all[3]));  // the same index, the same image: the same draws
  CHECK(torch::equal(aug.apply(batch, indices, 2), all));
  CHECK(!torch::equal(aug.apply(batch, indices, 3), all));  // another epoch
  Augment other{{"random_crop", "hflip", "erase"}, 2, 6};
  CHECK(!torch::equal(other.apply(batch, indices, 2), all));  // another seed
  CHECK(torch::equal(batch, before));  // the input is left as it was
}

}  // namespace unit_data_augment
