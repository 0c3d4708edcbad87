// EmptyInitScope: the Meta dispatch key included on this thread, so every operator that writes values
// runs its meta kernel (shape checks only). Factory functions still allocate where their options say
// (the CPU allocator hands out fresh pages, untouched until written) or return meta tensors; the
// sharding engine accepts both (parallel/zero_engine.cpp).
#include "xlr8/empty_init.hpp"

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace xlr8 {

struct EmptyInitScope::Saved {
  c10::impl::LocalDispatchKeySet keys;
};

EmptyInitScope::EmptyInitScope() : saved_(std::make_unique<Saved>(Saved{c10::impl::tls_local_dispatch_key_set()})) {
  auto keys = saved_->keys;
  keys.included_ = keys.included_ | c10::DispatchKeySet(c10::DispatchKey::Meta);
  c10::impl::_force_tls_local_dispatch_key_set(keys);
}

// Restored as saved, not by removing Meta: removing a per-backend key from a key set keeps its backend
// bit, which would leave every later CPU operator running its meta kernel.
EmptyInitScope::~EmptyInitScope() { c10::impl::_force_tls_local_dispatch_key_set(saved_->keys); }

}  // namespace xlr8
