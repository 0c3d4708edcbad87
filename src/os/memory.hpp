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

// Offload's disk tier trades speed for memory: from now on freed blocks above 1 MB go back to the system at
// once (mmapped, not kept warm in the heap by ProcessState's tuning), and the heap is trimmed above 64 MB.
// Otherwise the shards and gradients the tier moves through leave their freed memory resident: a run with its
// state on disk held twice its gradients' bytes more than it needed.
inline void return_freed_memory_promptly() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  malloc_trim(0);
#endif
}

}  // namespace xlr8::os
