// In-memory labelled data sets and the loaders that build them from a DataConfig.
#pragma once
#include <string>

#include <torch/types.h>

#include "config/config.hpp"

namespace dtrain {

struct Batch {
  torch::Tensor x;  // [n, ...] float32
  torch::Tensor y;  // [n] int64 class labels
};

// A whole split held in memory, decoded and normalised once; a batch is a gather.
struct TensorDataset {
  torch::Tensor x, y;
  int64_t size() const { return y.defined() ? y.size(0) : 0; }
  Batch gather(const torch::Tensor& indices) const {
    return {x.index_select(0, indices), y.index_select(0, indices)};
  }
};

struct DataSplits {
  TensorDataset train, test;
  Ints sample_shape;    // one sample's shape, e.g. {1, 28, 28}
  int64_t classes = 0;
};

// Reads an IDX file (.gz or plain) into a uint8 tensor of its dimensions; checks the magic
// number, the element type, `expected_dims` and the data size. Throws DataError naming the file.
torch::Tensor read_idx(const std::string& path, int64_t expected_dims);

// The data set the job names, train and test splits. Throws DataError (exit 3).
DataSplits load_data(const DataConfig& cfg, uint64_t seed);

}  // namespace dtrain
