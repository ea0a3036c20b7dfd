// In-memory labelled data sets and the loaders that build them from a DataConfig.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "config/config.hpp"

namespace dtrain {

struct Batch {
  torch::Tensor x;  // [n, ...] float32 samples, or [n, seq] int64 tokens
  torch::Tensor y;  // [n] int64 class labels, or [n, seq] int64 next tokens
};

// The batch on `device`. From pinned memory (the loader pins for a GPU) the copy does not
// block the caller: it is queued on the device's stream ahead of the step's kernels.
inline Batch to_device(const Batch& b, const c10::Device& device) {
  if (b.x.device() == device) return b;
  const auto on = torch::TensorOptions().device(device);
  return {b.x.to(on, /*non_blocking=*/true), b.y.to(on, /*non_blocking=*/true)};
}

// A split a batch is gathered from by sample index (the sampler's indices).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Batch gather(const torch::Tensor& indices) const = 0;
  // A checksum of everything the split holds, for ranks to check that they read the same
  // data: its size, a sum, and a sum weighted by position (so moved or changed bytes
  // count). One pass over the data.
  virtual std::vector<double> fingerprint() const = 0;
};

// A whole labelled split held in memory, decoded and normalised once; a batch is a gather.
struct TensorDataset : Dataset {
  TensorDataset(torch::Tensor x, torch::Tensor y) : x(std::move(x)), y(std::move(y)) {}
  int64_t size() const override { return y.defined() ? y.size(0) : 0; }
  Batch gather(const torch::Tensor& indices) const override {
    return {x.index_select(0, indices), y.index_select(0, indices)};
  }
  std::vector<double> fingerprint() const override;
  torch::Tensor x, y;
};

// Windows of a token stream for language modelling: sample i is the seq + 1 tokens from
// starts[i]; x is the first seq of them, y the last seq (each position's next token).
struct TokenWindows : Dataset {
  TokenWindows(torch::Tensor stream, torch::Tensor starts, int64_t seq)
      : stream(std::move(stream)), starts(std::move(starts)), seq(seq) {}
  int64_t size() const override { return starts.size(0); }
  Batch gather(const torch::Tensor& indices) const override;
  std::vector<double> fingerprint() const override;
  torch::Tensor stream;  // [tokens] int64
  torch::Tensor starts;  // [windows] int64
  int64_t seq;
};

struct DataSplits {
  std::shared_ptr<const Dataset> train, test;
  Ints sample_shape;    // one sample's shape: {1, 28, 28} for images, {seq} for tokens
  int64_t classes = 0;  // labelled data: number of classes
  int64_t vocab = 0;    // token data: distinct token values
};

// What a data set holds, from its keys alone (validation, before it is read): token
// windows (text, tokens, synthetic_tokens) or labelled samples, their shape and classes.
struct DataKind {
  bool tokens = false;
  Ints sample_shape;    // images: as decoded; tokens: {data.seq_len} (0: model.seq_len)
  int64_t classes = 0;  // labelled samples
};
DataKind data_kind(const DataConfig& cfg);

// Reads an IDX file (.gz or plain) into a uint8 tensor of its dimensions; checks the magic
// number, the element type, `expected_dims` and the data size. Throws DataError naming the file.
torch::Tensor read_idx(const std::string& path, int64_t expected_dims);

// `n` samples of `split` evenly spread over it (sample i is split's i * size / n), or the
// split itself when it holds no more (train.eval_samples).
std::shared_ptr<const Dataset> evenly_spaced(std::shared_ptr<const Dataset> split, int64_t n);

// How the ranks of a job read a corpus once between them (the token shards' scan): this
// rank's place, an all-gather over the ranks (every rank's vector, end to end in rank
// order; null: this process alone), and where the scan is recorded for the next start
// ("" = nowhere).
struct ReadTogether {
  int64_t rank = 0, ranks = 1;
  std::function<std::vector<double>(const std::vector<double>&)> all_gather;
  std::string record;
};

// The data set the job names, train and test splits. Throws DataError (exit 3).
DataSplits load_data(const DataConfig& cfg, uint64_t seed, const ReadTogether& together = {});

// dataset: text, a file or a folder of files read as bytes (vocabulary 256); every
// round(1 / eval_fraction)-th window is held out for evaluation, so the held-out text is
// spread over the whole corpus.
DataSplits load_text(const DataConfig& cfg);
// dataset: tokens, llm.c's or nanoGPT's uint16 token shards, memory-mapped (tokens.cpp);
// held out: data.eval_path's shards, else every round(1 / eval_fraction)-th window.
DataSplits load_tokens(const DataConfig& cfg, const ReadTogether& together);
// dataset: synthetic_tokens, uniform random tokens (benchmarks).
DataSplits synthetic_tokens(const DataConfig& cfg, uint64_t seed);

}  // namespace dtrain
