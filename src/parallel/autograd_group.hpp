#pragma once
// A communicator kept in an autograd node's context, so that backward has the group for as long as the
// graph lives (the collectives of tensor and context parallelism are autograd functions).
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <atomic>

#include "xlr8/communicator.hpp"

namespace xlr8::parallel {

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

// Every rank's `x` along `dim`, in rank order. `wire` counts the bytes sent as a ring sends them ((n-1)/n of
// the whole): tensor and context parallelism each keep their own count.
inline at::Tensor all_gather_on(const at::Tensor& x, Communicator group, int64_t dim, std::atomic<int64_t>& wire) {
  auto moved = x.movedim(dim, 0).contiguous();  // rank-major along dimension 0 of a flat buffer
  auto sizes = moved.sizes().vec();
  auto out = at::empty({group.size() * moved.numel()}, moved.options());
  wire += static_cast<int64_t>(out.nbytes()) * (group.size() - 1) / group.size();
  group.all_gather(out, moved);
  sizes[0] *= group.size();
  return out.view(sizes).movedim(0, dim).contiguous();
}

// This rank's 1/n of the sum over ranks of `x` along `dim`.
inline at::Tensor reduce_scatter_on(const at::Tensor& x, Communicator group, int64_t dim, std::atomic<int64_t>& wire) {
  auto moved = x.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  auto out = at::empty({moved.numel() / group.size()}, moved.options());
  wire += static_cast<int64_t>(moved.nbytes()) * (group.size() - 1) / group.size();
  group.reduce_scatter(out, moved.reshape(-1), ReduceOp::SUM);
  sizes[0] /= group.size();
  return out.view(sizes).movedim(0, dim).contiguous();
}

}  // namespace xlr8::parallel
