// What a tensor-parallel model's state is made of: which parameters are slices and of what whole (for
// checkpoints), and its gradient norm (slices are partial norms over the tp group, replicated
// parameters count once).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "parallel/grad_norm.hpp"
#include "core/text.hpp"
#include "parallel/tensor/tp_layer_kinds.hpp"
#include "xlr8/empty_init.hpp"
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
  std::vector<int64_t> parts;
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
    if (slot->style == Style::Rowwise) return {{"weight", linear->weight, &*slot, 1, {in}, {out, in}}};
    std::vector<LayerSlice> slices{{"weight", linear->weight, &*slot, 0, slot->parts, {out, in}}};
    if (linear->bias.defined()) slices.push_back({"bias", linear->bias, &*slot, 0, slot->parts, {out}});
    return slices;
  }
  if (auto* embedding = dynamic_cast<const nn::EmbeddingImpl*>(&module)) {
    const auto& slot = embedding->tensor_parallel();
    if (!split(slot)) return {};
    const int64_t rows = embedding->options.num_embeddings();
    return {{"weight", embedding->weight, &*slot, 0, {rows}, {rows, embedding->options.embedding_dim()}}};
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
    {
      const auto& group = slice.slot->group;
      auto placement = Placement::split(std::move(slice.whole_sizes), slice.dim, slice.parts, group.rank(), group.size());
      out[item.key().empty() ? slice.name : item.key() + "." + slice.name] =
          SliceLayout{group, slice.dim, std::move(slice.parts), std::move(placement)};
    }
  return out;
}

std::map<std::string, Placement> parameter_placements(const torch::nn::Module& model) {
  std::map<std::string, Placement> out;
  for (auto& [name, layout] : slice_layouts(model)) out.emplace(name, std::move(layout.placement));
  for (const auto& item : model.named_parameters())
    if (!out.count(item.key())) out.emplace(item.key(), Placement::whole_tensor(item.value().sizes().vec()));
  return out;
}

namespace {

// The whole's sizes with the split dimension first.
std::vector<int64_t> moved_sizes(const SliceLayout& layout) {
  auto sizes = layout.placement.whole();
  std::rotate(sizes.begin(), sizes.begin() + layout.dim, sizes.begin() + layout.dim + 1);
  return sizes;
}

}  // namespace

at::Tensor gather_whole(const at::Tensor& local, const SliceLayout& layout) {
  Communicator group = layout.group;
  if (group.size() == 1) return local;
  // Every rank's slice (its parts' shares stacked), then each part's shares in rank order.
  auto x = local.movedim(layout.dim, 0).contiguous();
  const int64_t n = group.size();
  auto gathered = at::empty({n * x.numel()}, x.options());
  group.all_gather(gathered, x);
  auto rest = x.sizes().vec();
  rest.erase(rest.begin());
  std::vector<int64_t> by_rank{n, x.size(0)};
  by_rank.insert(by_rank.end(), rest.begin(), rest.end());
  auto all = gathered.view(by_rank);
  std::vector<at::Tensor> wholes;
  int64_t begin = 0;
  for (const int64_t width : layout.parts) {
    auto part_sizes = rest;
    part_sizes.insert(part_sizes.begin(), width);
    wholes.push_back(all.narrow(1, begin, width / n).reshape(part_sizes));
    begin += width / n;
  }
  return at::cat(wholes, 0).reshape(moved_sizes(layout)).movedim(0, layout.dim).contiguous();
}

at::Tensor local_slice(const at::Tensor& whole, const SliceLayout& layout) {
  auto sizes = layout.placement.whole();
  sizes[static_cast<size_t>(layout.dim)] /= layout.group.size();
  return layout.placement.take(whole).view(sizes);
}

namespace detail {

std::vector<int64_t> fused_part_widths(const PlanEntry& entry, int64_t out_features) {
  if (!entry.fused_sizes.empty()) return entry.fused_sizes;
  return std::vector<int64_t>(static_cast<size_t>(entry.fused), out_features / entry.fused);
}

std::string heads_problem(const PlanEntry& entry, int64_t in_features, int64_t out_features, int tp_size) {
  if (entry.head_dim == 0 || (entry.style != Style::Colwise && entry.style != Style::Rowwise)) return "";
  if (entry.head_dim < 0) return fmt::format("head_dim {} must be 0 (unchecked) or more", entry.head_dim);
  const auto parts = entry.style == Style::Rowwise ? std::vector<int64_t>{in_features} : fused_part_widths(entry, out_features);
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto what = entry.style == Style::Rowwise ? std::string("input")
                      : parts.size() == 1           ? std::string("output")
                                                    : fmt::format("fused part {} of {}", i + 1, parts.size());
    const int64_t features = parts[i], hd = entry.head_dim;
    if (features % hd != 0)
      return fmt::format("its {} has {} features, which are not whole heads of {} (tp {}); check the head size", what,
                         features, hd, tp_size);
    if ((features / hd) % tp_size != 0)
      return fmt::format("its {} has {} features = {} heads of {}, which {} tp ranks cannot share whole; choose a tp "
                         "size that divides {}",
                         what, features, features / hd, hd, tp_size, features / hd);
  }
  return "";
}

at::Tensor slice_of_parts(const at::Tensor& whole, const std::vector<int64_t>& parts, int rank, int size) {
  if (parts.size() == 1) return whole.narrow(0, rank * (parts[0] / size), parts[0] / size);
  std::vector<at::Tensor> shares;
  int64_t begin = 0;
  for (const int64_t width : parts) {
    shares.push_back(whole.narrow(0, begin + rank * (width / size), width / size));
    begin += width;
  }
  return at::cat(shares, 0);
}

}  // namespace detail

GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, const SlicedParameters& sliced, double max_norm,
                        double norm_type) {
  std::vector<at::Tensor> whole, parts;
  // A tied weight is listed once per name by LibTorch's parameters(): counted (and scaled) once, as in PyTorch's
  // and the sharded strategies' clipping.
  std::set<const void*> seen;
  for (const auto& p : parameters)
    if (p.grad().defined() && seen.insert(p.unsafeGetTensorImpl()).second) (sliced.contains(p) ? parts : whole).push_back(p.grad());
  if (whole.empty() && parts.empty()) return GradNorm();
  const auto device = (whole.empty() ? parts : whole).front().device();
  auto part_total = xlr8::parallel::partial_norm(parts, norm_type, device);
  // Every tp rank takes part, sliced gradients or not: the collective pairs by position.
  if (sliced.group) {
    Communicator group = *sliced.group;
    group.all_reduce(part_total, std::isinf(norm_type) ? ReduceOp::MAX : ReduceOp::SUM);
  }
  return GradNorm(xlr8::parallel::scale_to_norm(at::cat({part_total, xlr8::parallel::partial_norm(whole, norm_type, device)}),
                                              {&whole, &parts}, max_norm, norm_type));
}

namespace detail {

namespace {

// One parameter or buffer as every rank must agree on it: its name, whole shape and dtype.
struct WholeEntry {
  std::string name;
  at::Tensor tensor;  // this rank's (a slice when `layout` is set)
  const SliceLayout* layout;
  std::vector<int64_t> whole_sizes;
};

std::string describe(const WholeEntry& e) {
  return fmt::format("{} {} {}", e.name, fmt::join(e.whole_sizes, "x"), c10::toString(e.tensor.scalar_type()));
}

}  // namespace

void take_whole_values_from_main(torch::nn::Module& model, const Communicator& world_group,
                                 const std::map<std::string, at::Tensor>& wholes, const at::Device& device) {
  Communicator world = world_group;
  const bool main = world.rank() == 0;
  if (!main) to_empty(model, device);  // meta until now: memory for this rank's slices only
  const auto layouts = slice_layouts(model);
  std::vector<WholeEntry> entries;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    auto it = layouts.find(name);
    const SliceLayout* layout = it == layouts.end() ? nullptr : &it->second;
    entries.push_back({name, t, layout, layout ? layout->placement.whole() : t.sizes().vec()});
  };
  for (const auto& item : model.named_parameters()) add(item.key(), item.value());
  for (const auto& item : model.named_buffers()) add(item.key(), item.value());
  // What only the main process can see, said to every rank before anything is sent (else the others would
  // wait in a broadcast): a tensor added after the build, or a slice changed after the plan cut it out of
  // the whole value kept (the other ranks' slices of that change exist nowhere).
  std::string problem;
  if (main)
    for (const auto& e : entries) {
      auto it = wholes.find(e.name);
      if (it == wholes.end()) {
        problem = fmt::format("prepare(): {} was added to the model after build_model() (the main process kept no "
                              "whole value of it to send); add parameters and buffers inside build_model()",
                              e.name);
        break;
      }
      if (e.layout && !at::equal(local_slice(it->second, *e.layout), e.tensor.detach().to(it->second.device()))) {
        problem = fmt::format("prepare(): {} changed after the tensor-parallel plan sliced it inside build_model(), "
                              "so only the main process has the new values of its slice; initialise parameters "
                              "before xlr8::tp::parallelize (or parallelize after build_model())",
                              e.name);
        break;
      }
    }
  if (const auto said = world.broadcast_object(problem, 0); !said.empty()) throw ConfigError(said);
  // A model built differently on some rank would pair the broadcasts below wrongly: refuse it first.
  std::string signature;
  for (const auto& e : entries) signature += describe(e) + "\n";
  const auto all = world.all_gather_object(signature);
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0]) {
      const auto a = text::split(all[0], '\n'), b = text::split(all[r], '\n');
      size_t i = 0;
      while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
      throw ConfigError(fmt::format(
          "prepare(): the model built on rank {} differs from the main process's (parameter/buffer {}: {:?} on rank 0, "
          "{:?} on rank {}); build the same model, with the same plan, on every rank",
          r, i, i < a.size() ? a[i] : "nothing", i < b.size() ? b[i] : "nothing", r));
    }
  torch::NoGradGuard no_grad;
  // One receiving buffer per dtype, as large as the largest whole tensor, reused for every tensor: no
  // allocator churn that would keep freed memory resident.
  std::map<at::ScalarType, at::Tensor> receiving;
  if (!main) {
    std::map<at::ScalarType, int64_t> largest;
    for (const auto& e : entries)
      largest[e.tensor.scalar_type()] =
          std::max(largest[e.tensor.scalar_type()], c10::multiply_integers(e.whole_sizes));
    for (const auto& [dtype, n] : largest)
      receiving[dtype] = at::empty({n}, at::TensorOptions().dtype(dtype).device(device));
  }
  for (const auto& e : entries) {
    at::Tensor whole;
    if (main) {
      whole = wholes.at(e.name).to(device, e.tensor.scalar_type()).contiguous();
    } else {
      whole = receiving.at(e.tensor.scalar_type()).narrow(0, 0, c10::multiply_integers(e.whole_sizes)).view(e.whole_sizes);
    }
    world.broadcast(whole, 0);  // one whole tensor alive at a time
    if (!main) {
      auto local = e.layout ? local_slice(whole, *e.layout) : whole;
      at::Tensor target = e.tensor;
      target.copy_(local);
    }
  }
}

}  // namespace detail

}  // namespace xlr8::tp
