#pragma once
// Building a model without computing its values (Accelerate's init_empty_weights, FSDP's meta-device
// construction), for LibTorch modules, which take no device argument. While an EmptyInitScope is alive on
// this thread, every tensor created is a meta tensor (shape, dtype and requires_grad, no memory) and
// every operator runs its meta kernel, so initialisers cost nothing. No real computation may run
// inside. to_empty() then gives the module's parameters and buffers memory on a device, untouched (so
// it costs no resident memory until written) and with undefined values, for something to overwrite:
// Accelerator::build_model does both, and prepare() fills them from the main process. A tensor the
// module keeps without registering it (neither parameter nor buffer) stays on the meta device and fails
// when used: register it, or create it in forward.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>

namespace xlr8 {

class EmptyInitScope {
 public:
  EmptyInitScope();
  ~EmptyInitScope();
  EmptyInitScope(const EmptyInitScope&) = delete;
  EmptyInitScope& operator=(const EmptyInitScope&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;  // this thread's dispatch state before the scope, restored exactly
};

// Every parameter and buffer of `module` on the meta device gets uninitialised memory on `device`, in
// place: the same tensor objects (so the module's members and autograd see them), same shape, dtype and
// requires_grad (PyTorch's Module.to_empty).
void to_empty(torch::nn::Module& module, const at::Device& device);

}  // namespace xlr8
