// The job spec: typed structs whose member initialisers are the only defaults in dtrain.
// Each struct's visit() lists its keys once; loading, --set overrides, printing and the
// unknown-key suggestions are all driven from those lists (see schema.hpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

using Ints = std::vector<int64_t>;
using Choices = std::vector<std::string>;

struct DataConfig {
  // fashion_mnist | mnist | synthetic (images) | text | synthetic_tokens (token windows)
  std::string dataset = "fashion_mnist";
  std::string path = "/usr/share/datasets/fashion-mnist"; // IDX folder; text: a file or folder
  int64_t batch_size = 64;    // GLOBAL batch per optimizer step, over all data-parallel ranks
  bool shuffle = true;        // a new permutation every epoch, from (seed, epoch)
  int64_t workers = 2;        // loader threads per process; 0 = load on the training thread
  int64_t prefetch = 4;       // batches prepared ahead of the step
  int64_t samples = 8192;     // synthetic: training samples
  int64_t test_samples = 2048;// synthetic: test samples
  Ints input_shape = {1, 28, 28};  // synthetic: one sample's shape
  int64_t classes = 10;       // synthetic: number of classes
  int64_t seq_len = 0;        // text, synthetic_tokens: tokens per window; 0 = model.seq_len
  double eval_fraction = 0.05;// text: share of the windows held out for evaluation
  int64_t vocab = 0;          // synthetic_tokens: token values in [0, vocab); 0 = model.vocab

  template <class V> void visit(V&& v) {
    v("dataset", dataset, Choices{"fashion_mnist", "mnist", "synthetic", "text", "synthetic_tokens"});
    v("path", path);
    v("batch_size", batch_size);
    v("shuffle", shuffle);
    v("workers", workers);
    v("prefetch", prefetch);
    v("samples", samples);
    v("test_samples", test_samples);
    v("input_shape", input_shape);
    v("classes", classes);
    v("seq_len", seq_len);
    v("eval_fraction", eval_fraction);
    v("vocab", vocab);
  }
};

struct ModelConfig {
  std::string arch = "cnn";     // mlp | cnn | gpt
  Ints hidden = {512, 256};     // mlp: hidden layer widths
  Ints channels = {32, 64};     // cnn: conv widths, each conv 3x3 (pad 1) + ReLU + 2x2 max-pool
  Ints fc = {128};              // cnn: hidden fully-connected widths after the convs
  bool batch_norm = false;      // cnn: BatchNorm after each conv
  double dropout = 0.0;         // mlp/cnn: before each hidden->next layer; gpt: GPT-2's places
  int64_t layers = 4;           // gpt: transformer blocks
  int64_t heads = 4;            // gpt: attention heads per block
  int64_t dim = 128;            // gpt: model width (a multiple of heads)
  int64_t vocab = 256;          // gpt: token values (256: bytes)
  int64_t seq_len = 128;        // gpt: context length (positions learned)

  template <class V> void visit(V&& v) {
    v("arch", arch, Choices{"mlp", "cnn", "gpt"});
    v("hidden", hidden);
    v("channels", channels);
    v("fc", fc);
    v("batch_norm", batch_norm);
    v("dropout", dropout);
    v("layers", layers);
    v("heads", heads);
    v("dim", dim);
    v("vocab", vocab);
    v("seq_len", seq_len);
  }
};

struct OptimizerConfig {
  std::string name = "sgd";   // sgd | adamw
  double lr = 0.05;           // peak learning rate (after warmup)
  double momentum = 0.9;      // sgd
  bool nesterov = false;      // sgd
  double weight_decay = 0.0;  // sgd: L2 added to the gradient; adamw: decoupled
  bool decay_1d = false;      // weight_decay on 1-D parameters (biases, norm gains) too
  double beta1 = 0.9;         // adamw
  double beta2 = 0.999;       // adamw
  double eps = 1e-8;          // adamw
  double grad_clip = 0.0;     // max global gradient norm; 0 = off

  template <class V> void visit(V&& v) {
    v("name", name, Choices{"sgd", "adamw"});
    v("lr", lr);
    v("momentum", momentum);
    v("nesterov", nesterov);
    v("weight_decay", weight_decay);
    v("decay_1d", decay_1d);
    v("beta1", beta1);
    v("beta2", beta2);
    v("eps", eps);
    v("grad_clip", grad_clip);
  }
};

struct ScheduleConfig {
  int64_t warmup_steps = 0;        // linear ramp from 0 to optimizer.lr
  std::string decay = "cosine";    // constant | cosine | linear | step
  double min_lr = 0.0;             // floor of cosine/linear decay
  int64_t step_size = 1000;        // step decay: multiply by gamma every step_size steps
  double gamma = 0.1;              // step decay factor

  template <class V> void visit(V&& v) {
    v("warmup_steps", warmup_steps);
    v("decay", decay, Choices{"constant", "cosine", "linear", "step"});
    v("min_lr", min_lr);
    v("step_size", step_size);
    v("gamma", gamma);
  }
};

struct TrainConfig {
  int64_t epochs = 1;           // used when max_steps is 0
  int64_t max_steps = 0;        // > 0 wins over epochs
  int64_t grad_accum = 1;       // micro-batches per optimizer step (a pipeline runs them all)
  int64_t eval_every = 0;       // steps; 0 = at the end of each epoch
  int64_t eval_batch_size = 1000;
  int64_t log_every = 10;       // steps between train lines in metrics.jsonl
  int64_t threads = 0;          // intra-op threads per process; 0 = cores / local processes
  bool pin_threads = true;      // pin each intra-op thread to its own CPU (see util/affinity.hpp)
  std::string on_nonfinite = "stop";  // a non-finite loss or gradient: stop (exit 3) | skip the step
  int64_t max_skipped = 10;     // skip: steps skipped in a row before the run counts as diverged
  // Activation recompute: blocks = each GPT block keeps only its input through forward and
  // runs again in backward (less memory, about a third more compute); none.
  std::string recompute = "none";
  // Where the model, its buffers and the optimizer state live: auto (CUDA when a GPU is
  // visible) | cpu | cuda (the local rank's own GPU) | cuda:N.
  std::string device = "auto";

  template <class V> void visit(V&& v) {
    v("epochs", epochs);
    v("max_steps", max_steps);
    v("grad_accum", grad_accum);
    v("eval_every", eval_every);
    v("eval_batch_size", eval_batch_size);
    v("log_every", log_every);
    v("threads", threads);
    v("pin_threads", pin_threads);
    v("on_nonfinite", on_nonfinite, Choices{"stop", "skip"});
    v("max_skipped", max_skipped);
    v("recompute", recompute, Choices{"none", "blocks"});
    v("device", device);
  }
};

struct ParallelConfig {
  int64_t data = 0;                  // 0 = world / (tensor * pipeline)
  int64_t tensor = 1;
  int64_t pipeline = 1;
  // Pipeline parallelism: the model's parts (GPT: embeddings, each block, the head; mlp
  // and cnn: their layers) split into pipeline x virtual_stages stages, balanced by
  // parameter count unless `stages` gives each stage's number of parts.
  Ints stages = {};
  std::string schedule = "1f1b";     // gpipe | 1f1b | interleaved_1f1b
  int64_t virtual_stages = 1;        // interleaved_1f1b: model chunks per pipeline rank
  int64_t zero = 0;                  // 0 | 1
  bool sync_batchnorm = false;
  // Gradient all-reduce granularity. 1 MiB, not DDP's 25: with Gloo over TCP, large
  // parameters split into 1 MiB all-reduces that run side by side (MLP at 2 ranks on
  // 2 cores: 29-30k samples/s against 24k with 25 MiB).
  double bucket_mb = 1.0;
  std::string compression = "none";  // none | fp16 | bf16 | sign | topk
  double topk_ratio = 0.01;
  std::string mode = "sync";         // sync | async_ps | local_sgd
  int64_t staleness = 4;             // async_ps bound
  int64_t average_every = 8;         // local_sgd

  template <class V> void visit(V&& v) {
    v("data", data);
    v("tensor", tensor);
    v("pipeline", pipeline);
    v("stages", stages);
    v("schedule", schedule, Choices{"gpipe", "1f1b", "interleaved_1f1b"});
    v("virtual_stages", virtual_stages);
    v("zero", zero);
    v("sync_batchnorm", sync_batchnorm);
    v("bucket_mb", bucket_mb);
    v("compression", compression, Choices{"none", "fp16", "bf16", "sign", "topk"});
    v("topk_ratio", topk_ratio);
    v("mode", mode, Choices{"sync", "async_ps", "local_sgd"});
    v("staleness", staleness);
    v("average_every", average_every);
  }
};

struct PrecisionConfig {
  std::string dtype = "fp32";        // fp32 | bf16 | fp16
  std::string loss_scale = "dynamic";// dynamic | a fixed number (fp16)
  // On CUDA, fp32 matrix products and convolutions may use TF32 tensor cores (10-bit
  // mantissa inputs, fp32 accumulation): PyTorch's allow_tf32, set by most GPU recipes.
  bool tf32 = true;

  template <class V> void visit(V&& v) {
    v("dtype", dtype, Choices{"fp32", "bf16", "fp16"});
    v("loss_scale", loss_scale);
    v("tf32", tf32);
  }
};

struct DistConfig {
  std::string backend = "auto";  // auto | gloo | nccl
  int64_t timeout_s = 120;       // bound on every collective
  int64_t port = 0;  // rendezvous port: 0 = MASTER_PORT, else 29500 (SLURM: from the job id)
  int64_t gloo_threads = 2;      // collectives Gloo runs at once per process (1 and 3 measured slower)
  // Under SLURM, after the checkpoint that SIGUSR1 (sbatch --signal=USR1@T) asks for, rank 0
  // requeues the job (scontrol requeue) so that it resumes; --no-requeue turns it off.
  bool requeue = true;
  // Where rank 0's rendezvous store listens: the interface of MASTER_ADDR, or all.
  std::string store_bind = "master_addr";

  template <class V> void visit(V&& v) {
    v("backend", backend, Choices{"auto", "gloo", "nccl"});
    v("timeout_s", timeout_s);
    v("port", port);
    v("gloo_threads", gloo_threads);
    v("requeue", requeue);
    v("store_bind", store_bind, Choices{"master_addr", "all"});
  }
};

struct CheckpointConfig {
  int64_t every_steps = 0;   // 0 = at the end of each epoch
  int64_t keep_last = 3;     // newest checkpoints kept (best is kept besides)
  bool keep_best = true;     // keep the checkpoint with the best eval metric

  template <class V> void visit(V&& v) {
    v("every_steps", every_steps);
    v("keep_last", keep_last);
    v("keep_best", keep_best);
  }
};

struct LoggingConfig {
  std::string progress = "auto";  // auto (only on a terminal) | on | off

  template <class V> void visit(V&& v) { v("progress", progress, Choices{"auto", "on", "off"}); }
};

struct JobConfig {
  std::string name = "dtrain-job";
  int64_t seed = 1234;
  std::string run_dir = "";     // "" = runs/NAME; --run-dir overrides
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

  template <class V> void visit(V&& v) {
    v("name", name);
    v("seed", seed);
    v("run_dir", run_dir);
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
  }
};

}  // namespace dtrain
