#pragma once
// Handing freed heap memory back to the system. xlr8 keeps freed blocks up to 128 MB in glibc's heap
// (ProcessState's allocator tuning) so that training steps reuse warm pages; but when a model's
// parameters move into new buffers once (sharding them), the freed originals would stay resident
// beside their replacements, doubling the memory of the start-up.
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <mutex>

namespace xlr8::os {

inline void return_free_memory_to_system() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

namespace detail {
struct MallocThresholds {
  std::mutex mutex;
  int mmap = 32 << 20, trim = 64 << 20;  // the warm setting; before any tuning, about glibc's dynamic ceiling
  int prompt_scopes = 0;                  // PromptlyFreedMemory scopes alive
  bool prompt_for_good = false;           // offload's disk tier asked
};
inline MallocThresholds& malloc_thresholds() {
  static MallocThresholds thresholds;
  return thresholds;
}
// Whether glibc took both.
inline bool set_malloc_thresholds([[maybe_unused]] int mmap, [[maybe_unused]] int trim) {
#if defined(__GLIBC__)
  return mallopt(M_MMAP_THRESHOLD, mmap) == 1 && mallopt(M_TRIM_THRESHOLD, trim) == 1;
#else
  return false;
#endif
}
// Freed blocks above 1 MB go back to the system at once; the heap is trimmed above 64 MB.
inline void set_prompt_thresholds() { set_malloc_thresholds(1 << 20, 64 << 20); }
}  // namespace detail

// ProcessState's tuning: freed blocks up to `mmap` bytes stay warm in the heap, which is trimmed above `trim`.
// Returns whether glibc took them; what a PromptlyFreedMemory scope returns to (32 MB / 64 MB when refused).
inline bool keep_freed_blocks_up_to(int mmap, int trim) {
  auto& t = detail::malloc_thresholds();
  std::lock_guard<std::mutex> lock(t.mutex);
  const bool taken = detail::set_malloc_thresholds(mmap, trim);
  if (taken) t.mmap = mmap, t.trim = trim;
  else detail::set_malloc_thresholds(t.mmap, t.trim);
  return taken;
}

// From now on freed blocks above 1 MB go back to the system at once (mmapped, not kept warm in the heap by
// ProcessState's tuning), and the heap is trimmed above 64 MB: offload's disk tier trades speed for memory
// (otherwise the shards and gradients it moves through leave their freed memory resident: a run with its state on
// disk held twice its gradients' bytes more than it needed).
inline void return_freed_memory_promptly() {
  auto& t = detail::malloc_thresholds();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    t.prompt_for_good = true;
    detail::set_prompt_thresholds();
  }
  return_free_memory_to_system();
}

// The same while it lives: a phase that frees large tensors once (a recorded model's values computed tensor by
// tensor or group by group: glibc's heap would otherwise keep each freed one, its mmap threshold rising to the
// size of the last freed). Training steps, which free and allocate the same temporaries every step, must reuse
// warm pages: the last scope to end restores the warm setting, unless the disk tier asked for good.
class PromptlyFreedMemory {
 public:
  PromptlyFreedMemory() {
    auto& t = detail::malloc_thresholds();
    std::lock_guard<std::mutex> lock(t.mutex);
    if (t.prompt_scopes++ == 0 && !t.prompt_for_good) detail::set_prompt_thresholds();
  }
  ~PromptlyFreedMemory() {
    auto& t = detail::malloc_thresholds();
    std::lock_guard<std::mutex> lock(t.mutex);
    if (--t.prompt_scopes == 0 && !t.prompt_for_good) detail::set_malloc_thresholds(t.mmap, t.trim);
  }
  PromptlyFreedMemory(const PromptlyFreedMemory&) = delete;
  PromptlyFreedMemory& operator=(const PromptlyFreedMemory&) = delete;
};

}  // namespace xlr8::os
