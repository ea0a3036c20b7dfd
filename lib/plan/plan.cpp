#include "plan/plan.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <system_error>
#include <unordered_set>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "data/dataset.hpp"
#include "grad/sync_cost.hpp"
#include "grad/grad_sync.hpp"
#include "launch/device.hpp"
#include "launch/supervisor.hpp"
#include "models/model.hpp"
#include "optim/optimizer.hpp"
#include "parallel/flat_params.hpp"
#include "pipeline/schedule.hpp"
#include "precision/autocast.hpp"
#include "run/mode.hpp"
#include "util/affinity.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace {

constexpr double kLoaderThreadBytes = 7 * kMiB;

// A dtrain process before any model, on the CPU, read off this process: LibTorch's
// libraries and their start-up. Exec'd (one process, a launcher's workers), it holds its
// anonymous memory and the library pages its start-up touched (165 MB with LibTorch 1.13
// here, 100 of them pages of the libraries); forked by `dtrain run --nproc`
// (launch/supervisor.hpp), it shares those and maps only the library code training runs
// (kForkedLibraryBytes, measured: 31 MB for the MLP). Then the thread pools and Gloo a run
// adds (5 MB; a run with no loader threads peaked at 170 MB before its model). Each loader
// thread's heap adds kLoaderThreadBytes (measured).
constexpr double kForkedLibraryBytes = 32 * kMiB;
double runtime_bytes(bool forked) {
  static const std::pair<double, double> own = [] {  // anonymous, library pages
    const double anon = proc_field_bytes("/proc/self/status", "RssAnon:");
    if (anon <= 0) return std::pair{60 * kMiB, 105 * kMiB};
    return std::pair{anon, proc_field_bytes("/proc/self/status", "RssFile:")};
  }();
  return own.first + (forked ? kForkedLibraryBytes : own.second) + 5 * kMiB;
}

// Tensor rank `tensor_rank`'s share of the model over `tensor` ranks, shapes only: built
// for the data's shape, with the model's vocabulary whatever the data's.
ModelContext outline_context(const JobConfig& cfg, int64_t tensor_rank, int64_t tensor) {
  const auto kind = data_kind(cfg.data);
  ModelContext c;
  c.sample_shape = kind.sample_shape;
  c.classes = kind.classes;
  c.vocab = cfg.model.vocab;
  c.options = torch::TensorOptions().device(torch::kMeta);
  if (tensor > 1) c.tensor = make_shape_comm(tensor_rank, tensor);
  return c;
}

// What the planner knows of the job for its world.
struct Job {
  const JobConfig& cfg;
  const ModeSpec& mode;
  ParallelDims dims;
  int64_t world = 1, apart = 0;  // ranks a mode sets apart from the layout (the first ones)
  bool cuda = false;
  std::vector<PartCost> costs;     // each part's, at dims.tensor
  std::vector<PartRange> split;    // each global stage's parts
  int64_t chunks = 1;              // stages per pipeline rank (interleaved: virtual_stages)
  int64_t micro = 1;               // micro-batches per step
  double rows = 1;                 // samples per micro-batch on a data rank
  mutable std::map<int64_t, std::shared_ptr<const FlatShape>> held_;  // held(), by pipeline rank
  mutable std::map<int64_t, RankCost> cost_;  // cost_of(), by world rank

  Job(const JobConfig& c, int64_t w, const Devices& devices = Devices::here())
      : cfg(c), mode(mode_spec(c.parallel.mode)), world(w) {
    const int64_t trainers = mode.trainers(cfg, world);
    dims = ParallelDims::resolve(cfg.parallel, trainers);
    apart = world - trainers;
    cuda = plans_gpu(cfg, devices);
    const auto kind = data_kind(cfg.data);
    const auto& spec = model_spec(cfg.model.arch);
    SizeContext sc{kind.sample_shape, kind.classes, dims.tensor, cuda};
    costs = spec.costs(cfg.model, sc);
    chunks = dims.pipeline > 1 ? cfg.parallel.virtual_stages : 1;
    split = planned_split(cfg, dims.pipeline * chunks, dims.tensor);
    micro = cfg.train.grad_accum;
    rows = double(cfg.data.batch_size) / double(dims.data * micro);
  }
  int64_t stages() const { return dims.pipeline * chunks; }
  // The global stage of pipeline rank `rank`'s chunk `c`.
  int64_t stage(int64_t c, int64_t rank) const { return c * dims.pipeline + rank; }
  // Whether part `p` is a block that backward recomputes.
  bool recomputed(const PartCost& p) const { return cfg.train.recompute == "blocks" && p.block; }
  // The parameters pipeline rank `r` holds (held_by, below): each rank's plan and the time
  // of every rank's work read them, built once (an outline of the rank's chunks).
  const FlatShape& held(int64_t r) const;
  // The world rank of the trainer at `at`: the ranks a mode sets apart come first.
  int64_t rank_at(const Coord& at) const { return apart + dims.rank_of(at); }
  Coord coord(int64_t rank) const { return rank < apart ? Coord{} : dims.coord_of(rank - apart); }
  // What world rank `rank` keeps and sends for its parameters, as its mode declares:
  // asked once per rank (a rank's plan and every rank's step time read it; ZeRO-3's plays
  // the step's gathers).
  const RankCost& cost_of(int64_t rank) const;
  // Part i's cost sheet in this job's precision: under 16-bit autocast its 16-bit
  // activations, and its casts among the kernels.
  PartCost part(int64_t i) const {
    PartCost p = costs[size_t(i)];
    if (cfg.precision.dtype != "fp32") {
      if (p.activation_bytes_16 >= 0) p.activation_bytes = p.activation_bytes_16;
      if (p.backward_bytes_16 >= 0) p.backward_bytes = p.backward_bytes_16;
      p.activation_bytes += p.weight_copy_16 / double(rows);  // a micro-batch's, per sample
      p.kernels += p.casts;
    }
    return p;
  }
};

// The parameters a pipeline rank holds, as FlatParams lays them out (grad/sync_cost.hpp's
// FlatShape), read off an outline of its chunks.
FlatShape held_by(const Job& job, int64_t pipeline_rank) {
  const auto& spec = model_spec(job.cfg.model.arch);
  FlatShape h;
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<std::string> tied_names;
  std::vector<NetworkPtr> nets;
  for (int64_t c = 0; c < job.chunks; ++c) {
    const int64_t stage = job.stage(c, pipeline_rank);
    ModelContext ctx = outline_context(job.cfg, 0, job.dims.tensor);
    ctx.first_part = job.split[size_t(stage)].first;
    ctx.last_part = job.split[size_t(stage)].last;
    h.first = h.first || stage == 0;
    h.last = h.last || stage == job.stages() - 1;
    // Kept alive to the end: a freed chunk's tensors' addresses could come back in the
    // next one's and pass for the same parameter.
    nets.push_back(spec.build(job.cfg.model, ctx));
    const auto& net = nets.back();
    tied_names = net->tied_parameters();
    std::map<const c10::TensorImpl*, size_t> entry_of;
    // In the compute dtype where every name of a parameter is cast anyway, as FlatParams
    // holds them.
    const auto cast = cast_by_autocast(*net);
    const int64_t low = int64_t(c10::elementSize(compute_dtype(job.cfg.precision.dtype)));
    for (const auto& p : net->named_parameters(/*recurse=*/true)) {
      const int64_t bytes = cast.count(p.key()) ? low : 4;
      if (auto it = entry_of.find(p.value().unsafeGetTensorImpl()); it != entry_of.end()) {
        auto& gathered = h.entries[it->second].gathered;
        gathered = std::max(gathered, bytes);
        continue;
      }
      if (!seen.insert(p.value().unsafeGetTensorImpl()).second) continue;
      entry_of[p.value().unsafeGetTensorImpl()] = h.entries.size();
      h.entries.push_back({p.key(), p.value().sizes().vec(), p.value().numel(), 0, bytes});
    }
    // Entries' offsets, for the units.
    std::vector<int64_t> offset(h.entries.size() + 1, 0);
    for (size_t i = 0; i < h.entries.size(); ++i) {
      h.entries[i].offset = offset[i];
      offset[i + 1] = offset[i] + h.entries[i].numel;
    }
    std::map<const torch::nn::Module*, size_t> unit_of;
    std::set<size_t> claimed;
    for (const auto* module : net->units()) {
      int64_t lo = -1, hi = -1;
      FlatShape::Unit unit;
      for (const auto& p : module->named_parameters(/*recurse=*/true)) {
        auto it = entry_of.find(p.value().unsafeGetTensorImpl());
        if (it == entry_of.end() || !claimed.insert(it->second).second) continue;
        const auto& e = h.entries[it->second];
        lo = lo < 0 ? e.offset : std::min(lo, e.offset), hi = std::max(hi, e.offset + e.numel);
        unit.entries.push_back(it->second);
        unit.bytes += double(e.numel * e.gathered);
        unit.dtypes.insert(e.gathered);
      }
      if (lo < 0) continue;  // no parameters of its own
      unit_of[module] = h.units.size();
      unit.offset = lo, unit.numel = hi - lo, unit.chunk = size_t(c);
      h.units.push_back(std::move(unit));
    }
    // Forward's calls, as the units they gather.
    std::vector<std::vector<size_t>> uses;
    for (const auto& use : net->uses()) {
      std::vector<size_t> units;
      for (const auto* module : use)
        if (auto it = unit_of.find(module); it != unit_of.end()) units.push_back(it->second);
      if (!units.empty()) uses.push_back(units);
    }
    h.uses.push_back(uses);
  }
  // A tied weight is summed across stages only where its two users sit on different ranks.
  for (const auto& e : h.entries) {
    if (h.first != h.last &&
        std::find(tied_names.begin(), tied_names.end(), e.name) != tied_names.end()) {
      h.tied += e.numel;
      h.tied_at.emplace_back(h.total, h.total + e.numel);
    }
    h.total += e.numel;
  }
  return h;
}

const FlatShape& Job::held(int64_t r) const {
  auto& h = held_[r];
  if (!h) h = std::make_shared<const FlatShape>(held_by(*this, r));
  return *h;
}

// The actions of one step on a pipeline rank, as its runner takes them.
std::vector<Action> step_actions(const Job& job, int64_t pipeline_rank) {
  if (job.dims.pipeline > 1)
    return pipeline_schedule(job.cfg.parallel.schedule, pipeline_rank, job.dims.pipeline, job.micro,
                             job.chunks);
  std::vector<Action> out;
  for (int64_t m = 0; m < job.micro; ++m) {
    out.push_back({Action::kForward, m, 0});
    out.push_back({Action::kBackward, m, 0});
  }
  return out;
}

const RankCost& Job::cost_of(int64_t rank) const {
  if (auto it = cost_.find(rank); it != cost_.end()) return it->second;
  const Coord at = coord(rank);
  DataGroup group;
  group.ranks = dims.data;
  group.rank = at.data;
  group.micro = micro;
  group.sums_16bit = cuda && cfg.dist.backend != "gloo";
  for (const Action& a : step_actions(*this, at.pipeline))
    group.passes.emplace_back(size_t(a.chunk), a.kind == Action::kForward);
  return cost_.emplace(rank, mode.cost(cfg, held(at.pipeline), group, rank)).first->second;
}

// A chunk's parts, per sample: what backward keeps (a recomputed block only its input), the
// flops of forward and backward (and recompute's second forward), the values all-reduced
// over the tensor group.
struct ChunkCost {
  double activation_bytes = 0, recompute_peak = 0, flops = 0, reduced = 0, reductions = 0;
  double backward_bytes = 0;  // what its backward holds at most besides activation_bytes
  double sent_forward = 0, sent_backward = 0;  // to the next stage, to the previous one
};
ChunkCost chunk_cost(const Job& job, int64_t stage) {
  const PartRange r = job.split[size_t(stage)];
  ChunkCost c;
  // Last part first, as backward runs them, each freeing what it kept: a part's gradients
  // in flight sit beside the activations of the parts before it, not of those after.
  double kept_after = 0;
  for (int64_t i = r.last - 1; i >= r.first; --i) {
    const PartCost p = job.part(i);
    const double input = i > 0 ? job.costs[size_t(i - 1)].output : 0;
    const bool again = job.recomputed(p);
    // Recomputed, a block keeps its input; backward rebuilds one block's activations at a
    // time and takes its gradients through them. On the CPU the process then holds about
    // three copies of each block's input and two of one block's activations (measured with
    // GPTs of 3 and 12 layers: the planned peak was 23% low counting one of each).
    const double kept = again ? 3 * 4 * input : p.activation_bytes;
    c.backward_bytes = std::max(c.backward_bytes, p.backward_bytes - kept_after);
    kept_after += kept;
    c.activation_bytes += kept;
    if (again) c.recompute_peak = std::max(c.recompute_peak, 2 * p.activation_bytes);
    c.flops += p.flops * (again ? 4 : 3);
    c.reduced += p.reduced * (again ? 2 : 1) + p.reduced_back;
    c.reductions += p.reductions * (again ? 2 : 1) + p.reductions_back;
  }
  if (stage + 1 < job.stages()) c.sent_forward = job.costs[size_t(r.last - 1)].output;
  if (stage > 0) c.sent_backward = job.costs[size_t(r.first - 1)].output;
  return c;
}

// How fast the planned device runs a stage's work: a matrix multiply's rate by its smallest
// side and its multiply-adds a call (batched: attention's products, head by head); memory's
// bytes per second.
struct Speed {
  std::function<double(double side, double work, bool batched)> matmul;
  double memory = 0;
  // Values a second of elementwise kernels, a sum's and GELU's, where measured (a CPU's:
  // there they run well below memory speed); else the activations and the update stream
  // at memory speed.
  double plain = 0, transcendental = 0;
};

// The values the update writes per parameter (lib/optim), the gradients' zeroing with
// them: AdamW's nine (the decay, each moment's two, the denominator's three, the step),
// SGD's step with its momentum's two and its decay's one; clipping's norm and scaling.
double update_values(const OptimizerConfig& o) {
  const double step = o.name == "adamw" ? 9 : 1 + (o.momentum != 0 ? 2 : 0) + (o.weight_decay != 0 ? 1 : 0);
  return 1 + step + (o.grad_clip > 0 ? 2 : 0);
}

// What a stage computes in a step, forward and backward, in seconds at a speed.
struct Work {
  double forward = 0, backward = 0;
  double total() const { return forward + backward; }
};

// Seconds a stage computes in a step: each part's matrix multiplies at the rate the profile
// measured for their size (per micro-batch), backward's twice forward's; its elementwise
// kernels' values at the profile's rates for them (16-bit autocast's at bf16's), or where
// the profile has none its activations at memory speed, written in forward, read and
// written in backward. A recomputed block runs forward again in backward.
Work compute_seconds(const Job& job, int64_t stage, const Speed& speed) {
  const PartRange r = job.split[size_t(stage)];
  const double rows_step = job.rows * double(job.micro);
  Work w;
  for (int64_t i = r.first; i < r.last; ++i) {
    const PartCost p = job.part(i);
    const double back = job.recomputed(p) ? 3 : 2;  // backward's passes, forward's one
    auto add = [&](double forward_seconds) {  // a pass's work, forward and backward
      w.forward += forward_seconds, w.backward += back * forward_seconds;
    };
    const double dense = p.flops - p.small_flops;
    if (dense > 0 && p.matmuls > 0) {
      // The profile's rates are by a product's smallest side: the side the model gives, or
      // else the cube root of one product's volume (no less than the smallest side, so
      // optimistic for a thin product).
      const double work = dense * job.rows / p.matmuls / 2;
      double size = std::cbrt(work);
      if (p.side > 0) size = std::min(size, p.side);
      add(dense * rows_step / speed.matmul(size, work, false));
    } else if (dense > 0 && speed.plain <= 0) {  // a lookup: among the values where counted
      add(4 * dense * rows_step / speed.memory);
    }
    if (p.small_flops > 0)  // the scores and their weighting: two batched products
      add(p.small_flops * rows_step / speed.matmul(p.small_side, p.small_flops * job.rows / 4, true));
    if (speed.plain > 0) {
      const double casts = job.cfg.precision.dtype != "fp32" ? 1 : 0;
      auto of = [&](const PartCost::Values& v) {
        return (v.plain + casts * v.casts_16) / speed.plain + v.transcendental / speed.transcendental;
      };
      const double forward = of(p.values) * rows_step;
      w.forward += forward;
      w.backward += (job.recomputed(p) ? forward : 0) + of(p.values_back) * rows_step;
    } else {
      add(p.activation_bytes * rows_step / speed.memory);
    }
  }
  return w;
}

// A step of the pipeline's schedule played out at `speed`, each stage's forward and
// backward of a micro-batch taking what it computes (pipeline/schedule.hpp): each rank's
// waits for its neighbours, unequal stages' included.
ScheduleRun played(const Job& job, const Speed& speed) {
  std::vector<double> forward, backward;
  for (int64_t g = 0; g < job.stages(); ++g) {
    const Work w = compute_seconds(job, g, speed);
    forward.push_back(w.forward / double(job.micro)), backward.push_back(w.backward / double(job.micro));
  }
  return play_schedule(job.cfg.parallel.schedule, job.dims.pipeline, job.micro, job.chunks, forward,
                       backward);
}

// A speed at which a stage's time is its FLOPs (where no profile says more).
const Speed kFlops{[](double, double, bool) { return 1.0; }, std::numeric_limits<double>::infinity()};

// Seconds a pipeline rank's device works in a step at `speed`: its chunks' computing, or
// with the schedule `played` at that speed, the step's computing with its waits (the
// played step's end), then the update over its shard: its values at the elementwise rate
// where measured, else `passes` over it at memory speed.
double work_seconds(const Job& job, int64_t pipeline_rank, const Speed& speed, int64_t shard,
                    double passes, const ScheduleRun* played = nullptr) {
  double compute = 0;
  for (int64_t c = 0; c < job.chunks; ++c)
    compute += compute_seconds(job, job.stage(c, pipeline_rank), speed).total();
  if (played) compute = played->makespan();
  if (speed.plain > 0) return compute + update_values(job.cfg.optimizer) * double(shard) / speed.plain;
  return compute + passes * 4 * double(shard) / speed.memory;
}

// work_seconds with its waits: a pipeline's schedule played at `speed`, this rank's share
// of it spent waiting put into `bubble`.
double step_work_seconds(const Job& job, int64_t pipeline_rank, const Speed& speed, int64_t shard,
                         double passes, double& bubble) {
  if (job.dims.pipeline == 1) return work_seconds(job, pipeline_rank, speed, shard, passes);
  const ScheduleRun run = played(job, speed);
  bubble = run.bubble(pipeline_rank);
  return work_seconds(job, pipeline_rank, speed, shard, passes, &run);
}

// The kernels a stage's host launches in a step for its parts: each part's forward,
// backward twice that (a recomputed block's forward again).
double stage_kernels(const Job& job, int64_t stage) {
  const PartRange r = job.split[size_t(stage)];
  double kernels = 0;
  for (int64_t i = r.first; i < r.last; ++i) {
    const PartCost p = job.part(i);
    kernels += p.kernels * (job.recomputed(p) ? 4 : 3);
  }
  return double(job.micro) * kernels;
}

// The dataset each process holds in memory, bytes: images as fp32 with int64 labels, text as
// int64 tokens, token shards mapped (resident once scanned).
double bytes_on_disk(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return double(fs::file_size(path, ec));
  double sum = 0;
  if (fs::is_directory(path, ec))
    for (const auto& e : fs::recursive_directory_iterator(path, ec))
      if (e.is_regular_file(ec)) sum += double(e.file_size(ec));
  return sum;
}
double data_bytes(const JobConfig& cfg) {
  const auto& d = cfg.data;
  const auto kind = data_kind(d);
  const double sample = double(shape_numel(kind.sample_shape));
  if (d.dataset == "fashion_mnist" || d.dataset == "mnist") return 70000 * (4 * sample + 8);
  if (d.dataset == "synthetic") return double(d.samples + d.test_samples) * (4 * sample + 8);
  if (d.dataset == "synthetic_tokens") return double(d.samples + d.test_samples) * sample * 8;
  if (d.dataset == "text") return 8 * bytes_on_disk(d.path);
  return bytes_on_disk(d.path) + (d.eval_path.empty() ? 0 : bytes_on_disk(d.eval_path));
}
// One step's batch on a data rank, as the loader holds it.
double batch_bytes(const JobConfig& cfg, double rows) {
  const auto kind = data_kind(cfg.data);
  const double sample = double(shape_numel(kind.sample_shape));
  return rows * (kind.tokens ? 2 * 8 * sample : 4 * sample + 8);
}

// Ranks that share one GPU: those beyond the GPUs take turns on them.
double ranks_per_gpu(const Job& job, const MachineProfile::Gpu& g) {
  return std::ceil(double(job.world) / double(std::max<int64_t>(1, g.count)));
}

// The backend a GPU job's ranks take there (a GPU machine's dtrain is taken to have NCCL);
// empty where the job's dist.backend cannot be had.
std::string gpu_backend(const Job& job, const MachineProfile::Gpu& g) {
  try {
    return pick_backend(job.cfg.dist.backend, c10::kCUDA, /*nccl=*/true, ranks_per_gpu(job, g) > 1,
                        job.mode.any_source);
  } catch (const ConfigError&) {
    return "";
  }
}

// A step's seconds on a GPU (the profile's), its talk aside: the device's work at the GPU's
// rates, ranks sharing a GPU taking turns on it; meanwhile the host launches every kernel,
// and the step takes the longer of the two.
double gpu_step_seconds(const Job& job, const Coord& at, const MachineProfile::Gpu& g,
                        int64_t shard, double parameters, double passes, double& bubble) {
  const auto& cfg = job.cfg;
  const std::string dtype = cfg.precision.dtype != "fp32" ? cfg.precision.dtype
                            : cfg.precision.tf32           ? "tf32"
                                                           : "fp32";
  const Speed speed{[&](double side, double work, bool batched) {
                      return g.matmul_flops(side, work, dtype, batched);
                    },
                    g.memory_bytes_per_s};
  const double device = step_work_seconds(job, at.pipeline, speed, shard, passes, bubble);
  double kernels = 0;
  for (int64_t c = 0; c < job.chunks; ++c) kernels += stage_kernels(job, job.stage(c, at.pipeline));
  // Each micro-batch's gradients into the flat buffer; the update, a fused kernel (and its
  // step count); the norm's two a piece.
  const double pieces = std::ceil(double(shard) / double(update_piece(shard)));
  kernels += double(job.micro) * parameters + 4 + 2 * pieces;
  return std::max(device * ranks_per_gpu(job, g), kernels * g.launch_s);
}

// The activations a pipeline rank holds at its peak: the micro-batches its schedule holds
// at once, each chunk's, with backward's gradients in flight and recompute's rebuilt block.
double activation_bytes(const Job& job, int64_t pipeline_rank, const std::vector<ChunkCost>& chunks) {
  double live = 0, most = 0, recompute_peak = 0;
  for (const Action& a : step_actions(job, pipeline_rank)) {
    const auto& cc = chunks[size_t(a.chunk)];
    if (a.kind == Action::kBackward) most = std::max(most, live + cc.backward_bytes);
    live += (a.kind == Action::kForward ? 1 : -1) * cc.activation_bytes;
    most = std::max(most, live);
    recompute_peak = std::max(recompute_peak, cc.recompute_peak);
  }
  return job.rows * (most + recompute_peak);
}

// Bytes a rank sends a step by group, and the operations they take (each pays the link's
// latency): the data group's (as the mode declares), the tensor group's all-reduces, the
// pipeline's activations and gradients, a tied weight's sum across the pipeline.
struct Traffic {
  double data = 0, data_ops = 0, tensor = 0, tensor_ops = 0, pipe = 0, pipe_ops = 0, tied = 0;
  double total() const { return data + tensor + pipe + tied; }
};
Traffic traffic(const Job& job, const std::vector<ChunkCost>& chunks, const SyncCost& sync,
                const FlatShape& h) {
  double reduced = 0, reductions = 0, piped = 0;
  for (const auto& cc : chunks) {
    reduced += cc.reduced;
    reductions += cc.reductions;
    piped += cc.sent_forward + cc.sent_backward;
  }
  const double rows_step = job.rows * double(job.micro);
  Traffic t;
  t.data = sync.bytes.value_or(0), t.data_ops = sync.ops;
  t.tensor = ring_all_reduce_share(4 * reduced * rows_step, job.dims.tensor);
  t.tensor_ops = double(job.micro) * reductions;
  t.pipe = 4 * piped * rows_step;
  t.pipe_ops = double(job.micro * job.chunks) * 2;
  t.tied = ring_all_reduce_share(4 * double(h.tied), 2);
  return t;
}

// A step's seconds spent talking: each group's bytes at its link's rate plus a latency per
// operation, not overlapped with computing.
double talk_seconds(const Job& job, const Traffic& t, const MachineProfile& profile,
                    const std::vector<MachineProfile::Link>& all_reduce,
                    const std::vector<MachineProfile::Link>& send) {
  double seconds = 0;
  auto talk = [&](const std::vector<MachineProfile::Link>& list, int64_t ranks, double bytes, double ops) {
    const auto* l = profile.link(list, ranks);
    if (bytes > 0 && l) seconds += ops * l->latency_s + bytes / l->bytes_per_s;
  };
  talk(all_reduce, job.dims.data, t.data, t.data_ops);
  talk(all_reduce, job.dims.tensor, t.tensor, t.tensor_ops);
  talk(send, 2, t.pipe, t.pipe_ops);
  talk(all_reduce, 2, t.tied, 1);
  return seconds;
}

// Passes the update makes over its shard at memory speed where the profile has no
// elementwise rates.
double update_passes(const OptimizerConfig& o) { return o.name == "adamw" ? 12 : 4; }

// A step's seconds on this machine's CPU (every rank planned on it): the ranks compute at
// once, the machine runs `busy` threads (its cores at most), at the rates measured for that
// many, and the ranks that fit on them at once (`running`) each get their part. Two
// one-thread ranks on two cores each get half of two threads' rate, not a lone thread's
// (the GPT at d2 took 0.85-0.92x the step of one process on two threads; a lone thread's
// rate said 0.58-0.70x). This rank's work, stretched by its bubble at that rate, bounds the
// step; so does every rank's work at the machine's rate: where ranks outnumber the cores,
// those a stage's bubble idles give their cores to the others (4 ranks on 2 cores, d2 x p2
// 1F1B at one micro-batch: 211 ms a step, the bubble's stretch said 422).
double cpu_step_seconds(const Job& job, const Coord& at, int64_t shard, const Traffic& t,
                        const MachineProfile& profile, double& bubble) {
  const auto& cfg = job.cfg;
  const double threads = double(intra_op_threads(cfg.train.threads, profile.cores, job.world));
  const double busy = std::min(double(profile.cores), double(job.world) * threads);
  const double running = busy / threads;
  const bool bf16 = cfg.precision.dtype == "bf16";  // autocast's matmuls
  const Speed speed{[&](double side, double, bool batched) {
                      return profile.matmul_flops(side, busy, bf16, batched);
                    },
                    profile.memory_bytes(busy), profile.elementwise_values(busy, bf16, false),
                    profile.elementwise_values(busy, bf16, true)};
  const double passes = update_passes(cfg.optimizer);
  double machine = 0;  // every rank's work, the machine's alone
  for (int64_t s = 0; s < job.dims.pipeline; ++s) {
    const int64_t stage_shard = job.cost_of(job.rank_at(Coord{0, 0, s})).sync.shard;
    machine += work_seconds(job, s, speed, stage_shard, passes) * double(job.dims.data * job.dims.tensor);
  }
  const double mine = step_work_seconds(job, at.pipeline, speed, shard, passes, bubble) * running;
  // And where they outnumber the cores, a rank that waits on another (a pipeline's
  // receiver, a tensor group's all-reduce) waits for a core back.
  double waits = 0;
  if (running < double(job.world)) {
    if (job.dims.pipeline > 1) waits += profile.crowded.handoff_s * t.pipe_ops;
    if (job.dims.tensor > 1) waits += profile.crowded.all_reduce_s * t.tensor_ops;
  }
  return std::max(mine, machine) + waits + talk_seconds(job, t, profile, profile.all_reduce, profile.send);
}

// The time of a step where the profile measured the planned device: the chunks' work as the
// schedule plays it, the update over its shard, the talk. On a GPU the links of the backend
// the ranks take: the GPU's where the profile measured that backend, else Gloo's between
// processes (its copies through the host aside); NCCL unmeasured (a profile of one GPU)
// leaves no estimate.
std::optional<double> step_seconds(const Job& job, const Coord& at, int64_t shard, const Traffic& t,
                                   const MachineProfile& profile, double& bubble) {
  if (!job.cuda && !profile.matmul.empty()) return cpu_step_seconds(job, at, shard, t, profile, bubble);
  if (!job.cuda || !profile.gpu) return std::nullopt;
  const auto& g = *profile.gpu;
  const std::string backend = job.world > 1 ? gpu_backend(job, g) : g.backend;
  const double work = gpu_step_seconds(job, at, g, shard, double(job.held(at.pipeline).entries.size()),
                                       update_passes(job.cfg.optimizer), bubble);
  if (backend == g.backend) return work + talk_seconds(job, t, profile, g.all_reduce, g.send);
  if (backend == "gloo") return work + talk_seconds(job, t, profile, profile.all_reduce, profile.send);
  return std::nullopt;
}

// Rank `rank`'s plan, from the job worked out once for every rank planned: the model's
// costs for its chunks, the schedule's, and what its mode declares for its parameters.
RankPlan rank_plan(const Job& job, int64_t rank, const MachineProfile* profile) {
  const JobConfig& cfg = job.cfg;
  const RankCost& cost = job.cost_of(rank);
  const SyncCost& sync = cost.sync;
  RankPlan out;
  out.rank = rank;
  out.coord = job.coord(rank);
  const Coord at = out.coord;
  // Parameters, gradients, optimizer state: as the summary's parameters_mb, gradient_mb,
  // optimizer_state_mb count them.
  MemoryPlan& m = out.memory;
  if (!job.cuda) {
    m.data = data_bytes(cfg);
    m.runtime = runtime_bytes(workers_forked(job.world)) + kLoaderThreadBytes * double(cfg.data.workers);
  }
  m.params = sync.params;
  m.grads = sync.grads;
  m.optimizer = 4 * double(slot_names(cfg.optimizer).size()) * double(sync.shard);
  if (!cost.trains) {  // a rank apart from the layout (a parameter server)
    out.role = cost.role;
    out.trains = false;
    out.alike = job.apart;
    return out;
  }
  out.role = job.stages() > 1 ? fmt::format("stage {} of {}", at.pipeline, job.dims.pipeline) : cost.role;
  out.alike = job.dims.data * job.dims.tensor;
  std::vector<ChunkCost> chunks;  // in its chunk order
  for (int64_t c = 0; c < job.chunks; ++c) chunks.push_back(chunk_cost(job, job.stage(c, at.pipeline)));
  m.activations = activation_bytes(job, at.pipeline, chunks);
  // Buffers: the loader's batches, and what the gradient's path holds (the sync's).
  m.buffers = double(cfg.data.prefetch) * batch_bytes(cfg, job.rows * double(job.micro)) + sync.buffers;
  for (const auto& cc : chunks) out.flops += cc.flops * job.rows * double(job.micro);
  const Traffic t = traffic(job, chunks, sync, job.held(at.pipeline));
  if (sync.bytes) out.comm_bytes = t.total();
  // The bubble: this rank's waits in the schedule played out with each stage taking its
  // FLOPs, or, where the profile measured the device, the time it computes.
  if (job.dims.pipeline > 1) out.bubble = played(job, kFlops).bubble(at.pipeline);
  if (profile && sync.bytes) out.step_s = step_seconds(job, at, sync.shard, t, *profile, out.bubble);
  return out;
}

}  // namespace

std::vector<PartRange> planned_split(const JobConfig& cfg, int64_t stages, int64_t tensor) {
  const ModelContext whole = outline_context(cfg, 0, tensor);
  return stage_split(cfg, *model_spec(cfg.model.arch).build(cfg.model, whole), whole, stages);
}

bool plans_gpu(const JobConfig& cfg, const Devices& devices) {
  return plan_device(cfg, 0, 1, mode_spec(cfg.parallel.mode).any_source, devices).device.is_cuda();
}

RankPlan plan_rank(const JobConfig& cfg, int64_t world, int64_t rank, const MachineProfile* profile) {
  return rank_plan(Job(cfg, world), rank, profile);
}

Plan plan_job(const JobConfig& cfg, int64_t world, const MachineProfile* profile, const Devices& devices) {
  const Job job(cfg, world, devices);
  Plan plan;
  plan.dims = job.dims;
  plan.world = world;
  plan.device = job.cuda ? "cuda" : "cpu";
  if (job.cuda && profile && profile->gpu) plan.ranks_per_gpu = int64_t(ranks_per_gpu(job, *profile->gpu));
  if (job.apart > 0) plan.ranks.push_back(rank_plan(job, 0, profile));
  for (int64_t s = 0; s < job.dims.pipeline; ++s)
    plan.ranks.push_back(rank_plan(job, job.rank_at({0, 0, s}), profile));
  bool timed = profile != nullptr;
  double slowest = 0;
  for (const auto& r : plan.ranks) {
    plan.world_memory += r.memory.total() * double(r.alike);
    if (!r.trains) continue;
    timed = timed && r.step_s.has_value();
    if (r.step_s) slowest = std::max(slowest, *r.step_s);
  }
  if (timed && slowest > 0) {
    plan.step_s = slowest;
    plan.samples_per_s = double(cfg.data.batch_size) / slowest;
  }
  return plan;
}

std::string plan_table(const JobConfig& cfg, const Plan& plan) {
  const auto& p = cfg.parallel;
  // Under fault tolerance the data ranks are replicas (of replica_data each: HSDP).
  const int64_t inside = cfg.fault_tolerance.replica_data;
  const std::string replicas =
      cfg.fault_tolerance.mode != "replicas" ? ""
      : inside > 1 ? fmt::format(" ({} fault-tolerant replicas of data {})", plan.dims.data / inside, inside)
                   : fmt::format(" ({} fault-tolerant replicas)", plan.dims.data);
  std::string out = fmt::format(
      "{} process(es): {}{}{}, zero {}, {} micro-batch(es) of {} sample(s){}, {}\n",
      plan.world, plan.dims.str(), replicas,
      plan.world > plan.dims.world() ? fmt::format(" + {} server(s)", plan.world - plan.dims.world()) : "",
      p.zero, cfg.train.grad_accum,
      cfg.data.batch_size / (plan.dims.data * cfg.train.grad_accum),
      plan.dims.pipeline > 1 ? fmt::format(", schedule {}", p.schedule) : "", plan.device);
  auto mb = [](double bytes) { return fmt::format("{:.1f}", bytes / kMiB); };
  auto opt = [&](const std::optional<double>& v) { return v ? mb(*v) : std::string("-"); };
  out += fmt::format("{:<5} {:<14} {:>5} | {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} | {:>11} {:>6} {:>10}\n",
                     "rank", "role", "alike", "params", "grads", "optimizer", "activ.", "buffers",
                     "data", "runtime", "total MB", "sent MB/step", "bubble", "GFLOP/step");
  for (const auto& r : plan.ranks) {
    const auto& m = r.memory;
    out += fmt::format("{:<5} {:<14} {:>5} | {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} | {:>11} {:>6.3f} {:>10.3f}\n",
                       r.rank, r.role.empty() ? "-" : r.role, r.alike, mb(m.params), mb(m.grads),
                       mb(m.optimizer), mb(m.activations), mb(m.buffers), opt(m.data),
                       opt(m.runtime), mb(m.total()),
                       r.comm_bytes ? fmt::format("{:.3f}", *r.comm_bytes / kMiB) : std::string("-"),
                       r.bubble, r.flops / 1e9);
  }
  if (plan.step_s)
    out += fmt::format("expected step {:.4g} s, {:.4g} samples/s (the slowest rank; from the "
                       "machine profile)\n", *plan.step_s, *plan.samples_per_s);
  return out;
}

nlohmann::json plan_json(const JobConfig& cfg, const Plan& plan) {
  auto or_null = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  auto mb = [&](const std::optional<double>& bytes) { return or_null(bytes ? *bytes / kMiB : bytes); };
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : plan.ranks) {
    const auto& m = r.memory;
    ranks.push_back({{"rank", r.rank},
                     {"role", r.role},
                     {"alike", r.alike},
                     {"coord", {{"data", r.coord.data}, {"tensor", r.coord.tensor}, {"pipeline", r.coord.pipeline}}},
                     {"memory_mb", {{"params", mb(m.params)}, {"grads", mb(m.grads)},
                                    {"optimizer", mb(m.optimizer)}, {"activations", mb(m.activations)},
                                    {"buffers", mb(m.buffers)}, {"data", mb(m.data)},
                                    {"runtime", mb(m.runtime)}, {"total", mb(m.total())}}},
                     {"comm_bytes", or_null(r.comm_bytes)},
                     {"bubble", r.bubble},
                     {"flops", r.flops},
                     {"step_s", or_null(r.step_s)}});
  }
  const auto& p = cfg.parallel;
  return {{"layout", {{"data", plan.dims.data}, {"tensor", plan.dims.tensor},
                      {"pipeline", plan.dims.pipeline}, {"zero", p.zero},
                      {"schedule", p.schedule}, {"grad_accum", cfg.train.grad_accum},
                      {"mode", p.mode}}},
          {"world", plan.world},
          {"device", plan.device},
          {"ranks", ranks},
          {"step_s", or_null(plan.step_s)},
          {"samples_per_s", or_null(plan.samples_per_s)}};
}

}  // namespace dtrain
