#pragma once
// Which modules a tensor-parallel plan may name (tp_plan.cpp and tp_auto.cpp agree on it here).
#include <torch/nn/module.h>

namespace xlr8::tp::detail {

// LibTorch's own Linear or Embedding (a plan refuses them by name: their forward takes no collectives).
bool is_plain_torch_layer(const torch::nn::Module& m);
// Ours or LibTorch's Linear or Embedding.
bool is_layer(const torch::nn::Module& m);

}  // namespace xlr8::tp::detail
