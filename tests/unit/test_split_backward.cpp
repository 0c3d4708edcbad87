// The zero-bubble schedules' backward in two parts (src/parallel/pipeline/split_backward.hpp): the inputs' part
// leaves the parameters untouched, the weights' part then gives them what one backward gives (also for a weight
// used at two depths), and a node above the weights' boundary runs once; a micro-batch whose boundary nodes
// cannot run twice is one whole backward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>
#include <vector>

#include "parallel/pipeline/split_backward.hpp"
#include "precision/float8_linear.hpp"
#include "xlr8/activation_checkpoint.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/pure_backward.hpp"

namespace {

// The identity, counting the times its backward runs.
int identity_backwards = 0;
struct CountedIdentity : torch::autograd::Function<CountedIdentity> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    ++identity_backwards;
    return {g[0]};
  }
};

struct Net {
  torch::nn::Linear first{12, 16}, second{16, 16}, third{16, 4};
  bool shared = false;  // `second` used twice, at two depths (then no custom Function, which would not be split)
  at::Tensor forward(const at::Tensor& x) {
    auto h = at::tanh(first->forward(x));
    h = at::tanh(second->forward(h));
    h = shared ? at::tanh(second->forward(h)) : CountedIdentity::apply(h);
    return third->forward(h);
  }
  std::map<std::string, at::Tensor> grads() const {
    std::map<std::string, at::Tensor> out;
    for (const auto* m : {&first, &second, &third})
      for (const auto& p : (*m)->named_parameters())
        out[std::string(m == &first ? "first." : m == &second ? "second." : "third.") + p.key()] = p.value().grad();
    return out;
  }
};

// One micro-batch's backward split and whole, from a stage input that needs its gradient (a middle stage) or from
// data that does not (the first stage).
void expect_split_equals_whole(bool shared, bool input_needs_gradient) {
  at::manual_seed(3);
  Net net;
  net.shared = shared;
  const auto data = at::randn({5, 12}), upstream = at::randn({5, 4});
  auto input = data.clone().requires_grad_(input_needs_gradient);
  torch::autograd::backward({net.forward(input)}, {upstream});
  const auto expected = net.grads();
  const auto expected_input = input_needs_gradient ? input.grad().clone() : at::Tensor();
  for (const auto* m : {&net.first, &net.second, &net.third})
    for (auto& p : (*m)->parameters()) p.mutable_grad() = at::Tensor();

  auto again = data.clone().requires_grad_(input_needs_gradient);
  const auto output = net.forward(again);
  identity_backwards = 0;
  xlr8::pp::SplitBackward split;
  const auto input_gradient = split.backward_input({output}, {upstream}, {again})[0];
  for (const auto& [name, g] : net.grads()) EXPECT_FALSE(g.defined()) << name << " has a gradient before its part";
  if (input_needs_gradient) {
    EXPECT_TRUE(at::allclose(input_gradient, expected_input, 1e-6, 1e-7));
  } else {
    EXPECT_FALSE(input_gradient.defined());
  }
  EXPECT_EQ(identity_backwards, input_needs_gradient && !shared ? 1 : 0);
  split.backward_weight();
  for (const auto& [name, g] : net.grads())
    EXPECT_TRUE(g.defined() && at::allclose(g, expected.at(name), 1e-6, 1e-7)) << name;
  EXPECT_EQ(split.whole_backwards(), 0) << "shared " << shared << " input " << input_needs_gradient;
  // The weights' part starts where the weights' graph leaves the inputs' path: the identity above those layers
  // ran once in all (in the input part, or in the first stage's one backward).
  if (!shared) {
    EXPECT_EQ(identity_backwards, 1);
  }
}

TEST(SplitBackward, TheTwoPartsGiveOneBackwardsGradientsWithoutRunningTheInputPathTwice) {
  expect_split_equals_whole(/*shared=*/false, /*input_needs_gradient=*/true);
  expect_split_equals_whole(/*shared=*/false, /*input_needs_gradient=*/false);
}

// x * w for a weight w of one value a feature, as a custom Function, counting its backwards.
int scale_backwards = 0;
struct Scale : torch::autograd::Function<Scale> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    ++scale_backwards;
    const auto saved = ctx->get_saved_variables();
    return {g[0] * saved[1], (g[0] * saved[0]).sum(0)};
  }
};

// A boundary node the weight part could not run again without counting twice (a custom Function taking a weight, a
// hook on a layer's output) makes that micro-batch's backward whole, in the input part: one backward's gradients.
TEST(SplitBackward, ABoundaryThatCannotRunTwiceMakesTheBackwardWholeInTheInputPart) {
  for (const bool custom : {true, false}) {
    at::manual_seed(5);
    torch::nn::Linear first(12, 16), last(16, 4);
    auto w = at::randn({16}).requires_grad_(true);
    const auto data = at::randn({5, 12}), upstream = at::randn({5, 4});
    auto forward = [&](const at::Tensor& x) {
      auto h = first->forward(x);
      if (custom) {
        h = Scale::apply(h, w);
      } else {
        h.register_hook([](const at::Tensor& g) { return g * 2; });
      }
      return last->forward(at::tanh(h));
    };
    auto input = data.clone().requires_grad_(true);
    torch::autograd::backward({forward(input)}, {upstream});
    std::vector<at::Tensor> expected{input.grad().clone(), w.grad().defined() ? w.grad().clone() : at::Tensor()};
    for (auto& p : first->parameters()) expected.push_back(p.grad().clone()), p.mutable_grad() = at::Tensor();
    for (auto& p : last->parameters()) expected.push_back(p.grad().clone()), p.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();

    auto again = data.clone().requires_grad_(true);
    const auto output = forward(again);
    scale_backwards = 0;
    xlr8::pp::SplitBackward split;
    const auto input_gradient = split.backward_input({output}, {upstream}, {again})[0];
    split.backward_weight();
    EXPECT_EQ(split.whole_backwards(), 1) << "custom " << custom;
    if (custom) {
      EXPECT_EQ(scale_backwards, 1);
    }
    std::vector<at::Tensor> got{input_gradient, w.grad()};
    for (auto& p : first->parameters()) got.push_back(p.grad());
    for (auto& p : last->parameters()) got.push_back(p.grad());
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].defined(), expected[i].defined()) << "custom " << custom << ", gradient " << i;
      if (got[i].defined() && expected[i].defined()) {
        EXPECT_TRUE(at::allclose(got[i], expected[i], 1e-6, 1e-7)) << "custom " << custom << ", gradient " << i;
      }
    }
  }
}

// Scale again, declared pure (xlr8/pure_backward.hpp), computing only the gradients each run asks for.
int pure_input_products = 0, pure_weight_products = 0;
struct PureScale : torch::autograd::Function<PureScale> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = g[0] * saved[1], ++pure_input_products;
    if (ctx->needs_input_grad(1)) dw = (g[0] * saved[0]).sum(0), ++pure_weight_products;
    return {dx, dw};
  }
};

// A custom Function declared pure splits like LibTorch's formulas: it runs in both parts, asked for the input's
// gradient in the first and the weight's in the second, so each product is computed once; the gradients are one
// backward's and the weight has none before its part.
TEST(SplitBackward, ACustomFunctionDeclaredPureSplitsAndComputesEachGradientOnce) {
  xlr8::pp::declare_pure_backward<PureScale>();
  at::manual_seed(5);
  torch::nn::Linear first(12, 16), last(16, 4);
  auto w = at::randn({16}).requires_grad_(true);
  const auto data = at::randn({5, 12}), upstream = at::randn({5, 4});
  auto forward = [&](const at::Tensor& x) { return last->forward(at::tanh(PureScale::apply(first->forward(x), w))); };
  auto input = data.clone().requires_grad_(true);
  torch::autograd::backward({forward(input)}, {upstream});
  std::vector<at::Tensor> expected{input.grad().clone(), w.grad().clone()};
  for (auto& p : first->parameters()) expected.push_back(p.grad().clone()), p.mutable_grad() = at::Tensor();
  for (auto& p : last->parameters()) expected.push_back(p.grad().clone()), p.mutable_grad() = at::Tensor();
  w.mutable_grad() = at::Tensor();

  auto again = data.clone().requires_grad_(true);
  const auto output = forward(again);
  pure_input_products = pure_weight_products = 0;
  xlr8::pp::SplitBackward split;
  std::vector<at::Tensor> got{split.backward_input({output}, {upstream}, {again})[0]};
  EXPECT_FALSE(w.grad().defined());
  EXPECT_EQ(pure_input_products, 1);
  EXPECT_EQ(pure_weight_products, 0);
  split.backward_weight();
  EXPECT_EQ(pure_input_products, 1);
  EXPECT_EQ(pure_weight_products, 1);
  EXPECT_EQ(split.whole_backwards(), 0);
  got.push_back(w.grad());
  for (auto& p : first->parameters()) got.push_back(p.grad());
  for (auto& p : last->parameters()) got.push_back(p.grad());
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(got[i].defined() && at::allclose(got[i], expected[i], 1e-6, 1e-7)) << "gradient " << i;
}

TEST(SplitBackward, AWeightUsedAtTwoDepthsGetsBothUsesGradients) {
  expect_split_equals_whole(/*shared=*/true, /*input_needs_gradient=*/true);
  expect_split_equals_whole(/*shared=*/true, /*input_needs_gradient=*/false);
}

// A stage checkpointed in regions (activation checkpointing per stage), one region nested in another: each region's
// parameters get their gradients in the weight part, as the layers outside do, and each region runs twice in all
// (its forward, one recomputation in the input part). A custom Function taking a weight inside the inner region
// makes that region's backward whole, in the input part, and leaves the rest split.
TEST(SplitBackward, CheckpointedRegionsSplitTooAndRecomputeOnce) {
  for (const bool custom_inside : {false, true}) {
    at::manual_seed(7);
    torch::nn::Linear first(12, 16), outer(16, 16), inner(16, 16), last(16, 4);
    auto w = at::randn({16}).requires_grad_(true);
    int outer_runs = 0, inner_runs = 0;
    auto forward = [&](const at::Tensor& x) {
      auto h = at::tanh(first->forward(x));
      h = xlr8::checkpoint(
          [&](const at::Tensor& a) {
            ++outer_runs;
            auto b = at::tanh(outer->forward(a));
            return xlr8::checkpoint(
                [&](const at::Tensor& c) {
                  ++inner_runs;
                  auto d = at::tanh(inner->forward(c));
                  return custom_inside ? Scale::apply(d, w) : d * w;
                },
                b) + a;
          },
          h);
      return last->forward(h);
    };
    auto leaves = [&] {
      std::vector<at::Tensor> out{w};
      for (const auto* m : {&first, &outer, &inner, &last})
        for (const auto& p : (*m)->parameters()) out.push_back(p);
      return out;
    };
    const auto data = at::randn({5, 12}), upstream = at::randn({5, 4});
    auto input = data.clone().requires_grad_(true);
    torch::autograd::backward({forward(input)}, {upstream});
    std::vector<at::Tensor> expected{input.grad().clone()};
    for (auto& p : leaves()) expected.push_back(p.grad().clone()), p.mutable_grad() = at::Tensor();

    auto again = data.clone().requires_grad_(true);
    const auto output = forward(again);
    outer_runs = inner_runs = 0;
    xlr8::pp::SplitBackward split;
    std::vector<at::Tensor> got{split.backward_input({output}, {upstream}, {again})[0]};
    // The outer region recomputed once, the inner twice (inside the outer's recomputation, then its own), as in a
    // whole backward; the weight part recomputes nothing.
    EXPECT_EQ(outer_runs, 1) << "custom " << custom_inside;
    EXPECT_EQ(inner_runs, 2) << "custom " << custom_inside;
    // Before the weight part only the inner region's weights (w, inner.weight, inner.bias), where it ran whole.
    const auto before = leaves();
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_EQ(before[i].grad().defined(), custom_inside && (i == 0 || i == 5 || i == 6))
          << "custom " << custom_inside << ", leaf " << i;
    split.backward_weight();
    EXPECT_EQ(outer_runs, 1) << "custom " << custom_inside;
    EXPECT_EQ(inner_runs, 2) << "custom " << custom_inside;
    EXPECT_EQ(split.whole_backwards(), custom_inside ? 1 : 0);
    EXPECT_EQ(split.split_regions(), custom_inside ? 1 : 2);
    for (auto& p : leaves()) got.push_back(p.grad());
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(got[i].defined() && at::allclose(got[i], expected[i], 1e-6, 1e-7)) << "custom " << custom_inside << ", " << i;
  }
}

}  // namespace

// fp8's product (delayed, tensor-wise and row-wise scaling) is split like LibTorch's formulas: micro-batches in a
// zero-bubble order (F0 B0 F1 B1 W0 F2 B2 W1 W2) give the gradients and the delayed scaling state of whole backwards
// in order, bitwise: the weights' part casts grad_output with the scale the inputs' part used, and records nothing.
TEST(SplitBackward, Fp8LayersSplitAndGiveWholeBackwardsGradientsAndScalingState) {
  using xlr8::fp8::Scaling;
  for (const auto scaling : {Scaling::Delayed, Scaling::Tensorwise, Scaling::Rowwise}) {
    auto make = [&] {
      at::manual_seed(5);
      auto net = torch::nn::Sequential(xlr8::nn::Linear(16, 32), torch::nn::Tanh(), xlr8::nn::Linear(32, 32),
                                       torch::nn::Tanh(), xlr8::nn::Linear(32, 16));
      xlr8::fp8::Recipe recipe;
      recipe.scaling = scaling;
      recipe.amax_history_len = 4;
      EXPECT_EQ(xlr8::fp8::convert_to_float8_training(*net, recipe, {}).converted, std::vector<std::string>{"2"});
      return net;
    };
    auto whole = make(), split = make();
    at::manual_seed(6);
    std::vector<at::Tensor> data, upstream, whole_inputs;
    for (int i = 0; i < 3; ++i) data.push_back(at::randn({8, 16})), upstream.push_back(at::randn({8, 16}));
    for (int i = 0; i < 3; ++i) {
      auto x = data[i].clone().requires_grad_(true);
      torch::autograd::backward({whole->forward(x)}, {upstream[i]});
      whole_inputs.push_back(x.grad());
    }
    std::vector<xlr8::pp::SplitBackward> parts(3);
    auto forward_and_inputs_part = [&](int i) {
      auto x = data[i].clone().requires_grad_(true);
      const auto got = parts[i].backward_input({split->forward(x)}, {upstream[i]}, {x})[0];
      EXPECT_TRUE(at::equal(got, whole_inputs[i])) << i;
    };
    forward_and_inputs_part(0);
    forward_and_inputs_part(1);
    parts[0].backward_weight();
    forward_and_inputs_part(2);
    parts[1].backward_weight();
    parts[2].backward_weight();
    for (const auto& part : parts) EXPECT_EQ(part.whole_backwards(), 0);
    const auto want = whole->named_parameters(), got = split->named_parameters();
    for (const auto& item : want)
      EXPECT_TRUE(at::equal(got[item.key()].grad(), item.value().grad())) << item.key() << " " << static_cast<int>(scaling);
    EXPECT_EQ(xlr8::fp8::delayed_state_of(*split), xlr8::fp8::delayed_state_of(*whole));
  }
}

// An fp8 layer used at two depths of one stage (its weight's graph reached from the input's path twice): the weights'
// part would run it again from the stage's outputs, asking its input's gradient again; such a micro-batch is one whole
// backward instead, and the gradients and delayed scaling state are a whole backward's.
TEST(SplitBackward, AnFp8LayerUsedAtTwoDepthsGivesAWholeBackwardsGradients) {
  struct Twice : torch::nn::Module {
    xlr8::nn::Linear first{16, 32}, middle{32, 32}, last{32, 16};
    Twice() {
      register_module("first", first), register_module("middle", middle), register_module("last", last);
    }
    at::Tensor forward(const at::Tensor& x) {
      return last(at::tanh(middle(at::tanh(middle(at::tanh(first(x)))))));
    }
  };
  auto make = [] {
    at::manual_seed(5);
    auto net = std::make_shared<Twice>();
    xlr8::fp8::Recipe recipe;
    recipe.scaling = xlr8::fp8::Scaling::Delayed;
    recipe.amax_history_len = 4;
    EXPECT_EQ(xlr8::fp8::convert_to_float8_training(*net, recipe, {}).converted, std::vector<std::string>{"middle"});
    return net;
  };
  auto whole = make(), split = make();
  at::manual_seed(6);
  const auto data = at::randn({8, 16}), upstream = at::randn({8, 16});
  auto x = data.clone().requires_grad_(true);
  torch::autograd::backward({whole->forward(x)}, {upstream});
  auto again = data.clone().requires_grad_(true);
  xlr8::pp::SplitBackward part;
  EXPECT_TRUE(at::equal(part.backward_input({split->forward(again)}, {upstream}, {again})[0], x.grad()));
  part.backward_weight();
  EXPECT_EQ(part.whole_backwards(), 1);
  const auto want = whole->named_parameters(), got = split->named_parameters();
  for (const auto& item : want) EXPECT_TRUE(at::equal(got[item.key()].grad(), item.value().grad())) << item.key();
  EXPECT_EQ(xlr8::fp8::delayed_state_of(*split), xlr8::fp8::delayed_state_of(*whole));
}
