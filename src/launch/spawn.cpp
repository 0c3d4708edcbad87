#include "launch/spawn.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "xlr8/error.hpp"

namespace xlr8::launcher {

SpawnedWorker spawn_worker(const std::string& program, const std::vector<std::string>& args,
                           const std::map<std::string, std::string>& env) {
  std::vector<std::string> env_strings, arg_strings = args;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& a : arg_strings) argv.push_back(a.data());
  argv.push_back(nullptr);

  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0)
    throw Error(fmt::format("pipe failed: {}", std::strerror(errno)));
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw Error(fmt::format("fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    // Child: own process group (so the whole worker tree can be signalled), die with the launcher.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(1);
    // Default dispositions and nothing blocked, whatever the launcher inherited: a shell without job
    // control starts background jobs with SIGINT and SIGQUIT ignored, and exec keeps ignored signals.
    for (int sig : {SIGINT, SIGQUIT, SIGTERM, SIGHUP, SIGPIPE, SIGUSR1, SIGUSR2}) signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    execve(program.c_str(), argv.data(), envp.data());
    dprintf(2, "xlr8 launch: cannot execute %s: %s\n", program.c_str(), std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent, so signalling the group never races the child's setpgid
  close(out_pipe[1]);
  close(err_pipe[1]);
  return {.pid = pid, .out_fd = out_pipe[0], .err_fd = err_pipe[0]};
}

}  // namespace xlr8::launcher
