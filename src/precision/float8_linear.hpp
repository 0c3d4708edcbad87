#pragma once
// An fp8 layer's state and its product: the autograd function xlr8::nn::Linear calls in place of at::linear
// once convert_to_float8_training gave it a LinearState.
#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>

#include "xlr8/communicator.hpp"
#include "xlr8/float8.hpp"

namespace torch::autograd {
struct Node;
}

namespace xlr8::fp8 {

// The ranks across which an operand's amax is reduced (max), so that every rank casts with the scale one
// process would: the batch group holds the other rows of the batch (data and context parallel ranks); the tensor
// parallel group holds the other slices of a split weight and of the activations it splits.
struct AmaxGroups {
  Communicator batch;          // invalid: none
  Communicator tensor;         // invalid: none
  bool tensor_splits_in = false;   // row-wise parallel: in_features are split
  bool tensor_splits_out = false;  // column-wise parallel: out_features are split
};

// One cast's delayed scaling: the newest amax first.
struct AmaxHistory {
  at::Tensor history;  // [amax_history_len] fp32
  at::Tensor scale;    // [] fp32, 1 until the first update
  int64_t casts = 0;   // amaxes recorded; the scale is recomputed every `interval`
};

class LinearState {
 public:
  LinearState(Recipe recipe, std::string path);

  const Recipe& recipe() const { return recipe_; }
  const std::string& path() const { return path_; }
  AmaxGroups groups;
  AmaxHistory input, weight, grad_output;

  // Delayed scaling's state for a checkpoint: "input.amax_history", "input.scale", "input.casts", ... (fp32 /
  // int64 CPU tensors); empty for dynamic scaling, which keeps none.
  std::map<std::string, at::Tensor> state_dict() const;
  // Restores a state_dict(); a missing key or another history length is an error naming the layer.
  void load_state_dict(const std::map<std::string, at::Tensor>& state);

 private:
  Recipe recipe_;
  std::string path_;
};

// The delayed-scaling state of every fp8 layer of `model`, by layer path, for a checkpoint's JSON (null when the
// model has none); and its restoration, which names `origin` and the layer when the checkpoint lacks one or holds
// another history length. `apply` false checks only (a checkpoint is checked whole before anything changes).
nlohmann::json delayed_state_of(torch::nn::Module& model);
void load_delayed_state(torch::nn::Module& model, const nlohmann::json& saved, const std::string& origin, bool apply);
// Model `model`'s part of a checkpoint state's "fp8" (null when it has none).
inline nlohmann::json saved_delayed_state(const nlohmann::json& state, size_t model) {
  return state.value("fp8", nlohmann::json::object()).value(std::to_string(model), nlohmann::json());
}

// input @ weight^T in fp8 by the state's recipe (no bias), in the compute dtype: autocast's where it is on for the
// input's device, else the input's. `training` records delayed amaxes; evaluation uses the scales it has.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::shared_ptr<LinearState>& state, bool training);

// Whether `node` is linear's backward, which computes only the gradients asked of it and, run in two parts (the
// input's, then the weight's: a zero-bubble schedule's split backward), gives a whole backward's gradients and
// records grad_output's amax once.
bool is_float8_product(const torch::autograd::Node& node);

}  // namespace xlr8::fp8
