#pragma once
// enable_cpu_affinity / ACCELERATE_CPU_AFFINITY=1: each local rank is bound to its own share of the
// cores this process may use, so the ranks of a host stop trading cores (and caches) with each other.
// Cores are split whole (hyperthread siblings stay together) in (socket, core) order, so a share stays
// on one socket where it can.
#include <string>
#include <vector>

namespace xlr8::os {

struct LogicalCpu {
  int id = 0;       // as in sched_setaffinity
  int package = 0;  // socket (topology/physical_package_id)
  int core = 0;     // core within the socket (topology/core_id)
};

// The logical CPUs this process may run on, with their socket and core from sysfs (a CPU whose
// topology cannot be read counts as its own core on socket 0).
std::vector<LogicalCpu> allowed_cpus();

// The CPU ids for `local_rank` of `local_world_size`, sorted: a contiguous block of whole cores when
// there are at least as many cores as ranks, else a block of logical CPUs, else (more ranks than
// CPUs) one CPU shared round-robin. Throws xlr8::Error on an empty set or a rank out of range.
std::vector<int> cpus_for_local_rank(std::vector<LogicalCpu> allowed, int local_rank, int local_world_size);

// Binds every thread of this process (and the threads it starts later) to `cpus`. Throws xlr8::Error
// naming the CPUs and the system's reason when the kernel refuses.
void bind_process_to(const std::vector<int>& cpus);

// "0-3,8,10-11"
std::string cpu_list_text(const std::vector<int>& cpus);

}  // namespace xlr8::os
