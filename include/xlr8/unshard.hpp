#pragma once
// The one change a model needs for stage-3 sharding (ZeRO-3 / FSDP FULL_SHARD). LibTorch modules have no
// forward hooks, so a sharded unit says where its forward begins and ends:
//
//   torch::Tensor BlockImpl::forward(torch::Tensor x) {
//     auto unit = xlr8::unshard(*this);   // gathers this unit's parameters (a no-op when not sharded)
//     x = x + attn(ln1(x));
//     return unit.done(x + mlp(ln2(x)));  // frees them again, and gathers them for the backward pass
//   }
//
// `done` marks the output so that the backward pass gathers the parameters again just before it reaches
// this unit; they are freed once their gradients are reduced. Put the same two lines in the model's own
// forward so that the parameters no unit owns (embeddings, final norm) are sharded too. Without
// sharding, or for a module that is not a unit, both calls do nothing.
//
// A forward that returns more than one tensor (a tuple, a struct, a KV cache) wraps its body instead:
//
//   std::tuple<torch::Tensor, Cache> BlockImpl::forward(torch::Tensor x, Cache cache) {
//     return xlr8::sharded(*this, [&] { ...; return std::tuple{y, new_cache}; });
//   }
//
// Every returned tensor that requires gradients then gathers the unit before its backward. The value may
// hold tensors in the containers xlr8/tensor_tree.hpp lists, and in structs that give themselves
// `T map_tensors(const xlr8::TensorFn& fn) const`. A unit whose forward opens no guard keeps its
// parameters whole on every rank: xlr8 names it, with its bytes, after the first backward.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "xlr8/activation_checkpoint.hpp"
#include "xlr8/tensor_tree.hpp"

namespace xlr8 {

namespace detail {
class UnitHooks;
}  // namespace detail

// Which of a model's classes are its blocks, as a Hugging Face model's `_no_split_modules`: with
// fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP and no fsdp_transformer_layer_cls_to_wrap, each module of
// these classes is a unit (and what fsdp_activation_checkpointing recomputes), as Accelerate does.
//
//   struct GptImpl : torch::nn::Module, xlr8::NoSplitModules {
//     std::vector<std::string> no_split_modules() const override { return {"Block"}; }
//   };
//
// Names match as the key's do ("Block", "BlockImpl", "gpt::BlockImpl"). The model's declaration and
// those of the modules inside it count (transformers gathers a nested model's too); the key, when set, wins.
class NoSplitModules {
 public:
  virtual ~NoSplitModules() = default;
  virtual std::vector<std::string> no_split_modules() const = 0;
};

class [[nodiscard]] UnshardScope {
 public:
  UnshardScope() = default;
  explicit UnshardScope(std::shared_ptr<detail::UnitHooks> unit);
  UnshardScope(UnshardScope&& other) noexcept;
  UnshardScope& operator=(UnshardScope&&) = delete;
  UnshardScope(const UnshardScope&) = delete;
  UnshardScope& operator=(const UnshardScope&) = delete;
  // Without done() (an exception left the forward), the parameters are freed again.
  ~UnshardScope();
  // The unit's output, returned through this: frees the gathered parameters (except the root's, whose
  // backward comes first) and arms their gathering for backward.
  at::Tensor done(const at::Tensor& output);
  // The same for any value holding tensors (see above): every tensor in it that requires gradients
  // gathers the unit before its backward.
  template <class T>
  T done(const T& output) {
    static_assert(detail::sees_tensors<T>::value,
                  "xlr8: a unit's output holds tensors xlr8 cannot see; give the type a member "
                  "`T map_tensors(const xlr8::TensorFn& fn) const` (xlr8/tensor_tree.hpp)");
    auto handed = done_with(tensors_of(output));
    size_t next = 0;
    return map_tensors(output, [&](const at::Tensor&) { return handed[next++]; });
  }

 private:
  std::vector<at::Tensor> done_with(const std::vector<at::Tensor>& outputs);
  std::shared_ptr<detail::UnitHooks> unit_;
};

// Gathers `unit`'s parameters when it is a stage-3 unit of a prepared model.
UnshardScope unshard(const torch::nn::Module& unit);

// Runs `body` (the unit's forward) with `unit`'s parameters gathered and returns what it returns, marked
// as done() marks it. If `body` throws, the parameters are freed again.
template <class Body>
auto sharded(const torch::nn::Module& unit, Body&& body) {
  using Result = std::decay_t<std::invoke_result_t<Body&&>>;
  static_assert(!std::is_void_v<Result>, "xlr8::sharded: the unit's forward must return its output");
  auto scope = unshard(unit);
  Result output = std::forward<Body>(body)();
  return scope.done(output);
}

namespace detail {
// The guard without the activation-checkpointing check: for sharded(unit, body, inputs...).
UnshardScope open_unit(const torch::nn::Module& unit);
// Whether fsdp_activation_checkpointing checkpoints `unit` (recording that its forward came this way).
bool checkpoints_unit(const torch::nn::Module& unit);
}  // namespace detail

// The same, for a body that takes the unit's inputs: the form activation checkpointing can recompute.
// When fsdp_activation_checkpointing covers the unit, `body` runs under xlr8::checkpoint (so it must not
// capture locals by reference), and backward gathers the parameters once for the recomputation and its
// gradients:
//
//   torch::Tensor BlockImpl::forward(torch::Tensor x) {
//     return xlr8::sharded(*this, [this](torch::Tensor x) { x = x + attn(ln1(x)); return x + mlp(ln2(x)); }, x);
//   }
template <class Body, class Input, class... Inputs>
auto sharded(const torch::nn::Module& unit, Body body, Input&& input, Inputs&&... inputs) {
  const torch::nn::Module* module = &unit;
  auto guarded = [module, body](auto&... args) {
    auto scope = detail::open_unit(*module);
    return scope.done(body(args...));
  };
  if (detail::checkpoints_unit(unit))
    return checkpoint(std::move(guarded), std::forward<Input>(input), std::forward<Inputs>(inputs)...);
  std::tuple<std::decay_t<Input>, std::decay_t<Inputs>...> args(std::forward<Input>(input),
                                                                std::forward<Inputs>(inputs)...);
  return std::apply(guarded, args);
}

}  // namespace xlr8
