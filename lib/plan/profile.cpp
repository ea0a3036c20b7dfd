#include "plan/profile.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "launch/device.hpp"
#include "layers/linear.hpp"
#include "util/affinity.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "util/memory.hpp"
#include "util/process.hpp"

#ifdef DTRAIN_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// Seconds per call of `fn`, over at least `budget` seconds after warming up for 30 ms:
// after a spell on one thread (or idle) the other cores come back slowly, and a step's
// back-to-back products see them warm (docs/plan.md has the figures).
template <class Fn>
double seconds_per(Fn fn, double budget = 0.2) {
  const auto warm = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - warm).count() < 0.03) fn();
  int64_t calls = 0;
  const auto start = Clock::now();
  double took = 0;
  do {
    fn();
    ++calls;
    took = std::chrono::duration<double>(Clock::now() - start).count();
  } while (took < budget);
  return took / double(calls);
}

// The middle of three values.
double median(std::array<double, 3> v) {
  std::sort(v.begin(), v.end());
  return v[1];
}

// A product whose smallest side is n, of about `work` multiply-adds a call, in the shapes
// training runs them: activations times a weight, [R, n] x [n, n] (R at least `min_rows`);
// or, `batched`, a batch of attention's small products [4n, n] x [n, 4n]; an operand at
// most 2^28 values (1 GiB in fp32). Its multiply-adds and a call's seconds, by `time(call)`.
struct Timed {
  double macs = 0, seconds = 0;
  double flops() const { return 2 * macs / seconds; }
};
template <class Time>
Timed time_product(int64_t n, double work, double min_rows, const torch::TensorOptions& like,
                   bool batched, Time time) {
  const double cap = double(int64_t(1) << 28), side = double(n);
  torch::Tensor a, b, c;
  if (batched) {
    const double each = 16 * side * side * side;
    const int64_t batch = int64_t(std::clamp(work / each, 1.0, cap / (4 * side * side)));
    a = torch::randn({batch, 4 * n, n}, like), b = torch::randn({batch, n, 4 * n}, like);
    c = torch::empty({batch, 4 * n, 4 * n}, like);
    return {double(batch) * each, time([&] { at::bmm_out(c, a, b); })};
  }
  const int64_t rows = int64_t(std::clamp(work / (side * side), min_rows, cap / side));
  a = torch::randn({rows, n}, like), b = torch::randn({n, n}, like);
  // A dense layer's product, by the kernel its layers take (layers/linear.hpp).
  return {double(rows) * side * side, time([&] { (void)dtrain::linear(a, b); })};
}

// flop/s of a product whose smallest side is n on this CPU, about 33 MFLOP or more a call
// (so that threads have work to share), at least n rows. A square product's rate by volume
// was up to 1.8x faster than the GPT's own at 2 threads, and 2x faster than its attention's.
double matmul_rate(int64_t n, torch::Dtype dtype, bool batched, double budget) {
  return time_product(n, 0x1p24, double(n), torch::TensorOptions().dtype(dtype), batched,
                      [&](const auto& call) { return seconds_per(call, budget); })
      .flops();
}

// Values a second of `op` writing a new tensor of 2^21 values of `dtype`: a sum, or GELU
// (tanh's approximation, as the GPT's).
double elementwise_rate(torch::Dtype dtype, bool transcendental, double budget) {
  const auto like = torch::TensorOptions().dtype(dtype);
  const auto a = torch::randn({int64_t(1) << 21}, like), b = torch::randn({int64_t(1) << 21}, like);
  const double seconds = transcendental ? seconds_per([&] { (void)at::gelu(a, "tanh"); }, budget)
                                        : seconds_per([&] { (void)at::add(a, b); }, budget);
  return double(a.numel()) / seconds;
}

double memory_rate(double budget) {
  auto a = torch::zeros({int64_t(16) << 20}), b = torch::ones({int64_t(16) << 20});
  return 3.0 * 4 * double(a.numel()) / seconds_per([&] { a.add_(b); }, budget);  // read a and b, write a
}

// Latency and bandwidth from the time of a small and a large operation.
MachineProfile::Link fit(int64_t ranks, double small_bytes, double small_s, double large_bytes,
                         double large_s) {
  MachineProfile::Link l;
  l.ranks = ranks;
  l.bytes_per_s = (large_bytes - small_bytes) / std::max(large_s - small_s, 1e-9);
  l.latency_s = std::max(0.0, small_s - small_bytes / l.bytes_per_s);
  return l;
}

// Runs rank(r) for ranks 0 to n - 1, each on a thread of its own; rethrows the first
// rank's failure once all have ended.
void on_threads(int64_t n, const std::function<void(int64_t)>& rank) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        rank(r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// All-reduce and send/recv among `n` ranks as threads of this process, real Gloo on
// loopback (or `opts`' backend, with rank r's tensors on `device(r)`): the links of rank
// 0, which sends as every rank does.
std::pair<MachineProfile::Link, MachineProfile::Link> measure_links(
    int64_t n, const CommOptions& opts = {},
    const std::function<c10::Device(int64_t)>& device = [](int64_t) { return c10::Device(c10::kCPU); }) {
  static int calls = 0;
  // A CUDA tensor's operations may be queued on a stream: the host waits for them (a read).
  auto settle = [](const torch::Tensor& t) {
    if (t.is_cuda()) (void)t[0].item<float>();
  };
  const std::string rendezvous = fmt::format("profile-{}-{}", ::getpid(), calls++);
  const int64_t small = 1024, large = int64_t(4) << 20;  // floats
  std::vector<double> times(4, 0);
  on_threads(n, [&](int64_t r) {
    const c10::Device here = device(r);
    if (here.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(here);
    CommOptions mine = opts;
    mine.device = here;
    mine.comm_first = n <= usable_cpus();  // as a run's ranks would (dtrain run)
    auto comm = make_in_process_comm(rendezvous, r, n, mine);
    const auto on = torch::TensorOptions().device(here);
    // A fixed number of each (every rank must make the same calls), each timed alone, and
    // the first quartile kept: back to back on idle cores, many small ones wait for a core
    // to wake, which a run's buckets do not (docs/plan.md has the figures).
    auto quartile = [&](int k, bool warm_up, auto op) {
      auto t = torch::ones({k == 0 ? small : large}, on);
      if (warm_up) op(t);
      comm->barrier();
      std::vector<double> v;
      for (int i = 0; i < (k == 0 ? 200 : 11); ++i) {
        const auto start = Clock::now();
        op(t);
        settle(t);
        v.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 4), v.end());
      return v[v.size() / 4];
    };
    for (int k = 0; k < 2; ++k) {
      const double took = quartile(k, /*warm_up=*/true, [&](torch::Tensor& t) { comm->all_reduce(t); });
      if (r == 0) times[size_t(k)] = took;
    }
    for (int k = 0; k < 2; ++k) {  // rank 0 sends to 1 and back: half of it one way
      const double took = quartile(k, /*warm_up=*/false, [&](torch::Tensor& t) {
        if (r == 0) comm->send(t, 1), comm->recv(t, 1);
        if (r == 1) comm->recv(t, 0), comm->send(t, 0);
      });
      if (r == 0) times[size_t(2 + k)] = took / 2;
    }
    comm->barrier();
  });
  auto ring = [&](double floats) { return 2 * 4 * floats * double(n - 1) / double(n); };
  return {fit(n, ring(double(small)), times[0], ring(double(large)), times[1]),
          fit(n, 4.0 * double(small), times[2], 4.0 * double(large), times[3])};
}

// What waiting on another rank costs where ranks outnumber the cores: `n` ranks as threads
// (twice the cores), in pairs, each rank working items of one-thread work. Every rank
// computes all the time, as a pipeline's stages past the bubble and a tensor group's ranks
// do, so the same work alone takes the machine's time for it; the difference, over the
// items, is what each item's wait costs: a pipeline's hand-off (the first of a pair sends
// a small tensor on after each item, the second receives it before its own) or a tensor
// group's all-reduce (both sum a small tensor after each item). 4 ranks on 2 cores: a few
// milliseconds, where the bytes take 50 us.
MachineProfile::Crowded measure_crowded(int64_t n) {
  static int calls = 0;
  const std::string rendezvous = fmt::format("crowded-{}-{}", ::getpid(), calls++);
  // An item of work: a dependent chain of multiply-adds, about 2 ms on one thread alone.
  std::atomic<double> sink{0};
  auto work = [&](int64_t steps) {
    double x = 1;
    for (int64_t i = 0; i < steps; ++i) x = x * 0.999999 + 1e-7;
    sink.store(x, std::memory_order_relaxed);  // the chain is computed, not optimized away
  };
  int64_t steps = 1 << 16;
  for (;;) {
    const auto start = Clock::now();
    work(steps);
    if (std::chrono::duration<double>(Clock::now() - start).count() >= 2e-3 || steps >= (int64_t(1) << 30)) break;
    steps *= 2;
  }
  enum Wait { kNone, kHandoff, kAllReduce };
  const int items = 24;
  std::array<std::array<double, 3>, 3> took{};  // [wait][sweep]
  on_threads(n, [&](int64_t r) {
    CommOptions opts;
    opts.comm_first = false;  // as dtrain run sets it where ranks outnumber the cores
    auto comm = make_in_process_comm(rendezvous, r, n, opts);
    const int64_t first = r - r % 2, partner = r ^ 1;  // pairs (0, 1), (2, 3), ...
    auto pair = comm->new_group(fmt::format("pair-{}", first), {first, first + 1});
    auto t = torch::ones({1024});
    for (int sweep = 0; sweep < 3; ++sweep)
      for (Wait wait : {kNone, kHandoff, kAllReduce}) {
        comm->barrier();
        const auto start = Clock::now();
        for (int i = 0; i < items; ++i) {
          if (wait == kHandoff && r % 2 == 1) comm->recv(t, partner);
          work(steps);
          if (wait == kHandoff && r % 2 == 0) comm->send(t, partner);
          if (wait == kAllReduce) pair->all_reduce(t);
        }
        comm->barrier();
        if (r == 0) took[wait][size_t(sweep)] = std::chrono::duration<double>(Clock::now() - start).count();
      }
  });
  auto per_item = [&](Wait wait) { return std::max(0.0, (median(took[wait]) - median(took[kNone])) / items); };
  return {n, per_item(kHandoff), per_item(kAllReduce)};
}

// The CPU's rates into `p` (its cores set): matmuls by dtype and size, memory, elementwise
// kernels, each on one thread and on all.
void measure_rates(MachineProfile& p) {
  // Three sweeps over every shape, one thread then all, and each rate the fastest of its
  // three: a shared machine's slow spells last seconds (a rate on all threads measured
  // back to back varied by up to 3x here), so the timings of one point are spread apart,
  // and a spell only slows a timing. The middle of three kept a spell that spanned two
  // sweeps: profiles minutes apart read 150 and 225 GFLOP/s for the same product on two
  // threads, where the GPT's steps ran at the faster.
  const struct {
    torch::Dtype dtype;
    bool batched;
    std::vector<MachineProfile::Matmul>* into;
    std::vector<int64_t> sizes;
  } tables[] = {{torch::kFloat32, false, &p.matmul, {32, 64, 128, 256, 512}},
                {torch::kFloat32, true, &p.bmm, {16, 32, 64, 128}},
                {torch::kBFloat16, false, &p.matmul_bf16, {32, 64, 128, 256, 512}},
                {torch::kBFloat16, true, &p.bmm_bf16, {16, 32, 64, 128}}};
  constexpr double kBudget = 0.07;  // seconds a timing
  std::map<std::pair<const void*, int64_t>, std::array<double, 3>> one, all;
  std::array<double, 3> memory_one{}, memory_all{};
  // Each dtype's sum and GELU, into the profile's one-thread and all-threads rates.
  const struct {
    torch::Dtype dtype;
    bool transcendental;
    double *one, *all;
  } kernels[] = {
      {torch::kFloat32, false, &p.elementwise.plain_one, &p.elementwise.plain_all},
      {torch::kFloat32, true, &p.elementwise.transcendental_one, &p.elementwise.transcendental_all},
      {torch::kBFloat16, false, &p.elementwise_bf16.plain_one, &p.elementwise_bf16.plain_all},
      {torch::kBFloat16, true, &p.elementwise_bf16.transcendental_one, &p.elementwise_bf16.transcendental_all}};
  std::map<double*, std::array<double, 3>> elementwise;
  // As a run's steps take their memory: a freed tensor's pages reused, not mapped anew
  // (without keep_cpu_blocks every product's output of 2 MiB or more paid the kernel's
  // page faults, and the rates came out at a third of a run's).
  tune_allocator();
  keep_cpu_blocks();
  use_cpu_matmul("auto");  // the dense layers' product as a run takes it by default
  // Threads pinned as a run pins them (util/affinity.hpp): one thread on its own CPU, or
  // a thread on each, so that the rates are those of the run's placement.
  auto use_threads = [&](int64_t n) {
    torch::set_num_threads(int(n));
    pin_compute_threads(n, 0, p.cores / n);
  };
  // `rate` on one thread, then on all (the same where there is one core).
  auto one_and_all = [&](const std::function<double()>& rate, double& one, double& all) {
    use_threads(1);
    one = rate();
    use_threads(p.cores);
    all = p.cores > 1 ? rate() : one;
  };
  for (size_t sweep = 0; sweep < 3; ++sweep) {
    for (const auto& table : tables)
      for (int64_t n : table.sizes) {
        const auto key = std::pair{static_cast<const void*>(table.into), n};
        one_and_all([&] { return matmul_rate(n, table.dtype, table.batched, kBudget); },
                    one[key][sweep], all[key][sweep]);
      }
    one_and_all([&] { return memory_rate(kBudget); }, memory_one[sweep], memory_all[sweep]);
    for (const auto& k : kernels)
      one_and_all([&] { return elementwise_rate(k.dtype, k.transcendental, kBudget); },
                  elementwise[k.one][sweep], elementwise[k.all][sweep]);
  }
  auto fastest = [](const std::array<double, 3>& v) { return *std::max_element(v.begin(), v.end()); };
  for (const auto& [into, rates] : elementwise) *into = fastest(rates);
  for (const auto& table : tables)
    for (int64_t n : table.sizes) {
      const auto key = std::pair{static_cast<const void*>(table.into), n};
      table.into->push_back({double(n), fastest(one[key]), fastest(all[key])});
    }
  p.memory_one = fastest(memory_one);
  p.memory_all = fastest(memory_all);
}

#ifdef DTRAIN_CUDA
// Seconds per call of `fn` on the GPU: calls queued back to back, then one wait for all
// of them; doubled until they take `budget` seconds.
double gpu_seconds_per(const std::function<void()>& fn, double budget) {
  fn();
  c10::cuda::device_synchronize();
  for (int64_t calls = 1;; calls *= 2) {
    const auto start = Clock::now();
    for (int64_t i = 0; i < calls; ++i) fn();
    c10::cuda::device_synchronize();
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    if (took >= budget || calls >= (int64_t(1) << 20)) return took / double(calls);
  }
}

// The GPU's rate of time_product's product of about `work` multiply-adds (at least 16 rows).
MachineProfile::Gpu::Rate gpu_matmul_rate(int64_t n, double work, torch::Dtype dtype, bool batched,
                                          double budget) {
  const Timed t = time_product(n, work, 16, torch::TensorOptions().dtype(dtype).device(torch::kCUDA),
                               batched, [&](const std::function<void()>& call) {
                                 return gpu_seconds_per(call, budget);
                               });
  return {double(n), t.macs, t.flops()};
}

// The first GPU: its matmuls by dtype, size and work; its memory's speed; the host's time
// per kernel launch; the links between its ranks (NCCL between GPUs, else Gloo through the
// host between ranks sharing it).
MachineProfile::Gpu measure_gpu(int64_t max_ranks) {
  MachineProfile::Gpu g;
  const c10::Device dev(c10::kCUDA, 0);
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(dev);
  const auto* props = at::cuda::getDeviceProperties(0);
  g.name = props->name;
  g.memory = double(props->totalGlobalMem);
  g.count = int64_t(torch::cuda::device_count());
  constexpr double kBudget = 0.02;
  auto& context = at::globalContext();
  const bool tf32_before = context.allowTF32CuBLAS();
  const struct {
    const char* name;
    torch::Dtype dtype;
    bool tf32;
  } dtypes[] = {{"fp32", torch::kFloat32, false}, {"tf32", torch::kFloat32, true},
                {"bf16", torch::kBFloat16, false}, {"fp16", torch::kFloat16, false}};
  for (const auto& d : dtypes) {
    context.setAllowTF32CuBLAS(d.tf32);
    auto rates = [&](std::vector<MachineProfile::Gpu::Rate>& list, bool batched,
                     std::initializer_list<int64_t> sizes, std::initializer_list<double> works) {
      for (int64_t n : sizes)
        for (double work : works) {
          const auto r = gpu_matmul_rate(n, work, d.dtype, batched, kBudget);
          // A clamped shape repeats a point: kept once.
          if (list.empty() || list.back().size != r.size || list.back().work != r.work) list.push_back(r);
        }
    };
    rates(g.matmul[d.name], /*batched=*/false, {64, 256, 1024, 4096}, {0x1p22, 0x1p26, 0x1p30, 0x1p34});
    rates(g.bmm[d.name], /*batched=*/true, {32, 64, 128}, {0x1p24, 0x1p28, 0x1p32});
  }
  context.setAllowTF32CuBLAS(tf32_before);
  {
    auto a = torch::zeros({int64_t(1) << 26}, dev), b = torch::ones({int64_t(1) << 26}, dev);
    g.memory_bytes_per_s = 3.0 * 4 * double(a.numel()) / gpu_seconds_per([&] { a.add_(b); }, kBudget);
    auto one = torch::zeros({1}, dev), other = torch::ones({1}, dev);
    g.launch_s = gpu_seconds_per([&] { one.add_(other); }, 0.05);
  }
  const bool nccl = g.count > 1 && nccl_built();
  g.backend = nccl ? "nccl" : "gloo";
  CommOptions opts;
  opts.backend = g.backend;
  const int64_t most = nccl ? std::min(g.count, max_ranks) : max_ranks;
  for (int64_t n = 2; n <= std::max<int64_t>(2, most); n *= 2) {
    auto [all_reduce, send] = measure_links(n, opts, [&](int64_t r) {
      return c10::Device(c10::kCUDA, c10::DeviceIndex(nccl ? r : 0));
    });
    g.all_reduce.push_back(all_reduce);
    g.send.push_back(send);
  }
  // The operands' gigabytes go back to the device: parallel.auto measures in the process
  // that then starts (or is) a rank.
  c10::cuda::CUDACachingAllocator::emptyCache();
  return g;
}
#endif

// A rate at `threads`, linear between its one-thread and all-`cores` measurements.
double at_threads(double one, double all, double threads, int64_t cores) {
  const double t = std::clamp(threads, 1.0, double(cores));
  return cores > 1 ? one + (all - one) * (t - 1) / double(cores - 1) : one;
}

// The y of `points` (x, y), ascending in x, at `x`: interpolated in log(x), held at the ends.
double log_interp(const std::vector<std::pair<double, double>>& points, double x) {
  if (x <= points.front().first) return points.front().second;
  for (size_t i = 1; i < points.size(); ++i)
    if (x <= points[i].first) {
      const auto& [x0, y0] = points[i - 1];
      const double w = std::log(x / x0) / std::log(points[i].first / x0);
      return y0 * (1 - w) + points[i].second * w;
    }
  return points.back().second;
}
}  // namespace

double MachineProfile::matmul_flops(double size, double threads, bool bf16, bool batched) const {
  const auto& plain = bf16 && !matmul_bf16.empty() ? matmul_bf16 : this->matmul;
  const auto& small = bf16 && !bmm_bf16.empty() ? bmm_bf16 : bmm;
  const auto& matmul = batched && !small.empty() ? small : plain;
  if (matmul.empty()) return 0;
  std::vector<std::pair<double, double>> rates;  // by size
  for (const auto& m : matmul) rates.emplace_back(m.size, at_threads(m.one, m.all, threads, cores));
  // Below the smallest size measured, in proportion to the size (not held).
  if (size <= rates.front().first) return rates.front().second * size / rates.front().first;
  return log_interp(rates, size);
}

double MachineProfile::Gpu::matmul_flops(double size, double work, const std::string& dtype,
                                          bool batched) const {
  const auto& table = batched && !bmm.empty() ? bmm : matmul;
  auto it = table.find(dtype);
  if (it == table.end()) it = table.find("fp32");
  if (it == table.end() || it->second.empty()) return 0;
  const auto& rates = it->second;  // by size, then by work
  std::vector<std::pair<double, double>> sizes, works;  // each size's rate at `work`; one size's
  for (size_t lo = 0; lo < rates.size(); lo += works.size()) {
    works.clear();
    for (size_t i = lo; i < rates.size() && rates[i].size == rates[lo].size; ++i)
      works.emplace_back(rates[i].work, rates[i].flops);
    sizes.emplace_back(rates[lo].size, log_interp(works, work));
  }
  return log_interp(sizes, size);
}

double MachineProfile::memory_bytes(double threads) const {
  return at_threads(memory_one, memory_all, threads, cores);
}

double MachineProfile::elementwise_values(double threads, bool bf16, bool transcendental) const {
  const Elementwise& e = bf16 ? elementwise_bf16 : elementwise;
  return transcendental ? at_threads(e.transcendental_one, e.transcendental_all, threads, cores)
                        : at_threads(e.plain_one, e.plain_all, threads, cores);
}

const MachineProfile::Link* MachineProfile::link(const std::vector<Link>& links, int64_t ranks) const {
  const Link* best = nullptr;
  for (const auto& l : links)
    if (!best || std::abs(l.ranks - ranks) < std::abs(best->ranks - ranks)) best = &l;
  return best;
}

MachineProfile measure_machine(int64_t max_ranks) {
  MachineProfile p;
  p.host = host_name();
  p.build = build_info();
  p.cores = usable_cpus();
  torch::NoGradGuard no_grad;
  const int before = torch::get_num_threads();
  measure_rates(p);
  torch::set_num_threads(1);
  unpin_this_thread();  // the ranks' threads below are made by this one
  for (int64_t n = 2; n <= std::max<int64_t>(2, max_ranks); n *= 2) {
    auto [all_reduce, send] = measure_links(n);
    p.all_reduce.push_back(all_reduce);
    p.send.push_back(send);
  }
  if (p.cores <= 8) p.crowded = measure_crowded(2 * p.cores);
  torch::set_num_threads(before);
#ifdef DTRAIN_CUDA
  if (visible_gpus() > 0) p.gpu = measure_gpu(max_ranks);
#endif
  return p;
}

std::string default_profile_path() {
  if (const char* p = std::getenv("DTRAIN_PROFILE"); p && *p) return p;
  if (const char* c = std::getenv("XDG_CACHE_HOME"); c && *c) return std::string(c) + "/dtrain/machine.json";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/dtrain/machine.json";
}

// The parts whose members are named as their keys; every key required on reading.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MachineProfile::Link, ranks, latency_s, bytes_per_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MachineProfile::Crowded, ranks, handoff_s, all_reduce_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MachineProfile::Gpu::Rate, size, work, flops)
// The others under names that say their units.
void to_json(nlohmann::json& j, const MachineProfile::Matmul& m) {
  j = {{"size", m.size}, {"one_thread_flops", m.one}, {"all_threads_flops", m.all}};
}
void to_json(nlohmann::json& j, const MachineProfile::Elementwise& e) {
  j = {{"plain_one_thread_values_per_s", e.plain_one},
       {"plain_all_threads_values_per_s", e.plain_all},
       {"transcendental_one_thread_values_per_s", e.transcendental_one},
       {"transcendental_all_threads_values_per_s", e.transcendental_all}};
}
void from_json(const nlohmann::json& j, MachineProfile::Elementwise& e) {
  e.plain_one = j.at("plain_one_thread_values_per_s").get<double>();
  e.plain_all = j.at("plain_all_threads_values_per_s").get<double>();
  e.transcendental_one = j.at("transcendental_one_thread_values_per_s").get<double>();
  e.transcendental_all = j.at("transcendental_all_threads_values_per_s").get<double>();
}

namespace {
nlohmann::json gpu_json(const MachineProfile::Gpu& g) {
  return {{"name", g.name},
          {"count", g.count},
          {"memory_bytes", g.memory},
          {"matmul", g.matmul},
          {"bmm", g.bmm},
          {"memory_bytes_per_s", g.memory_bytes_per_s},
          {"launch_s", g.launch_s},
          {"backend", g.backend},
          {"all_reduce", g.all_reduce},
          {"send", g.send}};
}
MachineProfile::Gpu gpu_of(const nlohmann::json& j) {
  MachineProfile::Gpu g;
  g.name = j.at("name");
  g.count = j.at("count");
  g.memory = j.at("memory_bytes");
  j.at("matmul").get_to(g.matmul);
  j.at("bmm").get_to(g.bmm);
  g.memory_bytes_per_s = j.at("memory_bytes_per_s");
  g.launch_s = j.at("launch_s");
  g.backend = j.at("backend");
  j.at("all_reduce").get_to(g.all_reduce);
  j.at("send").get_to(g.send);
  if (g.matmul.count("fp32") == 0 || g.memory_bytes_per_s <= 0) throw std::runtime_error("no GPU measurements");
  return g;
}

nlohmann::json profile_json(const MachineProfile& p) {
  return {{"format", "dtrain-machine"}, {"version", 6},    {"host", p.host},
          {"build", p.build},           {"cores", p.cores}, {"matmul_fp32", p.matmul},
          {"matmul_bf16", p.matmul_bf16}, {"bmm_fp32", p.bmm},
          {"bmm_bf16", p.bmm_bf16},
          {"memory_one_thread_bytes_per_s", p.memory_one},
          {"memory_all_threads_bytes_per_s", p.memory_all},
          {"elementwise_fp32", p.elementwise},
          {"elementwise_bf16", p.elementwise_bf16},
          {"gloo_all_reduce", p.all_reduce},
          {"gloo_send", p.send},
          {"crowded", p.crowded},
          {"gpu", p.gpu ? gpu_json(*p.gpu) : nlohmann::json(nullptr)}};
}
}  // namespace

MachineProfile measure_in_child(int64_t max_ranks, std::chrono::seconds timeout) {
  namespace fs = std::filesystem;
  std::error_code ec;
  auto dir = fs::temp_directory_path(ec);
  if (ec) dir = "/tmp";  // $TMPDIR names no folder
  auto name = (dir / "dtrain-profile-XXXXXX").string();
  const int fd = ::mkstemp(name.data());
  fail_if<RunDirError>(fd < 0, "parallel.auto: cannot make a temporary file to measure this "
                               "machine into ({}): {}", name, std::strerror(errno));
  ::close(fd);
  const std::string log = name + ".log";
  const ChildResult r = run_child({"/proc/self/exe", "plan", "--measure", "--nproc",
                                   std::to_string(max_ranks), "--profile", name},
                                  timeout, log);
  std::optional<MachineProfile> measured;
  std::string said;
  try {
    if (r.ok()) measured = load_profile(name);
  } catch (const Error& e) {
    said = first_line(e.what());
  }
  if (!measured && said.empty()) {  // the child's last line: its error
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) said = line;
  }
  ::unlink(name.c_str());
  ::unlink(log.c_str());
  if (measured) return *measured;
  // The child's own exit code where it names the input (exit 3: a temporary folder it
  // cannot write), else an internal failure.
  throw Error(r.code == kExitBadData ? kExitBadData : kExitFailure,
              fmt::format("parallel.auto: measuring this machine (dtrain plan --measure) {}{}",
                          r.error.empty() ? fmt::format("failed (exit {})", r.code) : r.error,
                          said.empty() ? "" : ": " + said));
}

void save_profile(const MachineProfile& p, const std::string& path) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  try {
    write_file_atomic(path, profile_json(p).dump(2) + "\n");
  } catch (const std::exception& e) {
    throw RunDirError(fmt::format("plan --measure: cannot write '{}': {}", path, e.what()));
  }
}

std::optional<MachineProfile> load_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  try {
    const auto j = nlohmann::json::parse(in);
    if (j.at("format") != "dtrain-machine") throw std::runtime_error("not a dtrain machine profile");
    // Version 1 timed square products, which the plan no longer reads its rates as, 2 had
    // no elementwise kernels, 3 no crowded ranks' waits, 4 timed the cores before they had
    // warmed up, 5 the fp32 products with ATen's mm where the dense layers may take
    // oneDNN's: as none, so that `plan --measure` or parallel.auto's first start measures
    // again.
    if (j.at("version").is_number_integer() && j.at("version").get<int>() >= 1 && j.at("version").get<int>() <= 5)
      return std::nullopt;
    if (j.at("version") != 6) throw std::runtime_error("not a dtrain machine profile of version 6");
    MachineProfile p;
    p.host = j.at("host");
    p.build = j.at("build");
    p.cores = j.at("cores");
    auto rates = [&](const char* key, std::vector<MachineProfile::Matmul>& into) {
      for (const auto& m : j.at(key)) into.push_back({m.at("size"), m.at("one_thread_flops"), m.at("all_threads_flops")});
    };
    rates("matmul_fp32", p.matmul);
    rates("matmul_bf16", p.matmul_bf16);
    rates("bmm_fp32", p.bmm);
    rates("bmm_bf16", p.bmm_bf16);
    p.memory_one = j.at("memory_one_thread_bytes_per_s");
    p.memory_all = j.at("memory_all_threads_bytes_per_s");
    j.at("elementwise_fp32").get_to(p.elementwise);
    j.at("elementwise_bf16").get_to(p.elementwise_bf16);
    j.at("gloo_all_reduce").get_to(p.all_reduce);
    j.at("gloo_send").get_to(p.send);
    j.at("crowded").get_to(p.crowded);
    // Measured where a GPU was visible (absent from profiles written before GPUs were).
    if (j.contains("gpu") && !j.at("gpu").is_null()) p.gpu = gpu_of(j.at("gpu"));
    if (p.matmul.empty() || p.memory_one <= 0 || p.elementwise.plain_one <= 0 || p.elementwise.transcendental_one <= 0)
      throw std::runtime_error("no measurements");
    return p;
  } catch (const std::exception& e) {
    throw RunDirError(fmt::format("the machine profile '{}' does not read: {} (run `dtrain plan "
                                  "--measure` again)", path, e.what()));
  }
}

}  // namespace dtrain
