#pragma once
// A gradient norm as clip_grad_norm computed it, left where the gradients are: on a GPU, reading it on
// the host waits for every kernel queued before it, so a training step that does not print it never
// waits. value() (or converting to double, as LibTorch's clip_grad_norm_ returned) reads it.
#include <ATen/core/Tensor.h>

namespace xlr8 {

class GradNorm {
 public:
  GradNorm() = default;  // no gradients: 0
  explicit GradNorm(at::Tensor norm) : norm_(std::move(norm)) {}
  // The norm as a number: waits for the device.
  double value() const { return norm_.defined() ? norm_.item<double>() : 0.0; }
  operator double() const { return value(); }  // NOLINT(google-explicit-constructor): a drop-in for double
  // The norm as a 0-dimensional double tensor on the gradients' device (undefined without gradients).
  const at::Tensor& tensor() const { return norm_; }

 private:
  at::Tensor norm_;
};

}  // namespace xlr8
