#pragma once
// How a model's parameters are grouped for sharding: stage 3 by units (FSDP's auto wrap policies),
// stages 1-2 by gradient buckets (as DDP). Each plan lists parameters by name, each parameter once
// (a tied parameter belongs to the first name it appears under). Buckets hold only parameters that
// require gradients (stages 1-2 keep frozen ones whole: they have neither gradients nor optimizer
// state to shard); stage 3 shards frozen parameters too, in a group of their own per unit.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "xlr8/zero.hpp"

namespace xlr8::detail {

struct ParameterGroupPlan {
  std::string label;
  const torch::nn::Module* unit = nullptr;  // stage 3: the module whose guard gathers the group
  bool frozen = false;                       // its parameters require no gradients
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
};

// Units in module order, then the root's own groups (the parameters no unit took), if any; a unit's
// trainable group comes before its frozen one. An unknown
// class in TRANSFORMER_BASED_WRAP is a ConfigError naming the classes the model has.
std::vector<ParameterGroupPlan> plan_units(const torch::nn::Module& root, const ZeroOptions& options);
// Buckets of consecutive parameters in reverse order (the order their gradients become ready).
std::vector<ParameterGroupPlan> plan_buckets(const torch::nn::Module& root, const ZeroOptions& options);

// Whether `class_name` (as the config names it) means the module class `reported` (Module::name(),
// e.g. "gpt::BlockImpl"): the full name, the name without namespaces, or either without "Impl".
bool layer_class_matches(const std::string& class_name, const std::string& reported);

}  // namespace xlr8::detail
