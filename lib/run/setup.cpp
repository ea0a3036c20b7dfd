// Builds a run: the order matters. Threads and the seed first (the model's initialisation
// draws from the generator), then data, model, flat buffers, optimizer, the gradient sync
// (its hooks), sampler; then the resume decision (collective), the restored
// state, and the broadcast that makes every data-parallel rank start from the same weights.
#include <filesystem>
#include <iostream>
#include <thread>

#include <fmt/format.h>
#include <torch/torch.h>

#include "config/schema.hpp"
#include "launch/device.hpp"
#include "parallel/schedule.hpp"
#include "train/context.hpp"
#include "train/state.hpp"
#include "util/affinity.hpp"
#include "util/blas.hpp"
#include "util/files.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

// Every rank must train on the same data: each one's fingerprint of both splits, gathered
// over the world, must be rank 0's (a file that grows while the ranks read it, a folder
// that differs between nodes). A collective.
void agree_on_data(Context& c) {
  auto mine = c.data.train->fingerprint();
  for (double v : c.data.test->fingerprint()) mine.push_back(v);
  auto world = c.mesh.job();
  if (world->size() == 1) return;
  const auto all = world->all_gather(torch::tensor(mine, torch::kFloat64));
  std::vector<int64_t> differ;
  // Sums of floats may differ in their last bits between machines with other core counts
  // (reduction order); a changed sample moves them far more.
  for (size_t r = 1; r < all.size(); ++r)
    if (!torch::allclose(all[r], all[0], /*rtol=*/1e-9, /*atol=*/0)) differ.push_back(int64_t(r));
  if (differ.empty()) return;
  auto sizes = [&](size_t r) {
    return fmt::format("{} train / {} test samples", int64_t(all[r][0].item<double>()),
                       int64_t(all[r][4].item<double>()));
  };
  throw DataError(fmt::format("data.path: the ranks read different data from '{}': rank 0 has {}, "
                              "rank {} has {}{}; every rank must see the same files",
                              c.cfg.data.path, sizes(0), differ[0], sizes(size_t(differ[0])),
                              differ.size() > 1 ? fmt::format(" (and {} more ranks differ)",
                                                              differ.size() - 1)
                                                : ""));
}

// This rank's chunks of the model: only the parts its stages hold, their parameters
// created uninitialised on the device (the flat buffers take them, then init_parameters
// fills them by name: setup()). The whole model's outline, on the meta device, says how
// big each part is (the stages' split) and every name. LibTorch's own layers draw their
// initial weights from the default generator as they are built (values init_parameters
// replaces): the generator is put back, so it is the seed's whatever a rank builds.
void build_chunks(Context& c, const ModelContext& mc) {
  const auto& cfg = c.cfg;
  const int64_t ranks = c.mesh.dims().pipeline, chunks = cfg.parallel.virtual_stages;
  c.stages = ranks * chunks;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  const auto seeded = gen.get_state();
  ModelContext outline_ctx = mc;
  outline_ctx.options = torch::TensorOptions().device(torch::kMeta);
  const auto outline = c.spec->build(cfg.model, outline_ctx);
  for (const auto& p : outline->named_parameters()) c.model_names.push_back(p.key());
  for (const auto& b : outline->named_buffers()) c.model_names.push_back(b.key());
  const auto split = split_stages(outline->part_params(), c.stages, cfg.parallel.stages);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t stage = chunk * ranks + c.mesh.coord().pipeline;
    ModelContext held = mc;
    held.options = torch::TensorOptions().device(c.device());
    held.first_part = split[size_t(stage)].first, held.last_part = split[size_t(stage)].last;
    auto net = c.spec->build(cfg.model, held);
    net->recompute_blocks(cfg.train.recompute == "blocks");
    net->to(c.device());  // LibTorch's own layers, and the buffers
    c.chunks.push_back(net);
    c.chunk_stage.push_back(stage);
  }
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(seeded);
}

// The tied parameters' entries, where the two parts that use them sit on different ranks.
void find_tied(Context& c) {
  if (!c.mesh.embedding() || c.holds_first() == c.holds_last()) return;
  const auto names = c.chunks.front()->tied_parameters();
  const auto& entries = c.params->entries();
  for (size_t i = 0; i < entries.size(); ++i)
    if (std::find(names.begin(), names.end(), entries[i].name) != names.end()) c.tied.push_back(i);
  c.tied_copy = c.holds_last();
}

}  // namespace

NamedTensors Context::named_buffers() const {
  NamedTensors out;
  for (const auto& chunk : chunks)
    for (const auto& b : chunk->named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

void Context::set_training(bool on) const {
  for (const auto& chunk : chunks) chunk->train(on);
}

void setup(Context& c) {
  const auto& cfg = c.cfg;
  const auto& dims = c.mesh.dims();
  tune_allocator();
  // Local processes share the machine's cores.
  const int64_t threads =
      cfg.train.threads > 0
          ? cfg.train.threads
          : std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency()) / c.world.local_world);
  torch::set_num_threads(static_cast<int>(threads));
  const std::string pinning = cfg.train.pin_threads
                                  ? pin_compute_threads(threads, c.world.local_rank, c.world.local_world)
                                  : "not pinned";
  torch::manual_seed(static_cast<uint64_t>(cfg.seed));  // the CPU's and every GPU's generator
  use_device(c.device(), cfg);

  auto blas = loaded_blas();
  if (c.root() && is_reference_blas(blas))
    std::cerr << "dtrain: warning: LibTorch is using the reference BLAS (" << blas
              << "), which is ~19x slower on Linear layers; install libopenblas0-openmp\n";

  c.data = load_data(cfg.data, static_cast<uint64_t>(cfg.seed));
  agree_on_data(c);
  c.spec = &model_spec(cfg.model.arch);
  c.task = c.spec->task;
  ModelContext mc;
  mc.sample_shape = c.data.sample_shape;
  mc.classes = c.data.classes;
  mc.vocab = c.data.vocab;
  if (cfg.parallel.sync_batchnorm && dims.data > 1) mc.sync_batchnorm = c.mesh.data();
  mc.tensor = c.mesh.tensor();
  build_chunks(c, mc);
  FlatOptions flat;
  flat.format = c.spec->format;
  flat.device = c.device();
  flat.keep_values = false;  // initialised in the buffer, below
  shard_flat(cfg.parallel, c.mesh, flat);
  std::vector<torch::nn::Module*> modules;
  for (auto& chunk : c.chunks) modules.push_back(chunk.get());
  c.params = std::make_unique<FlatParams>(modules, flat);
  init_parameters(*c.params, c.spec->init(cfg.model), uint64_t(cfg.seed), c.mesh.coord().tensor);
  find_tied(c);
  c.optimizer = make_optimizer(cfg.optimizer, *c.params, update_shard(cfg.parallel, c.mesh, *c.params));
  // The gradient sync (its hooks on the parameters): before a resume, which restores its
  // state.
  c.sync = make_grad_sync(cfg.parallel, c.mesh, *c.params, cfg.train.grad_accum, c.tied);
  for (auto& chunk : c.chunks)
    chunk->before_use([sync = c.sync.get()](const torch::nn::Module& m) { sync->before_use(m); });
  if (cfg.precision.dtype == "fp16")
    c.scaler = std::make_unique<LossScaler>(LossScaler::from_config(cfg.precision));
  // Each data rank's shard of every global batch (a server reads none: it counts steps).
  const bool reads = c.mesh.role() != Role::kServer;
  c.sampler.emplace(c.data.train->size(), cfg.data.batch_size, cfg.data.shuffle,
                    static_cast<uint64_t>(cfg.seed), /*rank=*/reads ? c.mesh.coord().data : 0,
                    /*ranks=*/reads ? dims.data : 1);
  c.total_steps = cfg.train.max_steps > 0 ? cfg.train.max_steps
                                          : cfg.train.epochs * c.steps_per_epoch();
  c.progress = std::make_unique<Progress>(c.root() ? cfg.logging.progress : "off", c.total_steps);
  c.mode = make_mode(c.cfg, c.mesh, *c.params, *c.optimizer, c.named_buffers(), c.total_steps);
  if (c.worker()) {  // async_ps: the servers hold the run; a worker gets its state from them
    c.runner = make_runner(c);
    return;
  }

  auto resume_from = open_run_dir(c);
  if (resume_from) restore(c, *resume_from);
  else if (!cfg.model.init_from.empty()) init_weights(c);  // a resume goes on from its own
  if (c.state.step >= c.total_steps) {  // a finished run: its files stay as they are
    c.finished = true;
    return;
  }
  broadcast_state(c);
  c.runner = make_runner(c);
  root_does(c, fmt::format("write in run directory '{}'", cfg.run_dir), [&] {
    write_file_atomic((fs::path(cfg.run_dir) / "config.yaml").string(), to_yaml(cfg));
    c.metrics = std::make_unique<MetricsLog>(
        (fs::path(cfg.run_dir) / "metrics.jsonl").string(),
        resume_from ? std::optional<int64_t>(c.state.step) : std::nullopt,
        cfg.logging.tensorboard ? (fs::path(cfg.run_dir) / "tb").string() : "");
    return int64_t(0);
  });
  int64_t local = 0, full = 0;
  for (const auto& e : c.params->entries()) {
    local += e.numel;
    int64_t n = 1;
    for (auto s : e.full_shape) n *= s;
    full += n;
  }
  c.say(fmt::format(
      "dtrain {}: job '{}', {} ({} parameters{}), {} ({} train / {} test), batch {}, {} steps "
      "({} per epoch), {} {}, world {} ({}, launcher {}), {} thread(s) per rank ({}), BLAS {}{}; "
      "logs in {}",
      DTRAIN_VERSION, cfg.name, cfg.model.arch, full,
      local != full ? fmt::format(", {} on each tensor rank", local) : "", cfg.data.dataset,
      c.data.train->size(), c.data.test->size(), cfg.data.batch_size, c.total_steps,
      c.steps_per_epoch(), c.device().str(), cfg.precision.dtype, c.mesh.job()->size(),
      c.mesh.role() == Role::kTrainer
          ? dims.str()
          : fmt::format("async_ps: {} server(s), {} worker(s), staleness {}", c.mesh.servers(),
                        c.mesh.workers(), cfg.parallel.staleness),
      c.world.launcher, threads, pinning,
      blas.empty() ? "unknown" : blas,
      resume_from ? fmt::format(", resumed at step {} from {}", c.state.step, *resume_from) : "",
      cfg.run_dir));
}

}  // namespace dtrain
