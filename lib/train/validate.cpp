#include "train/validate.hpp"

#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "config/schema.hpp"
#include "launch/device.hpp"
#include "models/model.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

// What this build of dtrain can run; a value outside it is refused up front rather than
// half-run. Each line names the key so the user knows what to change.
void check_supported(const JobConfig& c, const ParallelDims& layout) {
  auto refuse = [](bool bad, const std::string& key, const std::string& value) {
    if (bad)
      throw ConfigError(fmt::format("{}: {} is not supported by this version of dtrain", key,
                                    value));
  };
  refuse(c.parallel.zero != 0, "parallel.zero", "ZeRO sharding");
  refuse(c.parallel.compression != "none", "parallel.compression", "gradient compression");
  refuse(c.parallel.mode != "sync", "parallel.mode", "'" + c.parallel.mode + "'");
}

// The pipeline's stages against the model's parts and the micro-batches.
void check_pipeline(const JobConfig& cfg, const ParallelDims& layout) {
  const auto& p = cfg.parallel;
  const int64_t stages = layout.pipeline * p.virtual_stages;
  const int64_t parts = model_spec(cfg.model.arch).parts(cfg.model);
  const std::string what = p.virtual_stages > 1
                               ? fmt::format("{} stages (parallel.pipeline {} x "
                                             "parallel.virtual_stages {})", stages,
                                             layout.pipeline, p.virtual_stages)
                               : fmt::format("{} stage(s) (parallel.pipeline)", stages);
  fail_if<ConfigError>(stages > parts, "parallel.pipeline: {}, but the {} model has {} parts to "
                       "split (GPT: embeddings, each block, head; mlp/cnn: each layer)", what,
                       cfg.model.arch, parts);
  if (!p.stages.empty()) {
    int64_t sum = 0;
    for (auto n : p.stages) sum += n;
    fail_if<ConfigError>(int64_t(p.stages.size()) != stages || sum != parts,
                         "parallel.stages: {} gives {} stage(s) of {} part(s) in all; {} over "
                         "the model's {} parts need {} count(s) summing to {}",
                         fmt::format("{}", p.stages), p.stages.size(), sum, what, parts, stages,
                         parts);
  }
  fail_if<ConfigError>(p.virtual_stages > 1 && layout.pipeline == 1,
                       "parallel.virtual_stages: {} chunks per rank need a pipeline "
                       "(parallel.pipeline >= 2)", p.virtual_stages);
  if (p.schedule == "interleaved_1f1b" && layout.pipeline > 1)
    fail_if<ConfigError>(cfg.train.grad_accum % layout.pipeline != 0,
                         "train.grad_accum: {} micro-batches, but parallel.schedule "
                         "interleaved_1f1b runs them in groups of parallel.pipeline ({})",
                         cfg.train.grad_accum, layout.pipeline);
}

}  // namespace

ParallelDims validate(const JobConfig& cfg, int64_t world_size) {
  check_ranges(cfg);
  const auto layout = ParallelDims::resolve(cfg.parallel, world_size);
  check_supported(cfg, layout);
  plan_device(cfg, /*local_rank=*/0, /*local_world=*/1);  // train.device, fp16, nccl: here
  model_spec(cfg.model.arch).validate(cfg.model, layout);
  check_pipeline(cfg, layout);
  fail_if<ConfigError>(cfg.train.recompute == "blocks" && !model_spec(cfg.model.arch).blocks,
                       "train.recompute: blocks recomputes a GPT's transformer blocks; the {} "
                       "model has none (use none)", cfg.model.arch);
  const int64_t per_step = layout.data * cfg.train.grad_accum;
  fail_if<ConfigError>(cfg.data.batch_size % per_step != 0,
                       "data.batch_size: {} does not divide into {} data-parallel rank(s) x "
                       "train.grad_accum {}; use a multiple of {}",
                       cfg.data.batch_size, layout.data, cfg.train.grad_accum, per_step);
  const bool tokens = cfg.data.dataset == "text" || cfg.data.dataset == "synthetic_tokens";
  fail_if<ConfigError>(tokens != (model_spec(cfg.model.arch).task == &language_model_task()),
                       "model.arch: {} does not train on data.dataset {} ({})", cfg.model.arch,
                       cfg.data.dataset, tokens ? "token windows need a language model: gpt"
                                                : "a language model needs text or synthetic_tokens");
  return layout;
}


}  // namespace dtrain
