#pragma once
// `xlr8 launch`: starts this machine's workers with the torchrun/Accelerate environment, prefixes their
// output with the rank, fails fast like torchrun (first failure stops the rest: SIGTERM, then SIGKILL
// after a grace period), forwards SIGINT/SIGTERM, and restarts the whole group up to max_restarts times.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/config.hpp"
#include "xlr8/settings.hpp"

namespace xlr8 {

// A c10d-style dynamic rendezvous (`--rdzv_backend c10d`, torchrun's): every machine's `xlr8 launch` joins
// it, and each start of the worker group asks it for this machine's place; machines may leave (the others
// restart with fewer) and join (admitted at the next restart, which their arrival triggers).
struct ElasticOptions {
  int min_nodes = 1, max_nodes = 1;
  std::string endpoint_host = "127.0.0.1";  // the machine that hosts the rendezvous (--rdzv_endpoint)
  int endpoint_port = 29400;
  std::string run_id = "none";           // --rdzv_id: agents of other jobs are refused
  double join_timeout_s = 600;           // longest wait for a group of at least min_nodes machines
  double last_call_timeout_s = 30;       // a first group: how long more machines may join once min_nodes did
  double keep_alive_interval_s = 5;      // agents and the rendezvous ping each other this often...
  int keep_alive_max_attempt = 3;        // ...and one silent for this many intervals is gone
  double close_timeout_s = 300;          // the hosting machine, done, waits this long for the others to finish
  // "c10d": one machine's `xlr8 launch` serves the rendezvous (endpoint_*). "etcd" (--rdzv_backend etcd or
  // etcd-v2): an etcd cluster keeps it, so no machine of the job is a single point of failure.
  std::string backend = "c10d";
  std::vector<std::string> etcd_endpoints;      // the members' client addresses, host:port (--rdzv_endpoint a,b,c)
  std::string etcd_key_prefix = "/xlr8/rdzv";   // --rdzv_conf etcd_prefix: the job's keys go under <prefix>/<rdzv_id>/
  // --rdzv_conf read_timeout: one request to one member. 0: 3 s, or a third of the lease's life
  // (keep_alive_interval x keep_alive_max_attempt) when that is shorter; given, it must be below that life.
  double etcd_timeout_s = 0;
};

struct LaunchOptions {
  std::vector<std::string> command;  // program and its arguments
  int nproc_per_node = 1;
  int num_machines = 1;
  int machine_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (one machine) or 29500 (several)
  Settings settings;
  int max_restarts = 0;
  double grace_period_s = 5.0;  // between SIGTERM and SIGKILL
  std::string log_dir;          // per-rank stdout/stderr files under <log_dir>/attempt_<n>/<local_rank>/
  bool prefix_output = true;    // "[rankN]: " before each worker line (when more than one worker)
  std::string run_id = "none";
  std::map<std::string, std::string> extra_env;
  std::string mpirun_hostfile;  // set: one mpirun starts all ranks over the file's hosts (accelerate launch's way)
  std::optional<ElasticOptions> elastic;  // set: machines and ranks come from the rendezvous, not the fields above
  // Asked about ten times a second while the workers run (static launch): a non-empty answer stops them all
  // (SIGTERM), which is then no failure: the launch returns 0. `xlr8 verify` stops a job that has recorded
  // its steps this way.
  std::function<std::string()> stop_check;
  int world_size() const { return nproc_per_node * num_machines; }
};

// What the user typed on `xlr8 launch`; unset fields come from the config file, then defaults.
struct LaunchRequest {
  std::optional<std::string> config_file;
  std::optional<int> num_processes;   // total over all machines (Accelerate)
  std::optional<int> nproc_per_node;  // per machine (torchrun)
  std::optional<int> num_machines;
  std::optional<int> machine_rank;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::optional<std::string> mixed_precision;
  std::optional<int> gradient_accumulation_steps;
  bool cpu = false;
  bool use_fsdp = false;
  bool use_deepspeed = false;
  std::map<std::string, std::string> fsdp;       // keys as in fsdp_config (fsdp_sharding_strategy ...)
  std::map<std::string, std::string> deepspeed;  // keys as in deepspeed_config (zero_stage ...)
  std::map<std::string, std::string> parallelism;  // keys as in parallelism_config (parallelism_config_tp_size ...)
  std::map<std::string, std::string> fp8;  // by flag: fp8_backend ... (fp8_config's key without "fp8_", but fp8_format)
  // Other keys given as flags, "section.key" or a top-level key: dynamo_config.dynamo_backend, main_training_function ...
  std::map<std::string, std::string> other_keys;
  int max_restarts = 0;
  std::string log_dir;
  std::optional<int> rdzv_timeout_s;
  std::optional<int> num_cpu_threads_per_process;  // sets OMP_NUM_THREADS for every worker
  std::optional<std::string> log_with;             // trackers: XLR8_LOG_WITH for the workers
  std::optional<std::string> gpu_ids;              // "all" or "0,1": sets CUDA_VISIBLE_DEVICES
  bool debug = false;                              // ACCELERATE_DEBUG_MODE
  bool enable_cpu_affinity = false;                // ACCELERATE_CPU_AFFINITY: each local rank on its own cores
  std::optional<std::string> mpirun_hostfile;      // as mpirun_config.mpirun_hostfile
  // torchrun's rendezvous: --nnodes N or MIN:MAX, --rdzv_backend static|c10d, --rdzv_endpoint host[:port],
  // --rdzv_id, --rdzv_conf key=value,...
  std::optional<std::string> nnodes, rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf;
  std::vector<std::string> command;
};

// Merges flags over the config file (the file named by config_file, else the default one if it exists)
// and validates everything before any process starts. Throws ConfigError.
LaunchOptions plan_launch(const LaunchRequest& request);

// Runs the workers to completion (with mpirun_hostfile: runs mpirun, which starts them). Returns the exit code for the launcher: 0, the first failed worker's
// code, or 128 + signal. Throws xlr8::Error for problems found before any worker starts (missing or
// non-executable program, port in use).
int launch(const LaunchOptions& options);

// The worker that failed first in a launch's last attempt, for a caller that reports it itself (the Trainer).
struct WorkerFailure {
  int rank = 0, local_rank = 0, pid = 0;
  int exit_code = 0;          // as launch() returns it: the exit code, or 128 + signal
  std::string how;            // "exit code 3", "killed by SIGKILL (signal 9)"
  std::string error_message;  // what it wrote to its TORCHELASTIC_ERROR_FILE ("<type>: <what>"), if anything
  std::string error_file;     // that file's path
  std::string headline;       // the error line its stderr showed
  std::vector<std::string> stderr_tail;  // its last stderr lines, backtraces left out
};

struct LaunchOutcome {
  int exit_code = 0;  // what launch() returns
  int restarts = 0;   // group restarts done
  std::optional<WorkerFailure> failure;  // the last attempt's first failure (none with mpirun, or after a stall)
  std::string stalled;  // set when the launcher stopped a job that made no progress (XLR8_HEARTBEAT_TIMEOUT)
  int interrupted_by = 0;  // the signal (SIGINT, SIGTERM, ...) that stopped the launch, or 0
};

// launch(), also saying which worker failed and why. Each worker gets TORCHELASTIC_ERROR_FILE
// (<log_dir>/attempt_<n>/<local_rank>/error.json, or the same under a scratch folder removed afterwards).
LaunchOutcome launch_with_outcome(const LaunchOptions& options);

// Full path of `program` (searching PATH when it has no '/'); throws Error naming what is wrong.
std::string resolve_program(const std::string& program);
// A TCP port that is free on this machine now.
int pick_free_port();
bool port_is_free(int port);

}  // namespace xlr8
