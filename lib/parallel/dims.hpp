// How the world is split: data x pipeline x tensor = world. Pure arithmetic, computed once
// when the job is validated for its world size and carried everywhere after that.
//
// Ranks are laid out tensor-fastest, then data, then pipeline (Megatron's order): the ranks
// of one tensor group are neighbours, so on a multi-GPU node they share the fastest links.
//   world rank = tensor + T * (data + D * pipeline)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

struct ParallelConfig;

enum class Axis { kData, kTensor, kPipeline };

struct Coord {
  int64_t data = 0, tensor = 0, pipeline = 0;
};

struct ParallelDims {
  int64_t data = 1, tensor = 1, pipeline = 1;

  // parallel.data/tensor/pipeline for `world` processes (data 0 = the rest of the world).
  // Throws ConfigError naming the keys when the product cannot equal the world.
  static ParallelDims resolve(const ParallelConfig& cfg, int64_t world);

  int64_t world() const { return data * tensor * pipeline; }
  int64_t size(Axis a) const;
  Coord coord_of(int64_t rank) const;
  int64_t rank_of(const Coord& c) const;
  // The world ranks that share every coordinate of `rank` but `axis`, in axis order:
  // the members of rank's group along that axis.
  std::vector<int64_t> group_of(int64_t rank, Axis axis) const;
  std::string str() const;  // "data 2 x tensor 2 x pipeline 1"
};

}  // namespace dtrain
