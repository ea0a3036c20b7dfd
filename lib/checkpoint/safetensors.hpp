// The safetensors format (an 8-byte little-endian header length, a JSON header of
// name -> {dtype, shape, data_offsets} plus "__metadata__", then raw little-endian data):
// the form in which checkpoints hold tensors, so Python tools read them directly.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

namespace dtrain {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct SafetensorsFile {
  NamedTensors tensors;                        // in file order
  std::map<std::string, std::string> metadata;
};

// Writes (and fsyncs) `path`. Tensors are written contiguous on the CPU.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Throws CheckpointError naming the file on anything malformed.
SafetensorsFile read_safetensors(const std::string& path);
// Only the JSON header (for inspect): names, dtypes, shapes, metadata.
nlohmann::json read_safetensors_header(const std::string& path);

}  // namespace dtrain
