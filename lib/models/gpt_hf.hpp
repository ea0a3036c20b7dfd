// Hugging Face's GPT-2 layout, out and in: the folder transformers'
// GPT2LMHeadModel.save_pretrained writes and from_pretrained reads (config.json with GPT-2's
// fields, model.safetensors with `transformer.*` names). dtrain's gpt is GPT-2's network
// under GPT-2's names; two things differ: transformers' Conv1D keeps its weights [in, out]
// where a Linear keeps [out, in], and the names carry a `transformer.` prefix. The LM head is
// tied to the token embedding on both sides, so it is not written.
#pragma once
#include <string>

#include "util/safetensors.hpp"
#include "config/config.hpp"

namespace dtrain {

// Whether `path` is a folder holding a config.json (a Hugging Face model folder).
bool is_hf_folder(const std::string& path);

// Writes `weights` (a gpt's, under dtrain's names at full shapes) into the folder `out` as
// config.json and model.safetensors, the token embedding cut to its first `vocab` rows
// (a vocabulary padded for the tensor split, 50304, goes out as the tokenizer's 50257).
void write_hf_gpt2(const std::string& out, const NamedTensors& weights, const ModelConfig& model,
                   int64_t vocab);

struct HfGpt2 {
  ModelConfig model;     // arch gpt and the shape config.json gives (vocab: vocab_size)
  NamedTensors weights;  // under dtrain's names and layout, in the file's dtype
};
// Reads a GPT-2 folder; CheckpointError naming the config.json field that is not GPT-2's
// network as dtrain builds it (another architecture, activation, epsilon, ...).
HfGpt2 read_hf_gpt2(const std::string& folder);

// `hf`'s weights for a model configured as `model` (init_from): heads, layers and width must
// match, model.seq_len may be shorter than n_positions (the first rows are kept), and a
// model.vocab larger than vocab_size is padded with zero rows. CheckpointError naming the
// field otherwise.
NamedTensors hf_gpt2_for(const HfGpt2& hf, const ModelConfig& model, const std::string& folder);

}  // namespace dtrain
