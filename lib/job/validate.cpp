#include "job/validate.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "config/schema.hpp"
#include "grad/compression.hpp"
#include "launch/device.hpp"
#include "models/model.hpp"
#include "plan/plan.hpp"
#include "run/mode.hpp"
#include "util/affinity.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/units.hpp"

namespace dtrain {
namespace {

// Gradient compression against what it combines with.
void check_compression(const JobConfig& c) {
  const auto& how = c.parallel.compression;
  if (how == "none") return;
  fail_if<ConfigError>(c.parallel.zero > 0, "parallel.compression: {} with parallel.zero {} is "
                       "not supported (ZeRO reduces each shard to its owner uncompressed); "
                       "choose one", how, c.parallel.zero);
  // The residual would mix gradients scaled by different loss scales.
  fail_if<ConfigError>(compression_spec(how).residual && c.precision.dtype == "fp16",
                       "parallel.compression: {} keeps error-feedback residuals from step to "
                       "step, which fp16's changing loss scale would corrupt; use "
                       "precision.dtype bf16 or fp32", how);
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

double available_memory() { return proc_field_bytes("/proc/meminfo", "MemAvailable:"); }

void check_machine(const JobConfig& cfg, int64_t world, int64_t local_processes) {
  const int64_t cores = usable_cpus();
  const int64_t threads = intra_op_threads(cfg.train.threads, cores, local_processes);
  const bool from_key = cfg.train.threads > 0;  // else from OMP_NUM_THREADS: the share is at most the cores
  fail_if<ConfigError>(threads > 4 * cores,
                       "{}: {} threads per process is more than 4 per core this process may use "
                       "({} cores); {} the cores among the processes",
                       from_key ? "train.threads" : "OMP_NUM_THREADS", threads, cores,
                       from_key ? "train.threads: 0 shares" : "unset, dtrain shares");
  if (!cfg.train.memory_check) return;
  const DevicePlan plan = plan_device(cfg, 0, local_processes, mode_spec(cfg.parallel.mode).any_source);
  if (plan.device.is_cuda()) return;  // the GPU's memory is LibTorch's to report, at run
  const double available = available_memory();
  if (available <= 0) return;
  // The ranks on this machine: the first ones (a launcher numbers a node's ranks together).
  MemoryPlan sum;
  for (int64_t r = 0; r < std::min(world, local_processes); ++r) {
    const MemoryPlan m = plan_rank(cfg, world, r).memory;
    sum.params += m.params, sum.grads += m.grads, sum.optimizer += m.optimizer;
    sum.activations += m.activations, sum.buffers += m.buffers;
    sum.data = sum.data.value_or(0) + m.data.value_or(0);
    sum.runtime = sum.runtime.value_or(0) + m.runtime.value_or(0);
  }
  fail_if<ConfigError>(sum.total() > available,
                       "model: this job needs about {:.3g} GiB on this machine ({} process(es): "
                       "parameters {:.3g}, gradients and optimizer state {:.3g}, activations "
                       "{:.3g}, buffers {:.3g}, data and runtime {:.3g}; `dtrain plan` shows it by "
                       "rank) and {:.3g} GiB is available; make the model or the micro-batch "
                       "smaller, or set train.memory_check: false",
                       sum.total() / kGiB, local_processes, sum.params / kGiB,
                       (sum.grads + sum.optimizer) / kGiB, sum.activations / kGiB,
                       sum.buffers / kGiB, (sum.data.value_or(0) + sum.runtime.value_or(0)) / kGiB,
                       available / kGiB);
}

void validate_elastic(const JobConfig& cfg, int64_t min_nodes, int64_t max_nodes,
                      int64_t per_node, const WorldCheck& check) {
  for (int64_t nodes = min_nodes; nodes <= max_nodes; ++nodes) {
    try {
      if (check) check(cfg, nodes * per_node);
      else validate(cfg, nodes * per_node);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("at {} node(s) x {} process(es) (the elastic range {}:{}): {}",
                                    nodes, per_node, min_nodes, max_nodes, e.what()));
    }
  }
}

void check_model_fits_data(const JobConfig& cfg, const DataSplits& data) {
  ModelContext shape;  // the data's shape alone: no groups
  shape.sample_shape = data.sample_shape, shape.classes = data.classes, shape.vocab = data.vocab;
  model_spec(cfg.model.arch).fits(cfg.model, shape);
}

namespace {

// fault_tolerance: replicas, as far as it is built (docs/fault-tolerance.md says what is
// left): replicas of one process, of tensor and pipeline ranks, and of data ranks that
// shard ZeRO's state among themselves; the sync mode's step, or local SGD's.
void check_fault_tolerance(const JobConfig& cfg, const ParallelDims& layout) {
  fail_if<ConfigError>(cfg.fault_tolerance.mode == "off" && cfg.fault_tolerance.batch != "keep",
                       "fault_tolerance.batch: {} says what a replica's failure does to the "
                       "batch: it needs fault_tolerance.mode: replicas", cfg.fault_tolerance.batch);
  if (cfg.fault_tolerance.mode == "off") return;
  auto refuse = [](bool bad, const std::string& what) {
    fail_if<ConfigError>(bad, "fault_tolerance.mode: replicas with {} is not supported{}", what,
                         what.rfind("parallel.mode async_ps", 0) == 0 ? "" : " yet");
  };
  refuse(cfg.parallel.mode == "async_ps",
         "parallel.mode async_ps: its workers never wait for one another, and a failed one "
         "stops the job and restarts it from the latest checkpoint (--max-restarts) like any rank");
  const int64_t inside = cfg.fault_tolerance.replica_data;
  fail_if<ConfigError>(layout.data % inside != 0, "fault_tolerance.replica_data: {} does not "
                       "divide the {} data-parallel ranks into replicas", inside, layout.data);
  fail_if<ConfigError>(cfg.parallel.zero > 0 && inside == 1,
                       "parallel.zero {} with fault_tolerance.mode: replicas shards ZeRO's state "
                       "over the data ranks inside a replica: set fault_tolerance.replica_data "
                       "above 1 (each replica's data ranks)", cfg.parallel.zero);
  fail_if<ConfigError>(cfg.parallel.zero == 0 && inside > 1,
                       "fault_tolerance.replica_data: {} data ranks inside a replica shard ZeRO's "
                       "state; without parallel.zero each data rank is a replica of its own "
                       "(leave replica_data at 1)", inside);
}

}  // namespace

ParallelDims validate(const JobConfig& cfg, int64_t world_size, const Devices& devices) {
  check_ranges(cfg);
  const ModeSpec& mode = mode_spec(cfg.parallel.mode);
  mode.validate(cfg, world_size);
  // The layout of the ranks that train together (a mode may set some ranks apart).
  const int64_t trainers = mode.trainers(cfg, world_size);
  const auto layout = ParallelDims::resolve(cfg.parallel, trainers);
  check_compression(cfg);
  check_fault_tolerance(cfg, layout);
  plan_device(cfg, /*local_rank=*/0, /*local_world=*/1, mode.any_source, devices);  // train.device, fp16, nccl
  model_spec(cfg.model.arch).validate(cfg.model, layout);
  check_pipeline(cfg, layout);
  fail_if<ConfigError>(cfg.train.recompute == "blocks" && !model_spec(cfg.model.arch).blocks,
                       "train.recompute: blocks recomputes a GPT's transformer blocks; the {} "
                       "model has none (use none)", cfg.model.arch);
  const int64_t per_step = layout.data * cfg.train.grad_accum;
  fail_if<ConfigError>(cfg.data.batch_size % per_step != 0,
                       "data.batch_size: {} does not divide into {} data-parallel rank(s) x "
                       "train.grad_accum {} (world size {}{}); use a multiple of {}",
                       cfg.data.batch_size, layout.data, cfg.train.grad_accum, world_size,
                       trainers != world_size
                           ? fmt::format(", {} of them training (parallel.mode {})", trainers,
                                         cfg.parallel.mode)
                           : "",
                       per_step);
  const auto kind = data_kind(cfg.data);
  const bool tokens = kind.tokens;
  fail_if<ConfigError>(tokens && !cfg.data.augment.empty(),
                       "data.augment: augmentation is for images; data.dataset {} holds tokens",
                       cfg.data.dataset);
  fail_if<ConfigError>(!cfg.data.augment.empty() && kind.sample_shape.size() != 3,
                       "data.augment: augmentation is for images shaped [channels, height, "
                       "width]; data.input_shape {} is not", fmt::format("{}", kind.sample_shape));
  fail_if<ConfigError>(tokens && cfg.optimizer.label_smoothing > 0,
                       "optimizer.label_smoothing: for classification only; data.dataset {} "
                       "trains a language model", cfg.data.dataset);
  fail_if<ConfigError>(!cfg.data.eval_path.empty() && cfg.data.dataset != "tokens",
                       "data.eval_path: held-out shards are read for data.dataset tokens only, "
                       "not {} (text holds out every n-th window: data.eval_fraction)",
                       cfg.data.dataset);
  if (tokens != model_spec(cfg.model.arch).task->on_tokens()) {
    std::vector<std::string> fitting;
    for (const auto& name : model_names())
      if (model_spec(name).task->on_tokens() == tokens) fitting.push_back(name);
    throw ConfigError(fmt::format("model.arch: {} does not train on data.dataset {} ({}; model.arch "
                                  "{} does)", cfg.model.arch, cfg.data.dataset,
                                  tokens ? "it holds token windows" : "it holds labelled samples",
                                  fmt::join(fitting, " | ")));
  }
  return layout;
}

}  // namespace dtrain
