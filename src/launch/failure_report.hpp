#pragma once
// The launcher's report of a failed group: which rank failed first and how, what each failed rank said
// (ranks that said the same, once), and the first failure's last stderr lines.
#include <sys/types.h>

#include <string>
#include <vector>

#include "launch/worker_output.hpp"

namespace xlr8::launcher {

// How a worker ended, as the report needs it.
struct WorkerEnd {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  int status = 0;  // waitpid's
  const FailureNotes* notes = nullptr;
  std::string err_log_path;  // with --log_dir
  std::string error_file;    // its TORCHELASTIC_ERROR_FILE
};

std::string signal_name(int sig);
// "exit code N" or "killed by SIGX (signal N)".
std::string describe_status(int status);
// Every line through the log (level error), the first failure's first.
void report_first_failure(const std::vector<WorkerEnd>& workers, size_t first, const std::string& log_dir);

}  // namespace xlr8::launcher
