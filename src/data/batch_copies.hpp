#pragma once
// pin_memory's copies to a CUDA device: the stream a data loader copies its batches on. Device-generic
// c10 streams and events, so that no CUDA header is needed and a build without CUDA compiles the same.
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace xlr8 {

struct BatchCopies {
  explicit BatchCopies(c10::Device on);
  c10::Device device;
  c10::impl::VirtualGuardImpl guard;
  c10::Stream stream;  // from the device's pool, shared by the loader's worker threads
};

}  // namespace xlr8
