#pragma once
// Tensor parallelism (Megatron's layouts, the styles of PyTorch's parallelize_module): weights split for
// good across a tp group whose ranks all read the same batch. A plan says, by module path, which style
// each layer gets; parallelize() gives the planned layers (xlr8::nn::Linear / Embedding, which are
// LibTorch's own at tp 1) their local slices in place.
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8::tp {

enum class Style {
  // Weight and bias split on the output dimension; the input's gradient is all-reduced in backward.
  // The output stays split on its last dimension (what a row-wise layer expects) unless gathered.
  Colwise,
  // Weight split on the input dimension (the input arrives split on its last dimension); the partial
  // outputs are all-reduced in forward, and the bias, whole on every rank, is added once after that.
  Rowwise,
  // Embedding rows (the vocabulary) split; ids outside this rank's rows give zeros, then the outputs
  // are all-reduced.
  VocabParallel,
};
std::string to_string(Style style);

struct PlanEntry {
  // A module path with `*` standing for any run of characters within one path component
  // ("blocks.*.attn.qkv"), matched against the whole path.
  std::string pattern;
  Style style;
  bool gather_output = false;  // Colwise only: all-gather the output's last dimension (a column-wise head)
};
using Plan = std::vector<PlanEntry>;

// Applies `plan` to a built model (before an optimizer holds its parameters): every module a pattern
// matches must be an xlr8::nn layer of a kind the style fits, and is given this rank's slice of its
// parameters. Errors (ConfigError) name the pattern or path and what exists: a pattern that matches
// nothing, a planned plain LibTorch layer (with the xlr8 type to use), a dimension the tp size does not
// divide, and under `strict` a Linear or Embedding no pattern matched.
void parallelize(torch::nn::Module& model, const Communicator& tp_group, const Plan& plan, bool strict = false);

// True when `pattern` (the PlanEntry syntax) matches the whole of `path`.
bool path_matches(const std::string& pattern, const std::string& path);

// The collectives as autograd functions, each the dual of the other in backward (Megatron's regions).
// Identity forward, all-reduce of the gradient backward: where replicated activations enter a column-wise layer.
at::Tensor copy_to_tp_region(const at::Tensor& x, const Communicator& group);
// All-reduce forward, identity backward: the partial outputs of a row-wise layer.
at::Tensor reduce_from_tp_region(const at::Tensor& x, const Communicator& group);
// All-gather along `dim` forward, this rank's chunk of the gradient backward.
at::Tensor gather_from_tp_region(const at::Tensor& x, const Communicator& group, int64_t dim);

}  // namespace xlr8::tp
