#pragma once
// Handing freed heap memory back to the system. xlr8 keeps freed blocks up to 128 MB in glibc's heap
// (ProcessState's allocator tuning) so that training steps reuse warm pages; but when a model's
// parameters move into new buffers once (sharding them), the freed originals would stay resident
// beside their replacements, doubling the memory of the start-up.
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace xlr8::os {

inline void return_free_memory_to_system() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

namespace detail {
struct MallocThresholds {
  int mmap = 32 << 20, trim = 64 << 20;  // before any tuning: about glibc's dynamic ceiling
  bool prompt_for_good = false;
};
inline MallocThresholds& malloc_thresholds() {
  static MallocThresholds thresholds;
  return thresholds;
}
inline void set_malloc_thresholds([[maybe_unused]] int mmap, [[maybe_unused]] int trim) {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, mmap);
  mallopt(M_TRIM_THRESHOLD, trim);
#endif
}
}  // namespace detail

// ProcessState's tuning: freed blocks up to `mmap` bytes stay warm in the heap, which is trimmed above `trim`.
// Returns whether glibc took them. What keep_freed_memory_warm() returns to.
inline bool keep_freed_blocks_up_to(int mmap, int trim) {
#if defined(__GLIBC__)
  detail::malloc_thresholds().mmap = mmap;
  detail::malloc_thresholds().trim = trim;
  return mallopt(M_MMAP_THRESHOLD, mmap) == 1 && mallopt(M_TRIM_THRESHOLD, trim) == 1;
#else
  return false;
#endif
}

// Freed blocks above 1 MB go back to the system at once (mmapped, not kept warm in the heap by ProcessState's
// tuning), and the heap is trimmed above 64 MB. For good (`for_good`): offload's disk tier, which trades speed
// for memory (otherwise the shards and gradients it moves through leave their freed memory resident: a run with
// its state on disk held twice its gradients' bytes more than it needed). Else until keep_freed_memory_warm():
// a phase that frees large tensors once (a recorded model's values computed group by group), after which the
// training steps, which free and allocate the same temporaries every step, must reuse warm pages again.
inline void return_freed_memory_promptly(bool for_good) {
  detail::malloc_thresholds().prompt_for_good |= for_good;
  detail::set_malloc_thresholds(1 << 20, 64 << 20);
  return_free_memory_to_system();
}

// Ends a phase of return_freed_memory_promptly(false), unless the disk tier asked for it for good.
inline void keep_freed_memory_warm() {
  const auto& t = detail::malloc_thresholds();
  if (!t.prompt_for_good) detail::set_malloc_thresholds(t.mmap, t.trim);
}

}  // namespace xlr8::os
