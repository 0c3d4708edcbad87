#include "xlr8/autocast.hpp"

#include "compat/cpu_norm_autocast.hpp"
#include "compat/torch_compat.hpp"

#if XLR8_NEEDS_CPU_NORM_AUTOCAST
#include <torch/library.h>

namespace {

// Under CPU autocast, a normalisation whose input is in lower precision and whose weights are not runs in
// fp32 and returns the input's dtype: what 2.x's mixed-dtype CPU kernels do.
bool mixed(const at::Tensor& input, const c10::optional<at::Tensor>& weight) {
  return input.scalar_type() != at::kFloat && at::isFloatingType(input.scalar_type()) && weight &&
         weight->defined() && weight->scalar_type() != input.scalar_type();
}

at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef shape, const c10::optional<at::Tensor>& weight,
                      const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  if (!mixed(input, weight)) return at::layer_norm(input, shape, weight, bias, eps, cudnn);
  return at::layer_norm(input.to(at::kFloat), shape, weight, bias, eps, cudnn).to(input.scalar_type());
}

at::Tensor group_norm(const at::Tensor& input, int64_t groups, const c10::optional<at::Tensor>& weight,
                      const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  if (!mixed(input, weight)) return at::group_norm(input, groups, weight, bias, eps, cudnn);
  return at::group_norm(input.to(at::kFloat), groups, weight, bias, eps, cudnn).to(input.scalar_type());
}

at::Tensor batch_norm(const at::Tensor& input, const c10::optional<at::Tensor>& weight,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& running_mean,
                      const c10::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
                      bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const bool stats_differ = running_mean && running_mean->defined() && running_mean->scalar_type() != input.scalar_type();
  if (!mixed(input, weight) && !(stats_differ && input.scalar_type() != at::kFloat))
    return at::batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn);
  return at::batch_norm(input.to(at::kFloat), weight, bias, running_mean, running_var, training, momentum, eps, cudnn)
      .to(input.scalar_type());
}

TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) {
  m.impl("layer_norm", TORCH_FN(layer_norm));
  m.impl("group_norm", TORCH_FN(group_norm));
  m.impl("batch_norm", TORCH_FN(batch_norm));
}

}  // namespace
#endif

namespace xlr8 {

AutocastScope::AutocastScope(c10::DeviceType device, c10::ScalarType dtype, bool enabled) : device_(device) {
  if (!enabled) return;
  active_ = true;
  previous_enabled_ = compat::autocast_enabled(device);
  previous_dtype_ = compat::autocast_dtype(device);
  compat::set_autocast(device, true, dtype);
  compat::autocast_enter();
}

AutocastScope::AutocastScope(AutocastScope&& other) noexcept
    : active_(other.active_),
      device_(other.device_),
      previous_enabled_(other.previous_enabled_),
      previous_dtype_(other.previous_dtype_) {
  other.active_ = false;
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  compat::autocast_exit();
  compat::set_autocast(device_, previous_enabled_, previous_dtype_);
}

AutocastPause::AutocastPause()
    : cpu_(compat::autocast_enabled(c10::DeviceType::CPU)), cuda_(compat::autocast_enabled(c10::DeviceType::CUDA)) {
  if (cpu_) compat::set_autocast(c10::DeviceType::CPU, false, compat::autocast_dtype(c10::DeviceType::CPU));
  if (cuda_) compat::set_autocast(c10::DeviceType::CUDA, false, compat::autocast_dtype(c10::DeviceType::CUDA));
}

AutocastPause::~AutocastPause() {
  if (cpu_) compat::set_autocast(c10::DeviceType::CPU, true, compat::autocast_dtype(c10::DeviceType::CPU));
  if (cuda_) compat::set_autocast(c10::DeviceType::CUDA, true, compat::autocast_dtype(c10::DeviceType::CUDA));
}

}  // namespace xlr8
