// The data loader's side of pin_memory: page-locked host batches, their copies on the loader's stream, and
// the hand-over to the stream that uses them.
#include "data/batch_copies.hpp"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include "xlr8/data_loader.hpp"

namespace xlr8 {

namespace {
c10::Device with_index(c10::Device device, const c10::impl::VirtualGuardImpl& guard) {
  return device.has_index() ? device : c10::Device(device.type(), guard.getDevice().index());
}
}  // namespace

BatchCopies::BatchCopies(c10::Device on)
    : device(on), guard(on.type()), stream(guard.getStreamFromGlobalPool(with_index(on, guard))) {
  device = stream.device();
}

at::Tensor DataLoaderBase::pinned(const at::Tensor& t) const {
  if (!t.defined() || !t.is_cpu() || t.is_pinned()) return t;
  return t.pin_memory();
}

std::shared_ptr<void> DataLoaderBase::copy_aside(const std::function<void()>& copy) const {
  auto done = std::make_shared<c10::Event>(copies_->device.type());
  {
    c10::StreamGuard on_copy_stream(copies_->stream);
    copy();
  }
  done->record(copies_->stream);
  return done;
}

void DataLoaderBase::hand_over(const std::shared_ptr<void>& copies_done, const std::vector<at::Tensor>& tensors) const {
  const c10::Stream taker = copies_->guard.getStream(copies_->device);
  static_cast<const c10::Event*>(copies_done.get())->block(taker);
  for (const auto& t : tensors)
    if (t.defined() && t.device() == copies_->device) t.record_stream(taker);
}

}  // namespace xlr8
