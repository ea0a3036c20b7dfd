// async_ps's wire format (run/modes/async_ps.cpp tells the protocol): the point-to-point
// streams between workers and servers, the headers and orders they carry, and the helpers
// both roles use to cut and move the flat buffers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "parallel/flat_params.hpp"
#include "util/error.hpp"

namespace dtrain::ps {

// The job group's point-to-point streams; each is matched in posting order per pair.
enum Tag : int { kHeaderTag = 21, kGradTag, kBufferTag, kReplyTag, kParamsTag, kOrderTag };

// A push's header, worker -> server 0 (fp64).
struct PushHeader {
  enum : int64_t { kBase, kLoss, kNorm, kStop, kDataWaitMs, kForwardMs, kBackwardMs, kSize };
};
// A reply's header, server 0 -> worker: the version its parameters are at, what to do next,
// and the pushes of this worker applied so far (its data position).
struct ReplyHeader {
  enum : int64_t { kVersion, kCommand, kPushes, kSize };
};
constexpr double kGoOn = -1;  // a reply's command: push again; else the exit code to end with
// An order, server 0 -> the other servers.
struct Order {
  enum : int64_t { kKind, kWorker, kArg, kNorm, kSize };
  // kApply: push kArg (from 1) of worker kWorker, its gradient's norm kNorm. kDiscard: the
  // worker's push, dropped. kReply: answer the worker with command kArg (kGoOn: it pushes
  // again). kEvaluate / kCheckpoint: at step kArg. kEnd: exit with code kArg.
  enum Kind : int64_t { kApply = 1, kDiscard, kReply, kEvaluate, kCheckpoint, kEnd };
};

inline torch::Tensor f64(std::vector<double> v) { return torch::tensor(v, torch::kFloat64); }

// The job's roles: its first `servers` ranks are servers, the rest workers.
struct Roles {
  int64_t servers = 1, workers = 1;
  int64_t rank_of_worker(int64_t w) const { return servers + w; }
  std::string worker_name(int64_t w) const {
    return fmt::format("async_ps worker {} (rank {})", w, rank_of_worker(w));
  }
  // Each server's range of the flat buffers: equal, contiguous, in server order (the
  // buffers are padded for it: AsyncPs::shape_flat).
  std::vector<Shard> ranges(const FlatParams& params) const {
    std::vector<Shard> out;
    for (int64_t s = 0; s < servers; ++s) out.push_back(params.shard(servers, s));
    return out;
  }
};

inline torch::Tensor range_of(const torch::Tensor& flat, const Shard& r) {
  return flat.narrow(0, r.offset, r.numel);
}

// The model's floating-point buffers (BatchNorm's running statistics), which no gradient
// moves: a worker sends its own with each push to server 0, whose model takes the latest
// applied one's, and server 0 gives them to the other servers before an evaluation or a
// checkpoint. So the servers' model is evaluated and saved with statistics of the data its
// parameters were trained on. Packed as one fp32 tensor on the wire.
torch::Tensor pack(const std::vector<torch::Tensor>& buffers);
void unpack(const torch::Tensor& flat, const std::vector<torch::Tensor>& buffers);

// Waits for a transfer of rank `rank` with `who`, naming it if it fails (it died, or
// stalled past dist.timeout_s).
void wait_for(Pending& p, const std::string& who, int64_t rank);

}  // namespace dtrain::ps
