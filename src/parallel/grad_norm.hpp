#pragma once
// The arithmetic of a gradient norm assembled from parts (ranks' shards, tensor-parallel slices): each
// part reduced to one number, the numbers combined after their collectives, one coefficient for all.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace xlr8::parallel {

// Σ norm^p over double norms in one tensor (max for p = inf), as a 1-element tensor.
inline at::Tensor sum_of_powers(const at::Tensor& all, double norm_type) {
  return (std::isinf(norm_type) ? all.max() : all.pow(norm_type).sum()).reshape({1});
}

// Σ norm^p over norms already taken, one per gradient (max for p = inf), as partial_norm below combines them.
inline at::Tensor partial_norm_of_norms(const std::vector<at::Tensor>& norms, double norm_type, at::Device device) {
  if (norms.empty()) return at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  return sum_of_powers(at::stack(norms).to(at::kDouble).to(device), norm_type);
}

// Norms one at a time, each to double on `device` (tensors on several devices or of several dtypes), summed.
inline at::Tensor partial_norm_of_mixed(const std::vector<at::Tensor>& norms, double norm_type, at::Device device) {
  std::vector<at::Tensor> all;
  for (const auto& n : norms) all.push_back(n.to(at::kDouble).reshape({1}).to(device));
  return sum_of_powers(at::cat(all), norm_type);
}

// Whether every tensor of `lists` has the first one's device and dtype.
inline bool all_alike(std::initializer_list<const std::vector<at::Tensor>*> lists) {
  const at::Tensor* first = nullptr;
  for (const auto* list : lists)
    for (const auto& t : *list) {
      if (!first) first = &t;
      if (t.device() != first->device() || t.scalar_type() != first->scalar_type()) return false;
    }
  return true;
}

// Σ|g|^p over `grads` (max |g| for p = inf) as a 1-element double tensor on `device`; 0 for none.
inline at::Tensor partial_norm(const std::vector<at::Tensor>& grads, double norm_type, at::Device device) {
  if (grads.empty()) return at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  // One multi-tensor kernel for every gradient's norm on a GPU, not one norm and two copies each.
  if (all_alike({&grads})) return partial_norm_of_norms(at::_foreach_norm(grads, norm_type), norm_type, device);
  // Partial offload leaves some groups' gradients in host memory, the others' on the GPU (or dtypes differ).
  std::vector<at::Tensor> norms;
  for (const auto& g : grads) norms.push_back(g.norm(norm_type));
  return partial_norm_of_mixed(norms, norm_type, device);
}

// partial_norm over gradients of which some are in memory (`grads`) and some only known by their norms (`norms`,
// offload's gradients on disk), taken in the order `from_disk` gives (true: the next of `norms`): the sum partial_norm
// makes of them all in memory, bitwise (each norm by the same kernel, summed in the same order).
inline at::Tensor partial_norm_interleaved(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& norms,
                                           const std::vector<bool>& from_disk, double norm_type, at::Device device) {
  if (norms.empty()) return partial_norm(grads, norm_type, device);
  // Alike as partial_norm would judge them all in memory: a norm keeps its gradient's device and dtype.
  const bool alike = all_alike({&grads, &norms});
  std::vector<at::Tensor> of_grads;
  if (alike && !grads.empty()) of_grads = at::_foreach_norm(grads, norm_type);
  else
    for (const auto& g : grads) of_grads.push_back(g.norm(norm_type));
  std::vector<at::Tensor> in_order;
  size_t next_grad = 0, next_norm = 0;
  for (bool disk : from_disk) in_order.push_back(disk ? norms[next_norm++] : of_grads[next_grad++]);
  return alike ? partial_norm_of_norms(in_order, norm_type, device) : partial_norm_of_mixed(in_order, norm_type, device);
}

// The norm from already reduced partial totals (combined by sum, or max for p = inf), and every
// gradient in `lists` scaled as clip_grad_norm_ does when it exceeds `max_norm`. All on the device, as
// PyTorch's clip_grad_norm_: the coefficient is clamped to 1 and applied to every gradient (a NaN norm makes
// them NaN, as there), so nothing is read back (the norm comes back as a 0-dimensional double tensor).
// `coefficient`, when given, receives the coefficient applied (undefined when measuring only).
inline at::Tensor scale_to_norm(const at::Tensor& totals, std::initializer_list<std::vector<at::Tensor>*> lists,
                                double max_norm, double norm_type, at::Tensor* coefficient = nullptr) {
  const bool infinity = std::isinf(norm_type);
  const auto total = infinity ? totals.max() : totals.sum();
  const auto norm = infinity ? total : total.pow(1.0 / norm_type);
  if (std::isinf(max_norm)) return norm;  // measuring only (xlr8 verify, an engine without clipping)
  const auto coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  if (coefficient) *coefficient = coef;
  // The coefficient once per device (offload keeps some gradients in host memory): no copy per gradient.
  std::vector<std::pair<at::Device, at::Tensor>> on_device;
  const auto coef_on = [&](const at::Device& device) {
    for (const auto& [d, c] : on_device)
      if (d == device) return c;
    return on_device.emplace_back(device, coef.to(device, at::kFloat)).second;
  };
  at::NoGradGuard no_grad;
  for (auto* list : lists)
    for (auto& g : *list) g.mul_(coef_on(g.device()));
  return norm;
}

}  // namespace xlr8::parallel
