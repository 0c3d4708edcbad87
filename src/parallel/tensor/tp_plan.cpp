// Applying a tensor-parallel plan: module path patterns -> styles, checked against the model.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <map>
#include <set>

#include "parallel/tensor/tp_layer_kinds.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::tp {

std::string to_string(Style style) {
  switch (style) {
    case Style::Colwise: return "Colwise";
    case Style::Rowwise: return "Rowwise";
    case Style::VocabParallel: return "VocabParallel";
    case Style::Replicate: return "Replicate";
    case Style::SequenceParallel: return "SequenceParallel";
  }
  return "?";
}

bool path_matches(const std::string& pattern, const std::string& path) {
  // Glob with `*` confined to one path component: backtracking over the last star is enough.
  size_t p = 0, s = 0, star = std::string::npos, resume = 0;
  while (s < path.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = s;
    } else if (p < pattern.size() && pattern[p] == path[s]) {
      ++p, ++s;
    } else if (star != std::string::npos && path[resume] != '.') {
      p = star + 1;
      s = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

namespace {

std::string listed(const std::vector<std::string>& paths) {
  constexpr size_t kShown = 24;
  std::vector<std::string> shown(paths.begin(), paths.begin() + static_cast<std::ptrdiff_t>(std::min(paths.size(), kShown)));
  auto text = fmt::format("{}", fmt::join(shown, ", "));
  if (paths.size() > kShown) text += fmt::format(", ... ({} in all)", paths.size());
  return text;
}

// A SequenceParallel module saw only this rank's share of the sequence. Each parameter is hooked once,
// even when entries nest.
void sum_gradients_over(torch::nn::Module& module, const Communicator& group, std::set<const c10::TensorImpl*>& hooked) {
  for (auto& p : module.parameters(/*recurse=*/true))
    if (hooked.insert(p.unsafeGetTensorImpl()).second) detail::sum_gradient_over(p, group);
}

}  // namespace

namespace detail {

bool is_plain_torch_layer(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::LinearImpl*>(&m) || dynamic_cast<const torch::nn::EmbeddingImpl*>(&m);
}

void sum_gradient_over(at::Tensor& parameter, const Communicator& group) {
  if (group.size() == 1 || !parameter.requires_grad()) return;
  parameter.register_hook([group](const at::Tensor& grad) {
    auto sum = grad.contiguous().clone();
    Communicator(group).all_reduce(sum);
    return sum;
  });
}

bool is_layer(const torch::nn::Module& m) {
  return dynamic_cast<const nn::LinearImpl*>(&m) || dynamic_cast<const nn::EmbeddingImpl*>(&m) || is_plain_torch_layer(m);
}

}  // namespace detail

namespace {

// The model's modules and, for each, the plan entry that matched it (-1: none).
struct MatchedModules {
  std::vector<std::string> paths, layers;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::vector<int> entry_of;
};

// Every pattern must match, and a module gets at most one style.
MatchedModules match_tp_plan(torch::nn::Module& model, const Plan& plan) {
  MatchedModules m;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    m.paths.push_back(item.key());
    m.modules.push_back(item.value());
    if (detail::is_layer(*item.value())) m.layers.push_back(item.key());
  }
  m.entry_of.assign(m.paths.size(), -1);
  for (size_t e = 0; e < plan.size(); ++e) {
    bool matched = false;
    for (size_t i = 0; i < m.paths.size(); ++i) {
      if (!path_matches(plan[e].pattern, m.paths[i])) continue;
      matched = true;
      if (m.entry_of[i] >= 0)
        throw ConfigError(fmt::format("tp plan: module '{}' is matched by both '{}' and '{}'; make the patterns disjoint",
                                      m.paths[i], plan[static_cast<size_t>(m.entry_of[i])].pattern, plan[e].pattern));
      m.entry_of[i] = static_cast<int>(e);
    }
    if (!matched)
      throw ConfigError(fmt::format("tp plan: pattern '{}' matches no module; the model's layers are: {}", plan[e].pattern,
                                    listed(m.layers.empty() ? m.paths : m.layers)));
  }
  return m;
}

using ParameterNames = std::map<const c10::TensorImpl*, std::vector<std::string>>;  // parameter -> its names

// A norm or dropout planned SequenceParallel: whole, its gradients summed over tp. Not a module holding layers
// (their slices would be summed too), nor a weight tied to a use outside the split sequence.
void sequence_parallel_module_problems(const std::string& path, torch::nn::Module& m, const ParameterNames& holders,
                                       std::vector<std::string>& problems) {
  std::vector<std::string> inner;
  for (const auto& sub : m.named_modules(path, /*include_self=*/false))
    if (detail::is_layer(*sub.value())) inner.push_back(sub.key());
  if (!inner.empty())
    problems.push_back(fmt::format("'{}' (SequenceParallel) holds layers ({}); SequenceParallel is for norms and "
                                   "dropouts: plan it on those modules alone",
                                   path, fmt::join(inner, ", ")));
  for (const auto& p : m.named_parameters(/*recurse=*/true))
    if (const auto& names = holders.at(p.value().unsafeGetTensorImpl()); names.size() > 1)
      problems.push_back(fmt::format("'{}' (SequenceParallel): its {} is tied ({}); a tied weight would have its "
                                     "gradient summed over tp where it is whole",
                                     path, p.key(), fmt::join(names, ", ")));
}

// What is wrong with slicing the layer at `path` as `entry` says ("": nothing); a ConfigError for a module
// that cannot be sliced at all.
std::string layer_problem(const std::string& path, torch::nn::Module& m, const PlanEntry& entry, int tp_size,
                          const std::vector<std::string>& layers) {
  if (entry.sequence_parallel && entry.style == Style::SequenceParallel)
    return "sequence_parallel is a flag of Colwise, Rowwise and VocabParallel entries";
  if (auto* linear = dynamic_cast<nn::LinearImpl*>(&m)) return linear->tensor_parallel_problem(entry, tp_size);
  if (auto* embedding = dynamic_cast<nn::EmbeddingImpl*>(&m)) return embedding->tensor_parallel_problem(entry, tp_size);
  if (detail::is_plain_torch_layer(m)) {
    if (entry.style == Style::Replicate) return "";  // kept whole: LibTorch's own layer does that already
    throw ConfigError(fmt::format(
        "tp plan: '{}' ({}) is LibTorch's own layer, whose forward cannot take tensor parallelism's collectives; "
        "build it as xlr8::nn::{} (same parameters, same results at tp 1)",
        path, m.name(), dynamic_cast<torch::nn::LinearImpl*>(&m) ? "Linear" : "Embedding"));
  }
  throw ConfigError(fmt::format("tp plan: pattern '{}' matches '{}' ({}), which is not a Linear or Embedding; the "
                                "model's layers are: {}",
                                entry.pattern, path, m.name(), listed(layers)));
}

}  // namespace

void parallelize(torch::nn::Module& model, const Communicator& tp_group, const Plan& plan, bool strict) {
  if (!tp_group.valid()) throw ConfigError("tp::parallelize: the tp group is not a valid communicator");
  const auto matched = match_tp_plan(model, plan);
  const auto& paths = matched.paths;
  // Everything is checked before anything is sliced: an error leaves the model as it was.
  ParameterNames holders;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) holders[p.value().unsafeGetTensorImpl()].push_back(p.key());
  std::vector<std::string> unplanned, problems;
  for (size_t i = 0; i < paths.size(); ++i) {
    auto* m = matched.modules[i].get();
    if (matched.entry_of[i] < 0) {
      if (detail::is_layer(*m)) unplanned.push_back(paths[i]);
      continue;
    }
    const auto& entry = plan[static_cast<size_t>(matched.entry_of[i])];
    if (entry.style == Style::SequenceParallel && !detail::is_layer(*m)) {
      sequence_parallel_module_problems(paths[i], *m, holders, problems);
      continue;
    }
    const bool plain_replicated = detail::is_plain_torch_layer(*m) && entry.style == Style::Replicate;
    const auto problem = layer_problem(paths[i], *m, entry, tp_group.size(), matched.layers);
    if (plain_replicated) continue;
    if (!problem.empty()) problems.push_back(fmt::format("'{}' ({}): {}", paths[i], to_string(entry.style), problem));
    // A tied weight (one tensor under two names) would be sliced for one layer and silently for the other.
    if (entry.style != Style::Replicate && entry.style != Style::SequenceParallel)
      for (const auto& p : m->named_parameters(/*recurse=*/false))
        if (const auto& names = holders.at(p.value().unsafeGetTensorImpl()); names.size() > 1)
          problems.push_back(fmt::format("'{}': its {} is tied ({}); tied weights under tensor parallelism are not "
                                         "supported yet: untie them or leave the layers unplanned",
                                         paths[i], p.key(), fmt::join(names, ", ")));
  }
  if (!problems.empty())
    throw ConfigError(fmt::format("tp plan on {} ranks: {}", tp_group.size(), fmt::join(problems, "; ")));
  if (strict && !unplanned.empty())
    throw ConfigError(fmt::format("tp plan (strict): no pattern covers {}; add them to the plan or turn strict off",
                                  listed(unplanned)));
  std::set<const c10::TensorImpl*> hooked;
  for (size_t i = 0; i < paths.size(); ++i) {
    if (matched.entry_of[i] < 0) continue;
    const auto& entry = plan[static_cast<size_t>(matched.entry_of[i])];
    if (entry.style == Style::SequenceParallel)
      sum_gradients_over(*matched.modules[i], tp_group, hooked);
    else if (auto* linear = dynamic_cast<nn::LinearImpl*>(matched.modules[i].get()))
      linear->parallelize(entry, tp_group);
    else if (auto* embedding = dynamic_cast<nn::EmbeddingImpl*>(matched.modules[i].get()))
      embedding->parallelize(entry, tp_group);
  }
}

void check_whole_heads(const torch::nn::Module& model, int64_t head_dim) {
  if (head_dim == 0) return;
  std::vector<std::string> problems;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto* linear = dynamic_cast<const nn::LinearImpl*>(item.value().get());
    if (!linear || !linear->tensor_parallel() || !detail::is_attention_projection(item.key())) continue;
    // The entry that split it, as far as the heads go: its style and its fused parts' whole widths.
    const auto& slot = *linear->tensor_parallel();
    PlanEntry entry{item.key(), slot.style};
    if (slot.parts.size() > 1) entry.fused_sizes = slot.parts;
    entry.head_dim = head_dim;
    const auto& options = linear->options;
    if (auto problem = detail::heads_problem(entry, options.in_features(), options.out_features(), slot.group.size());
        !problem.empty())
      problems.push_back(fmt::format("'{}' ({}): {}", item.key(), to_string(slot.style), problem));
  }
  if (!problems.empty())
    throw ConfigError(fmt::format("the model's tp split cuts attention heads: {}", fmt::join(problems, "; ")));
}

}  // namespace xlr8::tp
