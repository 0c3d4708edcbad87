#pragma once
// Starting one worker process: its own process group, killed with the launcher, default signal
// dispositions, stdout and stderr into pipes the launcher reads.
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

namespace xlr8::launcher {

struct SpawnedWorker {
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;  // the read ends of its stdout and stderr (close-on-exec)
};

// Runs `program` with `args` (argv, program name first) and exactly `env`; throws xlr8::Error when the
// pipes or the fork fail. An exec failure shows as exit code 127 with the reason on its stderr.
SpawnedWorker spawn_worker(const std::string& program, const std::vector<std::string>& args,
                           const std::map<std::string, std::string>& env);

}  // namespace xlr8::launcher
