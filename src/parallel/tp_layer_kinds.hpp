#pragma once
// Which modules a tensor-parallel plan may name (tp_plan.cpp and tp_auto.cpp agree on it here), and the
// gradient sum sequence parallelism needs for what it keeps whole.
#include <torch/nn/module.h>

#include "xlr8/communicator.hpp"

namespace xlr8::tp::detail {

// LibTorch's own Linear or Embedding (a plan refuses them by name: their forward takes no collectives).
bool is_plain_torch_layer(const torch::nn::Module& m);
// Ours or LibTorch's Linear or Embedding.
bool is_layer(const torch::nn::Module& m);

// Under sequence parallelism a parameter kept whole (a norm's, a row-wise bias) sees only this rank's
// share of the sequence: its gradient is completed over `group` as backward produces it (before DDP or
// FSDP reduce it over dp).
void sum_gradient_over(at::Tensor& parameter, const Communicator& group);

}  // namespace xlr8::tp::detail
