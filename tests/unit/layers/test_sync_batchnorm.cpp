// SyncBatchNorm under autocast.
#include <doctest/doctest.h>
#include <cmath>
#include <limits>
#include <string>
#include <torch/torch.h>
#include "comm/comm.hpp"
#include "launch/device.hpp"
#include "optim/clip.hpp"
#include "parallel/flat_params.hpp"
#include "layers/sync_batchnorm.hpp"
#include "precision/loss_scaler.hpp"
#include "util/error.hpp"

namespace unit_layers_sync_batchnorm {

using namespace dtrain;

TEST_CASE("sync batchnorm: a bf16 or fp16 input (autocast's) keeps fp32 statistics") {
  auto comm = make_local_comm();
  // 1 x 17 x 17 = 289 elements per channel (bf16 rounds it to 288); 128 x 28 x 28 = 100352
  // (more than fp16 holds).
  for (auto shape : {std::vector<int64_t>{1, 3, 17, 17}, std::vector<int64_t>{128, 2, 28, 28}}) {
    for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
      CAPTURE(shape[0]);
      const std::string type = c10::toString(dtype);
      CAPTURE(type);
      torch::manual_seed(1);
      SyncBatchNorm2d bn(shape[1], comm);
      auto x = (torch::randn(shape) * 20 + 3).to(dtype);  // squares past fp16's range
      auto y = bn->forward(x);
      auto xf = x.to(torch::kFloat);
      auto ref = torch::batch_norm(xf, torch::ones({shape[1]}), torch::zeros({shape[1]}), {}, {},
                                   /*training=*/true, 0.1, 1e-5, /*cudnn_enabled=*/false);
      CHECK((y.scalar_type() == torch::kFloat));
      CHECK(torch::allclose(y, ref, 1e-4, 1e-4));
      auto dims = std::vector<int64_t>{0, 2, 3};
      CHECK(torch::allclose(bn->running_mean, xf.mean(dims) * 0.1, 1e-4, 1e-4));
    }
  }
}

}  // namespace unit_layers_sync_batchnorm
