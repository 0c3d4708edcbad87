#include "diagnostics/memory_meter.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "compat/torch_compat.hpp"

namespace xlr8::diagnostics::memory_meter {

namespace {

std::atomic<int64_t> live_bytes{0}, peak_bytes{0};

void add(int64_t n) {
  const int64_t now = live_bytes.fetch_add(n) + n;
  for (int64_t peak = peak_bytes.load(); now > peak && !peak_bytes.compare_exchange_weak(peak, now);) {
  }
}

// Sizes by address: LibTorch's raw_allocate wants the context to be the data pointer, so the size cannot
// travel in the context. Never destroyed: tensors freed during exit (a global model, a thread still running)
// still come here.
struct Sizes {
  std::mutex mutex;
  std::unordered_map<void*, int64_t> bytes;
};
Sizes& sizes() {
  static auto* table = new Sizes;
  return *table;
}
c10::DeleterFnPtr inner_delete = nullptr;  // the wrapped allocator's raw deleter

void release(void* data) {
  int64_t bytes = 0;
  {
    auto& table = sizes();
    std::lock_guard<std::mutex> lock(table.mutex);
    if (auto it = table.bytes.find(data); it != table.bytes.end()) bytes = it->second, table.bytes.erase(it);
  }
  live_bytes.fetch_sub(bytes);
  inner_delete(data);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override { return wrap(inner_->allocate(n), n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 private:
  static c10::DataPtr wrap(c10::DataPtr inner, size_t n) {
    // Only memory whose context is its pointer and which raw_deleter frees can be taken over; anything else
    // passes through uncounted.
    if (inner.get() != inner.get_context() || inner.get_deleter() != inner_delete) return inner;
    const auto device = inner.device();
    void* data = inner.release_context();
    if (data) {
      auto& table = sizes();
      std::lock_guard<std::mutex> lock(table.mutex);
      table.bytes[data] = static_cast<int64_t>(n);
    }
    add(static_cast<int64_t>(n));
    return {data, data, &release, device};
  }
  c10::Allocator* inner_;
};

bool on_cuda(const c10::Device& device) {
#ifdef XLR8_WITH_NCCL
  return device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

}  // namespace

void install(const c10::Device& device) {
  if (on_cuda(device)) return;
  static const bool installed = [] {
    auto* inner = c10::GetCPUAllocator();
    inner_delete = inner->raw_deleter();
    if (!inner_delete) return false;  // an allocator whose memory cannot be freed by address: not counted
    // Lives as long as the process: tensors freed at exit still call into it.
    static auto* counting = new CountingAllocator(inner);
    c10::SetCPUAllocator(counting, /*priority=*/100);
    return true;
  }();
  (void)installed;
}

Reading read(const c10::Device& device) {
#ifdef XLR8_WITH_NCCL
  if (on_cuda(device)) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto& allocated = stats.allocated_bytes[0];  // StatType::AGGREGATE
    return {allocated.current, allocated.peak};
  }
#endif
  return {live_bytes.load(), peak_bytes.load()};
}

void reset_peak(const c10::Device& device) {
#ifdef XLR8_WITH_NCCL
  if (on_cuda(device)) return c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  peak_bytes.store(live_bytes.load());
}

}  // namespace xlr8::diagnostics::memory_meter
