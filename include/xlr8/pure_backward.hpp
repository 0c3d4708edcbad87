#pragma once
// The zero-bubble pipeline schedule (InterleavedZeroBubble) splits each micro-batch's backward where the weights'
// graph leaves the inputs' path, and runs the nodes there twice: once for the inputs' gradients, which the previous
// stage waits for, and later for the weights', which fill the bubble. LibTorch's own derivative formulas compute
// only what each run asks. A custom autograd Function there might count or record something in its backward, so a
// micro-batch meeting one runs its backward whole, unsplit (pipeline_stats()'s "whole_backwards"), unless its class
// is declared pure:
//
//   struct FusedScale : torch::autograd::Function<FusedScale> { ... };
//   xlr8::pp::declare_pure_backward<FusedScale>();   // once, before training
//
// Declare only a backward that is a function of its saved values and incoming gradients alone (no counters, no
// state it updates, no hooks it fires). It then runs in both parts: for nothing to be computed twice, let it compute
// only the gradients `ctx->needs_input_grad(i)` asks for, as LibTorch's formulas do (each part asks for its own).
#include <torch/csrc/autograd/custom_function.h>

#include <functional>

namespace xlr8::pp {

namespace detail {
// Adds a test that a node is a declared Function's; split_backward asks every test it holds.
void add_pure_backward(std::function<bool(const torch::autograd::Node&)> is_declared);
}  // namespace detail

template <class Function>
void declare_pure_backward() {
  detail::add_pure_backward([](const torch::autograd::Node& node) {
    return dynamic_cast<const torch::autograd::CppNode<Function>*>(&node) != nullptr;
  });
}

}  // namespace xlr8::pp
