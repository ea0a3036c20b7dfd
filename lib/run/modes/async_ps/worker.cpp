// async_ps's worker: pull, then push and pull until told to end.
#include <chrono>
#include <thread>

#include "data/loader.hpp"
#include "optim/clip.hpp"
#include "run/modes/async_ps/roles.hpp"
#include "run/signals.hpp"

namespace dtrain::ps {

RunResult run_worker(WorkerParts& w) {
  const auto ranges = w.roles.ranges(w.params);
  const auto servers = int64_t(ranges.size());
  auto data = w.params.data(), grad = w.params.grad();
  auto reply = f64(std::vector<double>(ReplyHeader::kSize, 0.0));
  // The reply: server 0's header, and every server's range of the parameters, in place.
  auto pull = [&] {
    std::vector<P2POp> ops{{P2POp::kRecv, reply, 0, kReplyTag}};
    for (int64_t s = 0; s < servers; ++s)
      ops.push_back({P2POp::kRecv, range_of(data, ranges[size_t(s)]), s, kParamsTag});
    return ops;
  };
  auto exchange = [&](std::vector<P2POp> ops) {
    wait_for(*w.job.exchange_async(std::move(ops)), "the servers", w.job.rank());
  };
  exchange(pull());
  auto r = reply.accessor<double, 1>();
  if (r[ReplyHeader::kCommand] != kGoOn) return {int(r[ReplyHeader::kCommand]), nlohmann::json()};
  int64_t pushes = int64_t(r[ReplyHeader::kPushes]);
  // A worker is at most parallel.staleness pushes past the slowest, which ends at the last
  // step; one more push may be computed and dropped at the end.
  const auto& cfg = w.cfg;
  Loader loader(w.train, w.sampler, pushes, w.total_steps + cfg.parallel.staleness + 2,
                cfg.data.workers, cfg.data.prefetch, /*pin=*/w.device.is_cuda(),
                Augment{cfg.data.augment, cfg.data.crop_padding, uint64_t(cfg.seed)});
  auto header = f64(std::vector<double>(PushHeader::kSize, 0.0));
  while (r[ReplyHeader::kCommand] == kGoOn) {
    if (cfg.train.debug_slow_rank == w.job.rank())  // a slow worker, for benchmarks
      std::this_thread::sleep_for(std::chrono::milliseconds(cfg.train.debug_slow_ms));
    StepStats s;
    Batch batch = to_device(loader.next(&s.data_wait_ms), w.device);
    // Its dropout draws are the data rank's of the step its push counts for, as in sync.
    MicroBatchTimes times;
    const auto losses = w.runner.train(pushes + 1, batch, w.sync.loss_factor(), times, [] {});
    s.forward_ms = times.forward_ms, s.backward_ms = times.backward_ms;
    w.sync.finish();
    double loss = 0;
    for (const auto& l : losses) loss += l.item<double>() / double(losses.size());
    const double norm = global_grad_norm(w.params, *w.mesh.tensor(), *w.mesh.pipeline()).item<double>();
    auto h = header.accessor<double, 1>();
    h[PushHeader::kBase] = r[ReplyHeader::kVersion];
    h[PushHeader::kLoss] = loss;
    h[PushHeader::kNorm] = norm;
    h[PushHeader::kStop] = stop_signal() != 0 ? 1.0 : 0.0;
    h[PushHeader::kDataWaitMs] = s.data_wait_ms;
    h[PushHeader::kForwardMs] = s.forward_ms;
    h[PushHeader::kBackwardMs] = s.backward_ms;
    auto ops = pull();
    ops.push_back({P2POp::kSend, header, 0, kHeaderTag});
    if (!w.buffers.empty()) ops.push_back({P2POp::kSend, pack(w.buffers), 0, kBufferTag});
    for (int64_t sv = 0; sv < servers; ++sv)
      ops.push_back({P2POp::kSend, range_of(grad, ranges[size_t(sv)]), sv, kGradTag});
    exchange(std::move(ops));
    w.params.zero_grad();
    pushes = int64_t(r[ReplyHeader::kPushes]);
  }
  return {int(r[ReplyHeader::kCommand]), nlohmann::json()};
}

}  // namespace dtrain::ps
