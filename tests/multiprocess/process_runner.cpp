#include "process_runner.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

std::string temp_dir(const std::string& tag) {
  static int counter = 0;
  auto dir = std::filesystem::temp_directory_path() /
             ("xlr8_" + tag + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Process::Process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
  auto dir = temp_dir("proc");
  out_path_ = dir + "/out";
  err_path_ = dir + "/err";
  started_ = now();
  pid_ = fork();
  if (pid_ == 0) {
    setpgid(0, 0);
    int out = open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, 1);
    dup2(err, 2);
    for (auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());  // PATH lookup for tools like mpirun and srun
    _exit(127);
  }
}

Process::~Process() {
  if (!waited_) {
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

void Process::signal(int sig) { kill(pid_, sig); }
std::string Process::out_so_far() const { return read_file(out_path_); }
std::string Process::err_so_far() const { return read_file(err_path_); }

ProcessResult Process::wait(double timeout_s) {
  ProcessResult r;
  int status = 0;
  for (;;) {
    pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    if (now() - started_ > timeout_s) {
      r.timed_out = true;
      kill(-pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  waited_ = true;
  r.seconds = now() - started_;
  r.exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  r.out = read_file(out_path_);
  r.err = read_file(err_path_);
  std::filesystem::remove_all(std::filesystem::path(out_path_).parent_path());
  return r;
}

ProcessResult run(const std::vector<std::string>& args, double timeout_s, const std::map<std::string, std::string>& env) {
  Process p(args, env);
  return p.wait(timeout_s);
}

bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto close_paren = stat.rfind(')');
  return close_paren != std::string::npos && stat.size() > close_paren + 2 && stat[close_paren + 2] != 'Z';
}

size_t occurrences(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}
