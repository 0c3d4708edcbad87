#include "parallel/shard/wrap_policy.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <optional>
#include <utility>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "parallel/shard/unit_registry.hpp"
#include "xlr8/error.hpp"
#include "xlr8/unshard.hpp"

namespace xlr8 {
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

using ModuleDict = torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>;

std::string without_namespaces(const std::string& name) {
  auto pos = name.rfind("::");
  return pos == std::string::npos ? name : name.substr(pos + 2);
}

}  // namespace

namespace {

// The config's spelling of each mode; a table serves both directions.
constexpr std::pair<AutoWrapPolicy, const char*> kWrapPolicies[] = {
    {AutoWrapPolicy::TRANSFORMER_BASED_WRAP, "TRANSFORMER_BASED_WRAP"},
    {AutoWrapPolicy::SIZE_BASED_WRAP, "SIZE_BASED_WRAP"},
    {AutoWrapPolicy::NO_WRAP, "NO_WRAP"},
    {AutoWrapPolicy::GUARDED_MODULES, "GUARDED_MODULES"}};
constexpr std::pair<BackwardPrefetch, const char*> kPrefetchModes[] = {
    {BackwardPrefetch::BACKWARD_PRE, "BACKWARD_PRE"},
    {BackwardPrefetch::BACKWARD_POST, "BACKWARD_POST"},
    {BackwardPrefetch::NONE, "NO_PREFETCH"}};

template <class Mode, size_t N>
std::optional<Mode> mode_named(const std::string& value, const std::pair<Mode, const char*> (&table)[N]) {
  for (const auto& [mode, name] : table)
    if (value == name) return mode;
  return std::nullopt;
}

template <class Mode, size_t N>
const char* name_of(Mode mode, const std::pair<Mode, const char*> (&table)[N]) {
  for (const auto& [candidate, name] : table)
    if (candidate == mode) return name;
  return "?";
}

}  // namespace

AutoWrapPolicy parse_auto_wrap_policy(const std::string& value, const std::string& key) {
  if (auto mode = mode_named(value, kWrapPolicies)) return *mode;
  throw ConfigError(fmt::format("{} {:?}: allowed values are TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP and NO_WRAP",
                                key, value));
}

BackwardPrefetch parse_backward_prefetch(const std::string& value, const std::string& key) {
  if (value.empty()) return BackwardPrefetch::NONE;
  if (auto mode = mode_named(value, kPrefetchModes)) return *mode;
  throw ConfigError(fmt::format("{} {:?} is not a prefetch mode; use BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH or "
                                "leave it empty",
                                key, value));
}

const char* to_string(AutoWrapPolicy policy) { return name_of(policy, kWrapPolicies); }
const char* to_string(BackwardPrefetch prefetch) { return name_of(prefetch, kPrefetchModes); }

namespace shard {

bool opens_no_guard(const torch::nn::Module& module) {
  const auto& name = module.name();
  return name.rfind("torch::nn::", 0) == 0 || name.rfind("xlr8::nn::", 0) == 0;
}

bool layer_class_matches(const std::string& class_name, const std::string& reported) {
  for (const auto& candidate : {reported, without_namespaces(reported)}) {
    if (class_name == candidate) return true;
    if (candidate.size() > 4 && candidate.compare(candidate.size() - 4, 4, "Impl") == 0 &&
        class_name == candidate.substr(0, candidate.size() - 4))
      return true;
  }
  return false;
}

std::vector<std::string> declared_block_classes(const torch::nn::Module& root) {
  std::vector<std::string> out;
  auto add = [&](const torch::nn::Module& module) {
    if (const auto* declared = dynamic_cast<const NoSplitModules*>(&module))
      for (const auto& name : declared->no_split_modules())
        if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  };
  add(root);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) add(*item.value());
  return out;
}

namespace {

// TRANSFORMER_BASED_WRAP: each module of a block class is a unit. The classes are the config's, else
// the model's declaration (Accelerate falls back to `_no_split_modules` when the key is absent).
std::vector<UnitPlan> transformer_units(const torch::nn::Module& root, const ModuleDict& modules,
                                        const std::vector<std::string>& configured) {
  const auto classes = configured.empty() ? declared_block_classes(root) : configured;
  std::vector<UnitPlan> units;
  std::set<std::string> matched, present;
  for (const auto& item : modules) {
    present.insert(without_namespaces(item.value()->name()));
    for (const auto& cls : classes)
      if (layer_class_matches(cls, item.value()->name())) {
        matched.insert(cls);
        units.push_back({item.key(), item.value().get(), /*named_by_user=*/true, {}});
        break;
      }
  }
  if (classes.empty())
    throw ConfigError(fmt::format(
        "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP needs the classes of the model's blocks: set "
        "fsdp_transformer_layer_cls_to_wrap (the model's classes are {}), or declare them in the model as Accelerate "
        "reads a model's _no_split_modules: derive {} also from xlr8::NoSplitModules and return the names from "
        "no_split_modules(), e.g. {{\"Block\"}} (xlr8/unshard.hpp)",
        fmt::join(present, ", "), root.name()));
  const std::string source = configured.empty() ? "the model's no_split_modules()" : "fsdp_transformer_layer_cls_to_wrap";
  for (const auto& cls : classes)
    if (!matched.count(cls))
      throw ConfigError(fmt::format("{}: the model has no module of class {:?}; its classes are {}", source, cls,
                                    fmt::join(present, ", ")));
  return units;
}

}  // namespace

std::vector<UnitPlan> plan_units(const torch::nn::Module& root, const ZeroOptions& options) {
  const auto params = distinct_parameters(root, /*trainable_only=*/false);
  auto modules = root.named_modules("", /*include_self=*/false);
  // Nothing below a leaf module is a unit of its own: the leaf's unit (or its parent's) holds it whole.
  std::vector<std::string> leaves;
  for (const auto& item : modules)
    if (is_leaf_module(*item.value())) leaves.push_back(item.key());
  if (!leaves.empty()) {
    ModuleDict kept;
    for (const auto& item : modules)
      if (std::none_of(leaves.begin(), leaves.end(), [&](const std::string& leaf) { return inside(item.key(), leaf); }))
        kept.insert(item.key(), item.value());
    modules = std::move(kept);
  }
  std::vector<UnitPlan> units;  // in module order
  if (options.auto_wrap_policy == AutoWrapPolicy::TRANSFORMER_BASED_WRAP) {
    units = transformer_units(root, modules, options.layer_classes);
  } else if (options.auto_wrap_policy == AutoWrapPolicy::SIZE_BASED_WRAP) {
    // Bottom-up (reverse module order puts every module after its descendants): a module becomes a unit
    // when the parameters below it that no smaller unit took reach min_num_params. LibTorch's and
    // xlr8's layers never do: they cannot open a guard, so they would stay whole on every rank.
    std::vector<std::pair<std::string, const torch::nn::Module*>> all;
    for (const auto& item : modules)
      if (!opens_no_guard(*item.value())) all.emplace_back(item.key(), item.value().get());
    std::vector<bool> taken(params.size(), false);
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      int64_t count = 0;
      std::vector<size_t> mine;
      for (size_t k = 0; k < params.size(); ++k)
        if (!taken[k] && inside(params[k].name, it->first)) count += params[k].tensor.numel(), mine.push_back(k);
      if (count >= options.min_num_params && !mine.empty()) {
        for (auto k : mine) taken[k] = true;
        units.push_back({it->first, it->second, false, {}});
      }
    }
    std::reverse(units.begin(), units.end());
  } else if (options.auto_wrap_policy == AutoWrapPolicy::GUARDED_MODULES) {
    // Every module that can open a guard; which do is seen when the model runs. Kept even without
    // parameters of its own: a guarded block of unguarded children is their host. xlr8's drop-in layers
    // (an Embedding, a tied head) are not: their parameters join the unit around them, as LibTorch's do.
    for (const auto& item : modules)
      if (!opens_no_guard(*item.value())) units.push_back({item.key(), item.value().get(), false, {}});
  }
  // Every name of each tensor: a tied parameter belongs to the deepest unit holding all of them, since a unit that
  // holds one name is freed while another module may still use the tensor.
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names_of;
  for (const auto& item : root.named_parameters()) names_of[item.value().unsafeGetTensorImpl()].push_back(item.key());
  // Each parameter goes to the deepest unit that contains it; the rest to the root. Frozen parameters
  // form a second group of the same unit: no gradient hooks, released when the unit's backward is done.
  // Parameters below the persistence threshold go to a unit of no module, never freed.
  const size_t persistent_index = units.size(), root_index = persistent_index + 1;
  units.push_back({"(persistent)", nullptr, false, {}});
  units.push_back({"(root)", &root, false, {}});
  std::vector<UnitPlan::Group> trainable(units.size()), frozen(units.size());
  for (const auto& p : params) {
    const auto& names = names_of.at(p.tensor.unsafeGetTensorImpl());
    size_t best = root_index;
    for (size_t u = 0; u < persistent_index; ++u)
      if (std::all_of(names.begin(), names.end(), [&](const std::string& name) { return inside(name, units[u].label); }) &&
          (best == root_index || units[u].label.size() > units[best].label.size()))
        best = u;
    if (p.tensor.numel() < options.param_persistence_threshold) best = persistent_index;
    auto& group = p.tensor.requires_grad() ? trainable[best] : frozen[best];
    group.names.push_back(p.name);
    group.params.push_back(p.tensor);
  }
  std::vector<UnitPlan> out;
  for (size_t u = 0; u < units.size(); ++u) {
    for (auto* group : {&trainable[u], &frozen[u]})
      if (!group->params.empty()) units[u].groups.push_back(std::move(*group));
    // The root too: a model whose parameters all sit in modules of its own classes still has its
    // guard, the host of those that open none.
    const bool keep_empty = options.auto_wrap_policy == AutoWrapPolicy::GUARDED_MODULES && u != persistent_index;
    if (!units[u].groups.empty() || keep_empty) out.push_back(std::move(units[u]));
  }
  return out;
}

std::vector<UnitPlan> plan_buckets(const torch::nn::Module& root, double first_bucket_mb, double bucket_cap_mb) {
  const auto params = distinct_parameters(root, /*trainable_only=*/true);
  std::vector<UnitPlan> out;
  double used = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const double bytes = static_cast<double>(it->tensor.numel() * it->tensor.element_size());
    const double cap = (out.size() <= 1 ? first_bucket_mb : bucket_cap_mb) * 1024 * 1024;
    bool fits = !out.empty() && used + bytes <= cap &&
                out.back().groups[0].params.front().scalar_type() == it->tensor.scalar_type() &&
                out.back().groups[0].params.front().device() == it->tensor.device();
    if (!fits) {
      out.push_back({fmt::format("bucket {}", out.size()), nullptr, false, {UnitPlan::Group{}}});
      used = 0;
    }
    out.back().groups[0].names.push_back(it->name);
    out.back().groups[0].params.push_back(it->tensor);
    used += bytes;
  }
  return out;
}

}  // namespace shard
}  // namespace xlr8
