#include "parallel/dims.hpp"

#include <fmt/format.h>

#include "config/config.hpp"
#include "util/error.hpp"

namespace dtrain {

ParallelDims ParallelDims::resolve(const ParallelConfig& p, int64_t world) {
  fail_if<ConfigError>(world % (p.tensor * p.pipeline) != 0,
                       "parallel.tensor ({}) x parallel.pipeline ({}) does not divide the world "
                       "size {}", p.tensor, p.pipeline, world);
  const ParallelDims d{p.data > 0 ? p.data : world / (p.tensor * p.pipeline), p.tensor, p.pipeline};
  fail_if<ConfigError>(d.world() != world,
                       "parallel.data ({}) x parallel.tensor ({}) x parallel.pipeline ({}) = {} "
                       "but {} processes are running", d.data, d.tensor, d.pipeline, d.world(),
                       world);
  return d;
}

int64_t ParallelDims::size(Axis a) const {
  return a == Axis::kData ? data : a == Axis::kTensor ? tensor : pipeline;
}

Coord ParallelDims::coord_of(int64_t rank) const {
  return {(rank / tensor) % data, rank % tensor, rank / (tensor * data)};
}

int64_t ParallelDims::rank_of(const Coord& c) const {
  return c.tensor + tensor * (c.data + data * c.pipeline);
}

std::vector<int64_t> ParallelDims::group_of(int64_t rank, Axis axis) const {
  std::vector<int64_t> members;
  Coord c = coord_of(rank);
  for (int64_t i = 0; i < size(axis); ++i) {
    (axis == Axis::kData ? c.data : axis == Axis::kTensor ? c.tensor : c.pipeline) = i;
    members.push_back(rank_of(c));
  }
  return members;
}

std::string ParallelDims::str() const {
  return fmt::format("data {} x tensor {} x pipeline {}", data, tensor, pipeline);
}

}  // namespace dtrain
