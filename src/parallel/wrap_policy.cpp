#include "parallel/wrap_policy.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <set>
#include <unordered_set>

#include "xlr8/error.hpp"

namespace xlr8::detail {
namespace {

struct NamedParameter {
  std::string name;
  at::Tensor tensor;
};

std::vector<NamedParameter> distinct_parameters(const torch::nn::Module& root, bool trainable_only) {
  std::vector<NamedParameter> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : root.named_parameters())
    if ((item.value().requires_grad() || !trainable_only) && seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.push_back({item.key(), item.value()});
  return out;
}

bool inside(const std::string& name, const std::string& module_path) {
  return name.size() > module_path.size() && name.compare(0, module_path.size(), module_path) == 0 &&
         name[module_path.size()] == '.';
}

std::string without_namespaces(const std::string& name) {
  auto pos = name.rfind("::");
  return pos == std::string::npos ? name : name.substr(pos + 2);
}

}  // namespace

bool layer_class_matches(const std::string& class_name, const std::string& reported) {
  for (const auto& candidate : {reported, without_namespaces(reported)}) {
    if (class_name == candidate) return true;
    if (candidate.size() > 4 && candidate.compare(candidate.size() - 4, 4, "Impl") == 0 &&
        class_name == candidate.substr(0, candidate.size() - 4))
      return true;
  }
  return false;
}

std::vector<ParameterGroupPlan> plan_units(const torch::nn::Module& root, const ZeroOptions& options) {
  const auto params = distinct_parameters(root, /*trainable_only=*/false);
  const auto modules = root.named_modules("", /*include_self=*/false);
  std::vector<std::pair<std::string, const torch::nn::Module*>> units;  // path, module; in module order
  if (options.auto_wrap_policy == "TRANSFORMER_BASED_WRAP") {
    if (options.layer_classes.empty())
      throw ConfigError("fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP needs fsdp_transformer_layer_cls_to_wrap (the "
                        "class names of the model's layers, e.g. Block)");
    std::set<std::string> matched, present;
    for (const auto& item : modules) {
      present.insert(without_namespaces(item.value()->name()));
      for (const auto& cls : options.layer_classes)
        if (layer_class_matches(cls, item.value()->name())) {
          matched.insert(cls);
          units.emplace_back(item.key(), item.value().get());
          break;
        }
    }
    for (const auto& cls : options.layer_classes)
      if (!matched.count(cls))
        throw ConfigError(fmt::format("fsdp_transformer_layer_cls_to_wrap: the model has no module of class {:?}; its "
                                      "classes are {}",
                                      cls, fmt::join(present, ", ")));
  } else if (options.auto_wrap_policy == "SIZE_BASED_WRAP") {
    // Bottom-up (reverse module order puts every module after its descendants): a module becomes a unit
    // when the parameters below it that no smaller unit took reach min_num_params.
    std::vector<std::pair<std::string, const torch::nn::Module*>> all;
    for (const auto& item : modules) all.emplace_back(item.key(), item.value().get());
    std::vector<bool> taken(params.size(), false);
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      int64_t count = 0;
      std::vector<size_t> mine;
      for (size_t k = 0; k < params.size(); ++k)
        if (!taken[k] && inside(params[k].name, it->first)) count += params[k].tensor.numel(), mine.push_back(k);
      if (count >= options.min_num_params && !mine.empty()) {
        for (auto k : mine) taken[k] = true;
        units.push_back(*it);
      }
    }
    std::reverse(units.begin(), units.end());
  } else if (options.auto_wrap_policy != "NO_WRAP") {
    throw ConfigError(fmt::format("fsdp_auto_wrap_policy {:?}: allowed values are TRANSFORMER_BASED_WRAP, "
                                  "SIZE_BASED_WRAP and NO_WRAP",
                                  options.auto_wrap_policy));
  }
  // Each parameter goes to the deepest unit that contains it; the rest to the root. Frozen parameters
  // form a second group of the same unit: no gradient hooks, released when the unit's backward is done.
  const size_t root_index = units.size();
  units.emplace_back("(root)", &root);
  std::vector<ParameterGroupPlan> trainable(units.size()), frozen(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    trainable[u] = {units[u].first, units[u].second, false, {}, {}};
    frozen[u] = {units[u].first + " (frozen)", units[u].second, true, {}, {}};
  }
  for (const auto& p : params) {
    size_t best = root_index;
    for (size_t u = 0; u < root_index; ++u)
      if (inside(p.name, units[u].first) && (best == root_index || units[u].first.size() > units[best].first.size()))
        best = u;
    auto& plan = p.tensor.requires_grad() ? trainable[best] : frozen[best];
    plan.names.push_back(p.name);
    plan.params.push_back(p.tensor);
  }
  std::vector<ParameterGroupPlan> out;
  for (size_t u = 0; u < units.size(); ++u)
    for (auto* plan : {&trainable[u], &frozen[u]})
      if (!plan->params.empty()) out.push_back(std::move(*plan));
  return out;
}

std::vector<ParameterGroupPlan> plan_buckets(const torch::nn::Module& root, const ZeroOptions& options) {
  const auto params = distinct_parameters(root, /*trainable_only=*/true);
  std::vector<ParameterGroupPlan> out;
  double used = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const double bytes = static_cast<double>(it->tensor.numel() * it->tensor.element_size());
    const double cap = (out.size() <= 1 ? options.first_bucket_mb : options.bucket_cap_mb) * 1024 * 1024;
    bool fits = !out.empty() && used + bytes <= cap &&
                out.back().params.front().scalar_type() == it->tensor.scalar_type() &&
                out.back().params.front().device() == it->tensor.device();
    if (!fits) {
      out.push_back({fmt::format("bucket {}", out.size()), nullptr, false, {}, {}});
      used = 0;
    }
    out.back().names.push_back(it->name);
    out.back().params.push_back(it->tensor);
    used += bytes;
  }
  return out;
}

}  // namespace xlr8::detail
