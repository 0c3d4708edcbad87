#pragma once
// xlr8::train: Ray Train's Trainer in C++. One program is both the driver and its workers: the driver's
// fit() starts the worker group (as `xlr8 launch` does) by running this same executable again, each worker's
// fit() runs the training loop (then waits for every worker's loop, ending the group: end_training() is not
// needed), and when a worker fails the whole group is stopped and a fresh one started, up to
// FailureConfig::max_failures times. Workers resume from get_checkpoint(), the latest checkpoint
// report() registered under <storage_path>/<name>/; a new Trainer with the same (storage_path, name) resumes
// a run whose driver died.
//
//   int main() {
//     xlr8::train::Trainer trainer(loop, {{"lr", 1e-3}}, {.num_workers = 2},
//                                  {.name = "mnist", .storage_path = "runs", .failure_config = {.max_failures = 3}});
//     auto result = trainer.fit();
//     if (result.worker) return 0;  // this process was a worker: its loop has run
//     ...result.metrics, result.checkpoint, result.error...
//   }
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace xlr8::train {

// A number of workers, or Ray's elastic range: ScalingConfig{.num_workers = 4} or {.num_workers = {2, 4}}.
struct NumWorkers {
  int min = 1, max = 1;
  NumWorkers(int n = 1) : min(n), max(n) {}  // NOLINT: implicit, so that `.num_workers = 4` reads as in Ray
  NumWorkers(int lo, int hi) : min(lo), max(hi) {}
  bool elastic() const { return min != max; }
};

struct ScalingConfig {
  // Workers over all machines. A range {min, max}: each start of the group takes what is there, at least
  // min: on one machine, as many as its cores (resources_per_worker.cpus each) or GPUs allow, up to max;
  // across machines, whichever machines are up (a lost machine's workers are dropped, a returning one's
  // admitted at a new start).
  NumWorkers num_workers = 1;
  bool use_gpu = false;  // false: the workers stay on the CPU (ACCELERATE_USE_CPU)
  struct Resources {
    int cpus = 0;  // intra-op threads per worker (OMP_NUM_THREADS); 0: cores / workers
    int gpus = 0;  // 0 or 1: one GPU per worker is what the launcher gives (local rank -> device)
  } resources_per_worker;
  // Several machines: each runs this same program, whose fit() drives that machine's workers_per_machine
  // workers; they meet at the c10d rendezvous on `rendezvous_endpoint` (host[:port], served by the machine
  // owning that address, as `xlr8 launch --rdzv_backend c10d` does) under the run's name, or, given as
  // "etcd://host:port[,host:port...]", at a rendezvous kept by that etcd cluster (`--rdzv_backend etcd`: no
  // machine of the job is then a single point of failure). storage_path must be shared by every machine.
  // `rendezvous_conf`: torchrun's --rdzv_conf (keep_alive_interval=1,...).
  std::string rendezvous_endpoint;
  int workers_per_machine = 0;
  std::string rendezvous_conf;
};

struct CheckpointConfig {
  std::optional<int> num_to_keep;          // none: keep every checkpoint
  std::string checkpoint_score_attribute;  // a reported metric; empty: the most recent are the best
  std::string checkpoint_score_order = "max";  // "max" or "min"
};

struct FailureConfig {
  int max_failures = 0;  // group restarts after a worker fails; -1: without limit
};

struct RunConfig {
  std::string name;          // empty: "xlr8_train_run-<UTC date and time>"
  std::string storage_path;  // empty: $HOME/xlr8_results
  CheckpointConfig checkpoint_config;
  FailureConfig failure_config;
  // An Accelerate config file the workers are launched with (as `xlr8 launch --config_file`): strategy,
  // mixed precision, accumulation. Empty: the default config file when one exists, else plain DDP.
  std::string launch_config_file;
};

struct Checkpoint {
  std::string path;  // a directory under <storage_path>/<name>/
  const std::string& as_directory() const { return path; }
};

// Why fit() gave up: the last failed group's first failed worker.
struct TrainingFailedError {
  int failures = 0;  // groups that failed (the last one included)
  int rank = -1;
  std::string how;            // "exit code 1", "killed by SIGKILL (signal 9)"
  std::string error_message;  // what the worker's error file recorded ("<type>: <what>"), if anything
  std::string error_file;
  std::vector<std::string> stderr_tail;
  std::string message() const;  // one paragraph naming all of the above
};

struct Result {
  nlohmann::json metrics;                 // the last metrics rank 0 reported (null if none)
  std::optional<Checkpoint> checkpoint;   // the latest registered checkpoint
  std::vector<std::pair<Checkpoint, nlohmann::json>> best_checkpoints;  // kept ones, best first
  std::optional<TrainingFailedError> error;
  std::string path;     // <storage_path>/<name>
  bool worker = false;  // fit() returned in a worker process, after its loop: return from main
  // A finished or crashed run, from its storage (checkpoints, metrics, and the error if fit() ended in one).
  static Result from_path(const std::string& path);
};

using TrainLoop = std::function<void(const nlohmann::json& loop_config)>;

class Trainer {
 public:
  Trainer(TrainLoop train_loop_per_worker, nlohmann::json loop_config, ScalingConfig scaling, RunConfig run);
  // Driver: runs the worker group to the end (restarting it on failures) and returns the run's result; a
  // configuration error throws xlr8::ConfigError before any worker starts. Worker: runs the loop; an
  // exception from it is recorded in the worker's error file and rethrown.
  Result fit();

 private:
  Result drive();
  TrainLoop loop_;
  nlohmann::json loop_config_;
  ScalingConfig scaling_;
  RunConfig run_;
};

// --- inside train_loop_per_worker

// Every worker calls it the same number of times (a barrier). Rank 0's metrics are recorded; when any worker
// passes a directory, the directories of all workers are copied into one new checkpoint
// <storage_path>/<name>/checkpoint_<NNNNNN>/ (same relative path from two directories: an error), registered,
// and the checkpoints CheckpointConfig does not keep are deleted. An Accelerator::save_state directory is a
// valid checkpoint (sharded or not; it reshards when the next group has another size); its files are
// hard-linked rather than copied when the run directory is on the same filesystem (save_state never rewrites
// a file in place). The directories stay the program's: delete them after report() returns.
void report(const nlohmann::json& metrics, const std::string& checkpoint_dir = "");
// The newest registered checkpoint of this run that passes its check (a save_state checkpoint: every file
// against its manifest's size and CRC32), or none (a first start). One that fails is named in a warning,
// renamed <checkpoint_NNNNNN>.corrupt for inspection and unregistered, and the one before it is tried.
std::optional<Checkpoint> get_checkpoint();

struct TrainContext {
  int world_rank = 0, world_size = 1, local_rank = 0, local_world_size = 1, node_rank = 0;
  int restart_count = 0;  // 0 for the first group, then 1, 2, ... after each failure
  std::string experiment_name, storage_path;
};
// Throws xlr8::Error outside a Trainer's worker.
TrainContext get_context();

}  // namespace xlr8::train
