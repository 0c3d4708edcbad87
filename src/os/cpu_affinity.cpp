#include "os/cpu_affinity.hpp"

#include <dirent.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <tuple>

#include "xlr8/error.hpp"

namespace xlr8::os {
namespace {

int read_topology(int cpu, const char* field, int fallback) {
  std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu{}/topology/{}", cpu, field));
  int value = fallback;
  return (in >> value) ? value : fallback;
}

}  // namespace

std::vector<LogicalCpu> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0)
    throw Error(fmt::format("cannot read this process's CPU affinity: {}", std::strerror(errno)));
  std::vector<LogicalCpu> cpus;
  for (int id = 0; id < CPU_SETSIZE; ++id)
    if (CPU_ISSET(id, &set)) cpus.push_back({id, read_topology(id, "physical_package_id", 0), read_topology(id, "core_id", id)});
  return cpus;
}

std::vector<int> cpus_for_local_rank(std::vector<LogicalCpu> allowed, int local_rank, int local_world_size) {
  if (allowed.empty()) throw Error("CPU affinity: this process may run on no CPU at all");
  if (local_world_size < 1 || local_rank < 0 || local_rank >= local_world_size)
    throw Error(fmt::format("CPU affinity: local rank {} is not within a local world of {}", local_rank, local_world_size));
  std::sort(allowed.begin(), allowed.end(),
            [](const LogicalCpu& a, const LogicalCpu& b) { return std::tie(a.package, a.core, a.id) < std::tie(b.package, b.core, b.id); });
  // Whole cores, in (socket, core) order; each core's logical CPUs (its hyperthreads).
  std::map<std::pair<int, int>, std::vector<int>> by_core;
  for (const auto& c : allowed) by_core[{c.package, c.core}].push_back(c.id);
  std::vector<std::vector<int>> units;
  if (static_cast<int>(by_core.size()) >= local_world_size) {
    for (auto& [key, ids] : by_core) units.push_back(ids);
  } else {
    for (const auto& c : allowed) units.push_back({c.id});
  }
  const int n = static_cast<int>(units.size());
  std::vector<int> mine;
  if (n < local_world_size) {
    mine = units[static_cast<size_t>(local_rank % n)];  // more ranks than CPUs: share them round-robin
  } else {
    const long begin = static_cast<long>(n) * local_rank / local_world_size;
    const long end = static_cast<long>(n) * (local_rank + 1) / local_world_size;
    for (long u = begin; u < end; ++u) mine.insert(mine.end(), units[static_cast<size_t>(u)].begin(), units[static_cast<size_t>(u)].end());
  }
  std::sort(mine.begin(), mine.end());
  return mine;
}

void bind_process_to(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int id : cpus) CPU_SET(id, &set);
  auto refuse = [&](int tid) {
    throw Error(fmt::format("CPU affinity: cannot bind thread {} to CPUs {}: {}. Set enable_cpu_affinity: false "
                            "(or unset ACCELERATE_CPU_AFFINITY) to run unbound",
                            tid, cpu_list_text(cpus), std::strerror(errno)));
  };
  // sched_setaffinity binds one thread; threads started earlier (an OpenMP pool) are bound one by one.
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (dirent* entry = readdir(tasks)) {
      const int tid = std::atoi(entry->d_name);
      if (tid <= 0) continue;
      if (sched_setaffinity(tid, sizeof set, &set) != 0 && errno != ESRCH) {  // ESRCH: that thread has ended
        closedir(tasks);
        refuse(tid);
      }
    }
    closedir(tasks);
  }
  // This thread again, so it is bound even where /proc is not mounted.
  const int self = static_cast<int>(::syscall(SYS_gettid));
  if (sched_setaffinity(self, sizeof set, &set) != 0) refuse(self);
}

std::string cpu_list_text(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += fmt::format("{}{}", out.empty() ? "" : ",", i == j ? std::to_string(cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]));
    i = j + 1;
  }
  return out;
}

}  // namespace xlr8::os
