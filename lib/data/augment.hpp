// Image augmentation of training batches (data.augment), in the loader's threads. Every
// draw comes from (seed, epoch, the sample's index in the data set), not from the batch or
// the rank: a sample is augmented the same on every layout and after a resume, so a run
// stays exact and layout-independent. Evaluation never augments.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

namespace dtrain {

struct Augment {
  std::vector<std::string> ops;  // random_crop, hflip, erase: applied in that order
  int64_t padding = 2;           // random_crop's largest shift, pixels
  uint64_t seed = 0;

  bool empty() const { return ops.empty(); }
  // `x`: a batch [n, channels, height, width] of float images, sample i being data set
  // index indices[i]; returns it augmented (a new tensor).
  torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& indices, int64_t epoch) const;
};

}  // namespace dtrain
