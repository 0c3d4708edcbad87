// Ulysses all-to-alls as autograd functions (see sp_ulysses.hpp).
#include "parallel/sequence/sp_ulysses.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "parallel/autograd_group.hpp"
#include "parallel/sequence/cp_ring.hpp"
#include "xlr8/error.hpp"
#include "xlr8/format.hpp"

namespace xlr8::cp::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Chunk j of `input` (dimension 0 has n entries) to rank j, chunk i of the result from rank i. The bytes
// travel as bytes: an all-to-all only moves them, so any dtype goes on any backend (Gloo has no bf16).
at::Tensor exchange(const at::Tensor& input, const Communicator& group_handle) {
  Communicator group = group_handle;
  auto bytes = input.contiguous().view({-1}).view(at::kByte);
  auto out = at::empty_like(bytes);
  count_wire(static_cast<int64_t>(bytes.numel()) * (group.size() - 1) / group.size());
  group.all_to_all(out, bytes);
  return out.view(input.scalar_type()).view(input.sizes());
}

// [B, H, T/n, D] -> [B, H/n, T, D]
at::Tensor to_heads(const at::Tensor& x, const Communicator& group) {
  const int64_t n = group.size(), B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  if (H % n != 0)
    throw ConfigError(fmt::format("Ulysses: {} heads do not split over parallelism_config_sp_size {}; choose an sp size "
                                  "that divides the number of heads",
                                  H, n));
  auto received = exchange(x.reshape({B, n, H / n, T, D}).permute({1, 0, 2, 3, 4}), group);  // [source, B, H/n, T/n, D]
  return received.permute({1, 2, 0, 3, 4}).reshape({B, H / n, n * T, D});
}

// [B, H/n, T, D] -> [B, H, T/n, D]
at::Tensor to_sequence(const at::Tensor& x, const Communicator& group) {
  const int64_t n = group.size(), B = x.size(0), Hn = x.size(1), T = x.size(2), D = x.size(3);
  auto received = exchange(x.reshape({B, Hn, n, T / n, D}).permute({2, 0, 1, 3, 4}), group);  // [source, B, H/n, T/n, D]
  return received.permute({1, 0, 2, 3, 4}).reshape({B, n * Hn, T / n, D});
}

// Leading dimensions flattened into one batch dimension and back.
at::Tensor as_4d(const at::Tensor& x) { return x.reshape({-1, x.size(-3), x.size(-2), x.size(-1)}); }
at::Tensor with_leading(const at::Tensor& x4, const at::Tensor& like) {
  auto sizes = like.sizes().vec();
  sizes[sizes.size() - 3] = x4.size(1);
  sizes[sizes.size() - 2] = x4.size(2);
  return x4.reshape(sizes);
}

struct SequenceToHeads : torch::autograd::Function<SequenceToHeads> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Communicator& group) {
    xlr8::parallel::keep_group(ctx, group);
    return with_leading(to_heads(as_4d(x), group), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = xlr8::parallel::group_of(ctx);
    return {with_leading(to_sequence(as_4d(grads[0]), group), grads[0]), at::Tensor()};
  }
};

struct HeadsToSequence : torch::autograd::Function<HeadsToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Communicator& group) {
    xlr8::parallel::keep_group(ctx, group);
    return with_leading(to_sequence(as_4d(x), group), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = xlr8::parallel::group_of(ctx);
    return {with_leading(to_heads(as_4d(grads[0]), group), grads[0]), at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> sequence_to_heads(const std::vector<at::Tensor>& xs, const Communicator& group) {
  for (const auto& x : xs)
    if (x.dim() < 3)
      throw Error(fmt::format("attention() under Ulysses: {} must be [..., heads, T, head_dim]", x.sizes()));
  // Neighbours of one shape and dtype share an all-to-all (q, k, v; or k, v beside a grouped-query q).
  std::vector<at::Tensor> out;
  for (size_t first = 0, end = 0; first < xs.size(); first = end) {
    for (end = first + 1; end < xs.size() && xs[end].sizes() == xs[first].sizes() &&
                          xs[end].scalar_type() == xs[first].scalar_type();
         ++end) {
    }
    if (end - first == 1) {
      out.push_back(SequenceToHeads::apply(xs[first], group));
      continue;
    }
    const std::vector<at::Tensor> run(xs.begin() + static_cast<std::ptrdiff_t>(first),
                                      xs.begin() + static_cast<std::ptrdiff_t>(end));
    for (auto& part : SequenceToHeads::apply(at::stack(run), group).unbind(0)) out.push_back(part);
  }
  return out;
}

at::Tensor heads_to_sequence(const at::Tensor& x, const Communicator& group) { return HeadsToSequence::apply(x, group); }

}  // namespace xlr8::cp::detail
