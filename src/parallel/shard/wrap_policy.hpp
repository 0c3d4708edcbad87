#pragma once
// How a model's parameters are grouped for sharding: stage 3 by units (FSDP's auto wrap policies),
// stages 1-2 by gradient buckets (as DDP). Each plan lists parameters by name, each parameter once (a tied
// parameter under the first name it appears under, in the deepest unit that holds all its names). Buckets hold
// only parameters that require gradients (stages 1-2 keep frozen ones whole: they have neither gradients nor
// optimizer state to shard); stage 3 shards frozen parameters too, in a group of their own per unit.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "xlr8/zero.hpp"

namespace xlr8::shard {

struct UnitPlan {
  std::string label;                          // the module's path, "(root)", or "bucket k"
  const torch::nn::Module* module = nullptr;  // stage 3: the module whose guard gathers the unit; buckets: null
  bool named_by_user = false;                 // its class is a block class (the config's or the model's)
  struct Group {
    std::vector<std::string> names;
    std::vector<at::Tensor> params;  // all trainable, or all frozen
  };
  std::vector<Group> groups;  // none empty; a unit's trainable group before its frozen one
};

// Units in module order (none below a leaf module), then "(persistent)" (parameters under
// param_persistence_threshold; no module: never freed) and the root (the parameters no unit took), each
// if it holds any (GUARDED_MODULES keeps the others empty too: they may host unguarded ones).
// TRANSFORMER_BASED_WRAP takes options.layer_classes, else the model's declared block classes; none, or an
// unknown class, is a ConfigError naming the classes the model has (and, for none, what to declare).
std::vector<UnitPlan> plan_units(const torch::nn::Module& root, const ZeroOptions& options);
// The block classes `root` and the modules inside it declare (xlr8::NoSplitModules), each once, in module
// order.
std::vector<std::string> declared_block_classes(const torch::nn::Module& root);
// Buckets of consecutive trainable parameters in reverse order (the order their gradients become ready):
// the first up to `first_bucket_mb`, the others up to `bucket_cap_mb`, each of one dtype and device.
// DDP's and ZeRO-1/2's.
std::vector<UnitPlan> plan_buckets(const torch::nn::Module& root, double first_bucket_mb, double bucket_cap_mb);

// Whether `class_name` (as the config names it) means the module class `reported` (Module::name(),
// e.g. "gpt::BlockImpl"): the full name, the name without namespaces, or either without "Impl".
bool layer_class_matches(const std::string& class_name, const std::string& reported);
// LibTorch's own modules (torch::nn::Linear, Sequential, ...) and xlr8's drop-in layers (xlr8::nn::Linear,
// Embedding): their forwards are the libraries', which open no guard.
bool opens_no_guard(const torch::nn::Module& module);
// Whether the policy's units are blocks of classes the user names (or the root alone), whose forward opens its
// guard: units that may start freed. Units chosen by size may be modules that open none.
inline bool units_open_guards(AutoWrapPolicy policy) {
  return policy == AutoWrapPolicy::TRANSFORMER_BASED_WRAP || policy == AutoWrapPolicy::NO_WRAP;
}

}  // namespace xlr8::shard
