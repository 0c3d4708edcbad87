#pragma once
// Tensors in error messages: "float32[4, 8]". Separate from the communicator internals so that
// checkpoint code can name tensors without seeing c10d.
#include <ATen/core/Tensor.h>

#include <string>

#include "xlr8/format.hpp"

namespace xlr8::core {

std::string describe(const at::Tensor& t);  // "float32[4, 8]" (src/core/tensor_format.cpp)
using xlr8::dtype_name;                     // "bfloat16"

}  // namespace xlr8::core
