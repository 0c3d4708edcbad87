#pragma once
// Counts the calls of some ATen operators, on any thread, while an OpCounter lives (one at a time), through
// a RecordFunction callback: what a test uses to see which kernels a computation really ran.
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace xlr8::testing {

class OpCounter {
 public:
  explicit OpCounter(std::vector<std::string> names) : names_(std::move(names)) {
    active() = this;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (auto* self = active().load(); self && self->counts(fn.name())) ++self->count_;
          return nullptr;
        }));
  }
  ~OpCounter() {
    at::removeCallback(handle_);
    active() = nullptr;
  }
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;
  int64_t count() const { return count_.load(); }

  // The operators that read a tensor's values on the host. On a GPU each one waits for every kernel queued
  // before it (a device-to-host synchronisation); on the CPU they run all the same, so the count is the one
  // a GPU run would see. Every read of a value (item(), a Scalar from a tensor) goes through
  // aten::_local_scalar_dense; nonzero, masked_select and unique size their output from the values.
  static std::vector<std::string> host_reads() {
    return {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2"};
  }

 private:
  bool counts(std::string_view name) const { return std::find(names_.begin(), names_.end(), name) != names_.end(); }
  static std::atomic<OpCounter*>& active() {
    static std::atomic<OpCounter*> current{nullptr};
    return current;
  }
  std::vector<std::string> names_;
  std::atomic<int64_t> count_{0};
  at::CallbackHandle handle_ = 0;
};

}  // namespace xlr8::testing
