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
// The mesh's world is the ranks that train together: the job's, or a training mode's
// share of it (an asynchronous parameter server's workers, or its servers).
#pragma once
#include <memory>

#include "comm/comm.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

class Mesh {
 public:
  // Collective over the world: every rank creates the groups it belongs to. An axis of size
  // 1 gets a local Comm; an axis that spans the world reuses the world's group. A world
  // that is a group of the job names its ranks' job ranks (`job_ranks`, in its rank
  // order), which sub-groups are made of; empty: the world is the job.
  Mesh(const ParallelDims& dims, std::shared_ptr<Comm> world, bool replica_group = false,
       std::vector<int64_t> job_ranks = {});

  const ParallelDims& dims() const { return dims_; }
  const Coord& coord() const { return coord_; }
  int64_t rank() const { return world_->rank(); }  // in the mesh's world

  const std::shared_ptr<Comm>& world() const { return world_; }
  const std::shared_ptr<Comm>& data() const { return data_; }
  const std::shared_ptr<Comm>& tensor() const { return tensor_; }
  const std::shared_ptr<Comm>& pipeline() const { return pipeline_; }
  // Null unless this rank is the first or the last of a pipeline of two or more stages.
  const std::shared_ptr<Comm>& embedding() const { return embedding_; }
  // Null unless the mesh was made with its replica group.
  const std::shared_ptr<Comm>& replica() const { return replica_; }

 private:
  ParallelDims dims_;
  Coord coord_;
  std::shared_ptr<Comm> world_, data_, tensor_, pipeline_, embedding_, replica_;
};

}  // namespace dtrain
