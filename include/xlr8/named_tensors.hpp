#pragma once
// Tensors by name, in order: a state dict, a safetensors file's contents.
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace xlr8 {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

}  // namespace xlr8
