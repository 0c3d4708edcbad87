// FusedAdamW / FusedAdam against LibTorch's AdamW / Adam: the same trajectory to float32 rounding, the
// same state (interchangeable through torch::save/load), LibTorch's arithmetic on the paths the fused
// pass leaves out, and results that do not depend on the number of intra-op threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>

#include "checkpoint/optimizer_state.hpp"
#include "optim/fused_adam_testing.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"

using xlr8::optim::FusedAdam;
using xlr8::optim::FusedAdamW;
namespace fs = std::filesystem;

namespace {

// Parameters that cover every path: odd sizes (vector tail), a large one (split over threads), a
// non-contiguous one and a float64 one (LibTorch's arithmetic), one that never gets a gradient.
std::vector<torch::Tensor> make_parameters() {
  torch::manual_seed(3);
  std::vector<torch::Tensor> ps{torch::randn({37, 13}), torch::randn({100003}), torch::randn({64, 64}),
                                torch::randn({6, 4}).t(), torch::randn({5, 5}, torch::kDouble), torch::randn({4}),
                                torch::randn({21})};
  for (auto& p : ps) p.requires_grad_(true);
  return ps;
}

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) {
    // empty_strided keeps a non-contiguous parameter non-contiguous in the copy.
    auto c = torch::empty_strided(p.sizes(), p.strides(), p.options());
    c.copy_(p);
    out.push_back(c.detach().requires_grad_(true));
  }
  return out;
}

// Groups: [0..2] defaults, [3..4] other hyper-parameters, [6] amsgrad. Parameter 5 never gets a gradient.
template <class Optim, class Options>
Optim make_optimizer(const std::vector<torch::Tensor>& ps, double weight_decay) {
  using Group = torch::optim::OptimizerParamGroup;
  std::vector<Group> groups;
  groups.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1], ps[2], ps[5]});
  groups.emplace_back(std::vector<torch::Tensor>{ps[3], ps[4]},
                      std::make_unique<Options>(Options(5e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0)));
  groups.emplace_back(std::vector<torch::Tensor>{ps[6]},
                      std::make_unique<Options>(Options(2e-3).amsgrad(true).weight_decay(weight_decay)));
  return Optim(groups, Options(1e-3).weight_decay(weight_decay));
}

void give_gradients(std::vector<std::vector<torch::Tensor>*> sets, int step) {
  torch::manual_seed(100 + step);
  auto& first = *sets[0];
  for (std::size_t i = 0; i < first.size(); ++i) {
    if (i == 5) continue;
    auto g = torch::randn(first[i].sizes(), first[i].options().requires_grad(false));
    for (auto* set : sets) (*set)[i].mutable_grad() = g.clone();
  }
}

// Steps [from, to): the same fresh gradients into every run's parameters, then each run's optimizer steps.
using Run = std::pair<std::vector<torch::Tensor>*, torch::optim::Optimizer*>;
void take_steps(const std::vector<Run>& runs, int from, int to) {
  std::vector<std::vector<torch::Tensor>*> sets;
  for (const auto& run : runs) sets.push_back(run.first);
  for (int step = from; step < to; ++step) {
    give_gradients(sets, step);
    for (const auto& run : runs) run.second->step();
  }
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double rtol,
                  double atol) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], rtol, atol))
        << "parameter " << i << ": max difference " << (a[i] - b[i]).abs().max().item<double>();
}

template <class Fused, class Reference, class Options>
void expect_same_trajectory(double weight_decay) {
  auto fused_params = make_parameters(), reference_params = copies(fused_params);
  auto fused = make_optimizer<Fused, Options>(fused_params, weight_decay);
  auto reference = make_optimizer<Reference, Options>(reference_params, weight_decay);
  take_steps({{&fused_params, &fused}, {&reference_params, &reference}}, 0, 12);
  expect_close(fused_params, reference_params, 1e-5, 1e-6);
  // The trajectory moved far enough for a wrong coefficient to show.
  EXPECT_GT((fused_params[1] - make_parameters()[1]).abs().max().item<double>(), 5e-3);
  EXPECT_EQ(fused.state().size(), reference.state().size());  // none for the gradient-less parameter
  EXPECT_EQ(fused.state().size(), 6u);
}

}  // namespace

TEST(FusedAdam, AdamWFollowsLibTorchsAdamW) {
  expect_same_trajectory<FusedAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>(1e-2);
}

TEST(FusedAdam, AdamWithL2WeightDecayFollowsLibTorchsAdam) {
  expect_same_trajectory<FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>(0.1);
  expect_same_trajectory<FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>(0.0);
}

TEST(FusedAdam, ThePortableLoopFollowsLibTorchToo) {
  // The loop CPUs without AVX2+FMA run (and non-x86 builds), forced on this one.
  struct Portable {
    Portable() { xlr8::optim::detail::force_portable_kernel(true); }
    ~Portable() { xlr8::optim::detail::force_portable_kernel(false); }
  };
  auto vector_params = make_parameters();
  auto vector_opt = make_optimizer<FusedAdamW, torch::optim::AdamWOptions>(vector_params, 1e-2);
  take_steps({{&vector_params, &vector_opt}}, 0, 12);
  Portable portable;
  expect_same_trajectory<FusedAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>(1e-2);
  expect_same_trajectory<FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>(0.1);
  // The switch really changed the path: without FMA, some elements round differently.
  auto portable_params = make_parameters();
  auto portable_opt = make_optimizer<FusedAdamW, torch::optim::AdamWOptions>(portable_params, 1e-2);
  take_steps({{&portable_params, &portable_opt}}, 0, 12);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_FALSE(torch::equal(portable_params[1], vector_params[1]));
  }
#endif
  expect_close(portable_params, vector_params, 1e-5, 1e-6);
}

TEST(FusedAdam, LibTorchsFusedKernelPathFollowsLibTorchToo) {
  // The path CUDA parameters take (batches of one device, dtype and step count through _fused_adamw_),
  // run here on LibTorch's CPU kernel: float32, and the float64 parameter now fused too.
  struct TorchKernel {
    TorchKernel() { xlr8::optim::detail::use_torch_kernel_on_cpu(true); }
    ~TorchKernel() { xlr8::optim::detail::use_torch_kernel_on_cpu(false); }
  } torch_kernel;
  expect_same_trajectory<FusedAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>(1e-2);
  expect_same_trajectory<FusedAdam, torch::optim::Adam, torch::optim::AdamOptions>(0.1);
  // Parameters at different step counts (one joins late) land in different batches.
  torch::manual_seed(9);
  std::vector<torch::Tensor> fused{torch::randn({33}).requires_grad_(), torch::randn({7, 3}).requires_grad_()};
  auto reference = copies(fused);
  FusedAdamW fused_opt(fused, torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW reference_opt(reference, torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < fused.size(); ++i) {
      if (i == 1 && step < 2) continue;  // no gradient yet: no state, no step
      auto g = torch::randn(fused[i].sizes());
      fused[i].mutable_grad() = g.clone();
      reference[i].mutable_grad() = g;
    }
    fused_opt.step();
    reference_opt.step();
  }
  expect_close(fused, reference, 1e-5, 1e-6);
}

TEST(FusedAdam, StateIsInterchangeableWithLibTorchsAdamW) {
  auto dir = fs::temp_directory_path() / ("xlr8_optim_" + std::to_string(getpid()));
  fs::create_directories(dir);
  // Five fused steps, saved; a plain AdamW loads them and takes three more, as does the fused one.
  auto fused_params = make_parameters();
  auto fused = make_optimizer<FusedAdamW, torch::optim::AdamWOptions>(fused_params, 1e-2);
  take_steps({{&fused_params, &fused}}, 0, 5);
  torch::save(fused, (dir / "fused.pt").string());
  auto plain_params = copies(fused_params);
  auto plain = make_optimizer<torch::optim::AdamW, torch::optim::AdamWOptions>(plain_params, 1e-2);
  torch::load(plain, (dir / "fused.pt").string());
  // And back: a fused optimizer loading the plain one's archive.
  torch::save(plain, (dir / "plain.pt").string());
  auto again_params = copies(fused_params);
  auto again = make_optimizer<FusedAdamW, torch::optim::AdamWOptions>(again_params, 1e-2);
  torch::load(again, (dir / "plain.pt").string());
  take_steps({{&fused_params, &fused}, {&plain_params, &plain}, {&again_params, &again}}, 5, 8);
  expect_close(plain_params, fused_params, 1e-5, 1e-6);
  expect_close(again_params, fused_params, 1e-5, 1e-6);
  for (const auto& [key, state] : again.state())
    EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(*state).step(), 8);
  fs::remove_all(dir);
}

TEST(FusedAdam, ResultsDoNotDependOnThreadsOrOnWhereAnElementFallsInTheVectorLoop) {
  // Threads split a parameter at arbitrary elements; every element must take the same arithmetic.
  const int threads = at::get_num_threads();
  std::vector<torch::Tensor> results;
  for (int n : {1, 2, 3}) {
    at::set_num_threads(n);
    auto ps = make_parameters();
    auto opt = make_optimizer<FusedAdamW, torch::optim::AdamWOptions>(ps, 1e-2);
    take_steps({{&ps, &opt}}, 0, 3);
    results.push_back(ps[1].detach().clone());
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(results[0], results[1]));
  EXPECT_TRUE(torch::equal(results[0], results[2]));

  // 300 parameters of 7 elements (all vector tail) against one of 2100 (no tail), same values.
  torch::manual_seed(5);
  auto whole = torch::randn({2100}).requires_grad_(true);
  std::vector<torch::Tensor> pieces;
  for (const auto& chunk : whole.detach().split(7)) pieces.push_back(chunk.clone().requires_grad_(true));
  FusedAdamW one({whole}), many(pieces);
  for (int step = 0; step < 3; ++step) {
    whole.mutable_grad() = torch::randn({2100});
    auto grads = whole.grad().split(7);
    for (std::size_t i = 0; i < pieces.size(); ++i) pieces[i].mutable_grad() = grads[i].clone();
    one.step();
    many.step();
  }
  EXPECT_TRUE(torch::equal(torch::cat(pieces).detach(), whole.detach()));
}

TEST(FusedAdam, StepBumpsTheParameterVersionAndRunsTheClosure) {
  auto p = torch::randn({10}).requires_grad_(true);
  FusedAdamW opt({p}, torch::optim::AdamWOptions(1e-3));
  const auto version = p._version();
  int calls = 0;
  auto loss = opt.step([&] {
    ++calls;
    auto l = (p * p).sum();
    l.backward();
    return l;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(loss.defined());
  EXPECT_GT(p._version(), version);  // autograd sees the in-place update
}

TEST(FusedAdam, SparseGradientIsAClearError) {
  auto p = torch::randn({3, 2}).requires_grad_(true);
  p.mutable_grad() = torch::randn({3, 2}).to_sparse();
  FusedAdamW opt({p});
  try {
    opt.step();
    FAIL() << "expected an error";
  } catch (const xlr8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("FusedAdamW: the parameter of shape [3, 2] has a sparse gradient"),
              std::string::npos)
        << e.what();
  }
}

// Every portable optimizer type: the state read from one optimizer, written into a fresh one over other
// tensors with the same values, makes the next steps identical (moments, momentum buffers, step counts).
TEST(PortableOptimizerState, EveryBuiltInTypeRoundTripsThroughNamedTensors) {
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  const std::vector<std::pair<std::string, Factory>> kinds{
      {"adamw", [](auto p) { return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.1).amsgrad(true)); }},
      {"adam", [](auto p) { return std::make_unique<xlr8::optim::FusedAdam>(p, torch::optim::AdamOptions(0.1)); }},
      {"sgd", [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }},
      {"rmsprop", [](auto p) {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true));
       }},
      {"adagrad", [](auto p) { return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.1)); }},
  };
  auto step = [](torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params, int k) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i].mutable_grad() = at::sin(at::arange(params[i].numel(), at::kFloat).view(params[i].sizes()) * static_cast<double>(k + 1 + static_cast<int>(i)));
    opt.step();
  };
  for (const auto& [kind, make] : kinds) {
    SCOPED_TRACE(kind);
    at::manual_seed(3);
    std::vector<at::Tensor> a{at::randn({3, 2}).requires_grad_(), at::randn({4}).requires_grad_()};
    auto opt_a = make(a);
    EXPECT_EQ(xlr8::checkpoints::portable_optimizer_kind(*opt_a), kind);
    for (int k = 0; k < 3; ++k) step(*opt_a, a, k);
    std::vector<at::Tensor> b;
    for (auto& t : a) b.push_back(t.detach().clone().requires_grad_());
    auto opt_b = make(b);
    for (size_t i = 0; i < a.size(); ++i) {
      auto state = xlr8::checkpoints::read_parameter_state(*opt_a, a[i]);
      ASSERT_TRUE(state.has_value());
      xlr8::checkpoints::write_parameter_state(*opt_b, b[i], *state);
    }
    for (int k = 3; k < 5; ++k) step(*opt_a, a, k), step(*opt_b, b, k);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << i;
  }
}

