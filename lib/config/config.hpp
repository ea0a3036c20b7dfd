// The job spec: typed structs whose member initialisers are the only defaults in dtrain.
// Each struct's visit() lists its keys once, each with what it means:
//   v("key", member, "meaning")  or  v("key", member, Choices{...}, "meaning")
// (or listed("key"), the names a registry holds).
// Loading, --set overrides, printing, the unknown-key suggestions and the key reference
// (`dtrain config --reference`, docs/keys.md) are all driven from those lists (schema.hpp).
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace dtrain {

using Ints = std::vector<int64_t>;
using Names = std::vector<std::string>;  // a list of names, each one of the key's Choices
using Choices = std::vector<std::string>;

// The names a registry above config/ holds: model.arch's models (models/registry.cpp),
// parallel.mode's modes (run/modes/registry.cpp), parallel.compression's reductions
// (grad/compression.cpp). Each registry lists itself here as the program starts, so the
// spec checks and documents the registry's own names, in its order: a new model, mode or
// reduction is its file and its registry line.
using NamesOf = std::vector<std::string> (*)();
struct ListedBy {
  ListedBy(const char* key, NamesOf names);
};
Choices listed(const char* key);  // the names listed for `key` (none: any is accepted)

// The longest token window dtrain accepts (data.seq_len, model.seq_len): 16M tokens.
inline constexpr int64_t kMaxSeqLen = int64_t(1) << 24;

struct DataConfig {
  std::string dataset = "fashion_mnist";
  std::string path = "/usr/share/datasets/fashion-mnist";
  int64_t batch_size = 64;
  bool shuffle = true;
  int64_t workers = 2;
  int64_t prefetch = 4;
  int64_t samples = 8192;
  int64_t test_samples = 2048;
  Ints input_shape = {1, 28, 28};
  int64_t classes = 10;
  int64_t seq_len = 0;
  double eval_fraction = 0.05;
  int64_t vocab = 0;
  std::string eval_path = "";
  std::string token_format = "auto";
  Names augment = {};
  int64_t crop_padding = 2;

  template <class V> void visit(V&& v) {
    v("dataset", dataset,
      Choices{"fashion_mnist", "mnist", "synthetic", "text", "tokens", "synthetic_tokens"},
      "what to train on: images (fashion_mnist, mnist: IDX files; synthetic: random) or "
      "token windows (text: a file or folder read as bytes; tokens: uint16 token shards, "
      "llm.c's or nanoGPT's; synthetic_tokens: random)");
    v("path", path,
      "the IDX folder (fashion_mnist, mnist), the text file or folder (text), or the token "
      "shards (tokens: a file, a folder or a glob such as data/train_*.bin)");
    v("eval_path", eval_path,
      "tokens: the held-out shards (a file, a folder or a glob); empty = every n-th window "
      "of data.path (data.eval_fraction)");
    v("token_format", token_format, Choices{"auto", "llmc", "nanogpt"},
      "tokens: llmc (llm.c's shards: a 1024-byte header, then uint16 tokens), nanogpt (raw "
      "uint16 tokens), or auto (llm.c's when a file starts with its magic number)");
    v("batch_size", batch_size,
      "the global batch per optimizer step, over all data-parallel ranks and micro-batches");
    v("shuffle", shuffle, "a new order every epoch, from (seed, epoch)");
    v("workers", workers, "loader threads per process; 0 loads on the training thread");
    v("prefetch", prefetch, "batches prepared ahead of the step");
    v("samples", samples, "synthetic, synthetic_tokens: training samples");
    v("test_samples", test_samples, "synthetic, synthetic_tokens: held-out samples");
    v("input_shape", input_shape, "synthetic: one sample's shape, e.g. [1, 28, 28]");
    v("classes", classes, "synthetic: number of classes");
    v("seq_len", seq_len, "text, tokens, synthetic_tokens: tokens per window; 0 = model.seq_len");
    v("eval_fraction", eval_fraction,
      "text, tokens: share of the windows held out for evaluation, spread over the corpus");
    v("vocab", vocab,
      "synthetic_tokens, tokens: token values in [0, vocab); 0 = model.vocab");
    v("augment", augment, Choices{"random_crop", "hflip", "erase"},
      "images, training only: random_crop (shifted by up to crop_padding pixels, the edge "
      "filled with black), hflip (mirrored half the time), erase (a random rectangle blanked "
      "half the time); drawn per sample from the seed, so any layout and a resume see the "
      "same");
    v("crop_padding", crop_padding, "random_crop: the largest shift, pixels");
  }
};

struct ModelConfig {
  std::string arch = "cnn";
  Ints hidden = {512, 256};
  Ints channels = {32, 64};
  Ints fc = {128};
  bool batch_norm = false;
  double dropout = 0.0;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t dim = 128;
  int64_t vocab = 256;
  int64_t seq_len = 128;
  std::string init_from = "";
  bool init_strict = true;

  template <class V> void visit(V&& v) {
    v("arch", arch, listed("model.arch"),
      "the network: an MLP or a CNN (classification), a GPT (language model)");
    v("hidden", hidden, "mlp: hidden layer widths");
    v("channels", channels,
      "cnn: conv widths, each a 3x3 conv (pad 1), ReLU and 2x2 max-pool");
    v("fc", fc, "cnn: hidden fully-connected widths after the convs");
    v("batch_norm", batch_norm, "cnn: BatchNorm after each conv");
    v("dropout", dropout,
      "mlp, cnn: after each hidden layer; gpt: GPT-2's places (embeddings, attention, "
      "residuals)");
    v("layers", layers, "gpt: transformer blocks");
    v("heads", heads, "gpt: attention heads per block");
    v("dim", dim, "gpt: model width, a multiple of heads");
    v("vocab", vocab, "gpt: token values (256: bytes); pad to split over parallel.tensor");
    v("seq_len", seq_len, "gpt: context length (positions are learned)");
    v("init_from", init_from,
      "a fresh run starts from these weights, by name: a checkpoint (folder, run directory or "
      "pointer), a .safetensors file, or (gpt) a Hugging Face GPT-2 folder; empty = the "
      "seed's initialisation");
    v("init_strict", init_strict,
      "init_from: every tensor of the model must be there with its shape, and nothing more; "
      "false loads what matches and lists what it skipped");
  }
};

struct OptimizerConfig {
  std::string name = "sgd";
  double lr = 0.05;
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = 0.0;
  bool decay_1d = false;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double grad_clip = 0.0;
  double label_smoothing = 0.0;

  template <class V> void visit(V&& v) {
    v("name", name, Choices{"sgd", "adamw"}, "the update rule (torch.optim's)");
    v("lr", lr, "peak learning rate, reached after schedule.warmup_steps");
    v("momentum", momentum, "sgd: momentum");
    v("nesterov", nesterov, "sgd: Nesterov momentum");
    v("weight_decay", weight_decay,
      "sgd: L2 added to the gradient; adamw: decoupled decay; 2-D and larger parameters only "
      "unless decay_1d");
    v("decay_1d", decay_1d, "weight_decay on 1-D parameters (biases, norm gains) too");
    v("beta1", beta1, "adamw: first-moment decay");
    v("beta2", beta2, "adamw: second-moment decay");
    v("eps", eps, "adamw: added to the denominator");
    v("grad_clip", grad_clip,
      "largest global gradient norm (over every rank and shard); 0 = no clipping");
    v("label_smoothing", label_smoothing,
      "classification: the training loss's target puts this share on the other classes "
      "(PyTorch's CrossEntropyLoss(label_smoothing)); evaluation's loss is plain");
  }
};

struct ScheduleConfig {
  int64_t warmup_steps = 0;
  std::string decay = "cosine";
  double min_lr = 0.0;
  int64_t step_size = 1000;
  double gamma = 0.1;

  template <class V> void visit(V&& v) {
    v("warmup_steps", warmup_steps, "linear ramp from 0 to optimizer.lr");
    v("decay", decay, Choices{"constant", "cosine", "linear", "step"},
      "the learning rate after warmup, over the run's steps");
    v("min_lr", min_lr, "cosine, linear: the floor reached at the last step");
    v("step_size", step_size, "step: multiply by gamma every step_size steps");
    v("gamma", gamma, "step: the factor");
  }
};

struct TrainConfig {
  int64_t epochs = 1;
  int64_t max_steps = 0;
  int64_t grad_accum = 1;
  int64_t eval_every = 0;
  int64_t eval_batch_size = 1000;
  int64_t eval_samples = 0;
  int64_t log_every = 10;
  int64_t threads = 0;
  bool pin_threads = true;
  std::string cpu_matmul = "auto";
  std::string on_nonfinite = "stop";
  int64_t max_skipped = 10;
  std::string recompute = "none";
  std::string device = "auto";
  bool memory_check = true;
  int64_t debug_slow_rank = -1;
  int64_t debug_slow_ms = 0;

  template <class V> void visit(V&& v) {
    v("epochs", epochs, "passes over the training set, when max_steps is 0");
    v("max_steps", max_steps, "optimizer steps; > 0 wins over epochs");
    v("grad_accum", grad_accum,
      "micro-batches per optimizer step; a pipeline schedule runs them all");
    v("eval_every", eval_every, "steps between evaluations; 0 = at the end of each epoch");
    v("eval_batch_size", eval_batch_size, "samples per evaluation batch");
    v("eval_samples", eval_samples,
      "held-out samples (token windows) an evaluation reads at most, evenly spread over the "
      "held-out split; 0 = all of it (a large corpus's eval_fraction or eval_path may hold "
      "millions of windows)");
    v("log_every", log_every, "steps between train lines in metrics.jsonl");
    v("threads", threads, "intra-op threads per process; 0 = OMP_NUM_THREADS if set, else the CPUs this process may use over the local processes");
    v("pin_threads", pin_threads, "pin each intra-op thread to its own CPU");
    v("cpu_matmul", cpu_matmul, Choices{"auto", "onednn", "aten"},
      "the dense layers' fp32 products on the CPU: oneDNN's matmul, or ATen's (the BLAS "
      "LibTorch was built with, MKL in the pinned one); auto = oneDNN on AMD CPUs, where "
      "MKL runs AVX2 code and oneDNN AVX-512 (about 2x on Zen 5), ATen's elsewhere");
    v("on_nonfinite", on_nonfinite, Choices{"stop", "skip"},
      "a non-finite loss or gradient: stop the run (exit 3), or skip the step's update");
    v("max_skipped", max_skipped, "skip: steps skipped in a row before the run counts as diverged");
    v("recompute", recompute, Choices{"none", "blocks"},
      "blocks: each GPT block keeps only its input through forward and runs again in "
      "backward (less activation memory, about a third more compute)");
    v("device", device,
      "where the model and optimizer state live: auto (CUDA when a GPU is visible), cpu, "
      "cuda (the local rank's own GPU) or cuda:N");
    v("memory_check", memory_check,
      "refuse a job whose estimated memory (parameters, gradients, optimizer state, "
      "activations) exceeds what this machine has available for its processes (CPU)");
    v("debug_slow_rank", debug_slow_rank,
      "testing: the job's rank that sleeps debug_slow_ms before each step (a slow worker, "
      "for benchmarks); -1 = none");
    v("debug_slow_ms", debug_slow_ms, "testing: debug_slow_rank's sleep per step, ms");
  }
};

struct ParallelConfig {
  int64_t data = 0;
  int64_t tensor = 1;
  int64_t pipeline = 1;
  Ints stages = {};
  std::string balance = "params";
  std::string schedule = "1f1b";
  int64_t virtual_stages = 1;
  int64_t zero = 0;
  bool sync_batchnorm = false;
  // 1 MiB, not DDP's 25: with Gloo over TCP, large parameters split into 1 MiB all-reduces
  // that run side by side (MLP at 2 ranks on 2 cores: 29-30k samples/s against 24k with 25).
  double bucket_mb = 1.0;
  std::string compression = "none";
  double topk_ratio = 0.01;
  int64_t powersgd_rank = 2;
  std::string compression_warmup = "auto";
  std::string mode = "sync";
  int64_t servers = 1;
  int64_t staleness = 4;
  int64_t average_every = 8;
  int64_t local_after = 0;
  bool average_optimizer = false;
  double outer_lr = 1.0;
  double outer_momentum = 0.0;
  bool auto_layout = false;

  template <class V> void visit(V&& v) {
    v("auto", auto_layout,
      "choose the layout at start: the fastest that fits this machine's memory of those "
      "`dtrain plan --all` ranks (data x tensor x pipeline, zero, schedule, virtual_stages, "
      "train.grad_accum, train.recompute); the ones the job sets itself stay as set");
    v("data", data, "data-parallel replicas; 0 = the world over tensor x pipeline");
    v("tensor", tensor, "tensor-parallel ranks each layer is split over (mlp, gpt)");
    v("pipeline", pipeline, "pipeline stages the model's parts are split over");
    v("stages", stages,
      "parts per pipeline stage, e.g. [2, 4]; empty = balanced as parallel.balance says");
    v("balance", balance, Choices{"params", "flops"},
      "what an automatic split (parallel.stages empty) evens out over the stages: their "
      "parameters, or their forward FLOPs (the model's cost sheet: the stages' time)");
    v("schedule", schedule, Choices{"gpipe", "1f1b", "interleaved_1f1b"},
      "the pipeline's order of forwards and backwards");
    v("virtual_stages", virtual_stages, "interleaved_1f1b: model chunks per pipeline rank");
    v("zero", zero, "ZeRO stage: 1 shards the optimizer state over the data ranks, 2 the "
      "gradient too, 3 the parameters too (gathered a layer at a time; under bf16/fp16 the "
      "weights autocast casts are gathered and held in that dtype, fp32 master shards)");
    v("sync_batchnorm", sync_batchnorm, "BatchNorm statistics over the whole global batch");
    v("bucket_mb", bucket_mb, "gradient all-reduce slice size, MiB");
    v("compression", compression, listed("parallel.compression"),
      "gradient compression on the data-parallel wire (sign, topk, powersgd: with error "
      "feedback)");
    v("topk_ratio", topk_ratio, "topk: share of each gradient slice's entries sent");
    v("powersgd_rank", powersgd_rank, "powersgd: rank of each matrix's approximation");
    v("compression_warmup", compression_warmup,
      "steps all-reduced uncompressed before compression starts: a number, or auto (sign: "
      "the run's first quarter; topk: its first fifth; powersgd: its first tenth; fp16, bf16: "
      "none)");
    v("mode", mode, listed("parallel.mode"),
      "training mode: sync (every step's gradient averaged), async_ps (parameter servers apply "
      "each worker's gradient as it arrives), local_sgd (each data replica steps alone, the "
      "replicas averaged every average_every steps)");
    v("servers", servers,
      "async_ps: ranks that hold the parameters and optimizer state, each a contiguous range "
      "(the job's first ranks; the rest are workers)");
    v("staleness", staleness,
      "async_ps: pushes a worker may be ahead of the slowest worker before its reply is held "
      "(0 = lock-step)");
    v("average_every", average_every, "local_sgd: steps between averages of the replicas");
    v("local_after", local_after,
      "local_sgd: synchronous steps before the local ones start (post-local SGD)");
    v("average_optimizer", average_optimizer,
      "local_sgd: average the optimizer state (momentum, Adam's moments) with the parameters; "
      "else each replica keeps its own");
    v("outer_lr", outer_lr,
      "local_sgd: DiLoCo's outer step where the replicas meet: the parameters they last met "
      "at move by an SGD step of this rate along (those - the replicas' average); 1 with "
      "outer_momentum 0 takes the average itself (plain local SGD; DiLoCo: 0.7)");
    v("outer_momentum", outer_momentum,
      "local_sgd: the outer step's Nesterov momentum (DiLoCo: 0.9; 0 = none)");
  }
};

struct PrecisionConfig {
  std::string dtype = "fp32";
  std::string loss_scale = "dynamic";
  bool tf32 = true;

  template <class V> void visit(V&& v) {
    v("dtype", dtype, Choices{"fp32", "bf16", "fp16"},
      "the forward pass's precision: fp32, or bf16 (CPU, CUDA) and fp16 (CUDA) under autocast "
      "with fp32 master weights; the loss is taken in fp32");
    v("loss_scale", loss_scale, "fp16: dynamic, or a fixed number");
    v("tf32", tf32,
      "CUDA: fp32 matrix products and convolutions may use TF32 tensor cores (PyTorch's "
      "allow_tf32)");
  }
};

struct DistConfig {
  std::string backend = "auto";
  int64_t timeout_s = 120;
  int64_t hang_report_s = 30;
  int64_t port = 0;
  int64_t gloo_threads = 2;
  bool requeue = true;
  std::string store_bind = "master_addr";

  template <class V> void visit(V&& v) {
    v("backend", backend, Choices{"auto", "gloo", "nccl"},
      "c10d backend: auto = NCCL for CUDA tensors, Gloo otherwise");
    v("timeout_s", timeout_s, "bound on every collective and wait for a peer, seconds");
    v("hang_report_s", hang_report_s,
      "a collective waiting this long (or half of timeout_s, if shorter) is named: the ranks "
      "that have not posted it and how long each has been silent; 0 = never");
    v("port", port,
      "rendezvous port: 0 = MASTER_PORT, else 29500 (SLURM: one derived from the job id)");
    v("gloo_threads", gloo_threads, "collectives Gloo runs at once per process");
    v("requeue", requeue,
      "SLURM: after the checkpoint SIGUSR1 asks for, rank 0 requeues the job (scontrol requeue)");
    v("store_bind", store_bind, Choices{"master_addr", "all"},
      "where rank 0's rendezvous store listens: MASTER_ADDR's interface, or all");
  }
};

struct CheckpointConfig {
  int64_t every_steps = 0;
  int64_t keep_last = 3;
  bool keep_best = true;
  bool async = false;
  int64_t debug_write_delay_ms = 0;

  template <class V> void visit(V&& v) {
    v("every_steps", every_steps, "steps between checkpoints; 0 = at the end of each epoch");
    v("keep_last", keep_last, "newest checkpoints kept (the best is kept besides)");
    v("keep_best", keep_best, "keep the checkpoint with the best evaluation metric");
    v("async", async,
      "write checkpoints in the background while training goes on (the state is copied to "
      "host memory at the step first); the last one and a stop's are written at once");
    v("debug_write_delay_ms", debug_write_delay_ms,
      "testing: a background write's sleep before it writes, ms");
  }
};

struct LoggingConfig {
  std::string progress = "auto";
  bool tensorboard = false;

  template <class V> void visit(V&& v) {
    v("progress", progress, Choices{"auto", "on", "off"},
      "the live progress line: auto = only on a terminal");
    v("tensorboard", tensorboard,
      "also write every train and eval figure as a TensorBoard scalar to RUN_DIR/tb "
      "(tensorboard --logdir RUN_DIR/tb)");
  }
};

// Training through a replica's failure (docs/fault-tolerance.md).
struct FaultToleranceConfig {
  std::string mode = "off";
  int64_t heartbeat_s = 5;
  int64_t replica_data = 1;
  std::string batch = "keep";
  int64_t debug_kill_rank = -1;
  int64_t debug_kill_step = 0;
  std::string debug_kill_in = "step";
  std::string debug_kill_signal = "KILL";

  template <class V> void visit(V&& v) {
    v("mode", mode, Choices{"off", "replicas"},
      "replicas: each data-parallel replica (one process, or its parallel.tensor x "
      "parallel.pipeline ranks, times replica_data) may fail alone; the others go on without "
      "a restart, the step in flight trained again by the survivors on the same global batch "
      "(dtrain run --nproc, or a launcher a replica beside dtrain lighthouse; mode sync)");
    v("replica_data", replica_data,
      "data-parallel ranks inside each replica, which shard ZeRO's state among themselves "
      "(parallel.zero 1 to 3; shard within, replicate across: HSDP); parallel.data counts "
      "every data rank, so the job has parallel.data / replica_data replicas");
    v("batch", batch, Choices{"keep", "shrink"},
      "what a replica's failure does to the global batch: keep (the survivors deal its share "
      "among themselves: the same batch and learning rate) or shrink (each keeps its own "
      "share: the batch shrinks by the failed replica's, the learning rate with it, "
      "linearly, and the epoch's remaining samples go in the smaller batches; under local SGD "
      "a local step's rate stays, its batch being the replica's own share); a joiner brings "
      "it back");
    v("heartbeat_s", heartbeat_s,
      "a replica whose heartbeat is older than this is voted dead (a stopped or hung process)");
    v("debug_kill_rank", debug_kill_rank,
      "testing: the world rank that kills itself (SIGKILL) as step debug_kill_step starts; "
      "-1 = none");
    v("debug_kill_step", debug_kill_step, "testing: the step debug_kill_rank dies at");
    v("debug_kill_in", debug_kill_in, Choices{"step", "reduce", "eval"},
      "testing: where debug_kill_rank dies: as step debug_kill_step starts; in its "
      "reduction, its first bucket posted across the replicas (the others' in flight); or "
      "in the evaluation after it, its part scored, before the replicas add theirs up");
    v("debug_kill_signal", debug_kill_signal, Choices{"KILL", "TERM"},
      "testing: the signal debug_kill_rank sends itself: KILL (a failure) or TERM (a stop: "
      "its replica leaves the job)");
  }
};

struct JobConfig {
  std::string name = "dtrain-job";
  int64_t seed = 1234;
  std::string run_dir = "";
  DataConfig data;
  ModelConfig model;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  TrainConfig train;
  ParallelConfig parallel;
  PrecisionConfig precision;
  DistConfig dist;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  FaultToleranceConfig fault_tolerance;
  // Not a key: the leaf keys the job file and its --set arguments named (parallel.auto
  // holds those of the layout fixed).
  std::set<std::string> given;

  template <class V> void visit(V&& v) {
    v("name", name, "the job's name: letters, digits, '.', '_', '-'; the run folder is runs/NAME");
    v("seed", seed, "seeds the weights, the data order and dropout");
    v("run_dir", run_dir, "where logs and checkpoints go; empty = runs/NAME (--run-dir wins)");
    v.section("data", data);
    v.section("model", model);
    v.section("optimizer", optimizer);
    v.section("schedule", schedule);
    v.section("train", train);
    v.section("parallel", parallel);
    v.section("precision", precision);
    v.section("dist", dist);
    v.section("checkpoint", checkpoint);
    v.section("logging", logging);
    v.section("fault_tolerance", fault_tolerance);
  }
};

}  // namespace dtrain
