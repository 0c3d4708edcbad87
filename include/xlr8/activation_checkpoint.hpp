#pragma once
// Activation checkpointing: a region's forward keeps only its inputs, and backward runs it again to get
// the activations it needs, trading compute for memory (PyTorch's torch.utils.checkpoint).
//
//   auto y = xlr8::checkpoint([this](const torch::Tensor& x) { return mlp(ln(x)); }, x);
//
// `fn` runs once under no-grad in forward. In backward it runs again with gradients on, with the random
// number generators (CPU, and the inputs' CUDA devices) and the autocast state of the first run, so
// dropout draws the same masks; its gradients then flow to the inputs and to every parameter `fn` read,
// whether or not an input requires gradients (non-reentrant semantics: a region fed by token ids still
// trains its weights). `fn` is kept until backward and called with the inputs it was given (stored by
// value): capture modules with `this`, never locals by reference. Inputs and the result may be tensors,
// plain values, or the containers xlr8/tensor_tree.hpp walks. Outside autograd (no-grad, inference) it
// is just `fn(inputs...)`.
//
// What differs from PyTorch: parameters' gradients are accumulated by a backward nested inside the outer
// one, so use `accelerator.backward(loss)` or `loss.backward()`, not torch::autograd::grad, through a
// checkpointed region; and a parameter read both inside and outside a region (weights tied across it)
// is refused by DDP and ZeRO with its name, as PyTorch's DDP refuses it under reentrant checkpointing.
// The recomputation sets the process's generators to the forward's state for its duration: another thread
// drawing random numbers at that moment draws from that state.
//
// fsdp_activation_checkpointing checkpoints every unit of the wrap policy, with no call here: write the
// unit's forward as `return xlr8::sharded(*this, [this](torch::Tensor x) { ... }, x);` (xlr8/unshard.hpp).
#include <ATen/core/Tensor.h>
#include <torch/data/example.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xlr8/tensor_tree.hpp"

namespace xlr8 {

namespace detail {

// Whether map_tensors sees every tensor a T holds: tensors, the containers it walks, structs with
// map_tensors(fn), and values that hold none (numbers, enums, strings).
template <class T>
struct sees_tensors
    : std::bool_constant<std::is_arithmetic_v<T> || std::is_enum_v<T> || maps_own_tensors<T>> {};
template <>
struct sees_tensors<at::Tensor> : std::true_type {};
template <class C, class Tr, class A>
struct sees_tensors<std::basic_string<C, Tr, A>> : std::true_type {};
template <class D, class L>
struct sees_tensors<torch::data::Example<D, L>> : std::bool_constant<sees_tensors<D>::value && sees_tensors<L>::value> {};
template <class D>
struct sees_tensors<torch::data::Example<D, void>> : sees_tensors<D> {};
template <class T, class A>
struct sees_tensors<std::vector<T, A>> : sees_tensors<T> {};
template <class K, class V, class C, class A>
struct sees_tensors<std::map<K, V, C, A>> : sees_tensors<V> {};
template <class K, class V, class H, class E, class A>
struct sees_tensors<std::unordered_map<K, V, H, E, A>> : sees_tensors<V> {};
template <class A, class B>
struct sees_tensors<std::pair<A, B>> : std::bool_constant<sees_tensors<A>::value && sees_tensors<B>::value> {};
template <class... T>
struct sees_tensors<std::tuple<T...>> : std::bool_constant<(sees_tensors<T>::value && ...)> {};
template <class T>
struct sees_tensors<std::optional<T>> : sees_tensors<T> {};

// The region as the autograd node sees it: its input tensors in, its output tensors out.
using CheckpointBody = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Whether checkpointing applies now (gradients are being recorded).
bool checkpointing_records();
// Runs `body` on `inputs` as one autograd node that keeps only `inputs` and recomputes `body` in its
// backward. Returns the outputs to hand back.
std::vector<at::Tensor> run_checkpointed(const std::vector<at::Tensor>& inputs, CheckpointBody body);
}  // namespace detail

template <class Fn, class... Inputs>
auto checkpoint(Fn fn, Inputs&&... inputs) {
  using Stored = std::tuple<std::decay_t<Inputs>...>;
  using Result = std::decay_t<std::invoke_result_t<Fn&, std::decay_t<Inputs>&...>>;
  static_assert(!std::is_void_v<Result>, "xlr8::checkpoint: the region must return its output");
  static_assert(detail::sees_tensors<Result>::value && (detail::sees_tensors<std::decay_t<Inputs>>::value && ...),
                "xlr8::checkpoint: an input or the result holds tensors xlr8 cannot see; give the type a member "
                "`T map_tensors(const xlr8::TensorFn& fn) const` (xlr8/tensor_tree.hpp)");
  Stored stored(std::forward<Inputs>(inputs)...);
  if (!detail::checkpointing_records()) return std::apply(fn, stored);
  auto input_tensors = tensors_of(stored);
  // The node saves the input tensors; the region keeps the plain values and where the tensors go.
  Stored shape = map_tensors(stored, [](const at::Tensor&) { return at::Tensor(); });
  // The first run's result gives the shape of what is handed back; its tensors are the node's outputs.
  // Held weakly: the recomputation in backward finds it gone and keeps nothing.
  auto first = std::make_shared<std::optional<Result>>();
  std::weak_ptr<std::optional<Result>> first_run = first;
  auto body = [fn = std::move(fn), shape = std::move(shape), first_run](const std::vector<at::Tensor>& tensors) mutable {
    size_t next = 0;
    auto args = map_tensors(shape, [&](const at::Tensor&) { return tensors[next++]; });
    Result result = std::apply(fn, args);
    auto out = tensors_of(result);
    if (auto keep = first_run.lock()) *keep = std::move(result);
    return out;
  };
  auto handed = detail::run_checkpointed(input_tensors, std::move(body));
  size_t next = 0;
  return map_tensors(**first, [&](const at::Tensor&) { return handed[next++]; });
}

}  // namespace xlr8
