// dtrain: the command line. Parses, loads and validates the job, hands it to the library,
// and maps errors to the exit codes of docs/contract.md. No training logic lives here.
// main.cpp calls dtrain_main; the end-to-end tests call it too, in a forked copy of their
// own process (tests/e2e/run.hpp), as the supervisor starts its workers.
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "models/gpt_hf.hpp"
#include "config/schema.hpp"
#include "job/validate.hpp"
#include "plan/plan.hpp"
#include "plan/profile.hpp"
#include "job/layouts.hpp"
#include "data/dataset.hpp"
#include "comm/comm.hpp"
#include "comm/job_link.hpp"
#include "comm/lighthouse.hpp"
#include "comm/replica_set.hpp"
#include "comm/tcp_store.hpp"
#include "comm/watch.hpp"
#include "launch/device.hpp"
#include "launch/error_file.hpp"
#include "launch/requeue.hpp"
#include "launch/supervisor.hpp"
#include "launch/world.hpp"
#include "run/mode.hpp"
#include "run/signals.hpp"
#include "run/trainer.hpp"
#include "util/affinity.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "util/process.hpp"
#include "util/shape.hpp"
#include "verify/verify.hpp"

#include "cli.hpp"

namespace {

using namespace dtrain;

struct JobArgs {
  std::string path;
  std::vector<std::string> sets;
};

void add_job_args(CLI::App* cmd, JobArgs& a, bool required = true) {
  cmd->add_option("JOB", a.path, "job spec (YAML)")->required(required);
  cmd->add_option("--set", a.sets, "override a key: --set optimizer.lr=0.1 (repeatable)")
      ->allow_extra_args(false);
}

struct Job {
  JobConfig cfg;
  ParallelDims dims;
};

// A resolved job spec taken to its layout and validated for `world_size` processes
// (`local` of them on this machine) among `devices`: parallel.auto's choice, said on stderr
// where `say`.
Job settle(const JobConfig& cfg, int64_t world_size, int64_t local, bool say,
           const Devices& devices = Devices::here()) {
  auto choice = auto_layout(cfg, world_size, local, false);
  if (say && !choice.line.empty()) std::cerr << "dtrain: " << choice.line << "\n";
  Job job{std::move(choice.cfg), {}};
  job.dims = validate(job.cfg, world_size, devices);
  return job;
}

// The job spec with its --set overrides, resolved (`run_dir`, where given, over its own).
JobConfig read_job(const JobArgs& a, const std::string& run_dir = "") {
  JobConfig cfg = load_job(a.path, a.sets);
  if (!run_dir.empty()) cfg.run_dir = run_dir;
  resolve(cfg);
  return cfg;
}

// An elastic job's check at each world size: under parallel.auto, that some layout
// validates (the one auto_layout would take at that size).
WorldCheck elastic_check(const JobConfig& cfg) {
  return cfg.parallel.auto_layout ? WorldCheck(check_some_layout) : nullptr;
}

// The world size validate, config and plan check against, and its processes on this
// machine: --nproc (all local), else the launcher's (a job step under sbatch --ntasks 8,
// torchrun, mpirun), else one process.
std::pair<int64_t, int64_t> world_for_check(int64_t nproc) {
  if (nproc > 1) return {nproc, nproc};
  auto env = process_env();
  if (detect_launcher(env) == "single") return {1, 1};
  const auto world = discover_world(env, 0);
  return {world.world, std::min(world.world, world.local_world)};
}

// "MIN:MAX" or "N" (torchrun's --nnodes and PET_NNODES): the range of nodes.
std::pair<int64_t, int64_t> node_range(const std::string& text, const std::string& what) {
  const auto colon = text.find(':');
  int64_t lo = 0, hi = 0;
  try {
    size_t used = 0;
    lo = std::stoll(text.substr(0, colon), &used);
    hi = colon == std::string::npos ? lo : std::stoll(text.substr(colon + 1));
  } catch (const std::exception&) {
    lo = hi = 0;
  }
  fail_if<ConfigError>(lo < 1 || hi < lo || hi > 4096, "{}: expected MIN:MAX nodes, e.g. 1:4 "
                       "(got '{}')", what, text);
  return {lo, hi};
}

// The worker command line: ours without the supervisor's own options.
std::vector<std::string> worker_args(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nproc" || a == "--max-restarts") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0 || a.rfind("--max-restarts=", 0) == 0) continue;
    out.push_back(a);
  }
  return out;
}

// The --nproc supervisor's store for one attempt's workers (SupervisorOptions::host_store):
// it outlives any rank, and the supervisor reads their heartbeats through it to print the
// job's picture when a wait passes dist.hang_report_s.
SupervisorOptions::HostedStore host_store(int port, int64_t nproc, const JobConfig& cfg) {
  const auto& dist = cfg.dist;
  TcpStore::Options so;
  so.host = "127.0.0.1", so.port = port, so.server = true;
  so.timeout = std::chrono::seconds(dist.timeout_s);
  auto store = c10::make_intrusive<TcpStore>(so);
  SupervisorOptions::HostedStore hosted;
  hosted.tick = [store] {};
  hosted.ended = [store](int64_t rank) { mark_ended(*store, rank); };
  if (cfg.fault_tolerance.mode == "replicas") {
    auto live = std::make_shared<Liveness>(
        store, std::chrono::seconds(cfg.fault_tolerance.heartbeat_s), /*none_alive=*/true);
    hosted.silent = [live](const std::vector<int64_t>& ranks) { return live->dead_among(ranks); };
  }
  const auto after = hang_report_after(dist);
  if (after.count() <= 0) return hosted;
  auto watch = std::make_shared<JobWatch>(store, nproc, after, [](const std::string& picture) {
    std::cerr << picture << std::endl;
  });
  hosted.tick = [store, watch] { watch->tick(); };
  return hosted;
}

// A worker that the supervisor forked without exec (SupervisorOptions::start_here): the
// command line a worker would have been started with, run in this process.
int start_worker_here(std::vector<std::string> args) {
  return dtrain_main(int(args.size()), argv_of(args).data());
}

// fault_tolerance: replicas: this process's replica (of dims.tensor ranks: the job's ranks
// in runs of that many) and its place in the job's set of them (comm/replica_set.hpp),
// which every replica enters together. The replica's own ranks form a world of their own,
// named by its incarnation: a replica restarted after a failure (DTRAIN_FT_JOIN, from 1)
// builds a new one beside the old one's keys in the store.
struct ReplicaWorld {
  std::shared_ptr<ReplicaSet> set;
  std::shared_ptr<Comm> world;  // the replica's ranks
};
ReplicaWorld join_replicas(const JobConfig& cfg, const ParallelDims& dims, const WorldInfo& world,
                           CommOptions opts) {
  fail_if<ConfigError>(!world.store_hosted,
                       "fault_tolerance.mode: replicas needs a store that outlives every rank: "
                       "dtrain's own launcher's (dtrain run JOB --nproc N), or under {} a "
                       "lighthouse's (dtrain lighthouse JOB --replicas N, then each replica's "
                       "launcher with DTRAIN_LIGHTHOUSE and DTRAIN_REPLICA set)", world.launcher);
  const std::chrono::seconds heartbeat(cfg.fault_tolerance.heartbeat_s);
  if (opts.hang_after.count() <= 0) opts.hang_after = heartbeat;  // the watch beats
  JobLink link = link_job(world, opts, heartbeat);
  const int64_t size = replica_ranks(cfg, dims);
  const int64_t replica = world.rank / size, place = world.rank % size;
  const int64_t replicas = dims.data / cfg.fault_tolerance.replica_data;
  // Restarted by the supervisor (its count for this replica), or by the replica's own
  // launcher (torchrun's restart count).
  const auto incarnation = process_env()("DTRAIN_FT_JOIN");
  const int64_t generation = incarnation ? std::stoll(*incarnation) : world.restart_count;
  // Restarted, or one more than the replicas that started the job (scale-up).
  const int64_t starting = starting_replicas(*link.store, replicas);
  const bool joining = generation > 0 || replica >= starting;
  std::vector<int64_t> ranks;
  for (int64_t p = 0; p < size; ++p) ranks.push_back(replica * size + p);
  ReplicaWorld out;
  out.world = size == 1 ? make_local_comm()
                        : link.world(fmt::format("ft/replica/{}/{}", replica, generation), ranks);
  ReplicaSet::Options o;
  o.replica = replica, o.replicas = replicas, o.starting = starting;
  o.place = {place, size};
  o.ranks = ranks;
  o.world_rank = [size, place](int64_t r) { return r * size + place; };
  o.dead = [dead = link.dead, size](const std::vector<int64_t>& replicas) {
    std::vector<int64_t> ranks, out;  // a replica has gone when any of its ranks has
    for (int64_t r : replicas)
      for (int64_t p = 0; p < size; ++p) ranks.push_back(r * size + p);
    for (int64_t rank : dead(ranks))
      if (out.empty() || out.back() != rank / size) out.push_back(rank / size);
    return out;
  };
  o.make_group = link.group;
  // Not before: the store says this rank ended (its former self) until its peers have
  // seen that self gone, and a fresh heartbeat would then stand for the dead one.
  o.revive = [store = link.store, rank = world.rank] { clear_ended(*store, rank); };
  o.stopping = [] { return stop_signal() != 0; };
  o.timeout = std::chrono::seconds(cfg.dist.timeout_s);
  o.poll = std::chrono::milliseconds(20);
  out.set = std::make_shared<ReplicaSet>(*link.store, o, /*step=*/1, joining);
  return out;
}

// One replica of a fault-tolerant job whose launcher is one of several (DTRAIN_LIGHTHOUSE
// set): its place in the whole job, whose store the lighthouse hosts; else `launched`.
WorldInfo replica_world(const JobConfig& cfg, const WorldInfo& launched, const Env& env) {
  const auto lighthouse = env("DTRAIN_LIGHTHOUSE");
  if (!lighthouse) return launched;
  fail_if<ConfigError>(cfg.fault_tolerance.mode != "replicas", "DTRAIN_LIGHTHOUSE is set, for "
                       "fault_tolerance.mode: replicas; this job's is {}", cfg.fault_tolerance.mode);
  fail_if<ConfigError>(cfg.parallel.auto_layout, "parallel.auto under a lighthouse: name "
                       "parallel.tensor and parallel.pipeline, which make a replica");
  return lighthouse_world(launched, *lighthouse, env("DTRAIN_REPLICA").value_or(""),
                          replica_ranks(cfg, {1, cfg.parallel.tensor, cfg.parallel.pipeline}),
                          std::chrono::seconds(cfg.dist.timeout_s));
}

int run_job(const JobArgs& job, const std::string& run_dir, const std::string& resume,
            bool requeue, int64_t nproc, int64_t max_restarts, int argc, char** argv) {
  auto env = process_env();
  if (nproc > 1 && detect_launcher(env) == "single") {
    // A bad spec fails here, once, not in every worker (rank 0 says parallel.auto's choice).
    const auto checked = settle(read_job(job, run_dir), nproc, nproc, false);
    check_machine(checked.cfg, nproc, nproc);
    const JobConfig cfg = checked.cfg;
    const auto& mode = mode_spec(cfg.parallel.mode);
    return supervise({nproc, max_restarts, "/proc/self/exe", worker_args(argc, argv),
                      [&mode, cfg](int64_t rank) { return mode.role(cfg, rank); },
                      workers_forked(nproc) ? start_worker_here : nullptr,
                      [nproc, cfg](int port) { return host_store(port, nproc, cfg); },
                      /*replica_size=*/cfg.fault_tolerance.mode == "replicas"
                          ? replica_ranks(cfg, checked.dims) : 0});
  }
  // Parsed once; dist.port is needed to discover the world, which validation needs.
  JobConfig cfg = read_job(job, run_dir);
  auto world = replica_world(cfg, discover_world(env, cfg.dist.port), env);
  // A worker torchrun restarted continues the run, as --max-restarts does under --nproc;
  // one beside a lighthouse (a store hosted apart from the ranks) is a replica's, which
  // joins its peers instead.
  const std::string resume_from =
      resume.empty() && world.restart_count > 0 && !world.store_hosted ? "auto" : resume;
  const auto device = [&] {
    return plan_device(cfg, world.local_rank, world.local_world, mode_spec(cfg.parallel.mode).any_source);
  };
  const auto comm_options = [&] {
    const DevicePlan plan = device();
    CommOptions opts;
    opts.backend = plan.backend, opts.timeout = std::chrono::seconds(cfg.dist.timeout_s);
    opts.gloo_threads = cfg.dist.gloo_threads, opts.store_everywhere = cfg.dist.store_bind == "all";
    opts.device = plan.device;
    const int64_t cpus = usable_cpus();
    opts.comm_first = world.local_world * intra_op_threads(cfg.train.threads, cpus, world.local_world) <= cpus;
    opts.hang_after = hang_report_after(cfg.dist);
    return opts;
  };
  const auto connect = [&]() -> std::shared_ptr<Comm> {
    if (world.world == 1) return make_local_comm();
    return make_c10d_comm(world, comm_options());
  };
  std::shared_ptr<Comm> comm;
  if (cfg.parallel.auto_layout) {  // the ranks agree on one choice, over the job's comm
    comm = connect();
    cfg = agree_on_layout(cfg, world.local_world, !resume_from.empty(), *comm);
  }
  const ParallelDims dims = validate(cfg, world.world);
  check_machine(cfg, world.world, world.local_world);
  // An elastic range torchrun was given through its environment: every size in it must
  // work, not only this one (a join would otherwise stop the job later).
  if (auto range = env("PET_NNODES"); range && !world.run_id.empty()) {
    const auto [lo, hi] = node_range(*range, "PET_NNODES");
    validate_elastic(cfg, lo, hi, world.local_world, elastic_check(cfg));
  }
  RunOptions opts{resume_from, "", device().device, nullptr};
  if (world.launcher == "slurm" && cfg.dist.requeue && requeue)
    opts.requeue_job = slurm_job_to_requeue(env);
  if (cfg.fault_tolerance.mode == "replicas" && world.world > 1) {
    const auto replica = join_replicas(cfg, dims, world, comm_options());
    opts.replicas = replica.set;
    ParallelDims inside = dims;  // a replica's layout
    inside.data = cfg.fault_tolerance.replica_data;
    return run_training(cfg, inside, opts, world, replica.world).exit_code;
  }
  if (!comm) comm = connect();
  return run_training(cfg, dims, opts, world, comm).exit_code;
}

// A list of tensors under `title`: their count and values, then each one's shape and dtype.
void print_tensors(const char* title, const NamedTensors& ts) {
  int64_t total = 0;
  for (const auto& [n, t] : ts) total += t.numel();
  std::cout << fmt::format("{} ({} tensors, {} values):\n", title, ts.size(), total);
  for (const auto& [n, t] : ts)
    std::cout << fmt::format("  {:<40} {:<18} {}\n", n, shape_str(t), c10::toString(t.scalar_type()));
}

// A Hugging Face GPT-2 folder: its shape and its tensors as dtrain names them (init_from).
int inspect_hf(const std::string& folder) {
  const auto hf = read_hf_gpt2(folder);
  std::cout << fmt::format("hugging face gpt2 {}\n  layers {}  heads {}  dim {}  positions {}  "
                           "vocab {}\n", folder, hf.model.layers, hf.model.heads, hf.model.dim,
                           hf.model.seq_len, hf.model.vocab);
  print_tensors("model", hf.weights);
  return 0;
}

int inspect(const std::string& path) {
  if (is_hf_folder(path)) return inspect_hf(path);
  const std::string folder = resolve_checkpoint(path);
  auto manifest = verify_checkpoint(folder);
  auto state = load_checkpoint(folder);
  std::cout << fmt::format("checkpoint {}\n  step {}  epoch {}  layout {}  format v{}\n", folder,
                           manifest["step"].get<int64_t>(), manifest["epoch"].get<int64_t>(),
                           manifest["layout"].dump(), manifest["version"].get<int>());
  if (manifest.contains("metric"))
    std::cout << fmt::format("  {} {}\n", manifest["metric"]["name"].get<std::string>(),
                             manifest["metric"]["value"].get<double>());
  print_tensors("model", state.model);
  print_tensors("optimizer", state.optimizer);
  auto trainer = state.trainer;
  trainer.erase("rng_torch_cpu");
  std::cout << "trainer state: " << trainer.dump() << "\nconfig:\n" << state.config_yaml;
  return 0;
}

// Writes the checkpoint's weights (every part's, at full shapes) to `out` as one
// safetensors file, under a temporary name renamed into place, and reads back what it wrote.
// With `format` hf: a folder transformers' GPT2LMHeadModel.from_pretrained loads, the token
// embedding cut to `vocab` rows (0: all of model.vocab).
int export_weights(const std::string& path, const std::string& out, const std::string& format,
                   int64_t vocab) {
  const std::string folder = resolve_checkpoint(path);
  // A file written into a checkpoint folder (the one read, or any other) breaks the
  // checksums its manifest keeps: the checkpoint would no longer verify.
  namespace fs = std::filesystem;
  std::error_code ec;
  auto is_checkpoint = [&](const fs::path& at) {
    if (fs::equivalent(at, folder, ec)) return true;
    try {
      return nlohmann::json::parse(read_file((at / "manifest.json").string())).value("format", "") ==
             "dtrain-checkpoint";
    } catch (const std::exception&) {  // no manifest, or not dtrain's
      return false;
    }
  };
  for (fs::path at = fs::weakly_canonical(fs::absolute(out), ec); !at.empty() && at != at.root_path();
       at = at.parent_path())
    fail_if<ConfigError>(is_checkpoint(at), "export: '{}' is inside checkpoint '{}', whose "
                         "checksums a file there would break; write it elsewhere", out, at.string());
  const auto state = load_checkpoint(folder);  // verified, parts merged
  const auto& weights = state.model;
  if (format == "hf") {
    const auto model = parse_job(state.config_yaml, folder + "/config.yaml").model;
    write_hf_gpt2(out, weights, model, vocab > 0 ? vocab : model.vocab);
    std::cerr << fmt::format("wrote {} (config.json, model.safetensors)\n", out);
    return 0;
  }
  fail_if<ConfigError>(vocab > 0, "export --vocab: only with --format hf");
  fail_if<RunDirError>(std::filesystem::is_directory(out, ec),
                       "export: '{}' is a folder; name the file to write, e.g. {}/model.safetensors",
                       out, out);
  const std::string temp = out + ".tmp-export";
  try {
    write_safetensors(temp, weights, {{"format", "dtrain-model"}});
    std::filesystem::rename(temp, out);
  } catch (const std::exception& e) {
    std::filesystem::remove(temp, ec);
    throw RunDirError(fmt::format("export: cannot write '{}': {}", out, first_line(e.what())));
  }
  const auto back = read_safetensors(out);
  bool same = back.tensors.size() == weights.size();
  for (size_t i = 0; same && i < back.tensors.size(); ++i)
    same = back.tensors[i].first == weights[i].first &&
           back.tensors[i].second.equal(weights[i].second);
  fail_if<RunDirError>(!same, "export: '{}' does not read back as the checkpoint's weights", out);
  std::cerr << fmt::format("wrote {} ({} tensors)\n", out, back.tensors.size());
  return 0;
}

// Every command and option of the command line.
struct Cli {
  CLI::App app{"dtrain: distributed training jobs from one YAML file"};
  JobArgs job;
  std::string run_dir, resume, nnodes, folder, out, format = "safetensors";
  int64_t nproc = 1, max_restarts = 0, check_nproc = 1, vocab = 0;
  bool no_requeue = false, reference = false, json = false, measure = false, all = false;
  std::string profile, plan_device_name;
  double memory_gb = 0;
  VerifyOptions verify_opts;
  CLI::App *run = nullptr, *validate = nullptr, *config = nullptr, *inspect = nullptr,
           *export_ = nullptr, *verify = nullptr, *plan = nullptr, *lighthouse = nullptr;
  int64_t replicas = 0, max_replicas = 0;
  std::string host = "127.0.0.1";
  int port = 0;

  Cli() {
    app.set_version_flag("--version", fmt::format("dtrain {} ({})", DTRAIN_VERSION, build_info()));
    app.require_subcommand(1);
    add_run();
    add_checks();
    add_verify();
    add_checkpoint_commands();
  }

 private:
  void add_run() {
    run = app.add_subcommand("run", "train a job");
    add_job_args(run, job);
    run->add_option("--run-dir", run_dir, "logs and checkpoints (overrides run_dir)");
    run->add_option("--resume", resume, "auto (newest valid checkpoint, or start fresh) or a "
                                        "checkpoint folder");
    run->add_option("--nproc", nproc, "start N local worker processes and supervise them")
        ->check(CLI::Range(int64_t(1), int64_t(1024)));
    run->add_flag("--no-requeue", no_requeue,
                  "under SLURM: do not requeue the job after a SIGUSR1 checkpoint (dist.requeue)");
    run->add_option("--max-restarts", max_restarts,
                    "with --nproc: restart all workers from the latest checkpoint up to N times")
        ->check(CLI::Range(int64_t(0), int64_t(1000)));
    lighthouse = app.add_subcommand("lighthouse", "host a fault-tolerant job's store for "
                                                  "replicas that torchrun or srun start, one "
                                                  "launcher a replica (fault_tolerance: replicas)");
    add_job_args(lighthouse, job);
    lighthouse->add_option("--replicas", replicas, "the replicas that start the job")
        ->required()
        ->check(CLI::Range(int64_t(1), int64_t(4096)));
    lighthouse->add_option("--max-replicas", max_replicas, "the most it may have: a replica "
                                                           "above --replicas joins the job "
                                                           "running (default --replicas)")
        ->check(CLI::Range(int64_t(1), int64_t(4096)));
    lighthouse->add_option("--host", host, "the address to listen on, which the ranks are "
                                           "given (default 127.0.0.1: this machine only)");
    lighthouse->add_option("--port", port, "the port (default dist.port, else 29510)")
        ->check(CLI::Range(1, 65535));
  }

  // validate, config and plan: the job checked, printed or costed without training.
  void add_checks() {
    validate = app.add_subcommand("validate", "check a job spec; exit 0 or a clear error");
    add_job_args(validate, job);
    config = app.add_subcommand("config", "print the fully resolved job as YAML");
    add_job_args(config, job, /*required=*/false);
    config->add_flag("--reference", reference,
                     "print every job key with its type, default and meaning (Markdown)");
    plan = app.add_subcommand("plan", "what the job costs each rank, without training: memory "
                                      "by part, bytes sent, bubble, FLOPs");
    add_job_args(plan, job, /*required=*/false);
    plan->add_flag("--json", json, "one JSON object instead of the table");
    plan->add_flag("--measure", measure, "time this machine's matmuls, memory and Gloo between "
                                         "--nproc local ranks (default 2), and keep the profile "
                                         "for the time estimates");
    plan->add_option("--profile", profile, "the machine profile to write or read (default "
                                           "$DTRAIN_PROFILE, else ~/.cache/dtrain/machine.json)");
    plan->add_flag("--all", all, "every layout of --nproc processes the job can take, fastest "
                                 "first, marking those that do not fit");
    plan->add_option("--memory-gb", memory_gb, "with --all: the memory to fit in, GiB (default: "
                                               "what this machine has available; on a GPU: "
                                               "the profile's GPU's, less a tenth)")
        ->check(CLI::Validator(
            [](std::string& text) -> std::string {
              char* end = nullptr;
              const double gb = std::strtod(text.c_str(), &end);
              if (end == text.c_str() || *end || !std::isfinite(gb) || gb <= 0 || gb > 1e9)
                return fmt::format("a number of GiB above 0, e.g. 64 (got '{}')", text);
              return "";
            },
            "GIB"));
    plan->add_option("--device", plan_device_name, "cuda: plan for a GPU whatever this machine "
                                                   "has (with --profile of a GPU machine for "
                                                   "time and memory limit)")
        ->check(CLI::IsMember({"cuda"}));
    for (auto* cmd : {validate, config, plan})
      cmd->add_option("--nproc", check_nproc, "check for N processes (default: the launcher's "
                                              "world size, else 1)")
          ->check(CLI::Range(int64_t(1), int64_t(1 << 20)));
    validate->add_option("--nnodes", nnodes, "an elastic job's range of nodes, MIN:MAX (as "
                                             "torchrun's): check every world size in it, "
                                             "--nproc processes per node");
  }

  void add_verify() {
    verify = app.add_subcommand("verify", "train one process and each parallel layout a few "
                                          "steps; exit 0 when their losses agree");
    verify->add_option("JOB", verify_opts.job_path, "job spec (YAML)")->required();
    verify->add_option("--set", verify_opts.sets, "override a key in every run (repeatable)")
        ->allow_extra_args(false);
    verify->add_option("--layouts", verify_opts.layouts,
                       "comma-separated: d2, t2, p2, d2xt2xp2, with z1..z3 for ZeRO (d2xz1); "
                       "1 = one process");
    verify->add_option("--steps", verify_opts.steps, "steps each run trains (default 20, or the "
                                                     "--against file's)");
    verify->add_option("--tolerance", verify_opts.tolerance,
                       "largest relative loss difference allowed (default 1e-4)");
    verify->add_option("--save", verify_opts.save, "write the one-process losses to FILE (JSON)");
    verify->add_option("--against", verify_opts.against,
                       "compare with the losses in FILE (from --save) instead of one process");
    verify->add_flag("--keep", verify_opts.keep, "keep the runs' folders (the path is printed)");
  }

  // inspect and export: what a checkpoint holds, and its weights for other tools.
  void add_checkpoint_commands() {
    inspect = app.add_subcommand("inspect", "what a checkpoint holds");
    inspect->add_option("CHECKPOINT", folder, "checkpoint folder, a run directory (its "
                                              "latest checkpoint) or a Hugging Face GPT-2 folder")
        ->required();
    export_ = app.add_subcommand("export", "write a checkpoint's weights as safetensors, or as "
                                           "a Hugging Face GPT-2 folder");
    export_->add_option("CHECKPOINT", folder, "checkpoint folder, or a run directory (its "
                                              "latest checkpoint)")->required();
    export_->add_option("OUT", out, "output .safetensors file (--format hf: a folder)")->required();
    export_->add_option("--format", format, "safetensors: dtrain's names, one file; hf: "
                                            "config.json and model.safetensors as transformers' "
                                            "GPT2LMHeadModel saves them")
        ->check(CLI::IsMember({"safetensors", "hf"}));
    export_->add_option("--vocab", vocab, "with --format hf: keep the first N token rows (50257 "
                                          "for GPT-2's tokenizer from a model.vocab padded to "
                                          "50304); default all")
        ->check(CLI::Range(int64_t(1), int64_t(1) << 31));
  }
};

// `lighthouse`: the store of a job whose replicas other launchers start, for as long as
// they run (comm/lighthouse.hpp).
int lighthouse_command(const Cli& cli) {
  const JobConfig spec = read_job(cli.job);
  fail_if<ConfigError>(spec.fault_tolerance.mode != "replicas", "lighthouse: the job's "
                       "fault_tolerance.mode is {}; a lighthouse serves replicas",
                       spec.fault_tolerance.mode);
  fail_if<ConfigError>(spec.parallel.auto_layout, "lighthouse: parallel.auto: name "
                       "parallel.tensor and parallel.pipeline, which make a replica");
  fail_if<ConfigError>(cli.max_replicas > 0 && cli.max_replicas < cli.replicas, "lighthouse: "
                       "--max-replicas {} is below --replicas {}", cli.max_replicas, cli.replicas);
  const int64_t size = replica_ranks(spec, {1, spec.parallel.tensor, spec.parallel.pipeline});
  const int64_t most = std::max(cli.max_replicas, cli.replicas);
  settle(spec, cli.replicas * size, size, false);  // the job as it starts, and at its largest
  const auto cfg = settle(spec, most * size, size, false).cfg;
  LighthouseOptions o;
  o.host = cli.host, o.port = cli.port > 0 ? cli.port : cfg.dist.port > 0 ? int(cfg.dist.port) : 29510;
  o.replicas = cli.replicas, o.most = most, o.replica_size = size;
  o.timeout = std::chrono::seconds(cfg.dist.timeout_s);
  o.silent = std::chrono::seconds(cfg.fault_tolerance.heartbeat_s);
  o.hang_after = hang_report_after(cfg.dist);
  install_stop_signals();
  o.stop = [] { return stop_signal() != 0; };
  o.say = [](const std::string& line) { std::cerr << line << std::endl; };
  const int code = serve_lighthouse(o);
  return stop_signal() ? exit_code_for_signal(stop_signal()) : code;
}

// `validate`: the job for its world (every size of an elastic range), this machine, and
// the data as run would read it with the model's checks against it.
int validate_job(const Cli& cli) {
  if (!cli.nnodes.empty()) {
    const auto [lo, hi] = node_range(cli.nnodes, "--nnodes");
    const JobConfig cfg = read_job(cli.job);
    validate_elastic(cfg, lo, hi, cli.check_nproc, elastic_check(cfg));
  }
  const auto [world, local] = world_for_check(cli.check_nproc);
  auto checked = settle(read_job(cli.job), world, local, true);
  check_machine(checked.cfg, world, local);
  check_model_fits_data(checked.cfg, load_data(checked.cfg.data, static_cast<uint64_t>(checked.cfg.seed)));
  const DevicePlan plan = plan_device(checked.cfg, 0, 1, mode_spec(checked.cfg.parallel.mode).any_source);
  // A mode may set ranks apart from the layout (parameter servers).
  const int64_t others = world - checked.dims.world();
  std::cout << fmt::format("{}: ok ({} process(es): {}{}; {}{})\n", cli.job.path, world,
                           checked.dims.str(),
                           others > 0 ? fmt::format(", and {} more for parallel.mode {}", others,
                                                    checked.cfg.parallel.mode)
                                      : "",
                           plan.device.str(), world > 1 ? ", " + plan.backend : "");
  return 0;
}

// `plan`: measure the machine (--measure), then plan the job, or every layout (--all).
int plan_command(const Cli& cli) {
  // --profile stands for $DTRAIN_PROFILE, which parallel.auto's choice reads too.
  if (!cli.profile.empty()) ::setenv("DTRAIN_PROFILE", cli.profile.c_str(), 1);
  const std::string profile_path = default_profile_path();
  fail_if<ConfigError>(cli.job.path.empty() && !cli.measure, "plan: JOB is required (or --measure)");
  if (cli.measure) {
    // Each measured rank is a thread here, timing Gloo against the others: 32 took 83 s
    // and 1.1 GB, and beyond a node's cores the links time the same crowding.
    constexpr int64_t kMostMeasured = 16;
    fail_if<ConfigError>(cli.check_nproc > kMostMeasured, "plan --measure --nproc {}: at most {} "
                         "local ranks are measured (a plan for more uses their links); pass "
                         "--nproc {} or fewer", cli.check_nproc, kMostMeasured, kMostMeasured);
    std::cerr << "measuring this machine (about 20 s; 35 with a GPU)...\n";
    save_profile(measure_machine(std::max<int64_t>(2, cli.check_nproc)), profile_path);
    std::cerr << "wrote " << profile_path << "\n";
    if (cli.job.path.empty()) return 0;
  }
  const int64_t world = world_for_check(cli.check_nproc).first;
  JobConfig cfg = read_job(cli.job);
  // --device cuda: the job as a GPU machine would take it (the profile's GPUs, else one a
  // rank; its dtrain built with CUDA and NCCL), whatever this machine has.
  const bool elsewhere = cli.plan_device_name == "cuda";
  Devices devices = Devices::here();
  if (elsewhere) {
    const auto stored = load_profile(profile_path);
    devices = Devices::gpu_machine(stored && stored->gpu ? stored->gpu->count : world);
    fail_if<ConfigError>(!plans_gpu(cfg, devices), "plan --device cuda: train.device {} keeps "
                         "this job on the CPU of a GPU machine too; set train.device auto or "
                         "cuda to plan it for the GPU", cfg.train.device);
  }
  if (cli.all) {
    const bool cuda = plans_gpu(cfg, devices);
    // An auto job's list is ranked as its choice is: by time, measuring where need be.
    const auto profile = cfg.parallel.auto_layout && !elsewhere
                             ? std::optional(profile_for_auto(world, cuda))
                             : load_profile(profile_path);
    const MachineProfile* measured = profile ? &*profile : nullptr;
    const double limit = cli.memory_gb > 0 ? cli.memory_gb * 1024 * 1024 * 1024
                         : cuda            ? gpu_limit(measured)
                                           : available_memory();
    const auto all = all_layouts(cfg, world, measured, limit, devices);
    fail_if<ConfigError>(all.empty(), "plan --all: no layout of {} process(es) validates for {} "
                         "(`dtrain validate --nproc {}` says why for the job's own)",
                         world, cli.job.path, world);
    if (cli.json) std::cout << candidates_json(all, limit).dump() << "\n";
    else std::cout << cli.job.path << ": " << candidates_table(all, limit);
    return 0;
  }
  fail_if<ConfigError>(elsewhere && cfg.parallel.auto_layout, "plan --device cuda: parallel.auto "
                       "chooses its layout on the machine it runs on; `plan --all --device cuda` "
                       "ranks the layouts for a GPU");
  const auto checked = settle(cfg, world, world, true, devices);  // the spec read once
  const auto profile = load_profile(profile_path);  // after load: parallel.auto may have made it
  const MachineProfile* measured = profile ? &*profile : nullptr;
  const Plan plan = plan_job(checked.cfg, world, measured, devices);
  if (cli.json) {
    std::cout << plan_json(checked.cfg, plan).dump() << "\n";
  } else {
    std::cout << cli.job.path << ": " << plan_table(checked.cfg, plan);
    if (!measured) std::cout << "(no machine profile: `dtrain plan --measure` makes one for the time estimates)\n";
    else if (plan.device == "cuda" && !measured->gpu)
      std::cout << "(the machine profile has no GPU: `dtrain plan --measure` on a GPU machine adds one)\n";
  }
  return 0;
}

int run_cli(int argc, char** argv) {
  Cli cli;
  try {
    cli.app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --help-all, --version: printed by exit
    return cli.app.exit(e);
  } catch (const CLI::ParseError& e) {
    throw ConfigError(e.what());
  }
  if (*cli.run)
    return run_job(cli.job, cli.run_dir, cli.resume, !cli.no_requeue, cli.nproc, cli.max_restarts,
                   argc, argv);
  if (*cli.validate) return validate_job(cli);
  if (*cli.config) {
    if (cli.reference) {
      std::cout << key_reference();
      return 0;
    }
    fail_if<ConfigError>(cli.job.path.empty(), "config: JOB is required (or --reference)");
    const auto [world, local] = world_for_check(cli.check_nproc);
    std::cout << to_yaml(settle(read_job(cli.job), world, local, true).cfg);
    return 0;
  }
  if (*cli.verify) {
    cli.verify_opts.start_here = start_worker_here;  // each run a fork, as --nproc's workers
    return verify(cli.verify_opts);
  }
  if (*cli.plan) return plan_command(cli);
  if (*cli.lighthouse) return lighthouse_command(cli);
  if (*cli.inspect) return inspect(cli.folder);
  if (*cli.export_) return export_weights(cli.folder, cli.out, cli.format, cli.vocab);
  return kExitBadSpec;
}

// One line on stderr, and to the launcher when it asked for the reason (torchrun).
int fail(int code, const std::string& what) {
  const std::string line = "dtrain: error: " + first_line(what);
  std::cerr << line << "\n";
  dtrain::report_failure_to_launcher(dtrain::process_env(), line);
  return code;
}
}  // namespace

// The whole command: main's, and a worker's that the supervisor forks without exec.
int dtrain_main(int argc, char** argv) {
  // A write to a peer that died (Gloo's TCP pairs, the store) must fail as an error this
  // rank reports, not kill it: SIGPIPE ends a C++ program by default (Python, which runs
  // torchrun's workers, ignores it). Left to kill, a surviving rank could die of the
  // peer's death before the supervisor heard of the peer, and be blamed for it.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    return run_cli(argc, argv);
  } catch (const dtrain::Error& e) {
    return fail(e.code, e.what());
  } catch (const std::filesystem::filesystem_error& e) {  // a file that cannot be read or written
    return fail(dtrain::kExitBadData, e.what());
  } catch (const c10::Error& e) {
    return fail(dtrain::kExitFailure, std::string("internal error: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(dtrain::kExitFailure, std::string("internal error: ") + e.what());
  }
}
