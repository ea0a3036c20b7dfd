// FlatParams and the flat-buffer optimizers, checked step by step against LibTorch's own
// torch::optim::SGD and torch::optim::AdamW on a cloned model.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "config/config.hpp"
#include "parallel/flat_params.hpp"
#include "comm/comm.hpp"
#include "optim/clip.hpp"
#include "optim/optimizer.hpp"
#include "util/error.hpp"

namespace unit_optim_optimizer {

using namespace dtrain;

namespace {

torch::nn::Sequential small_model(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 3));
}

torch::nn::Sequential clone_of(const torch::nn::Sequential& m) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m->clone()));
}

struct Data {
  std::vector<torch::Tensor> x, t;
};
Data make_data(int steps) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2024);
  Data d;
  for (int i = 0; i < steps; ++i) {
    d.x.push_back(at::randn({8, 6}, gen));
    d.t.push_back(at::randn({8, 3}, gen));
  }
  return d;
}

torch::Tensor loss_of(torch::nn::Sequential& m, const torch::Tensor& x, const torch::Tensor& t) {
  return torch::mse_loss(m->forward(x), t);
}

double max_param_diff(const torch::nn::Sequential& a, const torch::nn::Sequential& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  REQUIRE(pa.size() == pb.size());
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    REQUIRE(pa[i].key() == pb[i].key());
    worst = std::max(worst, (pa[i].value() - pb[i].value()).abs().max().item<double>());
  }
  return worst;
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

const double kLrs[] = {0.1, 0.05, 0.2, 0.08, 0.12, 0.1, 0.07};

// An update rule to check: SGD (momentum, Nesterov) or AdamW, with weight decay.
struct Kind {
  const char* name;
  double momentum;
  bool nesterov;
  OptimizerConfig config(double weight_decay) const {
    OptimizerConfig cfg;
    cfg.name = name, cfg.momentum = momentum, cfg.nesterov = nesterov;
    cfg.weight_decay = weight_decay;
    return cfg;
  }
};

// Steps dtrain's optimizer (over FlatParams) and a LibTorch reference in lockstep.
void check_against_reference(torch::optim::Optimizer& ref_opt, torch::nn::Sequential& model,
                             torch::nn::Sequential& ref, FlatParams& flat, Optimizer& opt) {
  auto data = make_data(5);
  for (int step = 0; step < 5; ++step) {
    CAPTURE(step);
    flat.zero_grad();
    loss_of(model, data.x[step], data.t[step]).backward();
    opt.step(kLrs[step]);

    ref_opt.zero_grad();
    loss_of(ref, data.x[step], data.t[step]).backward();
    set_lr(ref_opt, kLrs[step]);
    ref_opt.step();

    CHECK(max_param_diff(model, ref) < 1e-6);
  }
  // ... and the parameters did move.
  CHECK(max_param_diff(model, small_model(1)) > 1e-3);
}

}  // namespace

TEST_CASE("flat params: parameters are views of data(), gradients land in grad()") {
  auto model = small_model(1);
  auto ref = clone_of(model);
  FlatParams flat(*model);

  // Entries in module order, packed back to back.
  const auto& e = flat.entries();
  REQUIRE(e.size() == 4);
  CHECK(e[0].name == "0.weight");
  CHECK(e[1].name == "0.bias");
  CHECK(e[2].name == "2.weight");
  CHECK(e[3].name == "2.bias");
  CHECK(e[0].offset == 0);
  CHECK(e[1].offset == 30);
  CHECK(e[2].offset == 35);
  CHECK(e[3].offset == 50);
  CHECK(flat.data().numel() == 53);
  CHECK(flat.grad().numel() == 53);
  CHECK(e[2].shape == std::vector<int64_t>{3, 5});

  // Values preserved.
  CHECK(max_param_diff(model, ref) == 0);
  auto params = model->parameters();
  CHECK(torch::equal(flat.view(flat.data(), 2), params[2]));

  // Writing data() writes the parameters, and the other way round.
  {
    torch::NoGradGuard no_grad;
    flat.data()[31] = 42.0f;  // 0.bias[1]
    CHECK(params[1][1].item<float>() == 42.0f);
    params[3].fill_(-7.0f);
    CHECK(torch::equal(flat.data().narrow(0, 50, 3), torch::full({3}, -7.0f)));
    flat.data().copy_(torch::cat({ref->parameters()[0].flatten(), ref->parameters()[1].flatten(),
                                  ref->parameters()[2].flatten(), ref->parameters()[3].flatten()}));
  }
  CHECK(max_param_diff(model, ref) == 0);

  // backward() accumulates into grad(): compare with plain autograd on the clone.
  auto x = torch::randn({4, 6}), t = torch::randn({4, 3});
  CHECK(flat.grad().abs().sum().item<double>() == 0);
  loss_of(model, x, t).backward();
  loss_of(ref, x, t).backward();
  std::vector<torch::Tensor> ref_grads;
  for (auto& p : ref->parameters()) ref_grads.push_back(p.grad().flatten());
  auto want = torch::cat(ref_grads);
  CHECK(torch::allclose(flat.grad(), want, /*rtol=*/1e-6, /*atol=*/1e-7));
  CHECK(flat.grad().abs().sum().item<double>() > 0);
  for (size_t i = 0; i < params.size(); ++i)
    CHECK(params[i].grad().data_ptr() == flat.view(flat.grad(), i).data_ptr());

  loss_of(model, x, t).backward();  // a second backward adds to the first
  CHECK(torch::allclose(flat.grad(), 2 * want, 1e-6, 1e-7));

  flat.zero_grad();
  CHECK(flat.grad().abs().sum().item<double>() == 0);
  loss_of(model, x, t).backward();  // still wired after zeroing
  CHECK(torch::allclose(flat.grad(), want, 1e-6, 1e-7));
}

// Each update rule against torch::optim's own, step by step (decay_1d: torch::optim decays
// every parameter).
TEST_CASE("optimizer: sgd (plain, momentum, nesterov) and adamw match torch::optim") {
  struct Rule {
    const char* what;
    std::function<void(OptimizerConfig&)> set;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> ref;
  };
  using torch::optim::SGDOptions;
  const std::vector<Rule> rules{
      {"sgd, momentum and weight decay",
       [](OptimizerConfig& c) { c.name = "sgd", c.momentum = 0.9, c.weight_decay = 0.01, c.decay_1d = true; },
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(p, SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
       }},
      {"sgd nesterov",
       [](OptimizerConfig& c) {
         c.name = "sgd", c.momentum = 0.9, c.nesterov = true, c.weight_decay = 0.01, c.decay_1d = true;
       },
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(
             p, SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01));
       }},
      {"plain sgd (no momentum)", [](OptimizerConfig& c) { c.name = "sgd", c.momentum = 0; },
       [](std::vector<torch::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, SGDOptions(0.1)); }},
      {"adamw with weight decay",
       [](OptimizerConfig& c) {
         c.name = "adamw", c.weight_decay = 0.01, c.decay_1d = true, c.beta1 = 0.9, c.beta2 = 0.999,
         c.eps = 1e-8;
       },
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(0.1).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01));
       }},
  };
  for (const auto& rule : rules) {
    CAPTURE(rule.what);
    OptimizerConfig cfg;
    rule.set(cfg);
    auto model = small_model(1);
    auto ref = clone_of(model);
    FlatParams flat(*model);
    auto opt = make_optimizer(cfg, flat);
    auto ref_opt = rule.ref(ref->parameters());
    check_against_reference(*ref_opt, model, ref, flat, *opt);
  }
}

TEST_CASE("optimizer: saved state restored into a fresh optimizer continues identically") {
  for (const char* name : {"sgd", "adamw"}) {
    CAPTURE(name);
    OptimizerConfig cfg;
    cfg.name = name;
    cfg.weight_decay = 0.01;
    cfg.decay_1d = true;
    auto data = make_data(7);

    auto a = small_model(1);
    FlatParams fa(*a);
    auto opt_a = make_optimizer(cfg, fa);
    for (int s = 0; s < 3; ++s) {
      fa.zero_grad();
      loss_of(a, data.x[s], data.t[s]).backward();
      opt_a->step(kLrs[s]);
    }

    PartsOf parts;
    RangesOf ranges;
    const NamedTensors state = optimizer_state(*opt_a, fa, /*tensor_rank=*/0, parts, ranges);
    CHECK(parts.empty());  // nothing split on one process
    CHECK(ranges.empty());  // nor sharded
    bool has_steps = false;
    for (const auto& [n, t] : state) {
      if (n == "steps") has_steps = true;
      CHECK(t.defined());
    }
    CHECK(has_steps);
    for (const std::string& slot : cfg.name == "sgd" ? std::vector<std::string>{"momentum_buffer"}
                                                     : std::vector<std::string>{"exp_avg",
                                                                                "exp_avg_sq"}) {
      bool found = false;
      for (const auto& [n, t] : state) found |= n == "2.weight." + slot;
      CHECK_MESSAGE(found, slot);
    }

    // Resumed copy: same parameters, fresh optimizer given the saved state (cloned, as a
    // checkpoint would hold it).
    auto b = clone_of(a);
    FlatParams fb(*b);
    auto opt_b = make_optimizer(cfg, fb);
    NamedTensors saved;
    for (const auto& [n, t] : state) saved.emplace_back(n, t.clone());
    load_optimizer_state(*opt_b, fb, saved, 0, "test");
    // Control: the same parameters with a fresh optimizer and no state.
    auto c = clone_of(a);
    FlatParams fc(*c);
    auto opt_c = make_optimizer(cfg, fc);

    for (int s = 3; s < 7; ++s) {
      for (auto* run : {&a, &b, &c}) {
        FlatParams* f = run == &a ? &fa : run == &b ? &fb : &fc;
        Optimizer* o = run == &a ? opt_a.get() : run == &b ? opt_b.get() : opt_c.get();
        f->zero_grad();
        loss_of(*run, data.x[s], data.t[s]).backward();
        o->step(kLrs[s]);
      }
    }
    CHECK((fa.data() - fb.data()).abs().max().item<double>() < 1e-6);
    CHECK((fa.data() - fc.data()).abs().max().item<double>() > 1e-4);  // the state mattered

    // load_state rejects missing or misshapen tensors.
    auto d = clone_of(a);
    FlatParams fd(*d);
    auto opt_d = make_optimizer(cfg, fd);
    NamedTensors missing;
    for (const auto& [n, t] : saved)
      if (n.rfind("0.bias.", 0) != 0) missing.emplace_back(n, t);
    CHECK_THROWS_AS(load_optimizer_state(*opt_d, fd, missing, 0, "test"), CheckpointError);
    NamedTensors misshapen;
    for (const auto& [n, t] : saved)
      misshapen.emplace_back(n, n.rfind("0.bias.", 0) == 0 ? torch::zeros({4}) : t);
    CHECK_THROWS_AS(load_optimizer_state(*opt_d, fd, misshapen, 0, "test"), CheckpointError);
    NamedTensors no_steps;
    for (const auto& [n, t] : saved)
      if (n != "steps") no_steps.emplace_back(n, t);
    CHECK_THROWS_AS(load_optimizer_state(*opt_d, fd, no_steps, 0, "test"), CheckpointError);
  }
}

TEST_CASE("optimizer: an unknown name is a ConfigError") {
  auto model = small_model(1);
  FlatParams flat(*model);
  OptimizerConfig cfg;
  cfg.name = "lamb";
  CHECK_THROWS_AS(make_optimizer(cfg, flat), ConfigError);
}

TEST_CASE("flat params: channels-last conv weights are views of the buffer and compute the same") {
  torch::manual_seed(5);
  torch::nn::Sequential plain(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                              torch::nn::ReLU(), torch::nn::Conv2d(8, 4, 3));
  auto flat_model = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(plain->clone());
  FlatOptions channels_last;
  channels_last.format = torch::MemoryFormat::ChannelsLast;
  dtrain::FlatParams flat(*flat_model, channels_last);
  auto w = flat_model->named_parameters()["0.weight"];
  CHECK(w.is_contiguous(torch::MemoryFormat::ChannelsLast));
  CHECK(!w.is_contiguous());
  CHECK(w.data_ptr<float>() == flat.data().data_ptr<float>());  // the first slot of the buffer
  auto x = torch::randn({2, 3, 6, 6});
  CHECK(torch::allclose(plain->forward(x), flat_model->forward(x.contiguous(torch::MemoryFormat::ChannelsLast)),
                        1e-5, 1e-6));
  // Gradients land in the flat gradient buffer in the same layout.
  flat_model->forward(x).sum().backward();
  plain->forward(x).sum().backward();
  auto g = flat.view(flat.grad(), 0);
  CHECK(torch::allclose(g, plain->named_parameters()["0.weight"].grad(), 1e-5, 1e-6));
  CHECK(flat_model->named_parameters()["0.weight"].grad().data_ptr<float>() == flat.grad().data_ptr<float>());
}

namespace {
// torch::optim with two parameter groups: weights decayed, biases not.
std::vector<torch::optim::OptimizerParamGroup> groups(torch::nn::Sequential& m,
                                                      std::unique_ptr<torch::optim::OptimizerOptions> decayed,
                                                      std::unique_ptr<torch::optim::OptimizerOptions> plain) {
  std::vector<torch::Tensor> weights, biases;
  for (auto& p : m->parameters()) (p.dim() >= 2 ? weights : biases).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> out;
  out.emplace_back(weights, std::move(decayed));
  out.emplace_back(biases, std::move(plain));
  return out;
}

// torch::optim's counterpart of `cfg` (lr 0.1) over `ref`: weights decay, biases do not.
std::unique_ptr<torch::optim::Optimizer> reference_for(const OptimizerConfig& cfg, torch::nn::Sequential& ref) {
  using namespace torch::optim;
  if (cfg.name == "sgd") {
    auto sgd = SGDOptions(0.1).momentum(cfg.momentum).nesterov(cfg.nesterov);
    return std::make_unique<SGD>(groups(ref, std::make_unique<SGDOptions>(SGDOptions(sgd).weight_decay(cfg.weight_decay)),
                                        std::make_unique<SGDOptions>(sgd)),
                                 SGDOptions(0.1));
  }
  return std::make_unique<AdamW>(groups(ref, std::make_unique<AdamWOptions>(AdamWOptions(0.1).weight_decay(cfg.weight_decay)),
                                        std::make_unique<AdamWOptions>(AdamWOptions(0.1).weight_decay(0))),
                                 AdamWOptions(0.1));
}
}  // namespace

TEST_CASE("optimizer: by default weight decay spares 1-D parameters (biases, norm gains)") {
  for (const char* name : {"sgd", "adamw"}) {
    CAPTURE(name);
    OptimizerConfig cfg;
    cfg.name = name;
    cfg.weight_decay = 0.05;
    CHECK(!cfg.decay_1d);
    CHECK(decays(cfg, {5, 6}));
    CHECK(!decays(cfg, {5}));
    auto model = small_model(1);
    auto ref = clone_of(model);
    FlatParams flat(*model);
    auto opt = make_optimizer(cfg, flat);
    check_against_reference(*reference_for(cfg, ref), model, ref, flat, *opt);
  }
}

TEST_CASE("optimizer: two optimizers over the two halves of the buffer equal one over all") {
  for (const char* name : {"sgd", "adamw"}) {
    CAPTURE(name);
    OptimizerConfig cfg;
    cfg.name = name;
    cfg.weight_decay = 0.01;
    auto whole_model = small_model(1);
    auto split_model = clone_of(whole_model);
    FlatParams whole(*whole_model), split(*split_model);
    auto one = make_optimizer(cfg, whole);
    // A boundary inside a parameter (0.weight holds 30 values), as a ZeRO shard may have.
    auto low = make_optimizer(cfg, split, Shard{0, 17});
    auto high = make_optimizer(cfg, split, Shard{17, -1});
    CHECK(low->slots()[0].second.numel() == 17);
    CHECK(high->slots()[0].second.numel() == 53 - 17);
    auto data = make_data(4);
    for (int s = 0; s < 4; ++s) {
      whole.zero_grad();
      split.zero_grad();
      loss_of(whole_model, data.x[s], data.t[s]).backward();
      loss_of(split_model, data.x[s], data.t[s]).backward();
      one->step(kLrs[s]);
      low->step(kLrs[s]);
      high->step(kLrs[s]);
      CHECK(torch::equal(whole.data(), split.data()));
    }
  }
}

TEST_CASE("flat params: a parameter registered twice (tied weights) is one entry, trained once") {
  // A weight that a submodule registers again under its own name (an LM head tied to the
  // token embedding, registered in both places).
  struct Head : torch::nn::Module {
    explicit Head(const torch::Tensor& w) { weight = register_parameter("weight", w); }
    torch::Tensor weight;
  };
  struct Tied : torch::nn::Module {
    Tied() {
      emb = register_module("emb", torch::nn::Embedding(7, 4));
      head = register_module("head", std::make_shared<Head>(emb->weight));
    }
    torch::Tensor forward(const torch::Tensor& idx) {
      return torch::nn::functional::linear(emb->forward(idx), head->weight);
    }
    torch::nn::Embedding emb{nullptr};
    std::shared_ptr<Head> head;
  };
  auto m = std::make_shared<Tied>();
  REQUIRE(m->named_parameters().size() == 2);
  CHECK(m->named_parameters()["emb.weight"].unsafeGetTensorImpl() ==
        m->named_parameters()["head.weight"].unsafeGetTensorImpl());
  FlatParams flat(*m);
  REQUIRE(flat.entries().size() == 1);
  CHECK(flat.entries()[0].name == "emb.weight");
  CHECK(flat.data().numel() == 28);
  // Both uses accumulate into the one gradient slot.
  auto idx = torch::tensor({1, 3}, torch::kInt64);
  m->forward(idx).pow(2).sum().backward();
  CHECK(flat.grad().abs().sum().item<double>() > 0);
  CHECK(m->head->weight.grad().data_ptr() == flat.grad().data_ptr());
  // An optimizer step moves the shared weight once, seen through both names.
  OptimizerConfig cfg;
  cfg.momentum = 0;
  auto before = flat.data().clone();
  make_optimizer(cfg, flat)->step(0.5);
  CHECK(torch::allclose(flat.data(), before - 0.5 * flat.grad()));
  CHECK(torch::equal(m->emb->weight, m->head->weight));
  CHECK(m->emb->weight.data_ptr() == flat.data().data_ptr());
}

TEST_CASE("optimizer: the gradient's norm goes a piece at a time: at most 64, of 2^20 values or more") {
  constexpr int64_t kMi = int64_t(1) << 20;
  CHECK(update_piece(0) == 1);
  CHECK(update_piece(53) == 53);
  CHECK(update_piece(kMi + 1) == kMi);
  CHECK(update_piece(64 * kMi) == kMi);
  CHECK(update_piece(64 * kMi + 1) == 2 * kMi);
  CHECK(update_piece(1000 * kMi) == 16 * kMi);
}

TEST_CASE("optimizer: a shard of several pieces updates as torch::optim does, and as its halves do") {
  // 1.06M parameters: two pieces, the boundary inside the first weight, and the biases
  // (spared by weight decay) between runs that decay.
  auto big = [](uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(6, 1030), torch::nn::Tanh(),
                                 torch::nn::Linear(1030, 1024), torch::nn::Tanh(), torch::nn::Linear(1024, 3));
  };
  const Kind kinds[] = {{"sgd", 0.9, false}, {"sgd", 0.9, true}, {"adamw", 0, false}};
  for (const auto& kind : kinds) {
    CAPTURE(kind.name);
    CAPTURE(kind.nesterov);
    const OptimizerConfig cfg = kind.config(0.05);
    auto model = big(3);
    auto ref = clone_of(model), split_model = clone_of(model);
    FlatParams flat(*model), split(*split_model);
    REQUIRE(flat.numel() > update_piece(flat.numel()));
    auto opt = make_optimizer(cfg, flat);
    // Halves cut inside the first piece and inside a weight.
    auto low = make_optimizer(cfg, split, Shard{0, 700001});
    auto high = make_optimizer(cfg, split, Shard{700001, -1});
    auto ref_opt = reference_for(cfg, ref);
    auto data = make_data(3);
    for (int s = 0; s < 3; ++s) {
      CAPTURE(s);
      flat.zero_grad(), split.zero_grad(), ref_opt->zero_grad();
      loss_of(model, data.x[s], data.t[s]).backward();
      loss_of(split_model, data.x[s], data.t[s]).backward();
      loss_of(ref, data.x[s], data.t[s]).backward();
      opt->step(kLrs[s] / 10), low->step(kLrs[s] / 10), high->step(kLrs[s] / 10);
      set_lr(*ref_opt, kLrs[s] / 10);
      ref_opt->step();
      CHECK(max_param_diff(model, ref) < 1e-6);
      // LibTorch's fused kernel takes each entry's part as a tensor of its own and rounds
      // a few values' last bit differently where a cut falls (seen on 2.15): within 1e-6.
      CHECK((flat.data() - split.data()).abs().max().item<double>() < 1e-6);
    }
    CHECK(max_param_diff(model, big(3)) > 1e-4);
  }
}

TEST_CASE("optimizer: a skip of 1 makes no update at all, even from a NaN gradient") {
  // What train.on_nonfinite: skip needs from the device: the step that `skip` names leaves
  // weights, moments and the step count as they were, and the run goes on as if that
  // gradient had never been seen. (The fused kernels read `skip` on the device.)
  const Kind kinds[] = {{"sgd", 0.9, false}, {"sgd", 0.9, true}, {"sgd", 0.0, false}, {"adamw", 0, false}};
  for (const auto& kind : kinds) {
    CAPTURE(kind.name);
    CAPTURE(kind.momentum);
    CAPTURE(kind.nesterov);
    const OptimizerConfig cfg = kind.config(0.01);  // two decay groups: biases are spared
    auto seen = small_model(1);
    auto never = clone_of(seen);
    FlatParams fs(*seen), fn(*never);
    auto skipping = make_optimizer(cfg, fs), plain = make_optimizer(cfg, fn);
    const auto no = torch::zeros({}, torch::kFloat32), yes = torch::ones({}, torch::kFloat32);
    auto data = make_data(4);
    for (int s = 0; s < 4; ++s) {
      CAPTURE(s);
      fs.zero_grad();
      loss_of(seen, data.x[s], data.t[s]).backward();
      if (s == 0 || s == 2) {  // bad steps (the first too): a NaN in the gradient, skip = 1
        fs.grad()[3] = std::nan("");
        const auto before = fs.data().clone();
        std::vector<torch::Tensor> slots_before;
        for (const auto& [n, t] : skipping->slots()) slots_before.push_back(t.clone());
        skipping->step(kLrs[s], yes);
        CHECK(torch::equal(fs.data(), before));
        for (size_t i = 0; i < slots_before.size(); ++i)
          CHECK(torch::equal(skipping->slots()[i].second, slots_before[i]));
        continue;
      }
      skipping->step(kLrs[s], no);  // skip = 0 is an ordinary step
      fn.zero_grad();
      loss_of(never, data.x[s], data.t[s]).backward();
      plain->step(kLrs[s]);
      CHECK((fs.data() - fn.data()).abs().max().item<double>() < 1e-7);
    }
    auto steps = [](const Optimizer& o) {
      for (const auto& [n, t] : o.scalars())
        if (n == "steps") return t.item<int64_t>();
      return int64_t(-1);
    };
    CHECK(steps(*skipping) == 2);
    CHECK(steps(*plain) == 2);
    CHECK(fs.data().isfinite().all().item<bool>());
  }
}

TEST_CASE("optimizer: over an empty shard it changes nothing and counts steps as the others do") {
  // A ZeRO rank's shard may hold nothing; its checkpoint's step count must still be the
  // other ranks'.
  for (const char* name : {"sgd", "adamw"}) {
    CAPTURE(name);
    OptimizerConfig cfg;
    cfg.name = name;
    auto model = small_model(1);
    FlatParams flat(*model);
    auto opt = make_optimizer(cfg, flat, Shard{flat.numel(), 0});
    CHECK(opt->slots()[0].second.numel() == 0);
    const auto before = flat.data().clone();
    opt->step(0.1);
    opt->step(0.1, torch::ones({}, torch::kFloat32));  // skipped: not counted
    opt->step(0.1, torch::zeros({}, torch::kFloat32));
    CHECK(torch::equal(flat.data(), before));
    CHECK(opt->scalars().at(0).second.item<int64_t>() == 2);
    opt->load_scalars({{"steps", torch::tensor({7}, torch::kInt64)}});
    CHECK(opt->scalars().at(0).second.item<int64_t>() == 7);
  }
}

TEST_CASE("clip_grad: torch's clip_grad_norm_ factor, and fp16's unscaling, in one multiply") {
  auto model = small_model(1);
  FlatParams flat(*model);
  auto local = make_local_comm();
  auto data = make_data(1);
  loss_of(model, data.x[0], data.t[0]).backward();
  const auto g = flat.grad().clone();
  const double n = g.norm().item<double>();
  REQUIRE(n > 0.2);
  // Above the limit: scaled to max_norm / (norm + 1e-6).
  clip_grad(flat, global_grad_norm(flat, *local, *local), 0.1);
  CHECK(flat.grad().norm().item<double>() == doctest::Approx(0.1 * n / (n + 1e-6)).epsilon(1e-6));
  CHECK(torch::allclose(flat.grad(), g * (0.1 / (n + 1e-6)), 1e-6, 1e-9));
  // Below it: unchanged.
  flat.grad().copy_(g);
  clip_grad(flat, global_grad_norm(flat, *local, *local), 10 * n);
  CHECK(torch::allclose(flat.grad(), g, 1e-6, 1e-9));
  // fp16: the gradient holds scale x g; the norm passed is already unscaled.
  flat.grad().copy_(g * 1024);
  clip_grad(flat, global_grad_norm(flat, *local, *local) / 1024, 0.1, 1024);
  CHECK(torch::allclose(flat.grad(), g * (0.1 / (n + 1e-6)), 1e-5, 1e-9));
  // Off, with no norm taken: only the unscaling.
  flat.grad().copy_(g * 1024);
  clip_grad(flat, torch::Tensor(), 0.0, 1024);
  CHECK(torch::allclose(flat.grad(), g, 1e-6, 1e-9));
}

}  // namespace unit_optim_optimizer
