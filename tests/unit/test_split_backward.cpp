// The zero-bubble schedules' backward in two parts (src/parallel/pipeline/split_backward.hpp): the inputs' part
// leaves the parameters untouched, the weights' part then gives them what one backward gives, and neither part
// runs a node of the inputs' path twice but where a weight is used at two depths.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>

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
  bool shared = false;  // `second` used twice, at two depths
  at::Tensor forward(const at::Tensor& x) {
    auto h = at::tanh(first->forward(x));
    h = CountedIdentity::apply(at::tanh(second->forward(h)));
    if (shared) h = at::tanh(second->forward(h));
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
    EXPECT_EQ(identity_backwards, 1);
  } else {
    EXPECT_FALSE(input_gradient.defined());
    EXPECT_EQ(identity_backwards, 0);
  }
  split.backward_weight();
  for (const auto& [name, g] : net.grads())
    EXPECT_TRUE(g.defined() && at::allclose(g, expected.at(name), 1e-6, 1e-7)) << name;
  // The weights' part starts where the weights' graph leaves the inputs' path; only a weight used at two depths
  // (the shared layer) makes it run that path again, from the outputs, for that weight alone.
  EXPECT_EQ(identity_backwards, shared || !input_needs_gradient ? 2 - !input_needs_gradient : 1)
      << "shared " << shared << " input " << input_needs_gradient;
}

TEST(SplitBackward, TheTwoPartsGiveOneBackwardsGradientsWithoutRunningTheInputPathTwice) {
  expect_split_equals_whole(/*shared=*/false, /*input_needs_gradient=*/true);
  expect_split_equals_whole(/*shared=*/false, /*input_needs_gradient=*/false);
}

TEST(SplitBackward, AWeightUsedAtTwoDepthsGetsBothUsesGradients) {
  expect_split_equals_whole(/*shared=*/true, /*input_needs_gradient=*/true);
  expect_split_equals_whole(/*shared=*/true, /*input_needs_gradient=*/false);
}

}  // namespace
