// EmptyInitScope: the Meta dispatch key included on this thread and BackendSelect excluded, so factory
// functions dispatch straight to their meta kernels (whatever device their options name) and every
// other operator on the meta tensors they return does too.
#include "xlr8/empty_init.hpp"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace xlr8 {

struct EmptyInitScope::Saved {
  c10::impl::LocalDispatchKeySet keys;
};

EmptyInitScope::EmptyInitScope() : saved_(std::make_unique<Saved>(Saved{c10::impl::tls_local_dispatch_key_set()})) {
  auto keys = saved_->keys;
  keys.included_ = keys.included_ | c10::DispatchKeySet(c10::DispatchKey::Meta);
  keys.excluded_ = keys.excluded_ | c10::DispatchKeySet(c10::DispatchKey::BackendSelect);
  c10::impl::_force_tls_local_dispatch_key_set(keys);
}

// Restored as saved, not by removing Meta: removing a per-backend key from a key set keeps its backend
// bit, which would leave every later CPU operator running its meta kernel.
EmptyInitScope::~EmptyInitScope() { c10::impl::_force_tls_local_dispatch_key_set(saved_->keys); }

void to_empty(torch::nn::Module& module, const at::Device& device) {
  auto give_memory = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_meta()) return;  // a tied tensor is seen twice: once is enough
    auto real = at::empty(t.sizes(), t.options().device(device).requires_grad(false));
    // Tensor::set_data refuses to move a tensor off the meta device; this is what it does once it has
    // checked (the autograd metadata, hence requires_grad and identity, stays with the tensor).
    t.unsafeGetTensorImpl()->shallow_copy_from(real.getIntrusivePtr());
  };
  for (const auto& p : module.parameters()) give_memory(p);
  for (const auto& b : module.buffers()) give_memory(b);
}

}  // namespace xlr8
