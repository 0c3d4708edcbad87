// What a tensor-parallel model's state is made of: which parameters are slices and of what whole (for
// checkpoints), and its gradient norm (slices are partial norms over the tp group, replicated
// parameters count once).
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::tp {

bool SlicedParameters::contains(const at::Tensor& p) const {
  for (const auto& s : parameters)
    if (s.is_same(p)) return true;
  return false;
}

SlicedParameters sliced_parameters(const torch::nn::Module& model) {
  SlicedParameters out;
  auto take = [&](const std::optional<nn::TensorParallelSlot>& slot, std::initializer_list<at::Tensor> sliced) {
    if (!slot || slot->style == Style::Replicate || slot->group.size() == 1) return;
    if (out.group && out.group->size() != slot->group.size())
      throw Error(fmt::format("tensor parallelism: the model's layers use tp groups of {} and {} ranks; one model "
                              "takes one tp group",
                              out.group->size(), slot->group.size()));
    if (!out.group) out.group = slot->group;
    for (const auto& t : sliced)
      if (t.defined()) out.parameters.push_back(t);
  };
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* linear = dynamic_cast<nn::LinearImpl*>(m.get())) {
      const auto& slot = linear->tensor_parallel();
      // A row-wise bias is whole on every rank (added after the all-reduce).
      const bool bias_sliced = slot && slot->style == Style::Colwise;
      take(slot, {linear->weight, bias_sliced ? linear->bias : at::Tensor()});
    } else if (auto* embedding = dynamic_cast<nn::EmbeddingImpl*>(m.get())) {
      take(embedding->tensor_parallel(), {embedding->weight});
    }
  }
  return out;
}

std::map<std::string, SliceLayout> slice_layouts(const torch::nn::Module& model) {
  std::map<std::string, SliceLayout> out;
  auto add = [&](const std::string& path, const char* name, const nn::TensorParallelSlot& slot, int64_t dim, int fused,
                 std::vector<int64_t> whole) {
    out[path.empty() ? name : path + "." + name] = SliceLayout{slot.group, dim, fused, std::move(whole)};
  };
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto& path = item.key();
    if (auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get())) {
      const auto& slot = linear->tensor_parallel();
      if (!slot || slot->style == Style::Replicate || slot->group.size() == 1) continue;
      const int64_t in = linear->options.in_features(), out_features = linear->options.out_features();
      if (slot->style == Style::Colwise) {
        add(path, "weight", *slot, 0, slot->fused, {out_features, in});
        if (linear->bias.defined()) add(path, "bias", *slot, 0, slot->fused, {out_features});
      } else {
        add(path, "weight", *slot, 1, 1, {out_features, in});
      }
    } else if (auto* embedding = dynamic_cast<nn::EmbeddingImpl*>(item.value().get())) {
      const auto& slot = embedding->tensor_parallel();
      if (!slot || slot->style == Style::Replicate || slot->group.size() == 1) continue;
      add(path, "weight", *slot, 0, 1, {embedding->options.num_embeddings(), embedding->options.embedding_dim()});
    }
  }
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
  const bool infinity = std::isinf(norm_type);
  const auto device = (whole.empty() ? parts : whole).front().device();
  auto reduced = [&](const std::vector<at::Tensor>& grads) {
    if (grads.empty()) return at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
    std::vector<at::Tensor> norms;
    for (const auto& g : grads) norms.push_back(g.norm(norm_type).to(at::kDouble).reshape({1}));
    auto all = at::cat(norms);
    return infinity ? all.max().reshape({1}) : all.pow(norm_type).sum().reshape({1});
  };
  auto part_total = reduced(parts);
  // Every tp rank takes part, sliced gradients or not: the collective pairs by position.
  if (sliced.group) {
    Communicator group = *sliced.group;
    group.all_reduce(part_total, infinity ? ReduceOp::MAX : ReduceOp::SUM);
  }
  auto total = infinity ? at::maximum(part_total, reduced(whole)) : part_total + reduced(whole);
  const double value = total.item<double>();
  const double norm = infinity ? value : std::pow(value, 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    at::NoGradGuard no_grad;
    for (auto* list : {&whole, &parts})
      for (auto& g : *list) g.mul_(coef);
  }
  return norm;
}

}  // namespace xlr8::tp
