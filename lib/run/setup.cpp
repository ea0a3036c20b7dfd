// Builds a run from components: the order matters. Threads and the seed first, then data,
// the model's parts, the flat buffers (initialised in place), optimizer, the gradient sync
// (its hooks), sampler, the run log and the runner; then, on the ranks that hold the run,
// the resume decision (collective), the restored state, and the broadcast that makes every
// data-parallel rank start from the same weights.
#include <filesystem>
#include <iostream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "config/schema.hpp"
#include "launch/device.hpp"
#include "layers/linear.hpp"
#include "precision/autocast.hpp"
#include "run/run.hpp"
#include "run/saved_state.hpp"
#include "util/affinity.hpp"
#include "util/blas.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "util/memory.hpp"
#include "util/shape.hpp"
#include "util/units.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

// The process: its allocator, intra-op threads (local processes share the machine's cores)
// and their pinning, the seed, the device. Returns what the start line says of them.
std::string set_up_process(const Run& run) {
  const auto& cfg = run.cfg;
  tune_allocator();
  const int64_t threads = intra_op_threads(cfg.train.threads, usable_cpus(), run.world.local_world);
  torch::set_num_threads(static_cast<int>(threads));
  const std::string pinning = cfg.train.pin_threads
                                  ? pin_compute_threads(threads, run.world.local_rank, run.world.local_world)
                                  : "not pinned";
  torch::manual_seed(static_cast<uint64_t>(cfg.seed));  // the CPU's and every GPU's generator
  use_device(run.device(), cfg);
  auto blas = loaded_blas();
  if (run.job->rank() == 0 && is_reference_blas(blas))
    std::cerr << "dtrain: warning: LibTorch is using the reference BLAS (" << blas
              << "), which is ~19x slower on Linear layers; install libopenblas0-openmp\n";
  const std::string matmul = use_cpu_matmul(cfg.train.cpu_matmul);
  return fmt::format("{} thread(s) per rank ({}), BLAS {}, dense layers {}", threads, pinning,
                     blas.empty() ? "unknown" : blas, matmul);
}

// Every rank must train on the same data: each one's fingerprint of both splits, gathered
// over the job, must be rank 0's (a file that grows while the ranks read it, a folder that
// differs between nodes). A collective.
void agree_on_data(const DataSplits& data, Comm& job, const std::string& path) {
  auto mine = data.train->fingerprint();
  const size_t test_at = mine.size();  // where the test split's figures start
  for (double v : data.test->fingerprint()) mine.push_back(v);
  if (job.size() == 1) return;
  const auto all = job.all_gather(torch::tensor(mine, torch::kFloat64));
  std::vector<int64_t> differ;
  // Sums of floats may differ in their last bits between machines with other core counts
  // (reduction order); a changed sample moves them far more.
  for (size_t r = 1; r < all.size(); ++r)
    if (!torch::allclose(all[r], all[0], /*rtol=*/1e-9, /*atol=*/0)) differ.push_back(int64_t(r));
  if (differ.empty()) return;
  auto sizes = [&](size_t r) {
    return fmt::format("{} train / {} test samples", int64_t(all[r][0].item<double>()),
                       int64_t(all[r][int64_t(test_at)].item<double>()));
  };
  throw DataError(fmt::format("data.path: the ranks read different data from '{}': rank 0 has {}, "
                              "rank {} has {}{}; every rank must see the same files",
                              path, sizes(0), differ[0], sizes(size_t(differ[0])),
                              differ.size() > 1 ? fmt::format(" (and {} more ranks differ)",
                                                              differ.size() - 1)
                                                : ""));
}

// This rank's chunks of the model: only the parts its stages hold, their parameters
// created uninitialised on the device (the flat buffers take them, then init_parameters
// fills them by name). The whole model's outline, on the meta device, says how big each
// part is (the stages' split) and every name. LibTorch's own layers draw their initial
// weights from the default generator as they are built (values init_parameters replaces):
// the generator is put back, so it is the seed's whatever a rank builds.
ModelParts build_model(const Run& run, const ModelContext& mc) {
  const auto& cfg = run.cfg;
  ModelParts m;
  m.spec = &model_spec(cfg.model.arch);
  const int64_t ranks = run.mesh().dims().pipeline, chunks = cfg.parallel.virtual_stages;
  m.stages = ranks * chunks;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  const auto seeded = gen.get_state();
  ModelContext outline_ctx = mc;
  outline_ctx.options = torch::TensorOptions().device(torch::kMeta);
  const auto outline = m.spec->build(cfg.model, outline_ctx);
  for (const auto& p : outline->named_parameters()) m.names.push_back(p.key());
  for (const auto& b : outline->named_buffers()) m.names.push_back(b.key());
  const auto split = stage_split(cfg, *outline, mc, m.stages);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t stage = chunk * ranks + run.mesh().coord().pipeline;
    ModelContext held = mc;
    held.options = torch::TensorOptions().device(run.device());
    held.first_part = split[size_t(stage)].first, held.last_part = split[size_t(stage)].last;
    auto net = m.spec->build(cfg.model, held);
    net->recompute_blocks(cfg.train.recompute == "blocks");
    net->to(run.device());  // LibTorch's own layers, and the buffers
    m.chunks.push_back(net);
    m.chunk_stage.push_back(stage);
  }
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(seeded);
  return m;
}

// The tied parameters' entries, where the two parts that use them sit on different ranks.
Tied find_tied(const ModelParts& m, const FlatParams& params, const Mesh& mesh) {
  Tied tied;
  if (!mesh.embedding() || m.holds_first() == m.holds_last()) return tied;
  tied.group = mesh.embedding();
  const auto names = m.chunks.front()->tied_parameters();
  const auto& entries = params.entries();
  for (size_t i = 0; i < entries.size(); ++i)
    if (std::find(names.begin(), names.end(), entries[i].name) != names.end()) tied.entries.push_back(i);
  tied.copy = m.holds_last();
  return tied;
}

// The model's parts, their flat buffers (initialised there), the optimizer over this
// rank's shard, the gradient sync (its hooks: before a resume, which restores its state)
// and fp16's loss scaler.
void build_training(Run& run) {
  const auto& cfg = run.cfg;
  const Mode& mode = *run.mode;
  ModelContext mc;
  mc.sample_shape = run.data.sample_shape;
  mc.classes = run.data.classes;
  mc.vocab = run.data.vocab;
  if (cfg.parallel.sync_batchnorm && run.mesh().dims().data > 1) mc.sync_batchnorm = run.mesh().data();
  mc.tensor = run.mesh().tensor();
  run.model = build_model(run, mc);
  FlatOptions flat;
  flat.format = run.model.spec->format;
  flat.device = run.device();
  flat.keep_values = false;  // initialised in the buffer, below
  flat.compute_dtype = compute_dtype(cfg.precision.dtype);
  mode.shape_flat(flat);
  std::vector<torch::nn::Module*> modules;
  for (auto& chunk : run.model.chunks) {
    modules.push_back(chunk.get());
    flat.units.push_back(chunk->units());
  }
  run.params = std::make_unique<FlatParams>(modules, flat);
  // A replica that joins takes every weight from a peer (run/modes/replicas.cpp): drawing
  // them first would only delay its rejoin (a pass of random draws over all of them).
  if (mode.state_from_peer())
    run.params->data().zero_();
  else
    init_parameters(*run.params, run.model.spec->init(cfg.model), uint64_t(cfg.seed),
                    run.mesh().coord().tensor);
  run.model.tied = find_tied(run.model, *run.params, run.mesh());
  run.optimizer = make_optimizer(cfg.optimizer, *run.params, mode.update_shard(*run.params));
  run.sync = mode.make_sync(*run.params, cfg.train.grad_accum, run.total_steps, run.model.tied);
  Network::UseHooks hooks;
  hooks.before = [sync = run.sync.get()](const Network::Modules& m) { sync->before_use(m); };
  hooks.after = [sync = run.sync.get()](const Network::Modules& m, const torch::Tensor& out) {
    sync->after_use(m, out);
  };
  for (auto& chunk : run.model.chunks) chunk->use_hooks(hooks);
  if (cfg.precision.dtype == "fp16")
    run.scaler = std::make_unique<LossScaler>(LossScaler::from_config(cfg.precision));
}

RunnerParts runner_parts(const Run& run) {
  const auto& cfg = run.cfg;
  RunnerParts p;
  p.chunks = run.model.chunks;
  p.stages = run.model.stages;
  p.task = &run.model.task();
  p.tensor = run.mesh().tensor();
  p.pipeline = run.mesh().pipeline();
  p.device = run.device();
  p.format = run.model.spec->format;
  p.sync = run.sync.get();
  p.grad_accum = cfg.train.grad_accum;
  p.dtype = cfg.precision.dtype;
  p.label_smoothing = cfg.optimizer.label_smoothing;
  p.schedule = cfg.parallel.schedule;
  p.virtual_stages = cfg.parallel.virtual_stages;
  p.seed = uint64_t(cfg.seed);
  p.dropout = cfg.model.dropout > 0;
  p.data_rank = run.mesh().coord().data;
  p.data_ranks = run.mesh().dims().data;
  return p;
}

// The run log, with what its lines say of the run.
void build_log(Run& run, bool root) {
  RunFacts facts;
  facts.steps_per_epoch = run.steps_per_epoch;
  facts.total_steps = run.total_steps;
  facts.items_per_sample = run.model.task().items_per_sample(run.data.sample_shape);
  facts.communicates = run.world.world > 1;
  facts.loss_scaled = run.scaler != nullptr;
  run.progress = std::make_unique<Progress>(root ? run.cfg.logging.progress : "off", run.total_steps);
  run.log = std::make_unique<RunLog>(run.cfg, run.model.task(), std::move(facts), root,
                                     run.progress.get());
  run.log->extend_summary([&run](nlohmann::json& s) {
    s["world_size"] = run.world.world;
    s["layout"] = run.mode->layout();
    s["device"] = run.device().str();
    // rank 0's: under ZeRO each data rank keeps about 1 / data of it
    s["optimizer_state_mb"] = double(optimizer_state_bytes(*run.optimizer)) / kMiB;
    const auto mib = [](const torch::Tensor& t) { return double(t.numel() * t.element_size()) / kMiB; };
    s["gradient_mb"] = mib(run.params->grad());
    // The parameters it keeps (under ZeRO-3 its shard; a unit or two more while gathered).
    s["parameters_mb"] = mib(run.params->data());
    // On a GPU, its allocator's peak (the host's is peak_rss_mb).
    if (run.device().is_cuda()) s["peak_gpu_mb"] = double(peak_allocated_bytes(run.device())) / kMiB;
    if (run.scaler) {
      s["loss_scale"] = run.scaler->scale();
      s["overflow_steps"] = run.scaler->overflows();
    }
  });
}

// Collective over the ranks that hold the run: the run directory claimed, the resume (or
// model.init_from), the data-parallel ranks made equal, the resolved job and the metrics
// file written. Returns the checkpoint resumed from, if any.
std::optional<std::string> open_run(Run& run) {
  const auto& cfg = run.cfg;
  Checkpointer::Options o{cfg.run_dir, cfg.checkpoint, run.opts.resume, run.world.run_id,
                          run.mesh().dims(), run.mesh().coord(),
                          [&run](const std::string& line) { run.say(line); },
                          run.mode->writes_files()};
  run.checkpointer = std::make_unique<Checkpointer>(std::move(o), run.mesh().world());
  // A replica that joins takes its state from a peer instead (run/modes/replicas.cpp).
  const bool from_peer = run.mode->state_from_peer();
  auto resume_from = from_peer ? std::nullopt : run.checkpointer->open();
  if (resume_from) run.checkpointer->restore(*resume_from, run.stateful());
  else if (!cfg.model.init_from.empty() && !from_peer) init_from(run);  // a resume goes on from its own
  if (run.state().step >= run.total_steps) {  // a finished run: its files stay as they are
    run.finished = true;
    return resume_from;
  }
  auto& data = *run.mesh().data();  // every data-parallel rank starts from data rank 0's
  if (data.size() > 1) {
    torch::NoGradGuard no_grad;
    if (!run.params->sharded()) data.broadcast(run.params->data(), 0);  // ZeRO-3: each its own
    for (auto& b : run.model.float_buffers()) data.broadcast(b, 0);
  }
  if (!run.mode->writes_files()) return resume_from;  // another replica writes them
  root_does(*run.mesh().world(), fmt::format("write in run directory '{}'", cfg.run_dir), [&] {
    // Restored: the checkpoint heads the run's line now; a rollback's later ones (and
    // their metrics lines) are kept aside.
    const auto branch = resume_from ? run.checkpointer->continue_from(*resume_from) : std::nullopt;
    write_file_atomic((fs::path(cfg.run_dir) / "config.yaml").string(), to_yaml(cfg));
    // The lines that stay: up to the step resumed, none after another line's checkpoint.
    std::optional<int64_t> kept_through;
    if (resume_from) kept_through = branch && !branch->on_line ? 0 : run.state().step;
    run.metrics = std::make_unique<MetricsLog>(
        (fs::path(cfg.run_dir) / "metrics.jsonl").string(), kept_through,
        cfg.logging.tensorboard ? (fs::path(cfg.run_dir) / "tb").string() : "",
        branch && !branch->kept_in.empty()
            ? (fs::path(cfg.run_dir) / branch->kept_in / "metrics.jsonl").string()
            : "");
    run.log->attach(run.metrics.get());
    if (branch) run.log->branched(*branch);
    return int64_t(0);
  });
  return resume_from;
}

// The start line: what is trained, where, how.
std::string start_line(const Run& run, const std::string& process,
                       const std::optional<std::string>& resume_from) {
  const auto& cfg = run.cfg;
  int64_t local = 0, full = 0;
  for (const auto& e : run.params->entries()) {
    local += e.numel;
    full += shape_numel(e.full_shape);
  }
  return fmt::format(
      "dtrain {}: job '{}', {} ({} parameters{}), {} ({} train / {} test), batch {}, {} steps "
      "({} per epoch), {} {}, world {} ({}, launcher {}), {}{}; logs in {}",
      DTRAIN_VERSION, cfg.name, cfg.model.arch, full,
      local != full ? fmt::format(", {} on each tensor rank", local) : "", cfg.data.dataset,
      run.data.train->size(), run.data.test->size(), cfg.data.batch_size, run.total_steps,
      run.steps_per_epoch, run.device().str(), cfg.precision.dtype, run.world.world,
      run.mode->describe(), run.world.launcher, process,
      resume_from ? fmt::format(", resumed at step {} from {}", run.state().step, *resume_from) : "",
      cfg.run_dir);
}

}  // namespace

void build_run(Run& run) {
  const auto& cfg = run.cfg;
  const Mode& mode = *run.mode;
  const std::string process = set_up_process(run);
  ReadTogether together{run.job->rank(), run.job->size(), nullptr,
                        (fs::path(cfg.run_dir) / "token-scan.json").string()};
  if (run.job->size() > 1)
    together.all_gather = [&run](const std::vector<double>& mine) {
      const auto all = torch::cat(run.job->all_gather(torch::tensor(mine, torch::kFloat64)));
      return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
    };
  run.data = load_data(cfg.data, static_cast<uint64_t>(cfg.seed), together);
  run.data.test = evenly_spaced(run.data.test, cfg.train.eval_samples);
  agree_on_data(run.data, *run.job, cfg.data.path);
  // Each data rank's shard of every global batch (a rank that reads none counts steps).
  const bool reads = mode.reads_data();
  run.sampler.emplace(run.data.train->size(), cfg.data.batch_size, cfg.data.shuffle,
                      static_cast<uint64_t>(cfg.seed), /*rank=*/reads ? run.mesh().coord().data : 0,
                      /*ranks=*/reads ? run.mesh().dims().data : 1);
  run.steps_per_epoch = run.sampler->steps_per_epoch();
  run.total_steps = cfg.train.max_steps > 0 ? cfg.train.max_steps
                                            : cfg.train.epochs * run.steps_per_epoch;
  build_training(run);
  build_log(run, mode.holds_run() && mode.writes_files() && run.mesh().world()->rank() == 0);
  run.runner = make_runner(runner_parts(run));
  run.savers = run_savers(run);
  run.mode->bind(train_parts(run));
  if (mode.holds_run()) {  // else it gets its state from the ranks that hold the run
    const auto resume_from = open_run(run);
    if (run.finished)
      run.say(fmt::format("nothing to train: the checkpoint is at step {} and the job ends at step {} "
                          "(train.max_steps, or train.epochs x {} steps); checkpoints and logs "
                          "unchanged", run.state().step, run.total_steps, run.steps_per_epoch));
    else
      run.say(start_line(run, process, resume_from));
  }
  // The steps' large tensors come back every step: keep their blocks from here (not the
  // setup's temporaries, which do not come back).
  keep_cpu_blocks();
}

}  // namespace dtrain
