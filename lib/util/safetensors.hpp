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

// Where each tensor of a file lies, checked against the file's size (every byte accounted
// for, as read_safetensors checks), so that single tensors can be read without the rest.
struct SafetensorsIndex {
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    size_t begin = 0, end = 0;  // byte offsets after the header
  };
  std::string path;
  size_t base = 0;                             // where the data begins
  std::vector<Entry> entries;                  // in file order
  std::map<std::string, std::string> metadata;
  const Entry* find(const std::string& name) const;
};
SafetensorsIndex index_safetensors(const std::string& path);
torch::Tensor read_tensor(const SafetensorsIndex& file, const SafetensorsIndex::Entry& entry);

}  // namespace dtrain
