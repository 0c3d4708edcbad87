#pragma once
// Moves a batch to a device: tensors, and tensors nested in vectors, maps, pairs, tuples, optionals,
// torch::data::Example and any user struct that provides `T to(const at::Device&) const` or map_tensors
// (tensor_tree.hpp).
#include <ATen/core/Tensor.h>
#include <torch/data/example.h>

#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xlr8/tensor_tree.hpp"

namespace xlr8 {

// Every overload is declared before any is defined, so nested containers find each other.
template <class T>
T to_device(const T& value, const at::Device& device);
inline at::Tensor to_device(const at::Tensor& t, const at::Device& device);
template <class D, class L>
torch::data::Example<D, L> to_device(const torch::data::Example<D, L>& e, const at::Device& device);
template <class D>
torch::data::Example<D, void> to_device(const torch::data::Example<D, void>& e, const at::Device& device);
template <class T, class A>
std::vector<T, A> to_device(const std::vector<T, A>& v, const at::Device& device);
template <class K, class V, class C, class A>
std::map<K, V, C, A> to_device(const std::map<K, V, C, A>& m, const at::Device& device);
template <class K, class V, class H, class E, class A>
std::unordered_map<K, V, H, E, A> to_device(const std::unordered_map<K, V, H, E, A>& m, const at::Device& device);
template <class A, class B>
std::pair<A, B> to_device(const std::pair<A, B>& p, const at::Device& device);
template <class... T>
std::tuple<T...> to_device(const std::tuple<T...>& t, const at::Device& device);
template <class T>
std::optional<T> to_device(const std::optional<T>& o, const at::Device& device);

namespace detail {
template <class T, class = void>
struct has_to : std::false_type {};
template <class T>
struct has_to<T, std::void_t<decltype(std::declval<const T&>().to(std::declval<const at::Device&>()))>> : std::true_type {};
}  // namespace detail

inline at::Tensor to_device(const at::Tensor& t, const at::Device& device) {
  return t.defined() && t.device() != device ? t.to(device, /*non_blocking=*/true) : t;
}
template <class D, class L>
torch::data::Example<D, L> to_device(const torch::data::Example<D, L>& e, const at::Device& device) {
  return {to_device(e.data, device), to_device(e.target, device)};
}
template <class D>  // torch::data::TensorExample: data only
torch::data::Example<D, void> to_device(const torch::data::Example<D, void>& e, const at::Device& device) {
  return torch::data::Example<D, void>(to_device(e.data, device));
}
template <class T, class A>
std::vector<T, A> to_device(const std::vector<T, A>& v, const at::Device& device) {
  std::vector<T, A> out(v.get_allocator());
  out.reserve(v.size());
  for (const auto& x : v) out.push_back(to_device(x, device));
  return out;
}
template <class K, class V, class C, class A>
std::map<K, V, C, A> to_device(const std::map<K, V, C, A>& m, const at::Device& device) {
  std::map<K, V, C, A> out(m.key_comp(), m.get_allocator());
  for (const auto& [k, v] : m) out.emplace(k, to_device(v, device));
  return out;
}
template <class K, class V, class H, class E, class A>
std::unordered_map<K, V, H, E, A> to_device(const std::unordered_map<K, V, H, E, A>& m, const at::Device& device) {
  std::unordered_map<K, V, H, E, A> out(m.bucket_count(), m.hash_function(), m.key_eq(), m.get_allocator());
  for (const auto& [k, v] : m) out.emplace(k, to_device(v, device));
  return out;
}
template <class A, class B>
std::pair<A, B> to_device(const std::pair<A, B>& p, const at::Device& device) {
  return {to_device(p.first, device), to_device(p.second, device)};
}
template <class... T>
std::tuple<T...> to_device(const std::tuple<T...>& t, const at::Device& device) {
  return std::apply([&](const auto&... x) { return std::tuple<T...>(to_device(x, device)...); }, t);
}
template <class T>
std::optional<T> to_device(const std::optional<T>& o, const at::Device& device) {
  return o ? std::optional<T>(to_device(*o, device)) : std::nullopt;
}
// User structs with `to(device)` or map_tensors(fn); anything else (ints, strings) passes through unchanged.
template <class T>
T to_device(const T& value, const at::Device& device) {
  if constexpr (detail::has_to<T>::value) return value.to(device);
  else if constexpr (detail::maps_own_tensors<T>)
    return value.map_tensors([&device](const at::Tensor& t) { return to_device(t, device); });
  else return value;
}

}  // namespace xlr8
