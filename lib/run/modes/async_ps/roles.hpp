// async_ps's two roles, each given the parts of the run it uses (the mode, async_ps.cpp,
// hands them out): a worker's loop (worker.cpp), and the servers' (server.cpp: server 0
// sequences, the others follow its orders).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "config/config.hpp"
#include "data/dataset.hpp"
#include "data/sampler.hpp"
#include "optim/optimizer.hpp"
#include "parallel/mesh.hpp"
#include "grad/grad_sync.hpp"
#include "pipeline/runner.hpp"
#include "run/run_log.hpp"
#include "run/modes/async_ps/wire.hpp"

namespace dtrain::ps {

// What a worker computes with: the whole model, its gradient, the data.
struct WorkerParts {
  Roles roles;
  Comm& job;         // every rank of the job: the servers are its first ranks
  const Mesh& mesh;  // the workers' group (the tensor and pipeline groups for the norm)
  const JobConfig& cfg;
  FlatParams& params;
  MicroBatchRunner& runner;
  GradSync& sync;    // its own gradient's (nothing sent)
  const Dataset& train;
  const ShardedSampler& sampler;
  int64_t total_steps = 0;
  c10::Device device = torch::kCPU;
  std::vector<torch::Tensor> buffers;  // the model's floating-point buffers
};
RunResult run_worker(WorkerParts& parts);

// What a server keeps and answers with: its range of the parameters and the optimizer,
// and, on server 0, the run's log, cadence and checkpoints.
struct ServerParts {
  Roles roles;
  Comm& job;
  const Mesh& mesh;  // the servers' group: this server's index is its data coordinate
  const JobConfig& cfg;
  FlatParams& params;
  Optimizer& optimizer;
  std::vector<torch::Tensor> buffers;
  RunLog& log;
  int64_t total_steps = 0, steps_per_epoch = 1;
  bool finished = false;         // resumed at or past the end: nothing to train
  std::string requeue_job;       // where a stop puts the job back in the queue ("": not)
  std::function<void(int64_t n)> evaluate;                 // collective over the servers
  std::function<void(int64_t n, bool evaluated)> save;     // collective over the servers
  // Each worker's applied pushes (its data position): restored from a checkpoint, saved
  // with one, kept by server 0.
  std::vector<int64_t>& worker_pushes;
};
RunResult run_server(ServerParts& parts);

}  // namespace dtrain::ps
