#pragma once
// RAII autocast (LibTorch has no C++ guard): enables autocast for a device type and dtype, restores
// the previous state on exit. A disabled scope changes nothing.
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace xlr8 {

class AutocastScope {
 public:
  AutocastScope() = default;  // disabled
  AutocastScope(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true);
  ~AutocastScope();
  AutocastScope(AutocastScope&& other) noexcept;
  AutocastScope& operator=(AutocastScope&&) = delete;
  AutocastScope(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::BFloat16;
};

// Suspends autocast on both CPU and CUDA (backward runs outside autocast, as PyTorch recommends).
class AutocastPause {
 public:
  AutocastPause();
  ~AutocastPause();
  AutocastPause(const AutocastPause&) = delete;

 private:
  bool cpu_, cuda_;
};

}  // namespace xlr8
