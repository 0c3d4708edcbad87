#pragma once
// Ulysses sequence parallelism's communication (DeepSpeed's ALST): an all-to-all that trades a split of
// the sequence for a split of the heads before attention, and its inverse after. Each is the other's
// backward (an all-to-all only moves elements, so its adjoint is its inverse).
#include <ATen/core/Tensor.h>

#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8::cp::detail {

// Tensors shaped [..., H, T/n, D] holding this rank's contiguous share of the sequence, to
// [..., H/n, T, D]: this rank's share of the heads over the whole sequence (H divisible by n). Neighbouring
// tensors of one shape go in one all-to-all.
std::vector<at::Tensor> sequence_to_heads(const std::vector<at::Tensor>& xs, const Communicator& group);
// [..., H/n, T, D] back to [..., H, T/n, D].
at::Tensor heads_to_sequence(const at::Tensor& x, const Communicator& group);

}  // namespace xlr8::cp::detail
