#pragma once
// Building a model larger than memory (DeepSpeed's zero.Init, torchdistx's deferred_init), for LibTorch
// modules, which compute their initial values in their constructors. While a DeferredInitScope is alive
// on this thread, tensors are meta tensors (as in EmptyInitScope: no memory) and every operator the build
// runs is recorded. finish(module) then runs the recording once (so the CPU generator ends where building
// the model whole leaves it) keeping nothing, and the module's parameters and buffers stay deferred:
// materialize() later gives any of them their values, bitwise those of the whole build, computing only
// the operators they depend on (random ones from the generator's state as it was when they ran). A
// sharded model thus holds one unit's full values at a time, never the whole model.
// While finish(), materialize() and a strategy computing the values (make_parallel_strategy, prepare) run,
// glibc's mmap threshold is 1 MB for the process (as the disk tier sets it for good), so that each freed
// tensor's memory goes back to the system at once; then the warm-heap tuning the training steps need is back.
// Limits: the build runs on the CPU; a tensor the module keeps without registering it stays on the meta
// device (register it, or create it in forward); values must not depend on data read back from tensors; the
// build must not seed the CPU generator (even if it sets it back), and no other thread may move it while the
// build records (each recorded operator checks that it is where the scope found it).
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace xlr8 {

class DeferredInitScope {
 public:
  DeferredInitScope();
  ~DeferredInitScope();  // without finish(): the recording is discarded
  DeferredInitScope(const DeferredInitScope&) = delete;
  DeferredInitScope& operator=(const DeferredInitScope&) = delete;
  // Ends the recording (on the thread that began it): `module`'s parameters and buffers made inside
  // become deferred, to be materialised later on `device`.
  void finish(torch::nn::Module& module, const at::Device& device = at::kCPU);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether `tensor` still waits for its values.
bool is_deferred(const at::Tensor& tensor);
bool has_deferred(const torch::nn::Module& module);
// Gives each deferred tensor of `tensors` its values, in place (the same tensor objects); others are left
// as they are. Tensors sharing memory with them are materialised with them. Returns how many were deferred.
size_t materialize(const std::vector<at::Tensor>& tensors);
// Every deferred parameter and buffer of `module`.
void materialize_module(const torch::nn::Module& module);
// Gives each deferred tensor of `tensors` uninitialised memory of its size instead of its values (as to_empty
// does), for values that come from elsewhere (another rank's broadcast); its recording is dropped. Returns how
// many were deferred.
size_t materialize_empty(const std::vector<at::Tensor>& tensors);
// Throws the Error materialize() would: a deferred tensor of `tensors` was written or replaced since finish().
void check_deferred_unchanged(const std::vector<at::Tensor>& tensors);

}  // namespace xlr8
