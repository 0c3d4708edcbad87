// xlr8::nn::Linear and Embedding: LibTorch's layers (same parameters, initialisation and arithmetic)
// until a tensor-parallel plan gives them a style and a slice.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/functional/embedding.h>
#include <ATen/ops/linear.h>
#include <torch/nn/init.h>

#include <cmath>

#include "parallel/tensor/tp_layer_kinds.hpp"
#include "precision/float8_linear.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"

namespace xlr8::nn {
namespace {

// This rank's first index and length of a dimension that tensor_parallel_problem found divisible.
std::pair<int64_t, int64_t> slice_of(int64_t whole, const Communicator& group) {
  const int64_t local = whole / group.size();
  return {group.rank() * local, local};
}

std::string indivisible(const std::string& what, int64_t size, int tp_size) {
  if (size % tp_size == 0) return "";
  return fmt::format("its {} is {}, which the tp size {} does not divide; choose a tp size that divides it", what, size,
                     tp_size);
}

// Keeps rows [offset, offset + length) of `dim` in the same tensor (set_data: the module's member, its
// parameter dictionary and anything else holding the tensor all see the slice).
void keep_slice(at::Tensor& parameter, int64_t dim, int64_t offset, int64_t length) {
  torch::NoGradGuard no_grad;
  tp::detail::KeepWholeValues::record(parameter);
  parameter.set_data(parameter.narrow(dim, offset, length).clone());
}

}  // namespace

}  // namespace xlr8::nn

namespace xlr8::tp::detail {
namespace {
thread_local KeepWholeValues* keeping_whole_values = nullptr;
}  // namespace

KeepWholeValues::KeepWholeValues() : outer_(keeping_whole_values) { keeping_whole_values = this; }
KeepWholeValues::~KeepWholeValues() { keeping_whole_values = outer_; }

at::Tensor KeepWholeValues::whole_of(const at::Tensor& tensor) const {
  auto it = wholes_.find(tensor.unsafeGetTensorImpl());
  return it == wholes_.end() ? tensor.detach() : it->second;
}

void KeepWholeValues::record(const at::Tensor& tensor) {
  // A detached alias keeps the storage alive after set_data gives the tensor its slice.
  if (keeping_whole_values) keeping_whole_values->wholes_.emplace(tensor.unsafeGetTensorImpl(), tensor.detach());
}

}  // namespace xlr8::tp::detail

namespace xlr8::nn {

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_) : options(options_) { reset(); }

void LinearImpl::reset() {
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias())
    bias = register_parameter("bias", torch::empty(options.out_features()));
  else
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  reset_parameters();
}

void LinearImpl::reset_parameters() {
  // LibTorch's Linear initialisation, draw for draw.
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    auto [fan_in, fan_out] = torch::nn::init::_calculate_fan_in_and_fan_out(weight);
    const double bound = 1 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "xlr8::nn::Linear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << (options.bias() ? "true" : "false");
  if (slot_) stream << ", tp=" << tp::to_string(slot_->style) << " " << slot_->group.rank() << "/" << slot_->group.size();
  stream << ")";
}

at::Tensor LinearImpl::product(const at::Tensor& input, const at::Tensor& with_bias) {
  // at::linear, as Python's F.linear: the bias inside the product (one GEMM with its epilogue, forward and
  // backward) for inputs of any rank. LibTorch's torch::nn::functional::linear folds it in only for 2-D inputs
  // and otherwise adds it in a pass of its own (on an H200 that cost the GPT's step 15 % in bf16).
  if (!float8_ || !(is_training() || float8_->recipe().use_autocast_during_eval)) return at::linear(input, weight, with_bias);
  auto out = fp8::linear(input, weight, float8_, is_training());
  return with_bias.defined() ? out + with_bias.to(out.scalar_type()) : out;
}

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  if (!slot_ || slot_->group.size() == 1) return product(input, bias);
  const auto& s = *slot_;
  if (s.style == tp::Style::Replicate) return product(input, bias);
  if (s.style == tp::Style::Colwise) {
    auto whole = s.sequence_parallel ? tp::gather_from_sequence_region(input, s.group) : tp::copy_to_tp_region(input, s.group);
    auto out = product(whole, bias);
    return s.gather_output ? tp::gather_from_tp_region(out, s.group, -1) : out;
  }
  // Rowwise: the bias once, after the partial products are summed (or summed and split on the sequence).
  auto partial = product(input, at::Tensor());
  auto out = s.sequence_parallel ? tp::reduce_scatter_to_sequence_region(partial, s.group)
                                 : tp::reduce_from_tp_region(partial, s.group);
  return bias.defined() ? out + bias : out;
}

std::string LinearImpl::tensor_parallel_problem(const tp::PlanEntry& entry, int tp_size) const {
  if (slot_) return "it is parallelised already";
  if (entry.fused < 1) return fmt::format("fused {} must be 1 or more", entry.fused);
  const bool fused = entry.fused > 1 || !entry.fused_sizes.empty();
  if (fused && entry.style != tp::Style::Colwise) return "fused parts apply to Colwise only";
  if (entry.gather_output && entry.style != tp::Style::Colwise)
    return "gather_output applies to Colwise only (a row-wise output is whole already)";
  if (entry.sequence_parallel && entry.style != tp::Style::Colwise && entry.style != tp::Style::Rowwise)
    return "sequence_parallel applies to Colwise and Rowwise Linears";
  switch (entry.style) {
    case tp::Style::Colwise: return colwise_problem(entry, tp_size);
    case tp::Style::Rowwise: {
      auto heads = tp::detail::heads_problem(entry, options.in_features(), options.out_features(), tp_size);
      return heads.empty() ? indivisible("in_features", options.in_features(), tp_size) : heads;
    }
    case tp::Style::Replicate: return "";
    case tp::Style::VocabParallel:
    case tp::Style::SequenceParallel: break;
  }
  return fmt::format("a Linear takes Colwise, Rowwise or Replicate, not {}", tp::to_string(entry.style));
}

std::string LinearImpl::colwise_problem(const tp::PlanEntry& entry, int tp_size) const {
  const int64_t out = options.out_features();
  const auto& sizes = entry.fused_sizes;
  if (sizes.empty()) {
    if (out % entry.fused != 0) return fmt::format("its out_features {} is not {} equal fused parts", out, entry.fused);
  } else {
    if (entry.fused != 1 && static_cast<size_t>(entry.fused) != sizes.size())
      return fmt::format("fused {} but {} fused_sizes; give one of them", entry.fused, sizes.size());
    int64_t sum = 0;
    for (const auto width : sizes) {
      if (width < 1) return fmt::format("fused_sizes [{}] must all be 1 or more", fmt::join(sizes, ", "));
      sum += width;
    }
    if (sum != out)
      return fmt::format("its out_features {} is not the sum of fused_sizes [{}] ({})", out, fmt::join(sizes, ", "), sum);
  }
  const auto parts = tp::detail::fused_part_widths(entry, out);
  if (parts.size() > 1 && entry.gather_output) return "gather_output of a fused output is not supported";
  // Whole heads per rank imply divisible widths, and say more when they are not.
  if (auto heads = tp::detail::heads_problem(entry, options.in_features(), out, tp_size); !heads.empty()) return heads;
  if (parts.size() == 1) return indivisible("out_features", out, tp_size);
  for (size_t i = 0; i < parts.size(); ++i)
    if (auto problem = indivisible(fmt::format("fused part {} of {}", i + 1, parts.size()), parts[i], tp_size);
        !problem.empty())
      return problem;
  return "";
}

void LinearImpl::parallelize(const tp::PlanEntry& entry, const Communicator& group) {
  if (auto problem = tensor_parallel_problem(entry, group.size()); !problem.empty())
    throw ConfigError("tensor parallelism: this Linear cannot be parallelised: " + problem);
  if (entry.style == tp::Style::Replicate) {
    slot_ = TensorParallelSlot{entry.style, group, false, 0, {options.out_features()}};
  } else if (entry.style == tp::Style::Colwise) {
    // Each fused part keeps its own slice, then the parts stack again.
    const auto parts = tp::detail::fused_part_widths(entry, options.out_features());
    auto keep_parts = [&](at::Tensor& t) {
      torch::NoGradGuard no_grad;
      tp::detail::KeepWholeValues::record(t);
      t.set_data(tp::detail::slice_of_parts(t, parts, group.rank(), group.size()).clone());
    };
    keep_parts(weight);
    if (bias.defined()) keep_parts(bias);
    const int64_t offset = group.rank() * (parts[0] / group.size());
    slot_ = TensorParallelSlot{entry.style, group, entry.gather_output, offset, parts, entry.sequence_parallel};
  } else {
    auto [offset, local] = slice_of(options.in_features(), group);
    keep_slice(weight, 1, offset, local);
    slot_ = TensorParallelSlot{entry.style, group, false, offset, {options.out_features()}, entry.sequence_parallel};
    // Added to this rank's share of the sequence only: its gradient is partial.
    if (entry.sequence_parallel && bias.defined()) tp::detail::sum_gradient_over(bias, group);
  }
}

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options_) : options(options_) { reset(); }

void EmbeddingImpl::reset() {
  if (auto p = options.padding_idx()) {
    if (*p >= options.num_embeddings() || *p < -options.num_embeddings())
      throw ConfigError(fmt::format("xlr8::nn::Embedding: padding_idx {} is outside the {} embeddings", *p,
                                    options.num_embeddings()));
    if (*p < 0) options.padding_idx(*p + options.num_embeddings());
  }
  if (options._weight().defined()) {
    weight = register_parameter("weight", options._weight());
    return;
  }
  weight = register_parameter("weight", torch::empty({options.num_embeddings(), options.embedding_dim()}));
  reset_parameters();
}

void EmbeddingImpl::reset_parameters() {
  // LibTorch's Embedding initialisation.
  torch::nn::init::normal_(weight);
  if (options.padding_idx()) {
    torch::NoGradGuard no_grad;
    weight[*options.padding_idx()].fill_(0);
  }
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "xlr8::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim();
  if (slot_) stream << ", tp=" << tp::to_string(slot_->style) << " " << slot_->group.rank() << "/" << slot_->group.size();
  stream << ")";
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& input) {
  if (!slot_ || slot_->group.size() == 1 || slot_->style == tp::Style::Replicate)
    return torch::nn::functional::detail::embedding(input, weight, options.padding_idx(), options.max_norm(),
                                                    options.norm_type(), options.scale_grad_by_freq(), options.sparse());
  // Ids outside this rank's rows look up row 0 and are zeroed; the sum over ranks has every id once.
  const auto& s = *slot_;
  const int64_t rows = weight.size(0);
  auto local = input - s.offset;
  auto outside = (local < 0).logical_or(local >= rows);
  auto looked_up = at::embedding(weight, local.masked_fill(outside, 0));
  looked_up = looked_up.masked_fill(outside.unsqueeze(-1), 0);
  return s.sequence_parallel ? tp::reduce_scatter_to_sequence_region(looked_up, s.group)
                             : tp::reduce_from_tp_region(looked_up, s.group);
}

at::Tensor EmbeddingImpl::attend(const at::Tensor& input) {
  if (!slot_ || slot_->group.size() == 1 || slot_->style == tp::Style::Replicate)
    return at::linear(input, weight);
  // This rank's rows score its share of the vocabulary: a column-wise layer over the vocabulary (whose
  // input, under sequence parallelism, is this rank's share of the sequence).
  const auto& s = *slot_;
  auto whole = s.sequence_parallel ? tp::gather_from_sequence_region(input, s.group) : tp::copy_to_tp_region(input, s.group);
  return tp::gather_from_tp_region(at::linear(whole, weight), s.group, -1);
}

std::string EmbeddingImpl::tensor_parallel_problem(const tp::PlanEntry& entry, int tp_size) const {
  if (slot_) return "it is parallelised already";
  if (entry.gather_output) return "gather_output applies to Colwise only";
  if (entry.fused != 1 || !entry.fused_sizes.empty()) return "fused parts apply to Colwise only";
  if (entry.head_dim != 0) return "head_dim applies to Linear layers (attention projections)";
  if (entry.sequence_parallel && entry.style != tp::Style::VocabParallel)
    return "sequence_parallel applies to a VocabParallel Embedding";
  if (entry.style == tp::Style::Replicate) return "";
  if (entry.style != tp::Style::VocabParallel)
    return fmt::format("an Embedding takes VocabParallel or Replicate, not {}", tp::to_string(entry.style));
  if (options.padding_idx() || options.max_norm() || options.scale_grad_by_freq() || options.sparse())
    return "a vocabulary-parallel Embedding supports none of padding_idx, max_norm, scale_grad_by_freq and sparse; "
           "leave it unplanned (replicated) or drop those options";
  return indivisible("num_embeddings", options.num_embeddings(), tp_size);
}

void EmbeddingImpl::parallelize(const tp::PlanEntry& entry, const Communicator& group) {
  if (auto problem = tensor_parallel_problem(entry, group.size()); !problem.empty())
    throw ConfigError("tensor parallelism: this Embedding cannot be parallelised: " + problem);
  if (entry.style == tp::Style::Replicate) {
    slot_ = TensorParallelSlot{entry.style, group, false, 0, {options.num_embeddings()}};
    return;
  }
  auto [offset, local] = slice_of(options.num_embeddings(), group);
  keep_slice(weight, 0, offset, local);
  slot_ = TensorParallelSlot{entry.style, group, false, offset, {options.num_embeddings()}, entry.sequence_parallel};
}

}  // namespace xlr8::nn
