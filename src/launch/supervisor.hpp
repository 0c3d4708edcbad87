#pragma once
// One machine's worker group behind `xlr8 launch`: starts the local workers of an attempt, supervises them
// (output, exits, signals, progress heartbeats), stops them all on the first failure and reports it.
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "xlr8/launcher.hpp"

namespace xlr8::launcher {

// Where this machine's workers sit in the job for one attempt: fixed for a static launch, the
// rendezvous' answer for an elastic one.
struct GroupPlacement {
  int node_rank = 0, num_nodes = 1;
  int world_size = 1, rank_offset = 0;  // this machine's workers are ranks rank_offset + local_rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
};

class WorkerGroup {
 public:
  // Blocks SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGCHLD into its own signalfd for its lifetime: create it before
  // starting any thread, so that threads inherit the mask.
  static std::unique_ptr<WorkerGroup> create(const LaunchOptions& options, std::string program);
  virtual ~WorkerGroup() = default;

  // One attempt: starts every local worker and supervises until all have exited. Returns 0, the first
  // failure's exit code (128 + signal when killed), 124 after a stall, or 128 + the signal that
  // interrupted the launcher. `stop_check`, asked about ten times a second, returns why the whole group
  // must start again (the rendezvous changed); the workers are then stopped, which is not a failure
  // (stopped_for() says why, the attempt returns 0).
  virtual int run_attempt(int attempt, const GroupPlacement& placement, std::function<std::string()> stop_check = {}) = 0;
  virtual void report_failure() const = 0;
  virtual bool failed() const = 0;  // a worker failed or the job stalled, and nobody interrupted it
  virtual const std::string& stalled() const = 0;
  virtual const std::string& stopped_for() const = 0;
  virtual int interrupted_by() const = 0;  // the signal that interrupted the last attempt, or 0
  virtual std::optional<WorkerFailure> first_failure() const = 0;
  // Between attempts: a SIGINT/SIGTERM/SIGHUP/SIGQUIT received within timeout_ms, or 0.
  virtual int wait_signal(int timeout_ms) = 0;
};

}  // namespace xlr8::launcher
