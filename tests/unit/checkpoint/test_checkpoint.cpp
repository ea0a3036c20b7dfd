// safetensors files (byte layout checked by hand) and the checkpoint store: keep-last-N plus
// best, the latest pointer, verification, fallback past a damaged checkpoint, temp cleanup.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "checkpoint/checkpoint.hpp"
#include "util/safetensors.hpp"
#include "temp_dir.hpp"
#include "util/error.hpp"
#include "util/files.hpp"

namespace unit_checkpoint_checkpoint {

using namespace dtrain;
using dtrain::test::TempDir;
namespace fs = std::filesystem;

namespace {

NamedTensors sample_tensors() {
  torch::manual_seed(5);
  return {
      {"layer.weight", torch::randn({3, 4})},
      {"index", torch::tensor({int64_t{-5}, int64_t{0}, int64_t{1234567890123}}, torch::kInt64)},
      {"bytes", torch::tensor({0, 1, 200, 255}, torch::kUInt8)},
      {"half.precision", torch::randn({2, 3}).to(torch::kBFloat16)},
      {"scalar", torch::tensor(3.5, torch::kFloat64)},
      {"transposed", torch::arange(6, torch::kFloat32).view({2, 3}).t()},  // not contiguous
  };
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return n;
}

std::string trim(std::string s) {
  s.erase(s.find_last_not_of(" \n") + 1);
  return s;
}

// A checkpoint's content that depends on its step, so folders can be told apart.
CheckpointState state_for(int64_t step) {
  CheckpointState s;
  s.model = {{"w", torch::full({2, 3}, static_cast<float>(step))},
             {"b", torch::arange(4, torch::kFloat32) * step}};
  s.optimizer = {{"steps", torch::tensor({step}, torch::kInt64)},
                 {"w.momentum_buffer", torch::full({2, 3}, -0.5f * step)}};
  s.trainer = {{"step", step}, {"epoch", step / 200}, {"rng", {1, 2, 3}}};
  s.config_yaml = "name: ckpt-test\nseed: " + std::to_string(step) + "\n";
  return s;
}

// One writer's checkpoint, as the checkpointer writes it: begin, the writer's part (the
// temporary folder removed if it fails), commit.
std::string save_checkpoint(CheckpointStore& store, const CheckpointState& state, int64_t step,
                            int64_t epoch, const nlohmann::json& layout,
                            const std::optional<Metric>& metric) {
  store.begin(step);
  const auto run_dir = fs::path(store.dir()).parent_path().string();
  try {
    CheckpointStore::write_part(CheckpointStore::temp_folder(run_dir, step), "", state.model,
                                state.optimizer);
  } catch (const std::exception&) {
    store.abort(step);
    throw;
  }
  return store.commit(state, step, epoch, layout, metric);
}

void check_same_tensors(const NamedTensors& got, const NamedTensors& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(want[i].first);
    CHECK(got[i].first == want[i].first);
    CHECK((got[i].second.scalar_type() == want[i].second.scalar_type()));
    CHECK(got[i].second.sizes() == want[i].second.sizes());
    CHECK(torch::equal(got[i].second, want[i].second.contiguous()));
  }
}

std::vector<std::string> checkpoint_folders(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory()) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void flip_byte(const std::string& path, size_t from_end) {
  std::string b = test::read_bytes(path);
  REQUIRE(b.size() > from_end);
  b[b.size() - 1 - from_end] = static_cast<char>(b[b.size() - 1 - from_end] ^ 0x01);
  test::write_bytes(path, b);
}

}  // namespace

TEST_CASE("safetensors: round trip of dtypes, shapes and metadata") {
  TempDir dir;
  const std::string path = dir / "t.safetensors";
  const auto tensors = sample_tensors();
  const std::map<std::string, std::string> meta{{"format", "test"}, {"note", "äöü \"quoted\""}};
  write_safetensors(path, tensors, meta);

  SafetensorsFile f = read_safetensors(path);
  check_same_tensors(f.tensors, tensors);
  CHECK(f.metadata == meta);

  // No metadata at all.
  write_safetensors(dir / "plain.safetensors", {{"x", torch::ones({2})}});
  auto plain = read_safetensors(dir / "plain.safetensors");
  CHECK(plain.metadata.empty());
  REQUIRE(plain.tensors.size() == 1);
  CHECK(torch::equal(plain.tensors[0].second, torch::ones({2})));
}

TEST_CASE("safetensors: the byte layout is the published format") {
  TempDir dir;
  const std::string path = dir / "t.safetensors";
  const auto tensors = sample_tensors();
  write_safetensors(path, tensors, {{"format", "test"}});
  const std::string bytes = test::read_bytes(path);

  // 8-byte little-endian header length, then that much JSON.
  const uint64_t n = header_length(bytes);
  REQUIRE(8 + n <= bytes.size());
  CHECK((8 + n) % 8 == 0);  // data aligned to 8 bytes
  nlohmann::json h;
  REQUIRE_NOTHROW(h = nlohmann::json::parse(bytes.substr(8, n)));
  CHECK(h["__metadata__"]["format"] == "test");

  const std::map<std::string, std::string> want_dtype{
      {"layer.weight", "F32"}, {"index", "I64"}, {"bytes", "U8"}, {"half.precision", "BF16"},
      {"scalar", "F64"}, {"transposed", "F32"}};
  const std::map<std::string, std::vector<int64_t>> want_shape{
      {"layer.weight", {3, 4}}, {"index", {3}}, {"bytes", {4}}, {"half.precision", {2, 3}},
      {"scalar", {}}, {"transposed", {3, 2}}};
  const std::map<std::string, size_t> want_bytes{{"layer.weight", 48}, {"index", 24},
                                                 {"bytes", 4}, {"half.precision", 12},
                                                 {"scalar", 8}, {"transposed", 24}};
  size_t total = 0;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& [name, dtype] : want_dtype) {
    CAPTURE(name);
    REQUIRE(h.contains(name));
    CHECK(h[name]["dtype"] == dtype);
    CHECK(h[name]["shape"].get<std::vector<int64_t>>() == want_shape.at(name));
    const size_t a = h[name]["data_offsets"][0], b = h[name]["data_offsets"][1];
    CHECK(b - a == want_bytes.at(name));
    ranges.emplace_back(a, b);
    total += b - a;
  }
  // The data ranges tile the rest of the file exactly.
  std::sort(ranges.begin(), ranges.end());
  CHECK(ranges.front().first == 0);
  for (size_t i = 1; i < ranges.size(); ++i) CHECK(ranges[i].first == ranges[i - 1].second);
  CHECK(bytes.size() == 8 + n + total);

  // Raw little-endian values (this host is little-endian, like every machine dtrain targets).
  const size_t base = 8 + n;
  const size_t w0 = h["layer.weight"]["data_offsets"][0];
  float first;
  std::memcpy(&first, bytes.data() + base + w0, sizeof first);
  CHECK(first == tensors[0].second[0][0].item<float>());
  const size_t i0 = h["index"]["data_offsets"][0];
  int64_t big;
  std::memcpy(&big, bytes.data() + base + i0 + 16, sizeof big);
  CHECK(big == int64_t{1234567890123});
  // The transposed tensor is written in its logical (row-major) order: 0 3 1 4 2 5.
  const size_t t0 = h["transposed"]["data_offsets"][0];
  float tv[6];
  std::memcpy(tv, bytes.data() + base + t0, sizeof tv);
  CHECK(tv[1] == 3.0f);
  CHECK(tv[2] == 1.0f);
}

TEST_CASE("safetensors: malformed files throw CheckpointError") {
  TempDir dir;
  const std::string good = dir / "good.safetensors";
  write_safetensors(good, {{"x", torch::arange(10, torch::kFloat32)}});
  const std::string bytes = test::read_bytes(good);
  auto bad = [&](const std::string& name, const std::string& content) {
    const std::string p = dir / name;
    test::write_bytes(p, content);
    CAPTURE(name);
    CHECK_THROWS_AS(read_safetensors(p), CheckpointError);
  };
  bad("empty", "");
  bad("short", bytes.substr(0, 5));
  bad("truncated-data", bytes.substr(0, bytes.size() - 4));
  bad("truncated-header", bytes.substr(0, 20));
  std::string huge = bytes;
  huge[7] = 0x7f;  // header length far past the end
  bad("huge-length", huge);
  std::string garbage = bytes;
  garbage[8] = '!';  // JSON no longer parses
  bad("garbage-header", garbage);
  CHECK_THROWS_AS(read_safetensors(dir / "missing"), CheckpointError);
  CHECK_THROWS_AS(index_safetensors(dir / "missing"), CheckpointError);

  // Headers that parse but describe impossible data: each is refused before anything is
  // allocated, as CheckpointError (never a LibTorch error or an allocation failure).
  auto with_header = [&](const std::string& name, const std::string& json, size_t data_bytes) {
    std::string h = json, out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t(h.size()) >> (8 * i)) & 0xff);
    bad(name, out + h + std::string(data_bytes, '\0'));
  };
  with_header("array-header", "[1, 2]", 0);
  with_header("negative-shape", R"({"x":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", 16);
  with_header("overflowing-shape",
              R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", 16);
  with_header("bad-dtype", R"({"x":{"dtype":"Q7","shape":[4],"data_offsets":[0,16]}})", 16);
  with_header("gap", R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[4,20]}})", 20);
  with_header("overlap", R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("y":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})", 24);
  with_header("trailing-bytes", R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 20);
  with_header("offsets-not-numbers", R"({"x":{"dtype":"F32","shape":[4],"data_offsets":"a"}})", 16);
  with_header("metadata-not-strings", R"({"__metadata__":{"a":1}})", 0);
}

TEST_CASE("checkpoint store: keep-last-N plus best, latest, verify, fallback") {
  TempDir run;
  CheckpointConfig cfg;
  cfg.keep_last = 2;
  cfg.keep_best = true;
  CheckpointStore store(run.path().string(), cfg);
  const std::string dir = store.dir();
  CHECK(fs::path(dir) == run.path() / "checkpoints");

  const double acc[] = {0.5, 0.9, 0.6, 0.7, 0.8};
  const nlohmann::json layout{{"data", 1}, {"tensor", 1}, {"pipeline", 1}};
  for (int i = 0; i < 5; ++i) {
    const int64_t step = 100 * (i + 1);
    auto folder = save_checkpoint(store, state_for(step), step, /*epoch=*/i, layout,
                                  Metric{"accuracy", acc[i]});
    CHECK(fs::path(folder) == fs::path(dir) / fmt::format("step-{:08d}", step));
    CHECK(fs::is_directory(folder));
  }
  // Best (0.9 at step 200) plus the two newest.
  CHECK(checkpoint_folders(dir) ==
        std::vector<std::string>{"step-00000200", "step-00000400", "step-00000500"});
  auto pointer = [&](const char* name) {
    const fs::path p = fs::path(dir) / name;
    if (fs::is_symlink(p)) return fs::read_symlink(p).filename().string();
    return trim(test::read_bytes(p.string()));
  };
  CHECK(pointer("latest") == "step-00000500");
  CHECK(pointer("best") == "step-00000200");
  for (const char* name : {"step-00000200", "step-00000400", "step-00000500"}) {
    CAPTURE(name);
    nlohmann::json m;
    CHECK_NOTHROW(m = verify_checkpoint((fs::path(dir) / name).string()));
    CHECK(m["step"] == std::stoi(std::string(name).substr(5)));
    CHECK(m["metric"]["name"] == "accuracy");
  }
  CHECK(store.newest_valid().value_or("<none>") == (fs::path(dir) / "step-00000500").string());

  // Everything comes back exactly.
  CheckpointState loaded = load_checkpoint((fs::path(dir) / "step-00000400").string());
  const CheckpointState want = state_for(400);
  check_same_tensors(loaded.model, want.model);
  check_same_tensors(loaded.optimizer, want.optimizer);
  CHECK(loaded.trainer == want.trainer);
  CHECK(loaded.config_yaml == want.config_yaml);

  // One flipped bit in the newest checkpoint's weights: it no longer counts.
  const std::string newest = (fs::path(dir) / "step-00000500").string();
  flip_byte(newest + "/model.safetensors", /*from_end=*/3);
  CHECK_THROWS_AS(verify_checkpoint(newest), CheckpointError);
  CHECK_THROWS_AS(load_checkpoint(newest), CheckpointError);
  CHECK(store.newest_valid().value_or("<none>") == (fs::path(dir) / "step-00000400").string());

  // A newer folder without manifest.json (a crash before the marker) is not a checkpoint.
  const fs::path incomplete = fs::path(dir) / "step-00000600";
  fs::copy(fs::path(dir) / "step-00000400", incomplete);
  fs::remove(incomplete / "manifest.json");
  CHECK_THROWS_AS(verify_checkpoint(incomplete.string()), CheckpointError);
  CHECK(store.newest_valid().value_or("<none>") == (fs::path(dir) / "step-00000400").string());

  // A missing file, or a manifest that is not JSON, also fails verification.
  const fs::path other = fs::path(dir) / "step-00000700";
  fs::copy(fs::path(dir) / "step-00000400", other);
  fs::remove(other / "trainer.json");
  CHECK_THROWS_AS(verify_checkpoint(other.string()), CheckpointError);
  test::write_bytes((other / "manifest.json").string(), "{not json");
  CHECK_THROWS_AS(verify_checkpoint(other.string()), CheckpointError);
  CHECK_THROWS_AS(verify_checkpoint((fs::path(dir) / "step-99999999").string()), CheckpointError);
  CHECK(store.newest_valid().value_or("<none>") == (fs::path(dir) / "step-00000400").string());
}

TEST_CASE("checkpoint store: without keep_best only the newest are kept") {
  TempDir run;
  CheckpointConfig cfg;
  cfg.keep_last = 2;
  cfg.keep_best = false;
  CheckpointStore store(run.path().string(), cfg);
  for (int64_t step : {1, 2, 3, 4})
    save_checkpoint(store, state_for(step), step, 0, nlohmann::json::object(),
                    Metric{"accuracy", step == 1 ? 0.99 : 0.1});
  CHECK(checkpoint_folders(store.dir()) ==
        std::vector<std::string>{"step-00000003", "step-00000004"});
  // Saves without a metric work too.
  save_checkpoint(store, state_for(5), 5, 0, nlohmann::json::object(), std::nullopt);
  CHECK(checkpoint_folders(store.dir()) ==
        std::vector<std::string>{"step-00000004", "step-00000005"});
}

TEST_CASE("checkpoint store: an empty store has no valid checkpoint; leftovers are removed") {
  TempDir run;
  CheckpointConfig cfg;
  {
    CheckpointStore store(run.path().string(), cfg);
    CHECK_FALSE(store.newest_valid().has_value());
  }
  const fs::path leftover = run.path() / "checkpoints" / ".tmp-step-00000042";
  fs::create_directories(leftover);
  test::write_bytes((leftover / "model.safetensors").string(), "partial");
  CheckpointStore store(run.path().string(), cfg);
  CHECK(fs::exists(leftover));  // not until the run owns the folder
  store.discard_partial();
  CHECK_FALSE(fs::exists(leftover));
  CHECK_FALSE(store.newest_valid().has_value());
}

TEST_CASE("checkpoint store: a save that fails removes its partial folder and keeps the rest") {
  TempDir run;
  CheckpointConfig cfg;
  CheckpointStore store(run.path().string(), cfg);
  save_checkpoint(store, state_for(1), 1, 0, nlohmann::json::object(), std::nullopt);
  CheckpointState unwritable = state_for(2);
  unwritable.model.emplace_back("complex", torch::zeros({2}, torch::kComplexFloat));  // no dtype
  CHECK_THROWS_WITH(
      save_checkpoint(store, unwritable, 2, 0, nlohmann::json::object(), std::nullopt),
      doctest::Contains("no dtype for ComplexFloat"));
  CHECK(checkpoint_folders(store.dir()) == std::vector<std::string>{"step-00000001"});
  CHECK_FALSE(fs::exists(fs::path(store.dir()) / ".tmp-step-00000002"));
  CHECK(store.newest_valid().value_or("<none>") == (fs::path(store.dir()) / "step-00000001").string());
}

TEST_CASE("checkpoint store: scan names every damaged folder newer than the one it picks") {
  TempDir run;
  CheckpointConfig cfg;
  cfg.keep_last = 5;
  CheckpointStore store(run.path().string(), cfg);
  for (int64_t step : {1, 2, 3})
    save_checkpoint(store, state_for(step), step, 0, nlohmann::json::object(), std::nullopt);
  const fs::path dir = store.dir();
  fs::remove(dir / "step-00000003" / "config.yaml");
  fs::remove(dir / "step-00000002" / "manifest.json");
  auto scan = store.scan();
  CHECK(scan.folders == 3);
  CHECK(scan.newest_valid.value_or("<none>") == (dir / "step-00000001").string());
  REQUIRE(scan.skipped.size() == 2);
  CHECK(scan.skipped[0].folder == (dir / "step-00000003").string());
  CHECK(scan.skipped[0].why.find("missing config.yaml") != std::string::npos);
  CHECK(scan.skipped[1].why.find("no manifest.json") != std::string::npos);
  fs::remove(dir / "step-00000001" / "trainer.json");
  scan = store.scan();
  CHECK_FALSE(scan.newest_valid.has_value());
  CHECK(scan.skipped.size() == 3);
}

TEST_CASE("resolve_checkpoint follows a run directory, checkpoints/ and its pointers") {
  TempDir run;
  CheckpointConfig cfg;
  cfg.keep_best = true;
  CheckpointStore store(run.path().string(), cfg);
  save_checkpoint(store, state_for(4), 4, 0, nlohmann::json::object(), Metric{"accuracy", 0.9});
  save_checkpoint(store, state_for(8), 8, 0, nlohmann::json::object(), Metric{"accuracy", 0.1});
  const std::string dir = store.dir();
  CHECK(resolve_checkpoint(run.path().string()) == dir + "/step-00000008");
  CHECK(resolve_checkpoint(dir) == dir + "/step-00000008");
  CHECK(resolve_checkpoint(dir + "/latest") == dir + "/step-00000008");
  CHECK(resolve_checkpoint(dir + "/best") == dir + "/step-00000004");
  CHECK(resolve_checkpoint(dir + "/step-00000004") == dir + "/step-00000004");
  CHECK_THROWS_WITH_AS(resolve_checkpoint(dir + "/step-00000008/trainer.json"),
                       doctest::Contains("is a file; a checkpoint is a folder"), CheckpointError);
  CHECK_THROWS_WITH_AS(resolve_checkpoint(run / "nothing"), doctest::Contains("does not exist"),
                       CheckpointError);
  test::write_bytes(dir + "/latest", "../../etc\n");  // a pointer names a sibling folder only
  CHECK_THROWS_WITH_AS(resolve_checkpoint(dir + "/latest"),
                       doctest::Contains("does not name a checkpoint folder"), CheckpointError);
}

TEST_CASE("timeline: a rollback keeps the abandoned checkpoints aside; auto follows latest") {
  TempDir run;
  CheckpointConfig cfg;
  cfg.keep_last = 2;
  cfg.keep_best = true;
  CheckpointStore store(run.path().string(), cfg);
  auto& line = store.timeline();
  const fs::path dir = store.dir();
  const nlohmann::json layout = nlohmann::json::object();
  auto save = [&](int64_t step, double acc) {
    save_checkpoint(store, state_for(step), step, 0, layout, Metric{"accuracy", acc});
  };
  save(2, 0.9), save(4, 0.1), save(6, 0.2), save(8, 0.3), save(10, 0.4);
  CHECK(line.line() == std::vector<std::string>{"step-00000002", "step-00000008", "step-00000010"});
  CHECK(line.best().value_or("") == (dir / "step-00000002").string());

  // Back to step 2 (the issue's case: the best, older than latest).
  auto branch = line.continue_from((dir / "step-00000002").string());
  REQUIRE(branch);
  CHECK(branch->step == 2);
  CHECK(branch->on_line);
  CHECK(branch->set_aside == std::vector<int64_t>{8, 10});
  CHECK(branch->kept_in == "checkpoints/abandoned/branch-1");
  CHECK(trim(test::read_bytes((dir / "latest").string())) == "step-00000002");
  CHECK(line.line() == std::vector<std::string>{"step-00000002"});
  const fs::path kept = dir / "abandoned" / "branch-1";
  for (int64_t step : {8, 10})  // whole, and still checkpoints a user may name
    CHECK(verify_checkpoint((kept / fmt::format("step-{:08d}", step)).string())["step"] == step);
  const auto record = nlohmann::json::parse(test::read_bytes((kept / "branch.json").string()));
  CHECK(record["step"] == 2);
  CHECK(record["latest_was"] == "step-00000010");
  CHECK(record["set_aside"] == nlohmann::json{"step-00000008", "step-00000010"});
  CHECK(store.newest_valid().value_or("") == (dir / "step-00000002").string());

  // The new branch's checkpoints are pruned among themselves only; best (step 2) stays.
  save(4, 0.5), save(6, 0.6), save(8, 0.7);
  CHECK(line.line() == std::vector<std::string>{"step-00000002", "step-00000006", "step-00000008"});
  CHECK(checkpoint_folders((kept).string()) == std::vector<std::string>{"step-00000008", "step-00000010"});
  CHECK(store.newest_valid().value_or("") == (dir / "step-00000008").string());
  CHECK(state_for(8).trainer == load_checkpoint((dir / "step-00000008").string()).trainer);

  // Resuming the head is no branch.
  CHECK_FALSE(line.continue_from((dir / "step-00000008").string()));
  CHECK(fs::exists(dir / "step-00000008"));

  // The abandoned branch's step 10, another line's checkpoint: the whole line goes aside,
  // latest names it where it is, best is gone with the line.
  branch = line.continue_from((kept / "step-00000010").string());
  REQUIRE(branch);
  CHECK_FALSE(branch->on_line);
  CHECK(branch->set_aside == std::vector<int64_t>{2, 6, 8});
  CHECK(branch->kept_in == "checkpoints/abandoned/branch-2");
  CHECK(line.line().empty());
  CHECK(trim(test::read_bytes((dir / "latest").string())) == "abandoned/branch-1/step-00000010");
  CHECK(resolve_checkpoint(run.path().string()) == (kept / "step-00000010").string());
  CHECK(store.newest_valid().value_or("") == (kept / "step-00000010").string());
  CHECK_FALSE(fs::exists(dir / "best"));
  save(12, 0.1);
  CHECK(line.line() == std::vector<std::string>{"step-00000012"});
  CHECK(trim(test::read_bytes((dir / "latest").string())) == "step-00000012");
  CHECK(line.best().value_or("") == (dir / "step-00000012").string());
}

TEST_CASE("timeline: a head that does not verify falls back along the line, never past it") {
  TempDir run;
  CheckpointConfig cfg;
  cfg.keep_last = 10;
  CheckpointStore store(run.path().string(), cfg);
  auto& line = store.timeline();
  const fs::path dir = store.dir();
  for (int64_t step : {1, 2, 3, 4})
    save_checkpoint(store, state_for(step), step, 0, nlohmann::json::object(), std::nullopt);

  // A crash between a rollback's `latest` and its moves: latest (2) is older than the
  // line's newest. auto takes latest; continuing from it sets the rest aside.
  write_file_atomic((dir / "latest").string(), "step-00000002\n");
  CHECK(store.newest_valid().value_or("") == (dir / "step-00000002").string());
  auto branch = line.continue_from((dir / "step-00000002").string());
  REQUIRE(branch);
  CHECK(branch->set_aside == std::vector<int64_t>{3, 4});
  CHECK(line.line() == std::vector<std::string>{"step-00000001", "step-00000002"});

  // latest names a folder that is gone: the newest older folder that verifies.
  save_checkpoint(store, state_for(5), 5, 0, nlohmann::json::object(), std::nullopt);
  save_checkpoint(store, state_for(6), 6, 0, nlohmann::json::object(), std::nullopt);
  remove_tree((dir / "step-00000006").string());
  fs::remove(dir / "step-00000005" / "trainer.json");
  auto scan = store.scan();
  CHECK(scan.newest_valid.value_or("") == (dir / "step-00000002").string());
  REQUIRE(scan.skipped.size() == 2);
  CHECK(scan.skipped[0].why.find("does not exist (named by latest)") != std::string::npos);
  CHECK(scan.skipped[1].folder == (dir / "step-00000005").string());

  // A head of another line that does not verify: the line's folders never stand in.
  fs::create_directories(run.path() / "elsewhere");
  fs::rename(dir / "step-00000002", run.path() / "elsewhere" / "step-00000002");
  write_file_atomic((dir / "latest").string(), (run.path() / "elsewhere" / "step-00000002").string());
  CHECK(store.newest_valid().value_or("") == (run.path() / "elsewhere" / "step-00000002").string());
  fs::remove(run.path() / "elsewhere" / "step-00000002" / "config.yaml");
  scan = store.scan();
  CHECK_FALSE(scan.newest_valid);
  CHECK(scan.folders == 3);  // 1 and 5 on the line, and the head

  // An unreadable latest: the line alone decides, and says so.
  write_file_atomic((dir / "latest").string(), "../../etc\n");
  scan = store.scan();
  CHECK(scan.newest_valid.value_or("") == (dir / "step-00000001").string());
  CHECK(scan.skipped.front().why.find("does not name a checkpoint folder") != std::string::npos);
}

TEST_CASE("DirLock: one holder at a time, named; free again once released") {
  TempDir dir;
  std::string holder;
  auto first = DirLock::try_lock(dir.path().string(), holder);
  REQUIRE(first.has_value());
  auto second = DirLock::try_lock(dir.path().string(), holder);  // another open file: refused
  CHECK_FALSE(second.has_value());
  CHECK(holder.rfind("pid " + std::to_string(::getpid()) + " on host ", 0) == 0);
  first.reset();
  CHECK(DirLock::try_lock(dir.path().string(), holder).has_value());
}

TEST_CASE("remove_tree: a whole tree, symlinks themselves but never their targets") {
  TempDir dir;
  const fs::path outside = dir.path() / "outside", tree = dir.path() / "tree";
  fs::create_directories(outside);
  test::write_bytes((outside / "keep.txt").string(), "keep");
  fs::create_directories(tree / "a" / "b");
  test::write_bytes((tree / "a" / "b" / "f.bin").string(), "x");
  test::write_bytes((tree / "top.txt").string(), "y");
  fs::create_directory_symlink(outside, tree / "a" / "link");
  remove_tree(tree.string());
  CHECK_FALSE(fs::exists(tree));
  CHECK(fs::exists(outside / "keep.txt"));
  CHECK_NOTHROW(remove_tree(tree.string()));  // absent: nothing to do
  remove_tree((outside / "keep.txt").string());  // a single file
  CHECK_FALSE(fs::exists(outside / "keep.txt"));
}

namespace {
std::string dir_of(const CheckpointStore& store, int64_t step) {
  return (fs::path(store.dir()) / fmt::format("step-{:08d}", step)).string();
}
}  // namespace

TEST_CASE("checkpoint store: each tensor rank's part of a split tensor, assembled on load") {
  TempDir run;
  CheckpointConfig cfg;
  CheckpointStore store(run.path().string(), cfg);
  // A fused QKV-like weight: 3 blocks along dim 0, each split over 2 tensor ranks; a
  // replicated bias written by tensor rank 0 only.
  const auto full = torch::arange(24, torch::kFloat32).view({6, 4});
  const Placement qkv = Placement::split(0, 2, 3);
  const auto bias = torch::ones({4});
  auto write = [&](int64_t step, std::vector<int64_t> ranks) {
    store.begin(step);
    const auto tmp = CheckpointStore::temp_folder(run.path().string(), step);
    for (int64_t r : ranks) {
      PartsOf parts{{"w", PartOf{qkv, r}}, {"w.momentum", PartOf{qkv, r}}};
      NamedTensors model{{"w", qkv.shard(full, r)}}, opt{{"w.momentum", qkv.shard(full, r) * 2}};
      if (r == 0) model.emplace_back("b", bias), opt.emplace_back("steps", torch::ones({}));
      CheckpointStore::write_part(tmp, fmt::format(".tp{}", r), model, opt, parts);
    }
    CheckpointState s = state_for(step);
    return store.commit(s, step, 0, nlohmann::json::object(), std::nullopt);
  };
  auto loaded = load_checkpoint(write(7, {0, 1}));
  std::map<std::string, torch::Tensor> model(loaded.model.begin(), loaded.model.end());
  std::map<std::string, torch::Tensor> opt(loaded.optimizer.begin(), loaded.optimizer.end());
  CHECK(torch::equal(model.at("w"), full));
  CHECK(torch::equal(model.at("b"), bias));
  CHECK(torch::equal(opt.at("w.momentum"), full * 2));
  CHECK(opt.count("steps") == 1);
  // A rank reads only what it needs: at the saved split, its own part's bytes (rank 0's
  // file may be gone by then); another split (here none) assembles from every part.
  {
    const CheckpointReader reader(dir_of(store, 7));
    const auto model = reader.tensors("model");
    fs::remove(fs::path(reader.folder()) / "model.tp0.safetensors");
    CHECK(torch::equal(model.part("w", {6, 4}, qkv, 1), qkv.shard(full, 1)));
    CHECK_THROWS_AS(model.at("w", {6, 4}), CheckpointError);  // needs rank 0's part too
    CHECK_THROWS_WITH_AS(model.part("w", {4, 6}, qkv, 1), doctest::Contains("shape"),
                         CheckpointError);
  }
  // A checkpoint whose writers left out a tensor rank names what it lacks.
  CHECK_THROWS_WITH_AS(load_checkpoint(write(8, {0})),
                       doctest::Contains("lacks tensor rank 1's part of 'w'"), CheckpointError);
}

TEST_CASE("checkpoint store: ZeRO's shards, one file per data rank, merged on load; a gap is named") {
  TempDir run;
  CheckpointConfig cfg;
  CheckpointStore store(run.path().string(), cfg);
  // A conv weight laid out channels-last in the flat buffer (N,H,W,C), cut between two
  // data ranks in the middle of a row of channels; a bias whole in data rank 1's shard;
  // a fused weight split over 2 tensor ranks (3 blocks), each tensor rank's part cut at
  // its 5th element. The step count is in every shard.
  const auto w = torch::arange(72, torch::kFloat32).view({4, 2, 3, 3});
  const auto w_flat = w.permute({0, 2, 3, 1}).contiguous().view(-1);
  const auto b = torch::arange(4, torch::kFloat32) + 100;
  const auto q = torch::arange(24, torch::kFloat32).view({6, 4}) + 1000;
  const Placement qkv = Placement::split(0, 2, 3);
  auto write = [&](int64_t step, std::vector<int64_t> data_ranks) {
    store.begin(step);
    const auto tmp = CheckpointStore::temp_folder(run.path().string(), step);
    CheckpointStore::write_part(tmp, "", {{"w", w}, {"b", b}}, {}, {}, /*with_optimizer=*/false);
    for (int64_t d : data_ranks)
      for (int64_t t = 0; t < 2; ++t) {
        const auto q_part = qkv.shard(q, t).reshape(-1);
        NamedTensors state{{"steps", torch::full({1}, 3, torch::kInt64)}};
        PartsOf parts{{"q", PartOf{qkv, t}}};
        RangesOf ranges;
        const int64_t cut = 5;
        state.emplace_back("q", d == 0 ? q_part.narrow(0, 0, cut) : q_part.narrow(0, cut, 12 - cut));
        ranges["q"] = RangeOf{d == 0 ? 0 : cut, {3, 4}, false};
        if (t == 0) {  // replicated tensors: tensor rank 0's
          state.emplace_back("w", d == 0 ? w_flat.narrow(0, 0, 40) : w_flat.narrow(0, 40, 32));
          ranges["w"] = RangeOf{d == 0 ? 0 : 40, {4, 2, 3, 3}, true};
          if (d == 1) state.emplace_back("b", b), ranges["b"] = RangeOf{0, {4}, false};
        }
        CheckpointStore::write_shard(tmp, "optimizer", d, fmt::format(".tp{}", t), state, parts, ranges);
      }
    CheckpointState s = state_for(step);
    return store.commit(s, step, 0, nlohmann::json::object(), std::nullopt);
  };
  const auto folder = write(3, {0, 1});
  auto loaded = load_checkpoint(folder);
  std::map<std::string, torch::Tensor> opt(loaded.optimizer.begin(), loaded.optimizer.end());
  CHECK(torch::equal(opt.at("w"), w));
  CHECK(torch::equal(opt.at("b"), b));
  CHECK(torch::equal(opt.at("q"), q));
  CHECK(opt.at("steps").item<int64_t>() == 3);
  {  // at the saved split, a tensor rank's part from its ranges only
    const CheckpointReader reader(folder);
    CHECK(torch::equal(reader.tensors("optimizer").part("q", {6, 4}, qkv, 1), qkv.shard(q, 1)));
  }
  // Data rank 1's shard lost: what no file holds is named.
  CHECK_THROWS_WITH_AS(load_checkpoint(write(4, {0})),
                       doctest::Contains("are in no file (a ZeRO shard's file missing)"), CheckpointError);
}

}  // namespace unit_checkpoint_checkpoint
