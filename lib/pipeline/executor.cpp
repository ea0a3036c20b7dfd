// Pipeline parallelism: this rank's chunks of the model run a step's micro-batches in the
// order parallel.schedule gives (pipeline/schedule.hpp); activations go forward to the
// next stage and their gradients back to the previous one by c10d send/recv.
//
// Communication. A send is posted as soon as its tensor exists; a receive is posted when
// the action needing it comes and waited for at once. So the only waits are for data a
// neighbour produces, and a schedule whose actions depend on each other without a cycle
// cannot deadlock, whatever order the two ends post in. (Waiting for sends too, as a batch
// with the next receive, deadlocks the interleaved schedule: two neighbours each wait for
// the other to receive what it only receives later.) A send is let go, its tensor with it,
// once it is known to have arrived: an activation when its gradient comes back, a gradient
// when the previous rank's schedule shows it ran that backward before sending an activation
// that has arrived here; the rest at the end of the step. That keeps 1F1B's bound on the
// activations a stage holds. Activations and gradients travel on separate tags, each in the
// order both ends run their actions.
//
// Shapes are agreed once: the first time a stage boundary carries a micro-batch of a given
// number of rows (training's micro-batches, evaluation's batches and its last, shorter
// one), the sender sends the activation's dtype and shape ahead of it, and both ends keep
// it. A gradient has its activation's shape, which its receiver already holds. Everything
// travels in the default (row-major) layout: a convolution's channels-last activations and
// their gradients are made contiguous to be sent (Gloo sends contiguous tensors only).
#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include <fmt/format.h>
#include <torch/torch.h>

#include "grad/grad_sync.hpp"
#include "pipeline/runner.hpp"
#include "pipeline/schedule.hpp"
#include "precision/autocast.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/units.hpp"

namespace dtrain {
namespace {

constexpr int kActivations = 1, kGradients = 2;
constexpr int64_t kMaxDims = 8;  // a header: dtype, rank, then up to kMaxDims sizes

class Pipeline : public MicroBatchRunner {
 public:
  explicit Pipeline(RunnerParts p)
      : p_(std::move(p)), pipe_(*p_.pipeline), rank_(pipe_.rank()), ranks_(pipe_.size()),
        stages_(p_.stages),
        schedule_(pipeline_schedule(p_.schedule, rank_, ranks_, p_.grad_accum, p_.virtual_stages)) {
    for (const auto& a : schedule_)
      if (a.kind == Action::kBackward) last_backward_ = a;
    previous_ = pipeline_schedule(p_.schedule, (rank_ + ranks_ - 1) % ranks_, ranks_,
                                  p_.grad_accum, p_.virtual_stages);
  }

  std::vector<torch::Tensor> train(int64_t step, const Batch& batch, double factor,
                                   MicroBatchTimes& s,
                                   const std::function<void()>& settle) override {
    const int64_t accum = p_.grad_accum;
    // Each stage cuts its share alike (a fault-tolerant job's survivors may deal it so that
    // the micro-batches differ by a row: micro_slice), so a receiver knows each one's rows.
    std::vector<MicroSlice> slices;
    for (int64_t m = 0; m < accum; ++m) slices.push_back(micro_slice(batch.y.size(0), accum, m));
    auto micro = [&](const torch::Tensor& t, int64_t m) {
      const auto& sl = slices[size_t(m)];
      auto part = accum == 1 ? t : t.narrow(0, sl.first, sl.rows);
      return part.dim() == 4 ? part.contiguous(p_.format) : part;
    };
    std::vector<torch::Tensor> losses(static_cast<size_t>(accum));
    const int64_t memory_base = allocated_bytes(p_.device);
    int64_t memory_peak = memory_base;
    wait_ms_ = 0;
    const auto t_step = Clock::now();
    for (const Action& a : schedule_) {
      const int64_t g = stage_of(a.chunk);
      const auto t0 = Clock::now();
      auto& held = held_[{a.micro, a.chunk}];
      if (a.kind == Action::kForward) {
        const auto& sl = slices[size_t(a.micro)];
        torch::Tensor x = g == 0 ? micro(batch.x, a.micro) : receive_activation(g, sl.rows, a.micro);
        if (g > 0 && x.is_floating_point()) x.requires_grad_(true);
        AutocastGuard guard(p_.dtype, p_.device.type());
        DropoutScope draw(micro_batch_draw(p_, step, sl.first, sl.rows));
        auto out = p_.chunks[size_t(a.chunk)]->forward(x);
        if (g == stages_ - 1) {
          Batch mb{torch::Tensor(), micro(batch.y, a.micro)};
          auto loss = p_.task->loss(out, mb, *p_.tensor, p_.label_smoothing);
          if (sl.weight != 1.0) loss = loss * sl.weight;
          losses[size_t(a.micro)] = loss.detach();
          out = factor != 1.0 ? loss * factor : loss;
        } else {
          send_activation(g + 1, out.detach(), a.micro);
        }
        held = {x, out};
        settle();
        memory_peak = std::max(memory_peak, allocated_bytes(p_.device));
        s.forward_ms += ms_since(t0);
      } else {
        p_.sync->begin_micro_batch(a == last_backward_);
        if (g == stages_ - 1) {
          held.output.backward();
        } else {
          auto grad = receive(g + 1, kGradients, torch::empty(held.output.sizes(), held.output.options()));
          let_go({kActivations, a.micro, g});  // arrived: its gradient came back
          torch::autograd::backward({held.output}, {grad});
        }
        if (g > 0) post({kGradients, a.micro, g}, {{P2POp::kSend, held.input.grad().contiguous(), peer_of(g - 1), kGradients}});
        held_.erase({a.micro, a.chunk});
        settle();
        s.backward_ms += ms_since(t0);
      }
    }
    finish_sends();
    const double step_ms = ms_since(t_step);
    s.bubble = step_ms > 0 ? wait_ms_ / step_ms : 0;
    s.activation_mb = double(memory_peak - memory_base) / kMiB;
    if (!held_.empty()) throw std::logic_error("pipeline: micro-batches left without backward");
    return holds_last() ? losses : std::vector<torch::Tensor>{};
  }

  torch::Tensor infer(const torch::Tensor& batch_x) override {
    const int64_t rows = batch_x.size(0);
    torch::Tensor out;
    for (size_t chunk = 0; chunk < p_.chunks.size(); ++chunk) {
      const int64_t g = stage_of(int64_t(chunk));
      torch::Tensor x = g == 0 ? (batch_x.dim() == 4 ? batch_x.contiguous(p_.format) : batch_x)
                               : receive_activation(g, rows, -1);
      {
        AutocastGuard guard(p_.dtype, p_.device.type());
        out = p_.chunks[chunk]->forward(x);
      }
      if (g < stages_ - 1) {
        send_activation(g + 1, out, -1);
        out = torch::Tensor();
      }
    }
    finish_sends();
    return out;
  }

  bool holds_last() const override {
    return stage_of(int64_t(p_.chunks.size()) - 1) == stages_ - 1;
  }
  void deal(int64_t rank, int64_t ranks) override { p_.data_rank = rank, p_.data_ranks = ranks; }

 private:
  struct InFlight {
    torch::Tensor input;   // the stage's input (its gradient goes back)
    torch::Tensor output;  // the stage's output, or on the last stage the scaled loss
  };

  int64_t stage_of(int64_t chunk) const { return chunk * ranks_ + rank_; }
  int64_t peer_of(int64_t stage) const { return stage % ranks_; }

  // A send in flight: what it carries (kActivations or kGradients), the micro-batch (-1 in
  // evaluation) and the stage that sent it.
  using SendKey = std::tuple<int, int64_t, int64_t>;

  // Sends `t`, stage `to`'s input for micro-batch `micro`; ahead of it its dtype and shape,
  // the first time this boundary carries this many rows.
  void send_activation(int64_t to, const torch::Tensor& t, int64_t micro) {
    std::vector<P2POp> ops;
    auto key = std::make_pair(to, t.size(0));
    if (!shapes_.count(key)) {
      shapes_[key] = {t.scalar_type(), t.sizes().vec()};
      auto header = torch::zeros({2 + kMaxDims}, torch::kInt64);
      header[0] = int64_t(t.scalar_type()), header[1] = t.dim();
      for (int64_t d = 0; d < t.dim(); ++d) header[2 + d] = t.size(d);
      ops.push_back({P2POp::kSend, header.to(t.device()), peer_of(to), kActivations});
    }
    ops.push_back({P2POp::kSend, t.contiguous(), peer_of(to), kActivations});
    post({kActivations, micro, to - 1}, std::move(ops));
  }

  // Stage `at`'s input for micro-batch `micro` (-1 in evaluation) of `rows` rows, from the
  // previous stage.
  torch::Tensor receive_activation(int64_t at, int64_t rows, int64_t micro) {
    auto key = std::make_pair(at, rows);
    if (!shapes_.count(key)) {
      auto header = receive(at - 1, kActivations, torch::zeros({2 + kMaxDims}, torch::kInt64)
                                                      .to(p_.device))
                        .cpu();
      const auto h = header.accessor<int64_t, 1>();
      if (h[1] < 1 || h[1] > kMaxDims)
        throw DistError(fmt::format("pipeline: stage {} sent a malformed activation header", at - 1));
      std::vector<int64_t> shape(h.data() + 2, h.data() + 2 + h[1]);
      shapes_[key] = {static_cast<torch::ScalarType>(h[0]), shape};
    }
    const auto& [dtype, shape] = shapes_.at(key);
    auto x = receive(at - 1, kActivations,
                     torch::empty(shape, torch::dtype(dtype).device(p_.device)));
    if (micro >= 0) {
      // The previous rank sent this after every backward its schedule puts before it, and
      // each of those had received its gradient from this rank.
      const Action sent{Action::kForward, micro, (at - 1) / ranks_};
      for (const auto& b : previous_) {
        if (b == sent) break;
        if (b.kind == Action::kBackward) let_go({kGradients, b.micro, b.chunk * ranks_ + peer_of(at - 1) + 1});
      }
    }
    return x;
  }

  // Receives `into` from stage `from`, waiting for it.
  torch::Tensor receive(int64_t from, int tag, torch::Tensor into) {
    const auto t0 = Clock::now();
    pipe_.exchange_async({{P2POp::kRecv, into, peer_of(from), tag}})->wait();
    wait_ms_ += ms_since(t0);
    return into;
  }

  // Posts sends, in order, without waiting for them.
  void post(const SendKey& key, std::vector<P2POp> ops) {
    sends_[key] = pipe_.exchange_async(std::move(ops));
  }

  // A send known to have arrived: its wait returns at once (or says how it failed).
  void let_go(const SendKey& key) {
    auto it = sends_.find(key);
    if (it == sends_.end()) return;
    it->second->wait();
    sends_.erase(it);
  }

  void finish_sends() {
    const auto t0 = Clock::now();
    for (auto& [key, s] : sends_) s->wait();
    sends_.clear();
    wait_ms_ += ms_since(t0);
  }

  RunnerParts p_;
  Comm& pipe_;
  int64_t rank_, ranks_, stages_;
  std::vector<Action> schedule_;
  Action last_backward_{Action::kBackward, 0};  // where the gradient sync's hooks fire
  std::map<std::pair<int64_t, int64_t>, InFlight> held_;  // (micro-batch, chunk)
  std::vector<Action> previous_;  // the previous pipeline rank's schedule
  std::map<SendKey, std::unique_ptr<Pending>> sends_;  // posted, not yet known to have arrived
  std::map<std::pair<int64_t, int64_t>, std::pair<torch::ScalarType, std::vector<int64_t>>>
      shapes_;  // (receiving stage, rows) -> the activation's dtype and shape
  double wait_ms_ = 0;  // this step's time blocked in exchanges
};

}  // namespace

std::unique_ptr<MicroBatchRunner> make_pipeline_runner(RunnerParts parts) {
  return std::make_unique<Pipeline>(std::move(parts));
}

}  // namespace dtrain
