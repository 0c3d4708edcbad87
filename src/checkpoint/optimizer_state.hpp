#pragma once
// LibTorch's built-in optimizers' per-parameter state as named tensors and counters, so that a
// checkpoint can hold it by parameter name and element range (any strategy, any process count) instead
// of as an archive keyed by tensor addresses that only the same layout can read back.
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace xlr8::checkpoints {

struct ParameterState {
  std::map<std::string, at::Tensor> tensors;  // shaped like the parameter (leaf) they belong to
  std::map<std::string, int64_t> counters;    // "step"
};

// The optimizer's type when its state can be written portably ("adamw", "adam", "sgd", "rmsprop",
// "adagrad"; xlr8's fused Adam/AdamW count as theirs), nullopt otherwise.
std::optional<std::string> portable_optimizer_kind(const torch::optim::Optimizer& optimizer);
// The state of `leaf`, nullopt when it has none yet (before the first step). Requires a portable kind.
std::optional<ParameterState> read_parameter_state(const torch::optim::Optimizer& optimizer, const at::Tensor& leaf);
// Replaces the state of `leaf` (tensors copied into new memory shaped like `leaf`).
void write_parameter_state(torch::optim::Optimizer& optimizer, const at::Tensor& leaf, const ParameterState& state);
// The names of the tensors and counters `kind` keeps per parameter (for checking a checkpoint).
std::vector<std::string> state_tensor_names(const std::string& kind);
// Those `optimizer` will keep given its groups' options (Adam's max_exp_avg_sq only with amsgrad, SGD's momentum
// buffer only with momentum...): what a swap file laid out before the first step holds. Requires a portable kind.
std::vector<std::string> kept_state_names(const torch::optim::Optimizer& optimizer);

}  // namespace xlr8::checkpoints
