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

TEST(SplitBackward, AWeightUsedAtTwoDepthsGetsBothUsesGradients) {
  expect_split_equals_whole(/*shared=*/true, /*input_needs_gradient=*/true);
  expect_split_equals_whole(/*shared=*/true, /*input_needs_gradient=*/false);
}

}  // namespace
