// What a tensor-parallel model's state is made of: which parameters are slices and of what whole (for
// checkpoints), and its gradient norm (slices are partial norms over the tp group, replicated
// parameters count once).
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>

#include "parallel/grad_norm.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::tp {

namespace {

// One sliced parameter of a layer: where it lies in its whole.
struct LayerSlice {
  const char* name;
  at::Tensor tensor;
  const nn::TensorParallelSlot* slot;
  int64_t dim;
  int fused;
  std::vector<int64_t> whole_sizes;
};

// The parameters of one module that a plan sliced (none for a kept-whole or one-rank layer). A row-wise
// bias stays whole on every rank (added after the all-reduce).
std::vector<LayerSlice> layer_slices(const torch::nn::Module& module) {
  auto split = [](const std::optional<nn::TensorParallelSlot>& slot) {
    return slot && slot->style != Style::Replicate && slot->group.size() > 1;
  };
  if (auto* linear = dynamic_cast<const nn::LinearImpl*>(&module)) {
    const auto& slot = linear->tensor_parallel();
    if (!split(slot)) return {};
    const int64_t in = linear->options.in_features(), out = linear->options.out_features();
    if (slot->style == Style::Rowwise) return {{"weight", linear->weight, &*slot, 1, 1, {out, in}}};
    std::vector<LayerSlice> slices{{"weight", linear->weight, &*slot, 0, slot->fused, {out, in}}};
    if (linear->bias.defined()) slices.push_back({"bias", linear->bias, &*slot, 0, slot->fused, {out}});
    return slices;
  }
  if (auto* embedding = dynamic_cast<const nn::EmbeddingImpl*>(&module)) {
    const auto& slot = embedding->tensor_parallel();
    if (!split(slot)) return {};
    return {{"weight", embedding->weight, &*slot, 0, 1,
             {embedding->options.num_embeddings(), embedding->options.embedding_dim()}}};
  }
  return {};
}

}  // namespace

SlicedParameters sliced_parameters(const torch::nn::Module& model) {
  SlicedParameters out;
  for (const auto& m : model.modules(/*include_self=*/true))
    for (const auto& slice : layer_slices(*m)) {
      const auto& group = slice.slot->group;
      if (out.group && out.group->size() != group.size())
        throw Error(fmt::format("tensor parallelism: the model's layers use tp groups of {} and {} ranks; one model "
                                "takes one tp group",
                                out.group->size(), group.size()));
      if (!out.group) out.group = group;
      out.members.insert(slice.tensor.unsafeGetTensorImpl());
    }
  return out;
}

std::map<std::string, SliceLayout> slice_layouts(const torch::nn::Module& model) {
  std::map<std::string, SliceLayout> out;
  for (const auto& item : model.named_modules("", /*include_self=*/true))
    for (auto& slice : layer_slices(*item.value()))
      out[item.key().empty() ? slice.name : item.key() + "." + slice.name] =
          SliceLayout{slice.slot->group, slice.dim, slice.fused, std::move(slice.whole_sizes)};
  return out;
}

namespace {

// The whole's sizes with the split dimension first.
std::vector<int64_t> moved_sizes(const SliceLayout& layout) {
  auto sizes = layout.whole_sizes;
  std::rotate(sizes.begin(), sizes.begin() + layout.dim, sizes.begin() + layout.dim + 1);
  return sizes;
}

}  // namespace

at::Tensor gather_whole(const at::Tensor& local, const SliceLayout& layout) {
  Communicator group = layout.group;
  if (group.size() == 1) return local;
  // [fused, this rank's part, everything else] from every rank, then each fused part's slices in rank order.
  auto x = local.movedim(layout.dim, 0);
  auto parts = x.reshape({layout.fused, x.size(0) / layout.fused, -1}).contiguous();
  auto gathered = at::empty({group.size() * parts.numel()}, parts.options());
  group.all_gather(gathered, parts);
  auto all = gathered.view({group.size(), layout.fused, parts.size(1), parts.size(2)}).transpose(0, 1);
  return all.reshape(moved_sizes(layout)).movedim(0, layout.dim).contiguous();
}

at::Tensor local_slice(const at::Tensor& whole, const SliceLayout& layout) {
  const auto& group = layout.group;
  auto x = whole.movedim(layout.dim, 0);
  const int64_t part = x.size(0) / layout.fused, local = part / group.size();
  auto sizes = moved_sizes(layout);
  sizes[0] = layout.fused * local;
  return x.reshape({layout.fused, part, -1}).narrow(1, group.rank() * local, local).reshape(sizes).movedim(0, layout.dim).contiguous();
}

double clip_grad_norm(const std::vector<at::Tensor>& parameters, const SlicedParameters& sliced, double max_norm,
                      double norm_type) {
  std::vector<at::Tensor> whole, parts;
  for (const auto& p : parameters)
    if (p.grad().defined()) (sliced.contains(p) ? parts : whole).push_back(p.grad());
  if (whole.empty() && parts.empty()) return 0.0;
  const auto device = (whole.empty() ? parts : whole).front().device();
  auto part_total = xlr8::detail::partial_norm(parts, norm_type, device);
  // Every tp rank takes part, sliced gradients or not: the collective pairs by position.
  if (sliced.group) {
    Communicator group = *sliced.group;
    group.all_reduce(part_total, std::isinf(norm_type) ? ReduceOp::MAX : ReduceOp::SUM);
  }
  return xlr8::detail::scale_to_norm(at::cat({part_total, xlr8::detail::partial_norm(whole, norm_type, device)}), {&whole, &parts},
                               max_norm, norm_type);
}

}  // namespace xlr8::tp
