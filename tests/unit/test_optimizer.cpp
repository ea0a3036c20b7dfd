// FlatParams and the flat-buffer optimizers, checked step by step against LibTorch's own
// torch::optim::SGD and torch::optim::AdamW on a cloned model.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "config/config.hpp"
#include "train/flat_params.hpp"
#include "train/optimizer.hpp"
#include "util/error.hpp"

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

TEST_CASE("optimizer: sgd with momentum and weight decay matches torch::optim::SGD") {
  OptimizerConfig cfg;
  cfg.name = "sgd";
  cfg.momentum = 0.9;
  cfg.weight_decay = 0.01;
  auto model = small_model(1);
  auto ref = clone_of(model);
  FlatParams flat(*model);
  auto opt = make_optimizer(cfg, flat);
  torch::optim::SGD ref_opt(ref->parameters(),
                            torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  check_against_reference(ref_opt, model, ref, flat, *opt);
}

TEST_CASE("optimizer: sgd nesterov matches torch::optim::SGD") {
  OptimizerConfig cfg;
  cfg.name = "sgd";
  cfg.momentum = 0.9;
  cfg.nesterov = true;
  cfg.weight_decay = 0.01;
  auto model = small_model(1);
  auto ref = clone_of(model);
  FlatParams flat(*model);
  auto opt = make_optimizer(cfg, flat);
  torch::optim::SGD ref_opt(
      ref->parameters(),
      torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01));
  check_against_reference(ref_opt, model, ref, flat, *opt);
}

TEST_CASE("optimizer: plain sgd (no momentum) matches torch::optim::SGD") {
  OptimizerConfig cfg;
  cfg.name = "sgd";
  cfg.momentum = 0;
  auto model = small_model(1);
  auto ref = clone_of(model);
  FlatParams flat(*model);
  auto opt = make_optimizer(cfg, flat);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  check_against_reference(ref_opt, model, ref, flat, *opt);
}

TEST_CASE("optimizer: adamw with weight decay matches torch::optim::AdamW") {
  OptimizerConfig cfg;
  cfg.name = "adamw";
  cfg.weight_decay = 0.01;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.999;
  cfg.eps = 1e-8;
  auto model = small_model(1);
  auto ref = clone_of(model);
  FlatParams flat(*model);
  auto opt = make_optimizer(cfg, flat);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.1)
                                                     .betas({0.9, 0.999})
                                                     .eps(1e-8)
                                                     .weight_decay(0.01));
  check_against_reference(ref_opt, model, ref, flat, *opt);
}

TEST_CASE("optimizer: state() -> load_state() into a fresh optimizer continues identically") {
  for (const char* name : {"sgd", "adamw"}) {
    CAPTURE(name);
    OptimizerConfig cfg;
    cfg.name = name;
    cfg.weight_decay = 0.01;
    auto data = make_data(7);

    auto a = small_model(1);
    FlatParams fa(*a);
    auto opt_a = make_optimizer(cfg, fa);
    for (int s = 0; s < 3; ++s) {
      fa.zero_grad();
      loss_of(a, data.x[s], data.t[s]).backward();
      opt_a->step(kLrs[s]);
    }

    const NamedTensors state = opt_a->state();
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
    opt_b->load_state(saved);
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
    CHECK_THROWS_AS(opt_d->load_state(missing), CheckpointError);
    NamedTensors misshapen;
    for (const auto& [n, t] : saved)
      misshapen.emplace_back(n, n.rfind("0.bias.", 0) == 0 ? torch::zeros({4}) : t);
    CHECK_THROWS_AS(opt_d->load_state(misshapen), CheckpointError);
    NamedTensors no_steps;
    for (const auto& [n, t] : saved)
      if (n != "steps") no_steps.emplace_back(n, t);
    CHECK_THROWS_AS(opt_d->load_state(no_steps), CheckpointError);
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
  dtrain::FlatParams flat(*flat_model, torch::MemoryFormat::ChannelsLast);
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
