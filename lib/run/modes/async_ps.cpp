// parallel.mode: async_ps, the asynchronous parameter server with bounded staleness;
// docs/modes.md says what users see: servers, workers, versions, staleness and server 0's
// ordering.
//
// Here: the mode (roles, their groups, the flat buffers' ranges, what each role is given)
// and its checks. async_ps/wire.hpp: the streams, headers and orders; worker.cpp: a
// worker's loop; server.cpp: server 0's and the other servers'.
#include <fmt/format.h>
#include <torch/torch.h>

#include "grad/zero.hpp"
#include "run/mode.hpp"
#include "run/model_parts.hpp"
#include "run/modes/async_ps/roles.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

// The flat buffers' padding: they cut into one range per server.
int64_t pad_to(int64_t servers) { return servers > 1 ? servers * kShardAlign : 1; }

// The mode: this rank's role, the groups of its role, the flat buffers cut into one range
// per server.
class AsyncPs : public Mode, public Stateful {
 public:
  AsyncPs(const JobConfig& cfg, std::shared_ptr<Comm> job)
      : cfg_(cfg), servers_(cfg.parallel.servers), workers_(job->size() - servers_),
        server_(job->rank() < servers_), mesh_(role_mesh(job)) {}

  const Mesh& mesh() const override { return *mesh_; }
  bool holds_run() const override { return server_; }
  bool reads_data() const override { return !server_; }
  // Servers and workers cut the buffers alike, in one range per server (one server's is
  // the whole buffer, laid out as one process's).
  void shape_flat(FlatOptions& opts) const override { opts.pad_to = pad_to(servers_); }
  Shard update_shard(const FlatParams& params) const override {
    return server_ ? params.shard(servers_, mesh_->coord().data) : Shard{};
  }
  // A worker's gradient is its own (pushed to the servers); a server computes none.
  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches, int64_t,
                                      Tied tied) const override {
    return make_no_sync(params, micro_batches, std::move(tied), update_shard(params));
  }
  std::string describe() const override {
    return fmt::format("async_ps: {} server(s), {} worker(s), staleness {}", servers_, workers_,
                       cfg_.parallel.staleness);
  }
  nlohmann::json layout() const override {
    return {{"data", workers_}, {"tensor", 1}, {"pipeline", 1}, {"servers", servers_}};
  }
  Stateful* state() override { return this; }
  // Each worker's data position (its applied pushes), in trainer.json.
  void save(StateWriter& out) const override {
    if (!pushes_.empty()) out.set("worker_pushes", pushes_);
  }
  void load(const StateReader& in) override {
    const auto& t = in.trainer();
    if (!t.contains("worker_pushes")) return;
    try {
      pushes_ = t.at("worker_pushes").get<std::vector<int64_t>>();
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointError(fmt::format("{}/trainer.json: {}", in.folder(), e.what()));
    }
    for (int64_t pushes : pushes_)
      fail_if<CheckpointError>(pushes < 0, "{}/trainer.json: worker_pushes holds {}, a negative "
                               "count", in.folder(), pushes);
  }

  // This rank's role, given the parts of the run it uses.
  RunResult run(TrainParts& run) override {
    const ps::Roles roles{servers_, workers_};
    const auto buffers = run.model.float_buffers();
    if (!server_) {
      ps::WorkerParts worker{roles,        run.job,         *mesh_,      run.cfg,
                             run.params,   run.runner,      run.sync,    run.train,
                             run.sampler,  run.total_steps, run.device,  buffers};
      return ps::run_worker(worker);
    }
    ps::ServerParts server{roles, run.job, *mesh_, run.cfg, run.params, run.optimizer, buffers,
                           run.log, run.total_steps, run.steps_per_epoch, run.finished,
                           run.requeue_job, run.evaluate,
                           [&run](int64_t n, bool evaluated) { run.save(n, evaluated, false); },
                           pushes_};
    return ps::run_server(server);
  }

 private:
  // Collective over the job: this rank's role's group (both roles create theirs at once),
  // its ranks on the data axis.
  std::unique_ptr<Mesh> role_mesh(const std::shared_ptr<Comm>& job) const {
    std::vector<int64_t> members;
    for (int64_t r = 0; r < job->size(); ++r)
      if ((r < servers_) == server_) members.push_back(r);
    auto group = job->new_group(server_ ? "servers" : "workers", members);
    ParallelDims dims;
    dims.data = int64_t(members.size());
    return std::make_unique<Mesh>(dims, std::move(group), /*replica_group=*/false, members);
  }

  JobConfig cfg_;
  int64_t servers_, workers_;
  bool server_;
  std::unique_ptr<Mesh> mesh_;
  std::vector<int64_t> pushes_;  // each worker's applied pushes (server 0's are saved)
};

// The world must hold a worker past the servers, and each worker computes on a whole model
// with a plain fp32/bf16 gradient.
void validate_async_ps(const JobConfig& c, int64_t world_size) {
  const auto& p = c.parallel;
  fail_if<ConfigError>(world_size <= p.servers,
                       "parallel.servers: {} server(s) leave no worker in a world of {} "
                       "process(es); async_ps needs at least parallel.servers + 1 (e.g. "
                       "--nproc {})", p.servers, world_size, p.servers + 1);
  const ModeRefusal refuse{"async_ps"};
  refuse(p.tensor > 1 || p.pipeline > 1,
         fmt::format("parallel.tensor {} x parallel.pipeline {}", p.tensor, p.pipeline),
         "each worker computes the whole model's gradient");
  refuse(p.zero > 0, fmt::format("parallel.zero {}", p.zero),
         "the servers already shard the optimizer state (parallel.servers)");
  refuse(p.compression != "none", "parallel.compression " + p.compression,
         "pushes carry the gradient as it is");
  refuse(p.sync_batchnorm, "parallel.sync_batchnorm",
         "its statistics span every worker at every step");
  refuse(c.precision.dtype == "fp16", "precision.dtype fp16",
         "each worker's loss scale would move apart from the servers' (use bf16)");
  refuse(c.checkpoint.async, "checkpoint.async",
         "its servers checkpoint when their leader orders, outside any step the workers share");
}

}  // namespace

ModeSpec async_ps_spec() {
  ModeSpec s;
  s.validate = validate_async_ps;
  // The data-parallel ranks are the workers: the world past the servers.
  s.trainers = [](const JobConfig& cfg, int64_t world) { return world - cfg.parallel.servers; };
  s.any_source = "parallel.mode async_ps's servers take pushes from whichever worker sends first";
  s.unrepeatable = "its workers run ahead of one another";
  s.role = [](const JobConfig& cfg, int64_t rank) {
    const int64_t servers = cfg.parallel.servers;
    return rank < servers ? fmt::format("async_ps server {}", rank)
                          : fmt::format("async_ps worker {}", rank - servers);
  };
  // A server keeps the buffers whole and updates its range of them; a worker keeps the
  // whole model and updates nothing. Pushes go whenever a worker is ready: no step's bytes.
  s.cost = [](const JobConfig& cfg, const FlatShape& shape, const DataGroup&, int64_t rank) {
    const int64_t servers = cfg.parallel.servers;
    RankCost c{unsharded_cost(shape, pad_to(servers)), true, ""};
    c.sync.bytes.reset();
    c.role = rank < servers ? "server" : "worker";
    c.trains = rank >= servers;
    c.sync.shard = c.trains ? 0 : c.sync.numel / servers;
    if (!c.trains) c.sync.buffers = 0;
    return c;
  };
  s.make = [](const JobConfig& cfg, const ParallelDims&,
              std::shared_ptr<Comm> job) -> std::unique_ptr<Mode> {
    return std::make_unique<AsyncPs>(cfg, std::move(job));
  };
  return s;
}

}  // namespace dtrain
