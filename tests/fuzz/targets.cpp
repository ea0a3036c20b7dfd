#include "targets.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "util/safetensors.hpp"
#include "config/schema.hpp"
#include "job/validate.hpp"
#include "data/dataset.hpp"
#include "run/saved_state.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "../unit/temp_dir.hpp"

namespace dtrain::fuzz {
namespace fs = std::filesystem;
namespace {

// A scratch folder for this process, the readers taking paths; removed as it ends.
const fs::path& scratch() {
  static const dtrain::test::TempDir dir("dtrain-fuzz");
  return dir.path();
}

std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const auto path = (scratch() / name).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

// A bug the fuzzer should report: abort with what was wrong.
[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace

void job_spec(const uint8_t* data, size_t size) {
  const auto path = write_input("job.yaml", data, size);
  JobConfig cfg;
  try {
    cfg = load_job(path, {});
    resolve(cfg);
  } catch (const ConfigError&) {
    return;
  }
  for (int64_t world : {1, 2, 4}) {
    try {
      // The machine checks too: the memory estimate's arithmetic on absurd sizes.
      validate(cfg, world);
      check_machine(cfg, world, world);
    } catch (const ConfigError&) {
    }
  }
  // What `config` prints reads back to the same job.
  const std::string printed = to_yaml(cfg);
  std::string again;
  try {
    again = to_yaml(parse_job(printed, "printed.yaml"));
  } catch (const ConfigError& e) {
    bug(std::string("the printed job does not read back: ") + e.what() + "\n" + printed);
  }
  if (again != printed) bug("the printed job reads back differently:\n" + printed + "\n" + again);
}

void idx(const uint8_t* data, size_t size) {
  const auto path = write_input("data-idx", data, size);
  for (int64_t dims : {1, 3}) {
    try {
      auto t = read_idx(path, dims);
      if (t.dim() != dims) bug("read_idx returned the wrong number of dimensions");
    } catch (const DataError&) {
    }
  }
}

void safetensors(const uint8_t* data, size_t size) {
  const auto path = write_input("t.safetensors", data, size);
  SafetensorsFile file;
  try {
    file = read_safetensors(path);
  } catch (const CheckpointError&) {
    return;
  }
  // What was read writes back and reads again to the same tensors.
  const auto copy = (scratch() / "copy.safetensors").string();
  write_safetensors(copy, file.tensors, file.metadata);
  const auto back = read_safetensors(copy);
  if (back.tensors.size() != file.tensors.size()) bug("safetensors round trip lost tensors");
  for (size_t i = 0; i < back.tensors.size(); ++i)
    if (back.tensors[i].first != file.tensors[i].first ||
        !back.tensors[i].second.equal(file.tensors[i].second))
      bug("safetensors round trip changed " + file.tensors[i].first);
}

void checkpoint(const uint8_t* data, size_t size) {
  // The input is a manifest beside real files, and a trainer state.
  const fs::path folder = scratch() / "step-00000001";
  static const bool made = [&] {
    fs::create_directories(folder);
    write_safetensors((folder / "model.safetensors").string(), {});
    write_safetensors((folder / "optimizer.safetensors").string(), {});
    write_file_synced((folder / "trainer.json").string(), "{}\n");
    write_file_synced((folder / "config.yaml").string(), "name: x\n");
    return true;
  }();
  (void)made;
  write_input("step-00000001/manifest.json", data, size);
  try {
    verify_checkpoint(folder.string());
  } catch (const CheckpointError&) {
  }
  const auto json = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return;
  try {
    read_trainer_state(json, folder.string());
  } catch (const CheckpointError&) {
  }
}

}  // namespace dtrain::fuzz
