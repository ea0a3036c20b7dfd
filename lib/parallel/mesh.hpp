// The process mesh: one c10d group per axis of ParallelDims, and this rank's coordinates.
// Each consumer asks for the group it needs:
//   data      the sampler's shard, loss averaging, evaluation, gradient sync, SyncBatchNorm
//   tensor    the tensor-parallel layers' collectives, gathering split tensors for checkpoints
//   pipeline  activations and gradients between stages, the gradient norm and evaluation
//             sums across stages
//   embedding the first and the last pipeline stage of one data and tensor coordinate: the
//             copies of a weight both ends use (GPT's token embedding and head)
//   world     agreement on stopping and the step's loss: always, whatever the layout, so no
//             rank checkpoints or exits while a peer waits in a collective
//   replica   the ranks of one data coordinate (every tensor and pipeline rank of one model
//             copy): local SGD agrees on a step's figures there between averages; made only
//             when asked for
// Under parallel.mode: async_ps the world has two roles (train/async_ps.hpp): servers, the
// world's first parallel.servers ranks, hold the parameters; workers, the rest, compute
// gradients. Each role gets a mesh of its own over its ranks (its data axis, its "world");
// the whole job's group (`job()`) carries the pushes and replies between them.
#pragma once
#include <memory>

#include "comm/comm.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

enum class Role { kTrainer, kServer, kWorker };

class Mesh {
 public:
  // Collective over the world: every rank creates the groups it belongs to. An axis of size
  // 1 gets a local Comm; an axis that spans the world reuses the world's group.
  Mesh(const ParallelDims& dims, std::shared_ptr<Comm> world, bool replica_group = false);

  // Collective over the job: under async_ps, this rank's role's mesh (its ranks on the data
  // axis, no tensor or pipeline axis), the servers being the job's first `servers` ranks.
  static Mesh for_role(int64_t servers, std::shared_ptr<Comm> job);

  const ParallelDims& dims() const { return dims_; }
  Role role() const { return role_; }
  // Every rank of the job: the world, or under async_ps the servers' and workers' together.
  const std::shared_ptr<Comm>& job() const { return job_; }
  // async_ps: the servers among the job's ranks (0 otherwise), and the workers, the rest.
  int64_t servers() const { return servers_; }
  int64_t workers() const { return job_->size() - servers_; }
  const Coord& coord() const { return coord_; }
  int64_t rank() const { return job_->rank(); }  // in the job
  // Rank 0 of the job: it writes the run's files (under async_ps, server 0).
  bool is_root() const { return job_->rank() == 0; }

  const std::shared_ptr<Comm>& world() const { return world_; }
  const std::shared_ptr<Comm>& group(Axis a) const;
  const std::shared_ptr<Comm>& data() const { return data_; }
  const std::shared_ptr<Comm>& tensor() const { return tensor_; }
  const std::shared_ptr<Comm>& pipeline() const { return pipeline_; }
  // Null unless this rank is the first or the last of a pipeline of two or more stages.
  const std::shared_ptr<Comm>& embedding() const { return embedding_; }
  // Null unless the mesh was made with its replica group.
  const std::shared_ptr<Comm>& replica() const { return replica_; }

 private:
  Mesh() = default;
  ParallelDims dims_;
  Coord coord_;
  Role role_ = Role::kTrainer;
  int64_t servers_ = 0;
  std::shared_ptr<Comm> job_, world_, data_, tensor_, pipeline_, embedding_, replica_;
};

}  // namespace dtrain
