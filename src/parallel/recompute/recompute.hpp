#pragma once
// The library's side of activation checkpointing: which units fsdp_activation_checkpointing covers, the
// recomputation the sharded model must tell from a forward, and end-of-backward callbacks armed from
// inside a recomputation's nested backward.
#include <torch/nn/module.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace xlr8::recompute {

// fsdp_activation_checkpointing: `module` (at `label` in the model `root`) is checkpointed through its
// sharded(...) guard for as long as it lives.
void mark_recomputed_unit(const torch::nn::Module& module, std::string label, const torch::nn::Module& root);
// The label of a marked unit, or empty.
std::string recomputed_unit_label(const torch::nn::Module& module);
// The units of `root` whose forward has not come through sharded(unit, body, inputs...) since they were
// marked, each reported once: a unit left whole by mistake is named after the first backward. (By model,
// so that ranks run as threads, each with its own model, each see their own.)
std::vector<std::string> recomputed_units_never_run(const torch::nn::Module& root);

// True while a checkpointed region is run again in backward, on this thread: a unit's guard then
// gathers for the gradients that follow and does not free or record a forward.
bool recomputing();

// Values a layer chose in a checkpointed region's first run that its recomputation must use again (fp8's
// delayed scales, which move on after each forward): remember() keeps one (nothing outside a region's first
// run); recall() gives them back in the same order while the region is recomputed, and nothing elsewhere.
void remember(const at::Tensor& value);
std::optional<at::Tensor> recall();

// Runs `callback` when the outermost backward pass ends (compat::at_end_of_backward's contract). Armed
// inside a recomputation's nested backward, it is handed to the enclosing pass instead, which would
// otherwise end first.
void at_end_of_backward(std::function<void()> callback, std::function<void()> abandoned = {});

// DDP's and ZeRO's error for a parameter whose gradient arrives twice in one backward pass (a checkpointed
// region's nested backward accumulates it on its own): after the first arrival its reduction is under
// way, so the second would be lost.
std::string accumulated_twice(const std::string& parameter);

// Whether `node` is a checkpointed region's (xlr8::checkpoint's). Its last input is an anchor: a fresh leaf that
// keeps the node in the graph when no input requires gradients, and never receives one. Its region's parameters
// get theirs from the nested backward that the node runs (or, split by run_nested_backward_with, from the runner's
// later part).
bool is_checkpoint_node(const torch::autograd::Node& node);

// What a checkpointed region's node runs in place of its one nested backward while a runner is set on it (the
// zero-bubble split's input part, which splits the region's backward too): given the recomputed outputs, their
// gradients and the region's inputs, it returns each input's gradient (undefined where none flows). An empty
// runner sets the node back to one nested backward. `node` must be a checkpoint node.
using NestedBackwardRunner = std::function<std::vector<at::Tensor>(
    const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& gradients,
    const std::vector<at::Tensor>& inputs)>;
void run_nested_backward_with(torch::autograd::Node& node, NestedBackwardRunner runner);

}  // namespace xlr8::recompute
