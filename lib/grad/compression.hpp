// Gradient compression: Reductions (grad_sync.hpp) that put fewer bytes on the wire than a
// slice's fp32 values, chosen by parallel.compression.
//   fp16, bf16   each value cast to 16 bits for the wire, the result back in fp32: on NCCL
//                an all-reduce in the 16-bit type (DDP's fp16 hook); on Gloo, which has no
//                fast 16-bit sum, every rank's 16-bit values all-gathered and summed in
//                fp32 (the same bytes as a 16-bit all-reduce at 2 ranks, D/2 times them at D)
//   sign         1 bit per value, scaled by the mean absolute value of its block (256
//                values of one parameter) (1-bit SGD, signSGD with a scale), bits packed
//                eight to a byte, with one fp32 scale per block, all-gathered
//   topk         the largest parallel.topk_ratio of each parameter's part of a slice by
//                magnitude, as (index, value) pairs, all-gathered
//   powersgd     each matrix as a rank-parallel.powersgd_rank product (PowerSgd, in
//                compression.cpp), the rest as it is
// sign, topk and powersgd keep error feedback: what a rank's compressed slice left out (its residual,
// a buffer laid out like the flat gradient) is added to that slice's next gradient, so it
// is delayed, never lost (Seide et al. 2014; Karimireddy et al., EF-SGD, 2019). The
// residual is the strategy's state: saved with checkpoints, dropped on a skipped step.
//
// The slices arrive already divided by the number of ranks (the loss factor), so every
// form sums.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "grad/grad_sync.hpp"

namespace dtrain {

// What a reduction's cost is figured from: the gradient a data rank syncs, parameter by
// parameter (this rank's part of each, in the flat layout's order), and its data group.
struct GradShape {
  struct Param {
    std::vector<int64_t> shape;
    int64_t numel = 0;
  };
  std::vector<Param> params;
  int64_t numel = 0;        // the flat gradient's values, padding included
  int64_t ranks = 1;        // the data group
  bool sums_16bit = false;  // the backend sums fp16 and bf16 itself (NCCL; Gloo does not)
};

// One choice of parallel.compression: how it runs and what it costs, declared beside its
// code so that the planner, validation and the warm-up ask it rather than name it. A new
// reduction is a class in compression.cpp and a line in its registry.
struct CompressionSpec {
  std::string name;
  // Keeps error feedback's residual from step to step: a buffer the flat gradient's size.
  bool residual = false;
  // parallel.compression_warmup `auto`: the run's first 1/warmup_share steps (0: none).
  int64_t warmup_share = 0;
  // The collectives a bucket takes.
  int64_t ops_per_bucket = 1;
  // The bytes a data rank sends a step, by the ring algorithms' counts (as its
  // Reduction::take_sent measures them).
  double (*step_bytes)(const ParallelConfig&, const GradShape&) = nullptr;
  // The reduction; null for `none`, grad_sync's plain all-reduce.
  std::unique_ptr<Reduction> (*make)(const ParallelConfig&, std::shared_ptr<Comm>,
                                     const FlatParams&) = nullptr;
};

// parallel.compression's spec; throws std::logic_error for a name it does not know (the
// config's choices are checked before).
const CompressionSpec& compression_spec(const std::string& name);
const std::vector<CompressionSpec>& compression_specs();

// The steps all-reduced uncompressed first: parallel.compression_warmup, or under `auto`
// the spec's warmup_share of a run of `total_steps`, rounded up. The start of training is
// the most sensitive to an approximate gradient (PyTorch's start_powerSGD_iter, Deep
// Gradient Compression's warm-up epochs, 1-bit Adam's freeze_step say the same); each
// share's measured cost is in docs/data-parallel.md.
int64_t compression_warmup_steps(const ParallelConfig& cfg, int64_t total_steps);

}  // namespace dtrain
