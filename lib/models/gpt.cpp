// The gpt family: a decoder-only transformer (GPT-2's shape). Token and learned position
// embeddings; pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP;
// a final LayerNorm; the LM head tied to the token embedding. Initialisation as GPT-2
// (gpt_init): N(0, 0.02) weights, zero biases, residual projections N(0, 0.02 / sqrt(2 *
// layers)), LayerNorms' gains 1.
// Names follow GPT-2's checkpoints: wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2,
// mlp.c_fc, mlp.c_proj}, ln_f.
//
// Tensor parallelism (Megatron): attention heads split over the tensor group (QKV
// column-parallel as three blocks, the output projection row-parallel), the MLP likewise,
// the token embedding and the tied LM head split by vocabulary; LayerNorms and the
// position embedding replicated.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <torch/nn.h>

#include "models/attention.hpp"
#include "models/dropout.hpp"
#include "models/model.hpp"
#include "models/recompute.hpp"
#include "layers/plain.hpp"
#include "layers/tensor_parallel.hpp"
#include "layers/vocab_parallel.hpp"
#include "util/error.hpp"
#include "util/strings.hpp"

#include <ATen/ops/scaled_dot_product_attention.h>

namespace dtrain {
namespace nn = torch::nn;

torch::Tensor plain_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const WeightsDropout& drop) {
  const int64_t seq = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(q.size(-1))));
  auto future = torch::ones({seq, seq}, torch::dtype(torch::kBool).device(q.device())).triu(1);
  auto weights = torch::softmax(scores.masked_fill(future, -INFINITY), -1);
  if (drop) weights = drop(weights);
  return torch::matmul(weights, v);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, 0.0, /*is_causal=*/true);
}

namespace {

ParallelLinearOptions linear(int64_t in, int64_t out, const torch::TensorOptions& options,
                             int64_t blocks = 1) {
  ParallelLinearOptions o{in, out};
  o.blocks = blocks;
  o.options = options;
  return o;
}

class AttentionImpl : public nn::Module {
 public:
  AttentionImpl(const ModelConfig& cfg, const ModelContext& ctx, int64_t block)
      : heads_(cfg.heads / ctx.tensor->size()),
        head_dim_(cfg.dim / cfg.heads),
        dropout_(cfg.dropout),
        weights_site_(dropout_site(fmt::format("h.{}.attn.weights", block))),
        out_site_(dropout_site(fmt::format("h.{}.attn.out", block))),
        heads_slice_{1, ctx.tensor->rank(), ctx.tensor->size()} {
    c_attn = register_module(
        "c_attn", ColumnParallelLinear(linear(cfg.dim, 3 * cfg.dim, ctx.options, 3), ctx.tensor));
    c_proj = register_module(
        "c_proj", RowParallelLinear(linear(cfg.dim, cfg.dim, ctx.options), ctx.tensor));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t batch = x.size(0), seq = x.size(1), width = heads_ * head_dim_;
    auto qkv = c_attn->forward(x).split(width, -1);  // this rank's heads of Q, K and V
    auto heads = [&](const torch::Tensor& t) {
      return t.view({batch, seq, heads_, head_dim_}).transpose(1, 2);
    };
    const bool drop = is_training() && dropout_ > 0;
    // The weights' dropout draws per (sample, head of the whole layer, query, key): the
    // plain form, as the fused kernel would draw its own.
    auto y = drop ? plain_causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                           [&](const torch::Tensor& w) {
                                             return seeded_dropout(w, dropout_, weights_site_,
                                                                   heads_slice_);
                                           })
                  : causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]));
    y = c_proj->forward(y.transpose(1, 2).contiguous().view({batch, seq, width}));
    return drop ? seeded_dropout(y, dropout_, out_site_) : y;
  }

  ColumnParallelLinear c_attn{nullptr};
  RowParallelLinear c_proj{nullptr};

 private:
  int64_t heads_, head_dim_;
  double dropout_;
  uint64_t weights_site_, out_site_;
  LayerSlice heads_slice_;
};
TORCH_MODULE(Attention);

class MlpImpl : public nn::Module {
 public:
  MlpImpl(const ModelConfig& cfg, const ModelContext& ctx, int64_t block)
      : dropout_(cfg.dropout), site_(dropout_site(fmt::format("h.{}.mlp.out", block))) {
    c_fc = register_module(
        "c_fc", ColumnParallelLinear(linear(cfg.dim, 4 * cfg.dim, ctx.options), ctx.tensor));
    c_proj = register_module(
        "c_proj", RowParallelLinear(linear(4 * cfg.dim, cfg.dim, ctx.options), ctx.tensor));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = c_proj->forward(torch::gelu(c_fc->forward(x), "tanh"));  // GPT-2's GELU
    return is_training() && dropout_ > 0 ? seeded_dropout(y, dropout_, site_) : y;
  }

  ColumnParallelLinear c_fc{nullptr};
  RowParallelLinear c_proj{nullptr};

 private:
  double dropout_;
  uint64_t site_;
};
TORCH_MODULE(Mlp);

class BlockImpl : public nn::Module {
 public:
  BlockImpl(const ModelConfig& cfg, const ModelContext& ctx, int64_t index) {
    ln_1 = register_module("ln_1", LayerNorm(cfg.dim, ctx.options));
    attn = register_module("attn", Attention(cfg, ctx, index));
    ln_2 = register_module("ln_2", LayerNorm(cfg.dim, ctx.options));
    mlp = register_module("mlp", Mlp(cfg, ctx, index));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn->forward(ln_1->forward(x));
    return x + mlp->forward(ln_2->forward(x));
  }

  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

// Parts: 0 the embeddings (token and position, and their dropout), 1..layers the blocks,
// layers + 1 the final LayerNorm with the head. The head is the token embedding's weight:
// a stage that holds the head but not the embeddings keeps its own copy of wte.
class Gpt : public Network {
 public:
  Gpt(const ModelConfig& cfg, const ModelContext& ctx) : dropout_(cfg.dropout) {
    const int64_t parts = cfg.layers + 2;
    auto count = [](const nn::Module& m) {
      int64_t n = 0;
      for (const auto& p : m.parameters()) n += p.numel();
      return n;
    };
    sizes_.assign(size_t(parts), 0);
    embeddings_ = ctx.holds(0, parts), head_ = ctx.holds(parts - 1, parts);
    if (embeddings_ || head_)
      wte = register_module("wte", VocabParallelEmbedding(cfg.vocab, cfg.dim, ctx.tensor, ctx.options));
    if (embeddings_) {
      wpe = register_module("wpe", Embedding(cfg.seq_len, cfg.dim, ctx.options));
      sizes_[0] = count(*wte) + count(*wpe);  // the head's weight is counted here
    }
    h = register_module("h", std::make_shared<nn::Module>());
    for (int64_t i = 0; i < cfg.layers; ++i) {
      if (!ctx.holds(i + 1, parts)) continue;
      blocks_.push_back(h->register_module(std::to_string(i), Block(cfg, ctx, i)));
      sizes_[size_t(i + 1)] = count(*blocks_.back());
    }
    if (head_) {
      ln_f = register_module("ln_f", LayerNorm(cfg.dim, ctx.options));
      sizes_.back() = count(*ln_f);
    }
  }

  // Token ids [batch, seq] (or, past the first stage, hidden states [batch, seq, dim]) ->
  // next-token logits [batch, seq, vocab / T], this tensor rank's part of the vocabulary
  // (or, before the last stage, hidden states).
  torch::Tensor forward(const torch::Tensor& in) override {
    torch::Tensor x = in;
    if (embeddings_) {
      auto pos = torch::arange(in.size(1), torch::dtype(torch::kInt64).device(in.device()));
      x = with({wte.get(), wpe.get()}, [&] { return wte->forward(in) + wpe->forward(pos); });
      if (is_training() && dropout_ > 0) x = seeded_dropout(x, dropout_, dropout_site("drop"));
    }
    // Recompute: a block keeps only its input (which must be part of the graph) and runs
    // again in backward.
    const bool again = recompute_ && is_training() && torch::GradMode::is_enabled();
    for (auto& block : blocks_)
      x = with({block.get()}, [&] {
        return again && x.requires_grad() ? recompute(*block, x) : block->forward(x);
      });
    if (!head_) return x;
    // The head is the embedding, tied.
    return with({ln_f.get(), wte.get()}, [&] { return wte->logits(ln_f->forward(x)); });
  }

  std::vector<const torch::nn::Module*> units() const override {
    std::vector<const torch::nn::Module*> out;
    if (wte) out.push_back(wte.get());
    if (wpe) out.push_back(wpe.get());
    for (const auto& block : blocks_) out.push_back(block.get());
    if (ln_f) out.push_back(ln_f.get());
    return out;
  }

  std::vector<Modules> uses() const override {
    std::vector<Modules> out;
    if (embeddings_) out.push_back({wte.get(), wpe.get()});
    for (const auto& block : blocks_) out.push_back({block.get()});
    if (head_) out.push_back({ln_f.get(), wte.get()});
    return out;
  }

  std::vector<int64_t> part_params() const override { return sizes_; }

  std::vector<std::string> tied_parameters() const override { return {"wte.weight"}; }
  void recompute_blocks(bool on) override { recompute_ = on; }

  VocabParallelEmbedding wte{nullptr};
  Embedding wpe{nullptr};
  std::shared_ptr<nn::Module> h;
  LayerNorm ln_f{nullptr};

 private:
  double dropout_;
  std::vector<Block> blocks_;  // the held ones, in order
  bool embeddings_ = true, head_ = true, recompute_ = false;
  std::vector<int64_t> sizes_;  // each part's parameters (the held ones')
};

int64_t gpt_parts(const ModelConfig& cfg) { return cfg.layers + 2; }
void validate_gpt(const ModelConfig& cfg, const ParallelDims& dims) {
  auto need = [](bool ok, const char* key, const std::string& rule) {
    if (!ok) throw ConfigError(fmt::format("{}: {}", key, rule));
  };
  need(cfg.layers >= 1, "model.layers", fmt::format("must be >= 1 (got {})", cfg.layers));
  need(cfg.heads >= 1, "model.heads", fmt::format("must be >= 1 (got {})", cfg.heads));
  need(cfg.dim >= 1 && cfg.dim % cfg.heads == 0, "model.dim",
       fmt::format("{} must be a positive multiple of model.heads ({})", cfg.dim, cfg.heads));
  need(cfg.vocab >= 2, "model.vocab", fmt::format("must be >= 2 (got {})", cfg.vocab));
  need(cfg.seq_len >= 1 && cfg.seq_len <= kMaxSeqLen, "model.seq_len",
       fmt::format("must be between 1 and {} (got {})", kMaxSeqLen, cfg.seq_len));
  // Far past any model that fits a machine; the memory check (train.memory_check) says
  // what does not fit. These keep the size arithmetic in range.
  need(cfg.layers <= (1 << 16), "model.layers", fmt::format("must be <= 65536 (got {})", cfg.layers));
  need(cfg.dim <= (1 << 20), "model.dim", fmt::format("must be <= 1048576 (got {})", cfg.dim));
  need(cfg.vocab <= (int64_t(1) << 31), "model.vocab",
       fmt::format("must be <= 2147483648 (got {})", cfg.vocab));
  need(cfg.dropout >= 0 && cfg.dropout < 1, "model.dropout",
       fmt::format("must be in [0, 1) (got {})", cfg.dropout));
  need(cfg.vocab % dims.tensor == 0, "model.vocab",
       fmt::format("{} does not split over parallel.tensor {} (pad it: GPT-2 uses 50304 for "
                   "50257)", cfg.vocab, dims.tensor));
  need(cfg.heads % dims.tensor == 0, "model.heads",
       fmt::format("{} heads do not split over parallel.tensor {}", cfg.heads, dims.tensor));
}

void gpt_fits(const ModelConfig& cfg, const ModelContext& ctx) {
  fail_if<ConfigError>(ctx.vocab == 0, "model.arch: gpt needs token data (data.dataset: text, tokens or "
                       "synthetic_tokens)");
  fail_if<ConfigError>(ctx.vocab > cfg.vocab, "model.vocab: {} is smaller than the data's {} "
                       "token values", cfg.vocab, ctx.vocab);
  fail_if<ConfigError>(ctx.sample_shape.at(0) > cfg.seq_len, "data.seq_len: windows of {} tokens "
                       "exceed model.seq_len {}", ctx.sample_shape[0], cfg.seq_len);
}

NetworkPtr build_gpt(const ModelConfig& cfg, const ModelContext& ctx) {
  gpt_fits(cfg, ctx);
  return std::make_shared<Gpt>(cfg, ctx);
}

// GPT-2's initialisation, by name.
InitRule gpt_init(int64_t layers) {
  const double proj_std = 0.02 / std::sqrt(2.0 * double(layers));
  return [proj_std](const std::string& name, const std::vector<int64_t>& shape, const ShapeOf&) {
    if (shape.size() == 1) return Init::constant(ends_with(name, ".weight") ? 1 : 0);
    return Init::normal(ends_with(name, ".c_proj.weight") ? proj_std : 0.02);
  };
}

// Per window of s tokens. A block runs 24 s h^2 + 4 s^2 h flops (its matmuls and the
// scores, causal or not, as MFU counts them); over T tensor ranks each holds 1/T of its
// heads and MLP and all-reduces its attention's and MLP's outputs in forward, its two
// inputs' gradients in backward. The embeddings all-reduce their sum (vocabulary-parallel);
// the head all-reduces three numbers per token for the loss. What each part keeps for
// backward is counted below, tensor by tensor, as the test (tests/unit/models/
// test_activations.cpp) measures it with LibTorch's allocator.
// A GPT's sizes as its cost sheets take them, per window of s tokens over t tensor ranks.
struct GptShape {
  double d, v, t, s, a;  // width, vocabulary, tensor ranks, window, heads
  bool split, dropout, fused, cuda;
  GptShape(const ModelConfig& m, const SizeContext& ctx)
      : d(double(m.dim)), v(double(m.vocab)), t(double(ctx.tensor)),
        s(ctx.sample_shape.empty() ? double(m.seq_len) : double(ctx.sample_shape[0])),
        a(double(m.heads)), split(ctx.tensor > 1), dropout(m.dropout > 0),
        fused(m.dropout <= 0),  // as Attention::forward takes it
        cuda(ctx.cuda) {}
};

PartCost gpt_embeddings_cost(const GptShape& g) {
  const double d = g.d, s = g.s;
  const bool split = g.split, dropout = g.dropout;
  PartCost embeddings;
  // Their sum (fp32 under autocast too), with a dropout its mask and output instead; split
  // by vocabulary, which ids are this rank's (1 byte each) and their local ids (8).
  embeddings.activation_bytes = embeddings.activation_bytes_16 = 4 * (dropout ? 2 : 1) * s * d + (split ? 9 * s : 0);
  embeddings.flops = s * d;
  embeddings.reduced = split ? s * d : 0;
  embeddings.reductions = split ? 1 : 0;
  embeddings.output = s * d;
  embeddings.matmuls = 0;
  embeddings.kernels = 4 + (dropout ? kDropoutKernels : 0);  // the positions, two lookups, their sum; its dropout
  // The tokens' lookup and the sum (the positions' once a micro-batch); a dropout's mask
  // and product. Split by vocabulary: the ids' mask (two comparisons, their and, its
  // negation twice), their local ids (a difference, zeroed where another rank's), the
  // zeroed rows and the sum's copy for its all-reduce; backward the zeroed rows' gradient.
  // Backward's weight gradients are the embeddings' size, once a micro-batch.
  embeddings.values.plain = 2 * s * d + (dropout ? 2 * s * d : 0) + (split ? 7 * s + 2 * s * d : 0);
  embeddings.values_back.plain = (dropout ? s * d : 0) + (split ? s * d : 0);
  return embeddings;
}

PartCost gpt_block_cost(const GptShape& g) {
  const double d = g.d, t = g.t, s = g.s, a = g.a;
  const bool split = g.split, dropout = g.dropout, fused = g.fused;
  PartCost block;
  // What a block keeps, with `low` bytes a value where products write (4 in fp32, 2 under
  // 16-bit autocast; the residual stream and the layer norms stay fp32): whole on each
  // tensor rank, the first layer norm's output (its cast), the second's input and output
  // (cast), the block's output; this rank's share of q, k and v, of attention's output
  // (heads side by side) and of the MLP's hidden layer before and after GELU; attention's
  // weights, or with the fused kernel its rows' log-sum-exp (fp32; its output, laid out
  // heads side by side, is the one counted); the layer norms' means and deviations. A
  // dropout keeps its mask, and the attention weights' output too (the residual ones'
  // outputs are only summed). On a GPU, CUDA's autocast keeps softmax's output in fp32
  // (PyTorch's fp32_set_opt_dtype list; the CPU's runs it in 16 bits): the weights, their
  // mask and, for the product with v, a 16-bit copy of them (or of their dropout's output).
  auto block_bytes = [&](double low) {
    double b = (8 + 2 * low) * s * d + 12 * low * s * d / t + 16 * s;
    if (fused) {
      b += 4 * a * s / t;
    } else {
      const double weights = g.cuda ? 4 : low;
      const double copy = weights != low || dropout ? low : 0;
      b += (weights + (dropout ? weights : 0) + copy) * a * s * s / t;
    }
    if (dropout) b += 2 * low * s * d;
    return b;
  };
  block.activation_bytes = block_bytes(4);
  block.activation_bytes_16 = block_bytes(2);
  block.backward_bytes = 4 * s * d + 16 * s * d / t;  // its input's gradient, the MLP's hidden one's
  block.flops = (24 * s * d * d + 4 * s * s * d) / t;
  block.reduced = block.reduced_back = split ? 2 * s * d : 0;
  block.reductions = block.reductions_back = split ? 2 : 0;  // attention's and the MLP's
  block.output = s * d;
  block.matmuls = 4;  // Q K V, the projection, the MLP's two: each with a side of d / T or more
  block.side = d / t;
  block.small_flops = 4 * s * s * d / t;  // the scores and their weighting of V, head by head
  // [s, d/heads] x [d/heads, s] and back: the profile's batched products have their long
  // sides at 4x the short one (s = 4 d/heads in gpt_text; GPT-2's 1024 tokens are 16x).
  block.small_side = std::min(s, d / a);
  block.block = true;
  // Two layer norms, four products, attention (fused: one; else the scores, their scale,
  // the causal mask made and applied, softmax and weighting, and the heads' layout copies),
  // GELU, two residual sums; three dropouts. Under autocast the products' weights and biases
  // cast, and their inputs from the layer norms.
  block.kernels = fused ? 10 : 20 + (dropout ? 3 * kDropoutKernels : 0);
  block.casts = 10;
  // Forward: the layer norms (with their statistics), the residual sums; GELU; unfused,
  // the copies of q, k, v and attention's output into and out of the heads' layout, the
  // scores' scale and mask, softmax (the fused kernel's work is its products'); a
  // dropout's mask and product each (the weights' and the two residual ones); under
  // autocast the layer norms' outputs cast; split, each row-parallel product's copy for
  // its all-reduce and its bias added after it. Backward: the layer norms', the residual
  // sums, the q, k, v gradients joined; GELU's; unfused, the layout copies back, softmax's,
  // the mask's and the scale's; the dropouts' products; under autocast four gradients
  // cast; split, each column-parallel product's input gradient copied for its all-reduce.
  // With one head on a rank, its q, k, v and output in the heads' layout are views: no
  // copies.
  const double scores = a * s * s / t;
  const double layout = a / t > 1 ? 1 : 0;
  block.values.plain = 2 * (s * d + 2 * s) + 2 * s * d + (fused ? 0 : layout * 4 * s * d / t + 2 * scores) +
                       (dropout ? 2 * (scores + 2 * s * d) : 0) + (split ? 4 * s * d : 0);
  block.values.transcendental = 4 * s * d / t + (fused ? 0 : scores);
  block.values.casts_16 = 2 * s * d;
  block.values_back.plain = 4 * s * d + 3 * s * d / t + (fused ? 0 : layout * 3 * s * d / t + 3 * scores) +
                            (dropout ? scores + 2 * s * d : 0) + (split ? 2 * s * d : 0);
  block.values_back.transcendental = 4 * s * d / t;
  block.values_back.casts_16 = 4 * s * d;
  return block;
}

PartCost gpt_head_cost(const GptShape& g) {
  const double d = g.d, v = g.v, t = g.t, s = g.s;
  const bool split = g.split;
  PartCost head;
  // The layer norm's output (cast under autocast) and statistics, the logits (16-bit under
  // autocast) and their log-softmax (fp32); backward holds the gradients of both at once.
  head.activation_bytes = 4 * s * d + 8 * s + 8 * s * v / t;
  head.activation_bytes_16 = 2 * s * d + 8 * s + 6 * s * v / t;
  head.backward_bytes = 8 * s * v / t;
  head.weight_copy_16 = 2 * v * d / t;  // the tied embedding's, held in fp32 for the lookup
  head.flops = 2 * s * d * v / t;
  head.reduced = split ? 3 * s : 0;
  head.reduced_back = split ? s * d : 0;
  head.reductions = split ? 3 : 0;  // the rows' maxima, the picks, the sums of exponentials
  head.reductions_back = split ? 1 : 0;
  // The layer norm, the product, the log-softmax, the loss and its mean; under autocast
  // the normed input and the tied weight cast, and the logits back to fp32.
  head.kernels = 5;
  head.casts = 3;
  // The layer norm (and its statistics), the loss's picks; the log-softmax; under autocast
  // the normed input cast and the logits back. Backward: the loss's mean and picks, the
  // layer norm's; the log-softmax's; under autocast the same two casts. Split by
  // vocabulary, the loss is Megatron's (layers/vocab_parallel.cpp): the rows' maxima (and
  // their indices), the logits shifted by them, the targets' mask and local ids (as the
  // embeddings'), the picks (gathered, zeroed), the exponentials, their sums, the softmax
  // (divided in place), the sums' log and the loss; backward the softmax copied, the
  // targets' mask cast and negated, added at the targets, scaled, the input gradient's
  // copy for its all-reduce, and the layer norm's.
  if (split) {
    head.values.plain = s * d + 2 * s + 2 * s + 2 * s * v / t + 6 * s + 3 * s + s + s;
    head.values.transcendental = s * v / t + s;
    head.values_back.plain = 3 * s + 3 * s * v / t + 2 * s * d;
  } else {
    head.values.plain = s * d + 2 * s + s;
    head.values.transcendental = s * v;
    head.values_back.plain = s + s * v + s * d;
    head.values_back.transcendental = s * v;
  }
  head.values.casts_16 = s * d + s * v / t;
  head.values_back.casts_16 = s * d + s * v / t;
  return head;
}

std::vector<PartCost> gpt_costs(const ModelConfig& m, const SizeContext& ctx) {
  const GptShape g(m, ctx);
  std::vector<PartCost> parts{gpt_embeddings_cost(g)};
  parts.insert(parts.end(), size_t(m.layers), gpt_block_cost(g));
  parts.push_back(gpt_head_cost(g));
  return parts;
}

}  // namespace

ModelSpec gpt_spec() {
  ModelSpec s;
  s.task = &language_model_task();
  s.validate = validate_gpt;
  s.build = build_gpt;
  s.parts = gpt_parts;
  s.init = [](const ModelConfig& cfg) { return gpt_init(cfg.layers); };
  s.costs = gpt_costs;
  s.blocks = true;
  s.fits = gpt_fits;
  return s;
}

}  // namespace dtrain
