#pragma once
// How long this process has been blocked waiting for collectives (Work::wait, every thread together):
// what DeepSpeed's wall_clock_breakdown reports as allreduce time, read as a difference around a phase.
#include <cstdint>

namespace xlr8::distributed {
int64_t collective_wait_ns();
}  // namespace xlr8::distributed
