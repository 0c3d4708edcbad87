#pragma once
// What a unit's guard (xlr8::unshard, xlr8::sharded) talks to: the stage-3 sharded model registers one
// UnitHooks per unit module. The registry maps a module to it; modules that are not units get none and
// their guards do nothing.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

// Declared in xlr8::detail: the public guard (xlr8/unshard.hpp) holds one.
namespace xlr8::detail {

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward() = 0;
  // The forward's output tensors (in map_tensors' order), returned as the ones to hand back.
  virtual std::vector<at::Tensor> after_forward(const std::vector<at::Tensor>& outputs) = 0;
  virtual void forward_abandoned() = 0;
};

}  // namespace xlr8::detail

namespace xlr8::shard {

using detail::UnitHooks;

void register_unit(const torch::nn::Module& module, std::weak_ptr<UnitHooks> unit);
// DeepSpeed's ZeRO-3 leaf modules (deepspeed::set_z3_leaf_modules): each is one unit gathered whole, with
// no unit below it. Marked for as long as the module lives.
void mark_leaf_module(torch::nn::Module& module);
bool is_leaf_module(const torch::nn::Module& module);
void unregister_unit(const torch::nn::Module& module);
std::shared_ptr<UnitHooks> find_unit(const torch::nn::Module& module);

// `output`, passed through an autograd function whose backward calls `before_backward` first: the
// hook that gathers a unit's parameters again just before backward reaches the unit.
at::Tensor with_backward_prehook(const at::Tensor& output, std::function<void()> before_backward);

// Where the autograd graph stands now: a unit's forward created the nodes numbered from here on.
uint64_t autograd_position();
// Calls `done` once every node of the outputs' graph created since `forward_start` (the unit's own
// operations, which are what saved its parameters) has run in backward: nothing reads the unit's
// parameters after that. Returns how many nodes there are; with none, `done` is never called. A node
// backward never reaches (an unused branch) keeps `done` from being called. `dropped` is called instead
// when the graph is freed before all of them ran (its backward never came, or not all of it).
size_t after_backward_of(const std::vector<at::Tensor>& outputs, uint64_t forward_start, std::function<void()> done,
                         std::function<void()> dropped);

}  // namespace xlr8::shard
