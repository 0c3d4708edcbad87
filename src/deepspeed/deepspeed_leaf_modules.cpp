// DeepSpeed's set_z3_leaf_modules (and its _by_name, _by_suffix forms): the modules ZeRO-3 gathers whole, as
// one unit with none below it.
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <functional>

#include "core/text.hpp"
#include "parallel/shard/unit_registry.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "xlr8/deepspeed.hpp"
#include "xlr8/error.hpp"

namespace xlr8::deepspeed {
namespace {

// Marks every module of `model` that `matches` (by its class name and path); ConfigError naming `what`
// when none does.
int mark_leaves(torch::nn::Module& model, const std::vector<std::string>& wanted, const char* what,
                const std::function<bool(const std::string&, const std::string&, const std::string&)>& matches) {
  int marked = 0;
  for (const auto& want : wanted)
    for (const auto& item : model.named_modules("", /*include_self=*/false))
      if (matches(want, item.value()->name(), item.key())) {
        shard::mark_leaf_module(*item.value());
        ++marked;
      }
  if (marked == 0)
    throw ConfigError(fmt::format("{}: no module of the model matches {}", what, text::join(wanted)));
  return marked;
}

}  // namespace

int set_z3_leaf_modules(torch::nn::Module& model, const std::vector<std::string>& classes) {
  return mark_leaves(model, classes, "set_z3_leaf_modules (zero_optimization.leaf_module.classes)",
                     [](const std::string& want, const std::string& cls, const std::string&) {
                       return shard::layer_class_matches(want, cls);
                     });
}

int set_z3_leaf_modules_by_name(torch::nn::Module& model, const std::vector<std::string>& names) {
  return mark_leaves(model, names, "set_z3_leaf_modules_by_name (zero_optimization.leaf_module.names)",
                     [](const std::string& want, const std::string&, const std::string& path) { return want == path; });
}

int set_z3_leaf_modules_by_suffix(torch::nn::Module& model, const std::vector<std::string>& suffixes) {
  return mark_leaves(model, suffixes, "set_z3_leaf_modules_by_suffix (zero_optimization.leaf_module.name_suffixes)",
                     [](const std::string& want, const std::string&, const std::string& path) {
                       return path == want || (path.size() > want.size() + 1 &&
                                               path.compare(path.size() - want.size(), want.size(), want) == 0 &&
                                               path[path.size() - want.size() - 1] == '.');
                     });
}

}  // namespace xlr8::deepspeed
