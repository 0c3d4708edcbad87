// Tensor parallelism's collectives as autograd functions: each one's backward is the other's forward.

#include <atomic>

#include <fmt/format.h>

#include "parallel/autograd_group.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using xlr8::parallel::group_of;
using xlr8::parallel::keep_group;

// Bytes each rank sends for the regions' collectives, as a ring moves them: an all-reduce of S bytes
// 2(n-1)/n S, an all-gather or reduce-scatter whose whole is S bytes (n-1)/n S.
std::atomic<int64_t> wire_bytes{0};

void count_wire(int64_t whole_bytes, const Communicator& group, int passes) {
  wire_bytes += passes * whole_bytes * (group.size() - 1) / group.size();
}

// The group by value: a Communicator is a shared handle, and its collectives are non-const.
at::Tensor all_reduced(const at::Tensor& x, Communicator group) {
  auto sum = x.contiguous().clone();
  count_wire(sum.nbytes(), group, 2);
  group.all_reduce(sum);
  return sum;
}

at::Tensor all_gathered(const at::Tensor& x, const Communicator& group, int64_t dim) {
  return xlr8::parallel::all_gather_on(x, group, dim, wire_bytes);
}

at::Tensor own_chunk(const at::Tensor& x, const Communicator& group, int64_t dim) {
  return x.chunk(group.size(), dim)[static_cast<size_t>(group.rank())].contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Communicator& group) {
    keep_group(ctx, group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduced(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const Communicator& group) {
    return all_reduced(x, group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Communicator& group, int64_t dim) {
    keep_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    return all_gathered(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {own_chunk(grads[0], group_of(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

// The sequence dimension ([..., T, C]) split over the group: rank r's chunk of the sum over ranks.
at::Tensor reduce_scattered(const at::Tensor& x, const Communicator& group) {
  return xlr8::parallel::reduce_scatter_on(x, group, x.dim() - 2, wire_bytes);
}

void check_sequence(const at::Tensor& x, const Communicator& group) {
  if (x.dim() < 2)
    throw ConfigError(fmt::format("sequence parallelism: an activation of {} dimension(s) has no sequence dimension "
                                  "(expected [..., sequence, features])",
                                  x.dim()));
  if (x.size(-2) % group.size() != 0)
    throw ConfigError(fmt::format("sequence parallelism: the sequence length {} is not divisible by the tp size {}; "
                                  "choose a sequence length that is a multiple of it",
                                  x.size(-2), group.size()));
}

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Communicator& group) {
    keep_group(ctx, group);
    return all_gathered(x, group, x.dim() - 2);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scattered(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Communicator& group) {
    keep_group(ctx, group);
    return reduce_scattered(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gathered(grads[0], group_of(ctx), grads[0].dim() - 2), at::Tensor()};
  }
};

int64_t checked_dim(const at::Tensor& x, int64_t dim) {
  return dim < 0 ? dim + x.dim() : dim;
}

}  // namespace

int64_t region_wire_bytes() { return wire_bytes.load(); }

at::Tensor gather_from_sequence_region(const at::Tensor& x, const Communicator& group) {
  if (group.size() == 1) return x;
  if (x.dim() < 2) check_sequence(x, group);
  return GatherFromSequence::apply(x, group);
}

at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, const Communicator& group) {
  if (group.size() == 1) return x;
  check_sequence(x, group);
  return ReduceScatterToSequence::apply(x, group);
}

at::Tensor copy_to_tp_region(const at::Tensor& x, const Communicator& group) {
  if (group.size() == 1) return x;
  return CopyToRegion::apply(x, group);
}

at::Tensor reduce_from_tp_region(const at::Tensor& x, const Communicator& group) {
  if (group.size() == 1) return x;
  return ReduceFromRegion::apply(x, group);
}

at::Tensor gather_from_tp_region(const at::Tensor& x, const Communicator& group, int64_t dim) {
  if (group.size() == 1) return x;
  return GatherFromRegion::apply(x, group, checked_dim(x, dim));
}

}  // namespace xlr8::tp
