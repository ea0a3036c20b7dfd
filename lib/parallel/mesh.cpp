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

Mesh::Mesh(const ParallelDims& dims, std::shared_ptr<Comm> world, bool replica_group)
    : dims_(dims), coord_(dims.coord_of(world->rank())), job_(world), world_(std::move(world)) {
  if (dims_.world() != world_->size())
    throw std::logic_error(fmt::format("mesh {} over a world of {}", dims_.str(), world_->size()));
  auto make = [&](Axis axis) {
    return world_->new_group(group_name(axis, coord_), dims_.group_of(world_->rank(), axis));
  };
  // The same order on every rank: a group's creation waits for all its members.
  tensor_ = make(Axis::kTensor);
  data_ = make(Axis::kData);
  pipeline_ = make(Axis::kPipeline);
  const int64_t last = dims_.pipeline - 1;
  if (last > 0 && (coord_.pipeline == 0 || coord_.pipeline == last)) {
    Coord first_end = coord_, last_end = coord_;
    first_end.pipeline = 0, last_end.pipeline = last;
    embedding_ = world_->new_group(fmt::format("embedding-d{}-t{}", coord_.data, coord_.tensor),
                                   {dims_.rank_of(first_end), dims_.rank_of(last_end)});
  }
  if (replica_group) {
    std::vector<int64_t> members;
    for (int64_t r = 0; r < dims_.world(); ++r)
      if (dims_.coord_of(r).data == coord_.data) members.push_back(r);
    replica_ = world_->new_group(fmt::format("replica-d{}", coord_.data), members);
  }
}

Mesh Mesh::for_role(int64_t servers, std::shared_ptr<Comm> job) {
  Mesh m;
  const int64_t rank = job->rank(), size = job->size();
  m.role_ = rank < servers ? Role::kServer : Role::kWorker;
  m.servers_ = servers;
  std::vector<int64_t> members;
  for (int64_t r = 0; r < size; ++r)
    if ((r < servers) == (m.role_ == Role::kServer)) members.push_back(r);
  // Both roles create their group at once, each over its own ranks.
  m.world_ = job->new_group(m.role_ == Role::kServer ? "servers" : "workers", members);
  m.job_ = std::move(job);
  m.dims_.data = int64_t(members.size());
  m.coord_ = m.dims_.coord_of(m.world_->rank());
  m.data_ = m.world_;
  m.tensor_ = m.pipeline_ = make_local_comm();
  return m;
}

const std::shared_ptr<Comm>& Mesh::group(Axis a) const {
  return a == Axis::kData ? data_ : a == Axis::kTensor ? tensor_ : pipeline_;
}

}  // namespace dtrain
