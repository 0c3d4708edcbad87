#pragma once
// Tensors in error messages: "float32[4, 8]". Separate from the communicator internals so that
// checkpoint code can name tensors without seeing c10d.
#include <ATen/core/Tensor.h>

#include <string>

namespace xlr8::detail {

std::string describe(const at::Tensor& t);  // "float32[4, 8]"
std::string dtype_name(at::ScalarType t);   // "bfloat16"

}  // namespace xlr8::detail
