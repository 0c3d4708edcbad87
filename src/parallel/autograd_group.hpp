#pragma once
// A communicator kept in an autograd node's context, so that backward has the group for as long as the
// graph lives (the collectives of tensor and context parallelism are autograd functions).
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include "xlr8/communicator.hpp"

namespace xlr8::detail {

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(Communicator group) : group(std::move(group)) {}
  Communicator group;
};

inline void keep_group(torch::autograd::AutogradContext* ctx, const Communicator& group) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
}

inline Communicator& group_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())->group;
}

}  // namespace xlr8::detail
