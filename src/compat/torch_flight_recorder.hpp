#pragma once
// LibTorch's flight recorder before 2.12 (c10d's record of every collective; read in 2.9's and 2.11's
// FlightRecorderDetail.hpp) inserts a process group's first record into a std::map before taking its mutex; 2.12
// moved that under the mutex. Two groups recording their first collective at once (ranks as threads in one process,
// as the unit tests run them; a DDP hook on an autograd device thread beside the main thread) corrupt that map: the
// unit tests crashed against 2.11 (SIGSEGV in std::_Rb_tree_insert_and_rebalance under
// FlightRecorder::recordWithResetEnabled, from ProcessGroupGloo::enqueue). There, unless the user sized the
// recorder, it is switched off before any group exists; xlr8's own flight recorder (core/flight_recorder.hpp, what
// `xlr8 launch` diagnoses hangs from) stays. (Kept out of torch_compat.hpp, which the precompiled header holds.)
#include <torch/version.h>

#include <cstdlib>

#include "xlr8/env.hpp"

namespace xlr8::compat {

inline void avoid_torch_flight_recorder_race() {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
  static const bool done = [] {
    if (!env_var("TORCH_FR_BUFFER_SIZE") && !env_var("TORCH_NCCL_TRACE_BUFFER_SIZE"))
      ::setenv("TORCH_FR_BUFFER_SIZE", "0", 0);
    return true;
  }();
  (void)done;
#endif
}

}  // namespace xlr8::compat
