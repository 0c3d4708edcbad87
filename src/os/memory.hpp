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

}  // namespace xlr8::os
