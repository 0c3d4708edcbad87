#pragma once
// What every data-parallel strategy does first: check that all ranks built the same model, then make
// them start from rank 0's values.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/error.hpp"

namespace xlr8::replicate {

// Collective: compares every rank's parameter and buffer names, dtypes and shapes (an Error names the
// first difference and the rank), then broadcasts parameters (unless `parameters` is false: their values
// come another way) and buffers from rank 0.
void make_replicas_equal(Communicator& comm, const torch::nn::Module& module, bool parameters = true);
// The error for parameters that got no gradient in a synchronised backward (`reduction`: the
// collective that cannot complete without them).
Error unused_parameters_error(int rank, const std::vector<std::string>& names, const std::string& reduction);
// One broadcast per dtype of all `tensors`, from rank 0, copied back in place.
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors);

}  // namespace xlr8::replicate
