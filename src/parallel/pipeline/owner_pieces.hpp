#pragma once
// Under pp, an owner stage whose strategy shards (ZeRO, FSDP) or tensor-splits its parameters holds a tied
// parameter as pieces spread over the stage's ranks. TiedWeights then needs two things of it: the whole values, for
// the other stages' copies, and a whole gradient (a copy's) added where the optimizer reads this rank's piece.
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "xlr8/communicator.hpp"
#include "xlr8/parallel_strategy.hpp"

namespace xlr8::pp {

class OwnerPieces {
 public:
  // `data_parallel`, `tensor_parallel`: the stage's groups its pieces are spread over (size 1 when not). `device`:
  // where the whole values and gradients travel (the communicators'), wherever the pieces live (offload: the host).
  OwnerPieces(const ParallelStrategy& strategy, Communicator data_parallel, Communicator tensor_parallel,
              at::Device device);
  // The parameter `name` (the stage's name for it) whole, in the dtype the optimizer steps, on every rank of the
  // stage. Collective over the stage's dp and tp groups: called in one order on all of them.
  at::Tensor whole(const std::string& name) const;
  // An uninitialised tensor of that shape and dtype (what a whole gradient arrives in).
  at::Tensor empty_whole(const std::string& name) const;
  // `whole_grad` (the whole parameter's shape) added to the gradient of this rank's piece. No communication.
  void add_gradient(const std::string& name, const at::Tensor& whole_grad) const;
  // "Float[4,6]": the whole parameter's dtype and shape, as TiedWeights describes the copies'.
  std::string describe(const std::string& name) const;

 private:
  const ParameterPiece& piece(const std::string& name) const;
  std::map<std::string, ParameterPiece> pieces_;
  mutable Communicator data_parallel_, tensor_parallel_;  // handles: collectives do not change what they name
  at::Device device_;
  bool replicated_;  // every dp peer holds the same piece: its dp rank 0's counts once
};

}  // namespace xlr8::pp
