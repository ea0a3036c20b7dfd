#include "parallel/mesh.hpp"

#include <fmt/format.h>

namespace dtrain {

namespace {
// A name unique to one group of one axis: the axis and the coordinates the members share.
std::string group_name(Axis axis, const Coord& c) {
  switch (axis) {
    case Axis::kData: return fmt::format("data-t{}-p{}", c.tensor, c.pipeline);
    case Axis::kTensor: return fmt::format("tensor-d{}-p{}", c.data, c.pipeline);
    case Axis::kPipeline: return fmt::format("pipeline-d{}-t{}", c.data, c.tensor);
  }
  return "";
}
}  // namespace

Mesh::Mesh(const ParallelDims& dims, std::shared_ptr<Comm> world, bool replica_group,
           std::vector<int64_t> job_ranks)
    : dims_(dims), coord_(dims.coord_of(world->rank())), world_(std::move(world)) {
  if (dims_.world() != world_->size())
    throw std::logic_error(fmt::format("mesh {} over a world of {}", dims_.str(), world_->size()));
  // Groups are made of job ranks: the world's own, or its ranks' in the job.
  auto group = [&](const std::string& name, std::vector<int64_t> members) {
    if (int64_t(members.size()) == world_->size()) return world_;
    if (!job_ranks.empty())
      for (auto& m : members) m = job_ranks.at(size_t(m));
    return world_->new_group(name, members);
  };
  auto make = [&](Axis axis) {
    return group(group_name(axis, coord_), dims_.group_of(world_->rank(), axis));
  };
  // The same order on every rank: a group's creation waits for all its members.
  tensor_ = make(Axis::kTensor);
  data_ = make(Axis::kData);
  pipeline_ = make(Axis::kPipeline);
  const int64_t last = dims_.pipeline - 1;
  if (last > 0 && (coord_.pipeline == 0 || coord_.pipeline == last)) {
    Coord first_end = coord_, last_end = coord_;
    first_end.pipeline = 0, last_end.pipeline = last;
    embedding_ = group(fmt::format("embedding-d{}-t{}", coord_.data, coord_.tensor),
                       {dims_.rank_of(first_end), dims_.rank_of(last_end)});
  }
  if (replica_group) {
    std::vector<int64_t> members;
    for (int64_t r = 0; r < dims_.world(); ++r)
      if (dims_.coord_of(r).data == coord_.data) members.push_back(r);
    replica_ = group(fmt::format("replica-d{}", coord_.data), members);
  }
}

}  // namespace dtrain
