// The job spec: defaults, YAML and --set layers, the printed form reading back exactly, and a
// table of bad specs with what each error message must tell the user.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "config/config.hpp"
#include "config/schema.hpp"
#include "grad/compression.hpp"
#include "job/validate.hpp"
#include "models/model.hpp"
#include "run/mode.hpp"
#include "util/error.hpp"

namespace unit_config_config {

using namespace dtrain;

namespace {

// Every leaf key of `a` and `b` holds the same value (keys come from the schema, so a key added
// later is compared too).
void check_same_fields(JobConfig a, JobConfig b) {
  auto fa = fields_of(a), fb = fields_of(b);
  REQUIRE(fa.size() == fb.size());
  for (size_t i = 0; i < fa.size(); ++i) {
    REQUIRE(fa[i].key == fb[i].key);
    INFO("key: " << fa[i].key);
    std::visit(
        [&](auto* pa) {
          using P = decltype(pa);
          REQUIRE(std::holds_alternative<P>(fb[i].value));
          CHECK(*pa == *std::get<P>(fb[i].value));
        },
        fa[i].value);
  }
}

// The message of the ConfigError that loading + validating `yaml` throws, or "" if none.
std::string spec_error(const std::string& yaml, int64_t world = 1) {
  try {
    JobConfig cfg = parse_job(yaml, "bad.yaml");
    resolve(cfg);
    validate(cfg, world);
  } catch (const ConfigError& e) {
    CHECK(e.code == kExitBadSpec);
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected dtrain::ConfigError, got another exception: " << e.what());
  }
  return "";
}

std::string override_error(const std::string& assignment) {
  JobConfig cfg;
  try {
    apply_override(cfg, assignment);
  } catch (const ConfigError& e) {
    CHECK(e.code == kExitBadSpec);
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("config: an empty spec gives the documented defaults") {
  for (const char* text : {"", "# only a comment\n", "~\n"}) {
    CAPTURE(text);
    JobConfig cfg = parse_job(text, "empty.yaml");
    check_same_fields(cfg, JobConfig{});
    // A few values of the documented contract, written out independently of config.hpp.
    CHECK(cfg.seed == 1234);
    CHECK(cfg.data.dataset == "fashion_mnist");
    CHECK(cfg.data.batch_size == 64);
    CHECK(cfg.data.shuffle);
    CHECK(cfg.model.arch == "cnn");
    CHECK(cfg.model.hidden == Ints{512, 256});
    CHECK(cfg.optimizer.name == "sgd");
    CHECK(cfg.optimizer.lr == 0.05);
    CHECK(cfg.optimizer.momentum == 0.9);
    CHECK(cfg.schedule.decay == "cosine");
    CHECK(cfg.train.epochs == 1);
    CHECK(cfg.train.grad_accum == 1);
    CHECK(cfg.parallel.schedule == "1f1b");
    CHECK(cfg.precision.dtype == "fp32");
    CHECK(cfg.checkpoint.keep_last == 3);
    CHECK_NOTHROW(validate(cfg, 1));
  }
}

TEST_CASE("config: YAML values override the defaults, untouched keys keep them") {
  JobConfig cfg = parse_job(R"(
name: my-job
seed: 7
data:
  batch_size: 128
  shuffle: false
  input_shape: [3, 32, 32]
model:
  arch: mlp
  hidden: [100, 50, 25]
  dropout: 0.25
optimizer:
  name: adamw
  lr: 0.001
  nesterov: false
schedule:
  decay: linear
  warmup_steps: 10
precision:
  dtype: bf16
checkpoint:
  keep_best: false
logging:   # an empty section is allowed
)",
                            "job.yaml");
  CHECK(cfg.name == "my-job");
  CHECK(cfg.seed == 7);
  CHECK(cfg.data.batch_size == 128);
  CHECK_FALSE(cfg.data.shuffle);
  CHECK(cfg.data.input_shape == Ints{3, 32, 32});
  CHECK(cfg.model.arch == "mlp");
  CHECK(cfg.model.hidden == Ints{100, 50, 25});
  CHECK(cfg.model.dropout == 0.25);
  CHECK(cfg.optimizer.name == "adamw");
  CHECK(cfg.optimizer.lr == 0.001);
  CHECK(cfg.schedule.decay == "linear");
  CHECK(cfg.schedule.warmup_steps == 10);
  CHECK(cfg.precision.dtype == "bf16");
  CHECK_FALSE(cfg.checkpoint.keep_best);
  // untouched
  CHECK(cfg.data.workers == JobConfig{}.data.workers);
  CHECK(cfg.optimizer.momentum == 0.9);
  CHECK(cfg.model.channels == Ints{32, 64});
  CHECK(cfg.logging.progress == "auto");
  CHECK_NOTHROW(validate(cfg, 1));
}

TEST_CASE("config: --set overrides are typed by the schema and applied after the file") {
  JobConfig cfg;
  apply_override(cfg, "model.hidden=[128,64]");
  CHECK(cfg.model.hidden == Ints{128, 64});
  apply_override(cfg, "model.hidden=[ 7 ]");
  CHECK(cfg.model.hidden == Ints{7});
  apply_override(cfg, "optimizer.lr=0.1");
  CHECK(cfg.optimizer.lr == 0.1);
  apply_override(cfg, "optimizer.lr=1e-3");
  CHECK(cfg.optimizer.lr == 0.001);
  apply_override(cfg, "data.batch_size=256");
  CHECK(cfg.data.batch_size == 256);
  apply_override(cfg, "data.shuffle=false");
  CHECK_FALSE(cfg.data.shuffle);
  apply_override(cfg, "model.arch=mlp");
  CHECK(cfg.model.arch == "mlp");
  // Strings are taken verbatim, even when they would read as YAML.
  apply_override(cfg, "data.path=/data/a: b=c");
  CHECK(cfg.data.path == "/data/a: b=c");
  apply_override(cfg, "precision.loss_scale=1024");
  CHECK(cfg.precision.loss_scale == "1024");

  // The file's value, then the override wins; overrides apply in order.
  JobConfig layered = parse_job("optimizer:\n  lr: 0.2\ndata:\n  batch_size: 32\n", "job.yaml",
                                {"optimizer.lr=0.3", "optimizer.lr=0.4", "train.epochs=5"});
  CHECK(layered.optimizer.lr == 0.4);
  CHECK(layered.data.batch_size == 32);
  CHECK(layered.train.epochs == 5);
  // The keys the file and the overrides named, and only those (parallel.auto holds them).
  CHECK(layered.given == std::set<std::string>{"optimizer.lr", "data.batch_size", "train.epochs"});
  CHECK(parse_job("", "empty.yaml").given.empty());

  SUBCASE("bad overrides") {
    std::string msg = override_error("data.batchsize=32");
    CHECK(contains(msg, "--set data.batchsize=32"));
    CHECK(contains(msg, "did you mean 'data.batch_size'"));
    CHECK(contains(override_error("optimizer.lr"), "KEY=VALUE"));
    CHECK(contains(override_error("=3"), "KEY=VALUE"));
    CHECK(contains(override_error("data.batch_size=abc"), "expected an integer"));
    CHECK(contains(override_error("optimizer.lr=fast"), "expected a number"));
    CHECK(contains(override_error("data.shuffle=maybe"), "expected true or false"));
    CHECK(contains(override_error("model.hidden=5"), "a list of integers"));
    CHECK(contains(override_error("model.hidden=[1, x]"), "model.hidden"));
    CHECK(contains(override_error("model.arch=foo"), "mlp | cnn"));
    CHECK(contains(override_error("data.batch_size="), "data.batch_size"));
  }
}

TEST_CASE("config: to_yaml reads back to the same job, every field") {
  JobConfig cfg;
  cfg.name = "round trip: #1";   // needs quoting
  cfg.seed = 99;
  cfg.run_dir = "";              // an empty string must survive
  cfg.data.dataset = "synthetic";
  cfg.data.path = "/some path/with spaces";
  cfg.data.batch_size = 96;
  cfg.data.shuffle = false;
  cfg.data.input_shape = {3, 17, 5};
  cfg.model.arch = "mlp";
  cfg.model.hidden = {1000, 3};
  cfg.model.channels = {};
  cfg.model.batch_norm = true;
  cfg.model.dropout = 0.1;
  cfg.optimizer.name = "adamw";
  cfg.optimizer.lr = 3e-4;
  cfg.optimizer.beta2 = 0.95;
  cfg.optimizer.eps = 1e-12;
  cfg.optimizer.weight_decay = 0.1 + 0.2;  // not exactly 0.3: must still read back exactly
  cfg.optimizer.grad_clip = 1.0 / 3.0;
  cfg.schedule.decay = "step";
  cfg.schedule.gamma = 0.5;
  cfg.train.max_steps = 123456789012;
  cfg.parallel.bucket_mb = 12.5;
  cfg.parallel.compression = "topk";
  cfg.precision.loss_scale = "null";  // a string that YAML would read as null if unquoted
  cfg.logging.progress = "off";

  const std::string text = to_yaml(cfg);
  JobConfig back = parse_job(text, "printed.yaml");
  check_same_fields(back, cfg);
  CHECK(to_yaml(back) == text);

  // Defaults print and read back too, and every key appears in the printed form.
  const std::string defaults = to_yaml(JobConfig{});
  check_same_fields(parse_job(defaults, "defaults.yaml"), JobConfig{});
  for (const auto& key : all_keys()) {
    auto leaf = key.substr(key.rfind('.') + 1);
    CHECK_MESSAGE(contains(defaults, leaf + ":"), key);
  }
}

TEST_CASE("config: bad specs throw ConfigError with a message the user can act on") {
  struct Case {
    const char* what;
    std::string yaml;
    std::vector<std::string> must_contain;
    int64_t world = 1;
  };
  const std::vector<Case> cases = {
      {"unknown key, suggested", "data:\n  batchsize: 32\n",
       {"bad.yaml:2:3", "unknown key 'data.batchsize'", "did you mean 'data.batch_size'"}},
      {"top-level misplaced key", "lr: 0.1\n", {"unknown key 'lr'", "did you mean 'optimizer.lr'"}},
      {"removed key, its replacement named", "parallel:\n  micro_batches: 8\n",
       {"bad.yaml:2:3", "'parallel.micro_batches' was removed", "train.grad_accum"}},
      {"duplicate key", "optimizer:\n  lr: 0.1\n  lr: 0.2\n",
       {"bad.yaml:3:3", "duplicate key 'optimizer.lr'"}},
      {"misspelt leaf in a section", "optimizer:\n  momentun: 0.5\n",
       {"did you mean 'optimizer.momentum'"}},
      {"wrong type: integer", "data:\n  batch_size: abc\n",
       {"bad.yaml:2:15", "data.batch_size", "expected an integer", "'abc'"}},
      {"wrong type: fraction for an integer", "data:\n  batch_size: 6.5\n",
       {"data.batch_size", "expected an integer"}},
      {"wrong type: number", "optimizer:\n  lr: fast\n", {"optimizer.lr", "expected a number"}},
      {"wrong type: bool", "data:\n  shuffle: maybe\n", {"data.shuffle", "true or false"}},
      {"wrong type: list", "model:\n  hidden: 512\n", {"model.hidden", "a list of integers"}},
      {"wrong type: mapping for a value", "optimizer:\n  lr:\n    peak: 0.1\n",
       {"optimizer.lr", "a single value"}},
      {"missing value", "optimizer:\n  lr:\n", {"optimizer.lr", "expected a value"}},
      {"bad enum", "model:\n  arch: foo\n", {"model.arch", "'foo'", "mlp | cnn"}},
      {"bad enum: optimizer", "optimizer:\n  name: lamb\n", {"optimizer.name", "sgd | adamw"}},
      {"out of range: lr", "optimizer:\n  lr: -1\n", {"optimizer.lr", "> 0"}},
      {"out of range: lr 0", "optimizer:\n  lr: 0\n", {"optimizer.lr"}},
      {"out of range: momentum", "optimizer:\n  momentum: 1.5\n", {"optimizer.momentum", "[0, 1)"}},
      {"out of range: keep_last", "checkpoint:\n  keep_last: 0\n", {"checkpoint.keep_last", ">= 1"}},
      {"out of range: batch", "data:\n  batch_size: 0\n", {"data.batch_size", ">= 1"}},
      {"out of range: dropout", "model:\n  dropout: 1.0\n", {"model.dropout"}},
      {"out of range: min_lr above lr", "schedule:\n  min_lr: 1.0\n", {"schedule.min_lr"}},
      {"out of range: widths", "model:\n  arch: mlp\n  hidden: [512, 0]\n", {"model.hidden", "positive"}},
      {"mlp width that does not split", "model:\n  arch: mlp\n  hidden: [510, 256]\nparallel:\n  tensor: 4\n",
       {"model.hidden", "510", "parallel.tensor 4"}, 4},
      {"gpt heads that do not split", "data: {dataset: synthetic_tokens}\nmodel: {arch: gpt, heads: 3, dim: 96}\nparallel: {tensor: 2}\n",
       {"model.heads", "parallel.tensor 2"}, 2},
      {"gpt width not a multiple of heads", "data: {dataset: synthetic_tokens}\nmodel: {arch: gpt, heads: 4, dim: 90}\n",
       {"model.dim", "model.heads"}},
      {"gpt on images", "model: {arch: gpt}\n", {"model.arch", "gpt", "fashion_mnist"}},
      {"mlp on text", "data: {dataset: text, path: /tmp}\nmodel: {arch: mlp}\n", {"model.arch", "text"}},
      {"eval_fraction", "data: {eval_fraction: 0.9}\n", {"data.eval_fraction"}},
      {"on_nonfinite", "train: {on_nonfinite: ignore}\n", {"train.on_nonfinite", "stop | skip"}},
      {"max_skipped", "train: {max_skipped: 0}\n", {"train.max_skipped", ">= 1"}},
      {"bad name", "name: a/b\n", {"name", "letters, digits", "(got 'a/b')"}},
      {"dot name", "name: ..\n", {"name", "not starting with '.'", "(got '..')"}},
      {"NUL in name", "name: \"a\\0b\"\n", {"name", "(got 'a\\x00b')"}},
      {"loss scale not a number", "precision:\n  loss_scale: 12abc\n", {"precision.loss_scale"}},
      {"batch not divisible by grad_accum", "data:\n  batch_size: 10\ntrain:\n  grad_accum: 4\n",
       {"data.batch_size", "does not divide", "train.grad_accum"}},
      {"YAML syntax error", "name: ok\nseed: 1\n  bad: 2\n", {"bad.yaml:3:6"}},
      {"section given as a scalar", "data: 5\n", {"'data'", "mapping"}},
      {"section given as a list", "optimizer: [sgd]\n", {"'optimizer'", "mapping"}},
      {"spec not a mapping", "- a\n- b\n", {"bad.yaml", "mapping"}},
      {"tensor larger than the world", "parallel:\n  tensor: 2\n", {"parallel.tensor"}},
      {"tensor parallel for the cnn", "parallel:\n  tensor: 2\n",
       {"parallel.tensor", "cnn"}, 2},
      {"unsupported: pipeline", "parallel:\n  pipeline: 2\n", {"parallel.pipeline"}},
      {"zero out of range", "parallel:\n  zero: 4\n", {"parallel.zero", "0, 1, 2 or 3"}},
      {"compression with zero", "parallel:\n  compression: sign\n  zero: 1\n",
       {"parallel.compression", "parallel.zero"}},
      {"error feedback under fp16", "precision:\n  dtype: fp16\nparallel:\n  compression: topk\n",
       {"parallel.compression", "fp16"}},
      {"negative warmup", "parallel:\n  compression_warmup: -1\n", {"parallel.compression_warmup"}},
      {"warmup a word", "parallel:\n  compression_warmup: soon\n",
       {"parallel.compression_warmup", "auto or a whole number", "soon"}},
      {"warmup a fraction", "parallel:\n  compression_warmup: 2.5\n",
       {"parallel.compression_warmup", "2.5"}},
      {"powersgd under fp16", "precision:\n  dtype: fp16\nparallel:\n  compression: powersgd\n",
       {"parallel.compression", "powersgd", "fp16"}},
      {"powersgd rank 0", "parallel:\n  compression: powersgd\n  powersgd_rank: 0\n",
       {"parallel.powersgd_rank", ">= 1"}},
      {"async_ps without a worker", "parallel:\n  mode: async_ps\n", {"parallel.servers", "no worker"}},
      {"async_ps, no server", "parallel:\n  mode: async_ps\n  servers: 0\n", {"parallel.servers", ">= 1"}},
      {"unsupported: fp16 on CPU", "train: {device: cpu}\nprecision:\n  dtype: fp16\n",
       {"precision.dtype", "bf16"}},
      {"unsupported: nccl on CPU", "train: {device: cpu}\ndist:\n  backend: nccl\n", {"dist.backend"}},
      {"device spelled wrong", "train: {device: gpu0}\n", {"train.device", "'gpu0'"}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    CAPTURE(c.yaml);
    const std::string msg = spec_error(c.yaml, c.world);
    CAPTURE(msg);
    REQUIRE_MESSAGE(!msg.empty(), "no ConfigError for: " << c.what);
    for (const auto& part : c.must_contain) CHECK_MESSAGE(contains(msg, part), "missing: " << part);
  }
}

TEST_CASE("config: a YAML syntax error is reported as origin:LINE:COL") {
  const std::string msg = spec_error("name: ok\ndata:\n  batch_size: [64\n  shuffle: true\n");
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(msg, m, std::regex(R"(^bad\.yaml:(\d+):(\d+): )")), msg);
  CHECK(std::stoi(m[1]) >= 3);  // the unterminated list starts on line 3
  CHECK(std::stoi(m[2]) >= 1);
}

TEST_CASE("config: load_job names a missing file and reads every shipped config") {
  try {
    load_job("/nonexistent/job.yaml");
    FAIL("no error for a missing file");
  } catch (const ConfigError& e) {
    CHECK(contains(e.what(), "/nonexistent/job.yaml"));
  }

  namespace fs = std::filesystem;
  int seen = 0;
  for (const auto& entry : fs::directory_iterator(DTRAIN_CONFIGS)) {
    if (entry.path().extension() != ".yaml") continue;
    ++seen;
    const std::string path = entry.path().string();
    CAPTURE(path);
    JobConfig cfg;
    CHECK_NOTHROW(cfg = load_job(path));
    CHECK_NOTHROW(validate(cfg, 1));
    CHECK(to_yaml(parse_job(to_yaml(cfg), path)) == to_yaml(cfg));
  }
  CHECK(seen >= 2);
}

TEST_CASE("config: resolve and derive_layout") {
  JobConfig cfg;
  cfg.name = "abc";
  resolve(cfg);
  CHECK(cfg.run_dir == "runs/abc");
  cfg.run_dir = "/elsewhere";
  resolve(cfg);
  CHECK(cfg.run_dir == "/elsewhere");

  // Token windows and the synthetic vocabulary follow the model unless given.
  CHECK(cfg.data.seq_len == cfg.model.seq_len);
  CHECK(cfg.data.vocab == cfg.model.vocab);

  auto l = ParallelDims::resolve(JobConfig{}.parallel, 4);
  CHECK(l.data == 4);
  CHECK(l.tensor == 1);
  CHECK(l.pipeline == 1);
  CHECK(l.world() == 4);
  JobConfig grid;
  grid.parallel.tensor = 2;
  grid.parallel.pipeline = 2;
  l = ParallelDims::resolve(grid.parallel, 8);
  CHECK(l.data == 2);
  CHECK_THROWS_AS(ParallelDims::resolve(grid.parallel, 6), ConfigError);
  grid.parallel.data = 3;
  CHECK_THROWS_AS(ParallelDims::resolve(grid.parallel, 8), ConfigError);
}

TEST_CASE("config: a model's options are checked only for that model") {
  // Widths of 0 would be refused for an mlp; a gpt job never reads them.
  auto cfg = parse_job("data: {dataset: synthetic_tokens}\n"
                       "model: {arch: gpt, hidden: [0], channels: [-1], layers: 2, heads: 2, dim: 8}\n",
                       "ok.yaml");
  resolve(cfg);
  CHECK_NOTHROW(validate(cfg, 1));
  // And the reverse: an mlp job ignores gpt's keys.
  cfg = parse_job("model: {arch: mlp, heads: 3, dim: 10}\n", "ok.yaml");
  resolve(cfg);
  CHECK_NOTHROW(validate(cfg, 1));
  // validate returns the layout it checked.
  cfg = parse_job("model: {arch: mlp}\nparallel: {tensor: 2}\n", "ok.yaml");
  resolve(cfg);
  auto dims = validate(cfg, 8);
  CHECK(dims.data == 4);
  CHECK(dims.tensor == 2);
}

TEST_CASE("config: nearest_key") {
  CHECK(nearest_key("data.batchsize") == "data.batch_size");
  CHECK(nearest_key("lr") == "optimizer.lr");
  CHECK(nearest_key("train.warmup_steps") == "schedule.warmup_steps");
  CHECK(nearest_key("completely.unrelated.thing") == "");
}

// The registries list their names for the keys they serve (config.hpp's listed()): the
// spec takes the registry's names, in its order, and refuses another at load.
TEST_CASE("config: model.arch, parallel.mode and parallel.compression take the registries' names") {
  JobConfig cfg;
  std::map<std::string, Choices> choices;
  for (const auto& f : fields_of(cfg)) choices[f.key] = f.choices;
  std::vector<std::string> reductions;
  for (const auto& spec : compression_specs()) reductions.push_back(spec.name);
  CHECK(choices.at("model.arch") == Choices{"mlp", "cnn", "gpt"});
  CHECK(choices.at("model.arch") == model_names());
  CHECK(choices.at("parallel.mode") == mode_names());
  CHECK(choices.at("parallel.compression") == reductions);
  CHECK(contains(override_error("parallel.mode=ring"), "'ring' is not one of sync | local_sgd | async_ps"));
}

}  // namespace unit_config_config
