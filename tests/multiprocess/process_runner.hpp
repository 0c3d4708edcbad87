#pragma once
// Runs a command as a real child process, capturing stdout/stderr, with a deadline.
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

struct ProcessResult {
  int exit_code = -1;  // 128 + signal when killed
  std::string out, err;
  double seconds = 0;
  bool timed_out = false;
};

class Process {
 public:
  Process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {});
  ~Process();
  pid_t pid() const { return pid_; }
  void signal(int sig);
  std::string out_so_far() const;  // what it has written so far
  std::string err_so_far() const;
  // Waits up to `timeout_s`; on expiry kills the child's process group and sets timed_out.
  ProcessResult wait(double timeout_s);

 private:
  pid_t pid_ = -1;
  std::string out_path_, err_path_;
  double started_ = 0;
  bool waited_ = false;
};

ProcessResult run(const std::vector<std::string>& args, double timeout_s = 60,
                  const std::map<std::string, std::string>& env = {});

// True while some process with this pid exists (and is not a zombie).
bool process_alive(pid_t pid);
std::string read_file(const std::string& path);
std::string temp_dir(const std::string& tag);
// How many times `needle` occurs in `text` (a process's output), overlapping ones included.
size_t occurrences(const std::string& text, const std::string& needle);
