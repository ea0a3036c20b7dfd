// Models by name: a registry of factories from the job's model section and the data's shape.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <torch/nn/modules/container/sequential.h>

#include "config/config.hpp"
#include "dist/comm.hpp"

namespace dtrain {

// Every model is a Sequential mapping a batch of samples to class logits.
using Model = torch::nn::Sequential;

struct ModelInput {
  Ints sample_shape;  // one sample, e.g. {1, 28, 28}
  int64_t classes = 0;
  // Set when BatchNorm must see the whole global batch (parallel.sync_batchnorm across
  // more than one data-parallel rank): the group its statistics are reduced over.
  std::shared_ptr<Comm> sync_batchnorm;
};

using ModelFactory = std::function<Model(const ModelConfig&, const ModelInput&)>;

// Builds model.arch; throws ConfigError when the arch does not fit the data.
Model build_model(const ModelConfig& cfg, const ModelInput& input);
std::vector<std::string> model_names();

// The memory format the model's kernels run fastest on: ChannelsLast for convolutional
// models (oneDNN on CPU: the CNN's step 1.4x faster), Contiguous otherwise.
torch::MemoryFormat preferred_format(const ModelConfig& cfg);

}  // namespace dtrain
