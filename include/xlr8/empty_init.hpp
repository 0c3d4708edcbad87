#pragma once
// Building a model without computing its values (Accelerate's init_empty_weights, FSDP's meta-device
// construction), for LibTorch modules, which take no device argument. While an EmptyInitScope is alive on
// this thread, operations that write values (initialisers, fills, random draws) do nothing: parameters and
// buffers get their shapes, dtypes and requires_grad, and either memory that is never touched (so it
// costs no resident memory) or the meta device. Their values are garbage until something overwrites them:
// use it only to build modules whose values then come from elsewhere (Accelerator::build_model does this
// for you: the main process builds for real and every other process receives its shards in prepare()).
// No real computation may run inside the scope.
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

}  // namespace xlr8
