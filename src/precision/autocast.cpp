#include "xlr8/autocast.hpp"

#include "compat/torch_compat.hpp"


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
