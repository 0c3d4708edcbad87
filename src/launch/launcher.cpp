// `xlr8 launch`: the program's path, free ports, and the restart loop of a static launch (the workers'
// supervision is launch/supervisor.cpp; an elastic launch is launch/elastic_agent.cpp).
#include "xlr8/launcher.hpp"

#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>

#include "core/log.hpp"
#include "launch/elastic_agent.hpp"
#include "launch/mpirun_launch.hpp"
#include "launch/supervisor.hpp"
#include "os/shm_segment.hpp"
#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace xlr8 {

std::string resolve_program(const std::string& program) {
  auto check = [&](const std::string& path) {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) throw Error(fmt::format("cannot run {:?}: it is a directory", program));
    if (access(path.c_str(), X_OK) != 0)
      throw Error(fmt::format("cannot run {:?}: the file is not executable (chmod +x {})", path, path));
    return true;
  };
  if (program.find('/') != std::string::npos) {
    if (!check(program)) throw Error(fmt::format("cannot run {:?}: no such file", program));
    return program;
  }
  std::string paths = env_var("PATH").value_or("/usr/bin:/bin");
  size_t start = 0;
  while (start <= paths.size()) {
    size_t end = paths.find(':', start);
    if (end == std::string::npos) end = paths.size();
    std::string dir = paths.substr(start, end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (check(candidate)) return candidate;
    start = end + 1;
  }
  throw Error(fmt::format("cannot run {:?}: not found in PATH (give a path such as ./{})", program, program));
}

namespace {

int bind_probe(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int result = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 && listen(fd, 1) == 0) {
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    result = ntohs(addr.sin_port);
  }
  close(fd);
  return result;
}

// The first of the kernel's ephemeral ports (net.ipv4.ip_local_port_range): bind(0) and every outgoing
// connection take theirs from there up.
int first_ephemeral_port() {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  return low;
}

}  // namespace

bool port_is_free(int port) { return bind_probe(port) == port; }

int pick_free_port() {
  // Below the ephemeral ports, at random: a port bind(0) hands out can become another process's next outgoing
  // connection before rank 0 listens on it (seen under `ctest -j 2` as EADDRINUSE at the rendezvous).
  constexpr int kLowest = 10000;
  if (const int below = first_ephemeral_port() - 1; below > kLowest) {
    std::random_device random;
    std::uniform_int_distribution<int> any(kLowest, below);
    for (int attempt = 0; attempt < 64; ++attempt)
      if (const int port = any(random); bind_probe(port) == port) return port;
  }
  int port = bind_probe(0);
  if (port <= 0) throw Error(fmt::format("cannot find a free TCP port: {}", std::strerror(errno)));
  return port;
}

int launch(const LaunchOptions& o) { return launch_with_outcome(o).exit_code; }

LaunchOutcome launch_with_outcome(const LaunchOptions& o) {
  if (o.command.empty()) throw Error("no program to launch");
  if (o.nproc_per_node < 1) throw Error(fmt::format("{} processes per machine: need at least 1", o.nproc_per_node));
  if (!o.mpirun_hostfile.empty()) return {.exit_code = launcher::launch_through_mpirun(o)};
  std::string program = resolve_program(o.command[0]);
  if (o.elastic) return launcher::launch_elastic(o, program);
  const bool choose_port = o.master_port == 0;
  int port = choose_port ? pick_free_port() : o.master_port;
  if (!choose_port && o.machine_rank == 0 && !port_is_free(port))
    throw Error(fmt::format("port {} is already in use on this machine; pass another --main_process_port, or omit it "
                            "to pick a free one",
                            port));
  // One machine: a run id of its own, as torchrun --standalone gives one, so that a rank of another job that
  // reaches this job's rendezvous (two launches that picked one free port at once) is refused by name instead of
  // joining it. Several machines must agree on theirs: they keep the one they were given.
  LaunchOptions own = o;
  if (o.num_machines == 1 && o.run_id == "none") {
    std::random_device random;
    own.run_id = fmt::format("xlr8-{}-{:08x}", ::getpid(), random());
  }
  auto group = launcher::WorkerGroup::create(own, program);
  auto& supervisor = *group;
  for (int attempt = 0;; ++attempt) {
    int code = supervisor.run_attempt(attempt, {.node_rank = o.machine_rank,
                                                .num_nodes = o.num_machines,
                                                .world_size = o.world_size(),
                                                .rank_offset = o.machine_rank * o.nproc_per_node,
                                                .master_addr = o.master_addr,
                                                .master_port = port},
                                     own.stop_check);
    // Workers unlink their segments once mapped; only one killed mid-setup can leave one behind.
    os::remove_job_segments(std::to_string(::getpid()));
    if (code == 0 || !supervisor.failed())  // also stopped by stop_check, or interrupted
      return {.exit_code = code, .restarts = attempt, .interrupted_by = supervisor.interrupted_by()};
    supervisor.report_failure();
    if (attempt >= o.max_restarts)
      return {.exit_code = code, .restarts = attempt, .failure = supervisor.first_failure(), .stalled = supervisor.stalled()};
    log::warning("xlr8 launch: restarting all {} local worker(s) (restart {} of {})", o.nproc_per_node, attempt + 1,
                 o.max_restarts == std::numeric_limits<int>::max() ? "no limit" : std::to_string(o.max_restarts));
    if (choose_port) port = pick_free_port();
  }
}

}  // namespace xlr8

