#include "train/memory_meter.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "compat/torch_compat.hpp"

namespace xlr8::detail::memory_meter {

namespace {

std::atomic<int64_t> live_bytes{0}, peak_bytes{0};

void add(int64_t n) {
  const int64_t now = live_bytes.fetch_add(n) + n;
  for (int64_t peak = peak_bytes.load(); now > peak && !peak_bytes.compare_exchange_weak(peak, now);) {
  }
}

// Sizes by address: LibTorch's raw_allocate wants the context to be the data pointer, so the size cannot
// travel in the context.
std::mutex sizes_mutex;
std::unordered_map<void*, int64_t> sizes;
c10::DeleterFnPtr inner_delete = nullptr;  // the wrapped allocator's raw deleter

void release(void* data) {
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(sizes_mutex);
    if (auto it = sizes.find(data); it != sizes.end()) bytes = it->second, sizes.erase(it);
  }
  live_bytes.fetch_sub(bytes);
  inner_delete(data);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
#if XLR8_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t n) override { return wrap(inner_->allocate(n), n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return wrap(inner_->allocate(n), n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 private:
  static c10::DataPtr wrap(c10::DataPtr inner, size_t n) {
    const auto device = inner.device();
    void* data = inner.release_context();  // the default CPU allocator's context is its data pointer
    if (data) {
      std::lock_guard<std::mutex> lock(sizes_mutex);
      sizes[data] = static_cast<int64_t>(n);
    }
    add(static_cast<int64_t>(n));
    return {data, data, &release, device};
  }
  c10::Allocator* inner_;
};

bool on_cuda() {
#ifdef XLR8_WITH_NCCL
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

}  // namespace

void install() {
  static const bool installed = [] {
    if (on_cuda()) return true;
    auto* inner = c10::GetCPUAllocator();
    inner_delete = inner->raw_deleter();
    if (!inner_delete) return false;  // an allocator whose memory cannot be freed by address: not counted
    // Lives as long as the process: tensors freed at exit still call into it.
    static CountingAllocator counting(inner);
    c10::SetCPUAllocator(&counting, /*priority=*/100);
    return true;
  }();
  (void)installed;
}

Reading read() {
#ifdef XLR8_WITH_NCCL
  if (on_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    const auto& allocated = stats.allocated_bytes[0];  // StatType::AGGREGATE
    return {allocated.current, allocated.peak};
  }
#endif
  return {live_bytes.load(), peak_bytes.load()};
}

void reset_peak() {
#ifdef XLR8_WITH_NCCL
  if (on_cuda()) return c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
#endif
  peak_bytes.store(live_bytes.load());
}

}  // namespace xlr8::detail::memory_meter
