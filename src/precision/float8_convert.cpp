// Which Linear layers of a model train in fp8, and the report of that choice (float8.hpp).
#include <fmt/format.h>
#include <torch/nn/modules/linear.h>

#include "precision/float8_linear.hpp"
#include "xlr8/error.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/nn.hpp"

namespace xlr8::fp8 {
namespace {

struct FoundLinear {
  std::string path;
  nn::LinearImpl* layer = nullptr;  // null: a plain torch::nn::Linear
};

std::vector<FoundLinear> linears_in_order(torch::nn::Module& model) {
  std::vector<FoundLinear> found;
  auto visit = [&](const std::string& path, torch::nn::Module& module) {
    if (auto* layer = module.as<nn::LinearImpl>())
      found.push_back({path, layer});
    else if (module.as<torch::nn::LinearImpl>())
      found.push_back({path, nullptr});
  };
  visit("(the model)", model);  // by reference: a model on the stack has no shared_ptr to give named_modules
  for (const auto& item : model.named_modules("", /*include_self=*/false)) visit(item.key(), *item.value());
  return found;
}

// Why this layer stays in the compute dtype, or "" when it converts. The widths are this rank's (a tensor-parallel
// slice is what the gemm sees).
std::string reason_to_skip(const FoundLinear& f, size_t index, size_t count, const LayerFilter& filter) {
  if (!f.layer)
    return "a torch::nn::Linear: build it as xlr8::nn::Linear (the same parameters and arithmetic) to train it in fp8";
  if (filter.skip_first_and_last && (index == 0 || index + 1 == count))
    return fmt::format("the model's {} Linear, kept in the compute dtype for stability (Accelerate's filter for AO; "
                       "Fp8Settings::skip_first_and_last_linear)",
                       index == 0 ? "first" : "last");
  const int64_t out = f.layer->weight.size(0), in = f.layer->weight.size(1);
  if (in % 16 != 0 || out % 16 != 0) {
    auto why = fmt::format("in_features {} and out_features {} (this rank's) are not both multiples of 16, which the fp8 "
                           "gemm needs",
                           in, out);
    if (filter.strict)
      throw ConfigError(fmt::format("mixed_precision fp8: layer {}: {}; make its widths multiples of 16, or set "
                                    "Fp8Settings::strict_linear_widths false to keep it in the compute dtype",
                                    f.path, why));
    return why;
  }
  if (filter.min_features > 0 && (in < filter.min_features || out < filter.min_features))
    return fmt::format("in_features {} or out_features {} below min_linear_features {} (torchao's size filter: its "
                       "casts would cost more than the fp8 gemm saves)",
                       in, out, filter.min_features);
  return "";
}

AmaxGroups groups_of(const nn::LinearImpl& layer, const Communicator& batch) {
  AmaxGroups groups;
  groups.batch = batch;
  if (const auto& slot = layer.tensor_parallel(); slot && slot->group.size() > 1) {
    groups.tensor = slot->group;
    groups.tensor_splits_in = slot->style == tp::Style::Rowwise;
    groups.tensor_splits_out = slot->style == tp::Style::Colwise;
  }
  return groups;
}

// The fp8 layers of `model` that keep delayed-scaling state.
std::vector<LinearState*> delayed_layers(torch::nn::Module& model) {
  std::vector<LinearState*> out;
  for (const auto& f : linears_in_order(model))
    if (f.layer && f.layer->float8() && f.layer->float8()->recipe().scaling == Scaling::Delayed)
      out.push_back(f.layer->float8().get());
  return out;
}

}  // namespace

nlohmann::json delayed_state_of(torch::nn::Module& model) {
  nlohmann::json out;
  for (auto* state : delayed_layers(model)) {
    auto& layer = out[state->path()];
    for (const auto& [key, t] : state->state_dict()) {
      auto flat = t.to(at::kDouble).reshape({-1}).contiguous();
      layer[key] = std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
    }
  }
  return out;
}

void load_delayed_state(torch::nn::Module& model, const nlohmann::json& saved, const std::string& origin, bool apply) {
  for (auto* state : delayed_layers(model)) {
    if (!saved.is_object() || !saved.contains(state->path()))
      throw Error(fmt::format("{}: no fp8 delayed-scaling state for layer {} (saved without mixed_precision fp8 and "
                              "backend TE, or from another model); resume with the settings it was saved with",
                              origin, state->path()));
    std::map<std::string, at::Tensor> tensors;
    for (const auto& [key, values] : saved[state->path()].items()) {
      auto numbers = values.get<std::vector<double>>();
      auto t = at::tensor(numbers, at::kDouble);
      tensors[key] = key.ends_with(".casts") ? t.to(at::kLong).reshape({}) : t.to(at::kFloat);
    }
    if (apply) {
      state->load_state_dict(tensors);
    } else {
      LinearState trial(state->recipe(), state->path());
      trial.load_state_dict(tensors);
    }
  }
}

std::string ConversionReport::describe() const {
  std::string text = fmt::format("fp8: {} Linear layer(s) compute in fp8, {} stay in the compute dtype", converted.size(),
                                 skipped.size());
  for (const auto& path : converted) text += fmt::format("\n  fp8      {}", path);
  for (const auto& [path, why] : skipped) text += fmt::format("\n  skipped  {}: {}", path, why);
  return text;
}

ConversionReport convert_to_float8_training(torch::nn::Module& model, const Recipe& recipe, const LayerFilter& filter,
                                            const Communicator& batch_group) {
  if (recipe.interval < 1 || recipe.amax_history_len < 1 || recipe.margin < 0)
    throw ConfigError(fmt::format("fp8 recipe: interval {} and amax_history_len {} must be at least 1, margin {} 0 or more",
                                  recipe.interval, recipe.amax_history_len, recipe.margin));
  const auto found = linears_in_order(model);
  // Every layer judged before any converts: a refused one leaves the model as it was.
  std::vector<std::string> reasons;
  for (size_t k = 0; k < found.size(); ++k) {
    if (found[k].layer && found[k].layer->float8())
      throw Error(fmt::format("convert_to_float8_training: layer {} is in fp8 already; convert a model once", found[k].path));
    reasons.push_back(reason_to_skip(found[k], k, found.size(), filter));
  }
  ConversionReport report;
  for (size_t k = 0; k < found.size(); ++k) {
    const auto& f = found[k];
    if (!reasons[k].empty()) {
      report.skipped.emplace_back(f.path, std::move(reasons[k]));
      continue;
    }
    auto state = std::make_shared<LinearState>(recipe, f.path);
    state->groups = groups_of(*f.layer, batch_group);
    f.layer->use_float8(std::move(state));
    report.converted.push_back(f.path);
  }
  return report;
}

}  // namespace xlr8::fp8
