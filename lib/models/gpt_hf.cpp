#include "models/gpt_hf.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "util/error.hpp"
#include "util/files.hpp"
#include "util/strings.hpp"

namespace dtrain {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kPrefix = "transformer.";

// transformers' Conv1D layers: attention's c_attn and c_proj, the MLP's c_fc and c_proj.
bool is_conv1d_weight(const std::string& name) {
  return ends_with(name, ".c_attn.weight") || ends_with(name, ".c_proj.weight") ||
         ends_with(name, ".c_fc.weight");
}

json read_config(const std::string& folder) {
  const std::string path = folder + "/config.json";
  std::ifstream f(path);
  fail_if<CheckpointError>(!f, "'{}': cannot be read", path);
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw CheckpointError(fmt::format("'{}': not JSON ({})", path, first_line(e.what())));
  }
}

// A config.json field, or `fallback` (transformers' GPT2Config default) where it is absent.
template <class T>
T field(const json& cfg, const std::string& path, const char* key, T fallback) {
  if (!cfg.contains(key) || cfg[key].is_null()) return fallback;
  try {
    return cfg[key].get<T>();
  } catch (const json::exception&) {
    throw CheckpointError(fmt::format("'{}': {} has the wrong type ({})", path, key, cfg[key].dump()));
  }
}

// The model's tensors: model.safetensors, or the shards model.safetensors.index.json names.
NamedTensors read_weights(const std::string& folder) {
  const std::string single = folder + "/model.safetensors",
                    index = folder + "/model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(single, ec)) return read_safetensors(single).tensors;
  fail_if<CheckpointError>(!fs::exists(index, ec),
                           "'{}' holds no model.safetensors{} (save it with transformers' "
                           "save_pretrained, safe_serialization=True)", folder,
                           fs::exists(folder + "/pytorch_model.bin", ec)
                               ? ", only pytorch_model.bin, which dtrain does not read" : "");
  std::set<std::string> files;
  try {
    std::ifstream f(index);
    const json doc = json::parse(f);  // a temporary would be gone before the loop's body
    for (const auto& [name, file] : doc.at("weight_map").items())
      files.insert(file.get<std::string>());
  } catch (const json::exception& e) {
    throw CheckpointError(fmt::format("'{}': no weight_map ({})", index, first_line(e.what())));
  }
  NamedTensors out;
  for (const auto& file : files) {
    fail_if<CheckpointError>(file.find('/') != std::string::npos || file.find("..") != std::string::npos,
                             "'{}': shard name '{}' leaves the folder", index, file);
    for (auto& t : read_safetensors(folder + "/" + file).tensors) out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(path + "/config.json", ec);
}

void write_hf_gpt2(const std::string& out, const NamedTensors& weights, const ModelConfig& model,
                   int64_t vocab) {
  fail_if<ConfigError>(model.arch != "gpt", "export --format hf: the checkpoint's model.arch is "
                       "{}; Hugging Face's GPT-2 layout holds a gpt", model.arch);
  fail_if<ConfigError>(vocab < 1 || vocab > model.vocab, "export --vocab: {} is not in [1, {}] "
                       "(the checkpoint's model.vocab)", vocab, model.vocab);
  NamedTensors hf;
  for (const auto& [name, t] : weights) {
    torch::Tensor w = t;
    if (name == "wte.weight") w = t.narrow(0, 0, vocab);
    if (is_conv1d_weight(name)) w = t.t();
    hf.emplace_back(kPrefix + name, w.contiguous());
  }
  const json config = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"activation_function", "gelu_new"},  // GELU's tanh form, as dtrain's gpt computes it
      {"n_embd", model.dim},
      {"n_head", model.heads},
      {"n_layer", model.layers},
      {"n_positions", model.seq_len},
      {"n_ctx", model.seq_len},
      {"n_inner", nullptr},  // 4 * n_embd
      {"vocab_size", vocab},
      {"layer_norm_epsilon", 1e-5},
      {"attn_pdrop", model.dropout},
      {"embd_pdrop", model.dropout},
      {"resid_pdrop", model.dropout},
      {"initializer_range", 0.02},
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"reorder_and_upcast_attn", false},
      {"tie_word_embeddings", true},
      {"bos_token_id", std::min<int64_t>(50256, vocab - 1)},  // GPT-2's <|endoftext|>
      {"eos_token_id", std::min<int64_t>(50256, vocab - 1)},
      {"torch_dtype", "float32"},
      {"use_cache", true},
  };
  std::error_code ec;
  fail_if<RunDirError>(fs::exists(out, ec) && !fs::is_directory(out, ec),
                       "export: '{}' is a file; --format hf writes a folder", out);
  const bool made = !fs::exists(out, ec);
  fs::create_directories(out, ec);
  fail_if<RunDirError>(bool(ec), "export: cannot create '{}': {}", out, ec.message());
  // Each file under a temporary name renamed into place; a write that fails (a full disk,
  // a read-only folder) leaves no temporary behind, nor the folder if it made it.
  const std::string weights_path = out + "/model.safetensors", config_path = out + "/config.json";
  try {
    write_safetensors(weights_path + ".tmp-export", hf, {{"format", "pt"}});  // transformers wants "pt"
    fs::rename(weights_path + ".tmp-export", weights_path);
    write_file_atomic(config_path, config.dump(2) + "\n");  // its temporary removed if it fails
  } catch (const std::exception& e) {
    fs::remove(weights_path + ".tmp-export", ec);
    if (made) fs::remove(out, ec);  // only if empty
    throw RunDirError(fmt::format("export: cannot write '{}': {}", out, first_line(e.what())));
  }
}

HfGpt2 read_hf_gpt2(const std::string& folder) {
  const json cfg = read_config(folder);
  const std::string path = folder + "/config.json";
  auto need = [&](bool ok, const std::string& what) {
    fail_if<CheckpointError>(!ok, "'{}': {}; dtrain's gpt is GPT-2's network", path, what);
  };
  const auto type = field<std::string>(cfg, path, "model_type", "");
  need(type == "gpt2", fmt::format("model_type is '{}', not gpt2", type));
  const auto act = field<std::string>(cfg, path, "activation_function", "gelu_new");
  need(act == "gelu_new" || act == "gelu_pytorch_tanh",
       fmt::format("activation_function is {}, not gelu_new (GELU's tanh form)", act));
  const double eps = field<double>(cfg, path, "layer_norm_epsilon", 1e-5);
  need(std::abs(eps - 1e-5) < 1e-12, fmt::format("layer_norm_epsilon is {}, not 1e-05", eps));
  need(field<bool>(cfg, path, "scale_attn_weights", true), "scale_attn_weights is false");
  need(!field<bool>(cfg, path, "scale_attn_by_inverse_layer_idx", false),
       "scale_attn_by_inverse_layer_idx is true");
  need(field<bool>(cfg, path, "tie_word_embeddings", true), "tie_word_embeddings is false");
  need(!field<bool>(cfg, path, "add_cross_attention", false), "add_cross_attention is true");

  HfGpt2 hf;
  hf.model.arch = "gpt";
  hf.model.dim = field<int64_t>(cfg, path, "n_embd", 768);
  hf.model.heads = field<int64_t>(cfg, path, "n_head", 12);
  hf.model.layers = field<int64_t>(cfg, path, "n_layer", 12);
  hf.model.seq_len = field<int64_t>(cfg, path, "n_positions", 1024);
  hf.model.vocab = field<int64_t>(cfg, path, "vocab_size", 50257);
  hf.model.dropout = field<double>(cfg, path, "resid_pdrop", 0.1);
  const auto inner = field<int64_t>(cfg, path, "n_inner", 4 * hf.model.dim);
  need(inner == 4 * hf.model.dim, fmt::format("n_inner is {}, not 4 * n_embd ({})", inner,
                                              4 * hf.model.dim));
  need(hf.model.heads >= 1 && hf.model.dim % hf.model.heads == 0,
       fmt::format("n_embd {} is not a multiple of n_head {}", hf.model.dim, hf.model.heads));

  for (auto& [file_name, t] : read_weights(folder)) {
    std::string name = file_name.rfind(kPrefix, 0) == 0 ? file_name.substr(kPrefix.size()) : file_name;
    // The head is the token embedding; old saves also hold the attention's causal mask.
    if (name == "lm_head.weight" || ends_with(name, ".attn.bias") ||
        ends_with(name, ".attn.masked_bias"))
      continue;
    hf.weights.emplace_back(name, is_conv1d_weight(name) && t.dim() == 2 ? t.t().contiguous() : t);
  }
  return hf;
}

NamedTensors hf_gpt2_for(const HfGpt2& hf, const ModelConfig& model, const std::string& folder) {
  const std::string path = folder + "/config.json";
  auto same = [&](int64_t ours, int64_t theirs, const char* key, const char* field) {
    fail_if<CheckpointError>(ours != theirs, "model.init_from: {} {} differs from {} {} in '{}'",
                             key, ours, field, theirs, path);
  };
  fail_if<CheckpointError>(model.arch != "gpt", "model.init_from: '{}' is a GPT-2; model.arch is {}",
                           folder, model.arch);
  same(model.dim, hf.model.dim, "model.dim", "n_embd");
  same(model.heads, hf.model.heads, "model.heads", "n_head");
  same(model.layers, hf.model.layers, "model.layers", "n_layer");
  fail_if<CheckpointError>(model.seq_len > hf.model.seq_len, "model.init_from: model.seq_len {} "
                           "exceeds n_positions {} in '{}'", model.seq_len, hf.model.seq_len, path);
  fail_if<CheckpointError>(model.vocab < hf.model.vocab, "model.init_from: model.vocab {} is "
                           "smaller than vocab_size {} in '{}'", model.vocab, hf.model.vocab, path);
  NamedTensors out;
  for (const auto& [name, t] : hf.weights) {
    torch::Tensor w = t;
    if (name == "wpe.weight" && t.dim() == 2) w = t.narrow(0, 0, std::min(t.size(0), model.seq_len));
    if (name == "wte.weight" && t.dim() == 2 && t.size(0) < model.vocab)  // rows no token uses
      w = torch::cat({t, torch::zeros({model.vocab - t.size(0), t.size(1)}, t.options())});
    out.emplace_back(name, w.contiguous());
  }
  return out;
}

}  // namespace dtrain
