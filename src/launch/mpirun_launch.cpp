#include "launch/mpirun_launch.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/log.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace xlr8::launcher {

void check_mpirun_launch(const LaunchOptions& o) {
  const std::string& hostfile = o.mpirun_hostfile;
  if (!std::ifstream(hostfile))
    throw ConfigError(fmt::format("mpirun_config.mpirun_hostfile {:?} does not exist or cannot be read; write the host "
                                  "file (a line `<host> slots=<processes>` per machine) or pass --mpirun_hostfile PATH",
                                  hostfile));
  if (o.machine_rank != 0)
    throw ConfigError(fmt::format("machine_rank {} with mpirun_config.mpirun_hostfile {:?}: mpirun starts every "
                                  "machine's processes from one xlr8 launch; run it once, on machine 0 (machine_rank 0)",
                                  o.machine_rank, hostfile));
  if (o.max_restarts != 0)
    throw ConfigError(fmt::format("--max_restarts {} cannot be used with mpirun_config.mpirun_hostfile {:?}: mpirun "
                                  "ends the job at its first failure; drop --max_restarts or mpirun_config",
                                  o.max_restarts, hostfile));
  if (!o.log_dir.empty())
    throw ConfigError(fmt::format("--log_dir {:?} cannot be used with mpirun_config.mpirun_hostfile {:?}: mpirun "
                                  "relays every rank's output itself; drop --log_dir or mpirun_config",
                                  o.log_dir, hostfile));
}

MpirunCommand mpirun_command(const LaunchOptions& o, const std::string& mpirun, bool open_mpi, int port) {
  MpirunCommand c;
  for (const auto& vars : {settings_to_env(o.settings), o.extra_env})
    for (const auto& [k, v] : vars) c.env[k] = v;
  c.env["MASTER_ADDR"] = o.master_addr;
  c.env["MASTER_PORT"] = std::to_string(port);
  if (!env_var("OMP_NUM_THREADS") && !c.env.count("OMP_NUM_THREADS")) {  // as for local workers: never oversubscribed
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    c.env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(o.nproc_per_node)));
  }
  const std::string per_node = std::to_string(o.nproc_per_node), total = std::to_string(o.world_size());
  if (open_mpi) {
    c.argv = {mpirun, "--hostfile", o.mpirun_hostfile, "--npernode", per_node, "-n", total, "--bind-to", "socket"};
    for (const auto& [name, value] : c.env) c.argv.insert(c.argv.end(), {"-x", name});
  } else {
    c.argv = {mpirun, "-f", o.mpirun_hostfile, "-ppn", per_node, "-n", total};
  }
  c.argv.insert(c.argv.end(), o.command.begin(), o.command.end());
  return c;
}

namespace {

// "mpirun", else "mpiexec", as `accelerate launch` looks for them.
std::string find_mpirun() {
  for (const char* name : {"mpirun", "mpiexec"}) {
    try {
      return resolve_program(name);
    } catch (const Error&) {
    }
  }
  throw Error("mpirun_config.mpirun_hostfile is set but neither mpirun nor mpiexec is on PATH; install Open MPI "
              "(apt-get install openmpi-bin) or another MPI, or remove mpirun_config");
}

bool is_open_mpi(const std::string& mpirun) {
  std::string text;
  if (FILE* pipe = popen(fmt::format("'{}' --version 2>&1", mpirun).c_str(), "r")) {
    char buffer[512];
    while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) text.append(buffer, n);
    pclose(pipe);
  }
  return text.find("Open MPI") != std::string::npos;
}

// Runs argv with env and waits, passing SIGTERM and SIGHUP (and a SIGINT sent to the launcher alone) on
// to it; a terminal's Ctrl-C reaches mpirun directly, since it stays in the launcher's process group.
int run_forwarding_signals(std::vector<std::string> args, const std::map<std::string, std::string>& env) {
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  sigset_t mask, saved;
  sigemptyset(&mask);
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&mask, s);
  sigprocmask(SIG_BLOCK, &mask, &saved);
  pid_t pid = fork();
  if (pid == 0) {
    sigprocmask(SIG_SETMASK, &saved, nullptr);
    execve(argv[0], argv.data(), envp.data());
    dprintf(2, "xlr8 launch: cannot execute %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  if (pid < 0) {
    sigprocmask(SIG_SETMASK, &saved, nullptr);
    throw Error(fmt::format("fork failed: {}", std::strerror(errno)));
  }
  int status = 0;
  for (;;) {
    siginfo_t info{};
    if (sigwaitinfo(&mask, &info) < 0) continue;  // EINTR
    if (info.si_signo == SIGCHLD) {
      if (waitpid(pid, &status, WNOHANG) == pid) break;
    } else if (info.si_code != SI_KERNEL) {
      kill(pid, info.si_signo);
    }
  }
  sigprocmask(SIG_SETMASK, &saved, nullptr);
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

}  // namespace

int launch_through_mpirun(const LaunchOptions& o) {
  check_mpirun_launch(o);
  resolve_program(o.command[0]);  // a missing program is named here, not once per rank by mpirun
  const std::string mpirun = find_mpirun();
  const int port = o.master_port != 0 ? o.master_port : pick_free_port();
  MpirunCommand c = mpirun_command(o, mpirun, is_open_mpi(mpirun), port);
  log::info("xlr8 launch: starting {} processes through {}", o.world_size(), text::join(c.argv, " "));
  std::map<std::string, std::string> env = Env::current().vars();
  for (const auto& [k, v] : c.env) env[k] = v;
  return run_forwarding_signals(c.argv, env);
}

}  // namespace xlr8::launcher
