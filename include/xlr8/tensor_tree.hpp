#pragma once
// Nested values that hold tensors: vectors, maps, pairs, tuples, optionals, torch::data::Example and user
// structs. map_tensors rebuilds such a value with every tensor replaced by fn(tensor), visiting the
// tensors in a fixed order (containers in order, maps by key) so that every rank visits the same
// sequence: collectives over a nested value (Accelerator::gather, reduce ...) rely on it.
//
// A user struct takes part by providing
//   MyBatch map_tensors(const xlr8::TensorFn& fn) const { return {fn(input), fn(mask), label_count}; }
#include <ATen/core/Tensor.h>
#include <torch/data/example.h>

#include <algorithm>
#include <concepts>
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace xlr8 {

using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

namespace detail {
template <class T>
concept maps_own_tensors = requires(const T& value, const TensorFn& fn) {
  { value.map_tensors(fn) } -> std::convertible_to<T>;
};
}  // namespace detail

// Declared before any is defined, so nested containers find each other.
template <class T>
T map_tensors(const T& value, const TensorFn& fn);
inline at::Tensor map_tensors(const at::Tensor& t, const TensorFn& fn);
template <class D, class L>
torch::data::Example<D, L> map_tensors(const torch::data::Example<D, L>& e, const TensorFn& fn);
template <class D>
torch::data::Example<D, void> map_tensors(const torch::data::Example<D, void>& e, const TensorFn& fn);
template <class T, class A>
std::vector<T, A> map_tensors(const std::vector<T, A>& v, const TensorFn& fn);
template <class K, class V, class C, class A>
std::map<K, V, C, A> map_tensors(const std::map<K, V, C, A>& m, const TensorFn& fn);
template <class K, class V, class H, class E, class A>
std::unordered_map<K, V, H, E, A> map_tensors(const std::unordered_map<K, V, H, E, A>& m, const TensorFn& fn);
template <class A, class B>
std::pair<A, B> map_tensors(const std::pair<A, B>& p, const TensorFn& fn);
template <class... T>
std::tuple<T...> map_tensors(const std::tuple<T...>& t, const TensorFn& fn);
template <class T>
std::optional<T> map_tensors(const std::optional<T>& o, const TensorFn& fn);

inline at::Tensor map_tensors(const at::Tensor& t, const TensorFn& fn) { return fn(t); }
template <class D, class L>
torch::data::Example<D, L> map_tensors(const torch::data::Example<D, L>& e, const TensorFn& fn) {
  auto data = map_tensors(e.data, fn);  // data before target, whatever the compiler's argument order
  return {std::move(data), map_tensors(e.target, fn)};
}
template <class D>  // torch::data::TensorExample: data only
torch::data::Example<D, void> map_tensors(const torch::data::Example<D, void>& e, const TensorFn& fn) {
  return torch::data::Example<D, void>(map_tensors(e.data, fn));
}
template <class T, class A>
std::vector<T, A> map_tensors(const std::vector<T, A>& v, const TensorFn& fn) {
  std::vector<T, A> out(v.get_allocator());
  out.reserve(v.size());
  for (const auto& x : v) out.push_back(map_tensors(x, fn));
  return out;
}
template <class K, class V, class C, class A>
std::map<K, V, C, A> map_tensors(const std::map<K, V, C, A>& m, const TensorFn& fn) {
  std::map<K, V, C, A> out(m.key_comp(), m.get_allocator());
  for (const auto& [k, v] : m) out.emplace(k, map_tensors(v, fn));
  return out;
}
// By sorted key when keys compare: an unordered_map's own order may differ between processes.
template <class K, class V, class H, class E, class A>
std::unordered_map<K, V, H, E, A> map_tensors(const std::unordered_map<K, V, H, E, A>& m, const TensorFn& fn) {
  std::vector<const std::pair<const K, V>*> items;
  for (const auto& item : m) items.push_back(&item);
  if constexpr (std::totally_ordered<K>)
    std::sort(items.begin(), items.end(), [](const auto* a, const auto* b) { return a->first < b->first; });
  std::unordered_map<K, V, H, E, A> out(m.bucket_count(), m.hash_function(), m.key_eq(), m.get_allocator());
  for (const auto* item : items) out.emplace(item->first, map_tensors(item->second, fn));
  return out;
}
template <class A, class B>
std::pair<A, B> map_tensors(const std::pair<A, B>& p, const TensorFn& fn) {
  return std::pair<A, B>{map_tensors(p.first, fn), map_tensors(p.second, fn)};  // braces: in order
}
template <class... T>
std::tuple<T...> map_tensors(const std::tuple<T...>& t, const TensorFn& fn) {
  return std::apply([&](const auto&... x) { return std::tuple<T...>{map_tensors(x, fn)...}; }, t);
}
template <class T>
std::optional<T> map_tensors(const std::optional<T>& o, const TensorFn& fn) {
  return o ? std::optional<T>(map_tensors(*o, fn)) : std::nullopt;
}
// User structs with map_tensors(fn); values without tensors (ints, strings) are returned unchanged.
template <class T>
T map_tensors(const T& value, const TensorFn& fn) {
  if constexpr (detail::maps_own_tensors<T>) return value.map_tensors(fn);
  else return value;
}

// Every tensor of `value`, in map_tensors' order.
template <class T>
std::vector<at::Tensor> tensors_of(const T& value) {
  std::vector<at::Tensor> found;
  map_tensors(value, [&found](const at::Tensor& t) {
    found.push_back(t);
    return t;
  });
  return found;
}

// Values whose every leaf is a tensor: what the collectives over nested values accept (an optional may be
// empty on one rank only, and a plain number has no tensor to gather).
template <class T>
struct is_tensor_tree : std::bool_constant<detail::maps_own_tensors<T>> {};
template <>
struct is_tensor_tree<at::Tensor> : std::true_type {};
template <class D, class L>
struct is_tensor_tree<torch::data::Example<D, L>> : std::bool_constant<is_tensor_tree<D>::value && is_tensor_tree<L>::value> {};
template <class D>
struct is_tensor_tree<torch::data::Example<D, void>> : is_tensor_tree<D> {};
template <class T, class A>
struct is_tensor_tree<std::vector<T, A>> : is_tensor_tree<T> {};
template <class K, class V, class C, class A>
struct is_tensor_tree<std::map<K, V, C, A>> : is_tensor_tree<V> {};
template <class K, class V, class H, class E, class A>
struct is_tensor_tree<std::unordered_map<K, V, H, E, A>> : is_tensor_tree<V> {};
template <class A, class B>
struct is_tensor_tree<std::pair<A, B>> : std::bool_constant<is_tensor_tree<A>::value && is_tensor_tree<B>::value> {};
template <class... T>
struct is_tensor_tree<std::tuple<T...>> : std::bool_constant<(is_tensor_tree<T>::value && ...)> {};
template <class T>
inline constexpr bool is_tensor_tree_v = is_tensor_tree<T>::value;

}  // namespace xlr8
