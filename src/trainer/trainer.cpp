// Trainer::fit: the driver starts this executable again as its worker group through the launcher (same
// supervision, restarts and failure report as `xlr8 launch`), and the same fit() in a worker runs the loop.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <optional>
#include <thread>

#include "compat/torch_compat.hpp"
#include "core/error_file.hpp"
#include "core/log.hpp"
#include "os/net.hpp"
#include "trainer/run_storage.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/train.hpp"

namespace fs = std::filesystem;

namespace xlr8::train {

namespace {

// Variables the driver gives its workers.
constexpr const char* kWorkerVar = "XLR8_TRAIN_WORKER";
constexpr const char* kRunDirVar = "XLR8_TRAIN_RUN_DIR";
constexpr const char* kNameVar = "XLR8_TRAIN_NAME";
constexpr const char* kStorageVar = "XLR8_TRAIN_STORAGE_PATH";
constexpr const char* kLoopConfigVar = "XLR8_TRAIN_LOOP_CONFIG_FILE";  // a file: a variable is limited to 128 KiB
constexpr const char* kCheckpointConfigVar = "XLR8_TRAIN_CHECKPOINT_CONFIG";

bool in_worker() {
  return env_var(kWorkerVar) == "1";
}

std::string default_run_name() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d_%H-%M-%S", &utc);
  return fmt::format("xlr8_train_run-{}", text);
}

// This program's own command line, to start it again as a worker (argv[0] as the executable's real path,
// so a relative path or a PATH lookup cannot pick another program).
std::vector<std::string> own_command() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t start = 0; start < all.size();) {
    size_t end = all.find('\0', start);
    if (end == std::string::npos) end = all.size();
    args.push_back(all.substr(start, end - start));
    start = end + 1;
  }
  if (args.empty()) throw Error("Trainer: cannot read this program's command line from /proc/self/cmdline");
  // The running image itself, even when its file is rebuilt or removed during the run (a restarted group
  // must run the same program). The launcher forks before exec, so the worker's /proc/self/exe is this one.
  args[0] = "/proc/self/exe";
  return args;
}

// One driver per run: a second fit() on the same (storage_path, name) while one runs would interleave two
// worker groups' reports. Held until fit() returns (the kernel drops it if the driver dies).
class RunLock {
 public:
  explicit RunLock(const fs::path& run_dir) {
    fd_ = ::open((run_dir / ".driver.lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd_ < 0) throw Error(fmt::format("Trainer: cannot open {}: {}", (run_dir / ".driver.lock").string(), std::strerror(errno)));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd_);
      throw ConfigError(fmt::format("Trainer: run {} is being driven by another fit() now (it holds {}); wait for it, "
                                    "or give this one another RunConfig.name",
                                    run_dir.string(), (run_dir / ".driver.lock").string()));
    }
  }
  ~RunLock() { ::close(fd_); }
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

nlohmann::json to_json(const TrainingFailedError& e) {
  return {{"failures", e.failures}, {"rank", e.rank}, {"how", e.how}, {"error_message", e.error_message},
          {"error_file", e.error_file}, {"stderr_tail", e.stderr_tail}};
}

TrainingFailedError failure_from_json(const nlohmann::json& j) {
  return {.failures = j.value("failures", 0),
          .rank = j.value("rank", -1),
          .how = j.value("how", ""),
          .error_message = j.value("error_message", ""),
          .error_file = j.value("error_file", ""),
          .stderr_tail = j.value("stderr_tail", std::vector<std::string>{})};
}

std::string describe(const NumWorkers& n) { return n.elastic() ? fmt::format("{{{}, {}}}", n.min, n.max) : std::to_string(n.min); }

void check(const ScalingConfig& s) {
  if (s.num_workers.min < 1 || s.num_workers.max < s.num_workers.min)
    throw ConfigError(fmt::format("ScalingConfig.num_workers {} must be at least 1 (a range: min <= max)",
                                  describe(s.num_workers)));
  if (!s.rendezvous_endpoint.empty() && (s.workers_per_machine < 1 || s.workers_per_machine > s.num_workers.max))
    throw ConfigError(fmt::format("ScalingConfig.rendezvous_endpoint is set (several machines): workers_per_machine {} "
                                  "must be 1 to num_workers' maximum {}",
                                  s.workers_per_machine, s.num_workers.max));
  if (!s.rendezvous_endpoint.empty() && s.workers_per_machine > 0 &&
      (s.num_workers.min + s.workers_per_machine - 1) / s.workers_per_machine > s.num_workers.max / s.workers_per_machine)
    throw ConfigError(fmt::format("ScalingConfig.num_workers {} is no whole number of machines of workers_per_machine {} "
                                  "each; make the range hold a multiple of it",
                                  describe(s.num_workers), s.workers_per_machine));
  if (s.rendezvous_endpoint.empty() && s.workers_per_machine != 0)
    throw ConfigError("ScalingConfig.workers_per_machine is for several machines: set rendezvous_endpoint too, or use "
                      "num_workers alone on one machine");
  if (s.resources_per_worker.cpus < 0)
    throw ConfigError(fmt::format("ScalingConfig.resources_per_worker.cpus {} must be 0 (cores / workers) or more",
                                  s.resources_per_worker.cpus));
  if (s.resources_per_worker.gpus < 0 || s.resources_per_worker.gpus > 1)
    throw ConfigError(fmt::format("ScalingConfig.resources_per_worker.gpus {} must be 0 or 1: each worker drives one "
                                  "GPU (its local rank's)",
                                  s.resources_per_worker.gpus));
  if (s.resources_per_worker.gpus > 0 && !s.use_gpu)
    throw ConfigError("ScalingConfig.resources_per_worker.gpus is 1 but use_gpu is false; set use_gpu = true to train "
                      "on GPUs");
  const int gpus = s.use_gpu ? compat::cuda_device_count() : 0;
  if (s.use_gpu && gpus == 0)
    throw ConfigError("ScalingConfig.use_gpu is set but this LibTorch sees no CUDA device; set use_gpu = false to "
                      "train on the CPU");
  const int here = s.rendezvous_endpoint.empty() ? s.num_workers.min : s.workers_per_machine;
  if (s.use_gpu && gpus < here)
    throw ConfigError(fmt::format("ScalingConfig.num_workers {} with use_gpu needs {} GPUs on this machine; it has {}",
                                  describe(s.num_workers), here, gpus));
}

// One machine, a range: as many workers as this machine offers (a GPU each, or resources_per_worker.cpus
// cores each), at least min, at most max.
int workers_here(const ScalingConfig& s) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!s.num_workers.elastic()) {
    // A fixed count is the program's to choose, but more CPU workers than cores run slower than fewer would.
    const int wanted = s.num_workers.min * std::max(1, s.resources_per_worker.cpus);
    if (!s.use_gpu && s.rendezvous_endpoint.empty() && wanted > cores)
      log::warning("xlr8: ScalingConfig.num_workers {} (resources_per_worker.cpus {}) needs {} cores and this machine has "
                   "{}: the workers will share them (give num_workers = {{1, {}}} to take as many as fit)",
                   s.num_workers.min, s.resources_per_worker.cpus, wanted, cores, s.num_workers.min);
    return s.num_workers.min;
  }
  // Without a count of cores a worker, one core each (as Ray's default of one CPU a worker; it took the maximum).
  const int offered = s.use_gpu ? compat::cuda_device_count() : cores / std::max(1, s.resources_per_worker.cpus);
  if (offered < s.num_workers.min)
    throw ConfigError(fmt::format("ScalingConfig.num_workers {}: this machine offers {} worker(s) ({}), fewer than the "
                                  "minimum",
                                  describe(s.num_workers), offered,
                                  s.use_gpu ? "its GPUs"
                                            : fmt::format("{} cores, resources_per_worker.cpus {}", cores,
                                                          s.resources_per_worker.cpus)));
  return std::min(offered, s.num_workers.max);
}

// The loop has returned on this rank: it waits for every rank's loop before the process exits, as Ray Train
// ends its process group after the training function. Rank 0 serves the store that object collectives go
// through; leaving report()'s last broadcast as soon as it has posted its outcome, it would otherwise exit
// while the others still read it ("Broken pipe"), failing a finished run. A loop that called
// Accelerator::end_training() (a barrier too) passes this one at once.
void end_worker_group() {
  if (!ProcessState::exists()) return;  // no collective was ever made
  const auto& state = ProcessState::instance();
  if (state.world_size() > 1) state.world().barrier();
}

}  // namespace

std::string TrainingFailedError::message() const {
  std::string text = fmt::format("training failed {} time(s); the last time rank {} failed first ({})", failures, rank, how);
  if (!error_message.empty()) text += fmt::format(": {} (from {})", error_message, error_file);
  if (!stderr_tail.empty()) text += fmt::format("; its stderr ended with: {}", stderr_tail.back());
  return text;
}

Result Result::from_path(const std::string& path) {
  if (!fs::is_directory(path)) throw Error(fmt::format("Result::from_path: {:?} is not a run directory", path));
  auto snapshot = detail::RunSnapshot::load(path);
  Result result;
  result.path = path;
  result.metrics = snapshot.latest_metrics;
  if (!snapshot.kept.empty()) result.checkpoint = Checkpoint{(fs::path(path) / snapshot.kept.back().dir_name).string()};
  for (auto& c : snapshot.best_first())
    result.best_checkpoints.emplace_back(Checkpoint{(fs::path(path) / c.dir_name).string()}, c.metrics);
  if (std::ifstream in(fs::path(path) / detail::kFitErrorFile); in) {
    try {
      result.error = failure_from_json(nlohmann::json::parse(in));
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}/{} cannot be read: {}", path, detail::kFitErrorFile, e.what()));
    }
  }
  return result;
}

Trainer::Trainer(TrainLoop train_loop_per_worker, nlohmann::json loop_config, ScalingConfig scaling, RunConfig run)
    : loop_(std::move(train_loop_per_worker)),
      loop_config_(std::move(loop_config)),
      scaling_(scaling),
      run_(std::move(run)) {
  if (!loop_) throw ConfigError("Trainer: train_loop_per_worker is empty");
}

Result Trainer::fit() {
  if (!in_worker()) return drive();
  // A worker: the driver's loop configuration (not this process's, which may differ: a time, a random name).
  xlr8::core::install_error_file_handler();
  const auto config_file = env_var(kLoopConfigVar);
  try {
    nlohmann::json config = loop_config_;
    if (config_file) {
      std::ifstream in(*config_file);
      if (!in) throw Error(fmt::format("Trainer: the driver's loop configuration {} cannot be read", *config_file));
      config = nlohmann::json::parse(in);
    }
    loop_(config);
    end_worker_group();
  } catch (const std::exception& e) {
    xlr8::core::write_error_file(xlr8::core::describe_exception(e));
    throw;
  }
  Result result;
  result.worker = true;
  if (const auto dir = env_var(kRunDirVar)) result.path = *dir;
  return result;
}

namespace {

// What the launch of the workers asks for: one machine's workers, or this machine's part of an elastic job.
LaunchRequest launch_request(const ScalingConfig& scaling, const RunConfig& run, const std::string& name) {
  LaunchRequest request;
  if (!run.launch_config_file.empty()) request.config_file = run.launch_config_file;
  if (!scaling.rendezvous_endpoint.empty()) {
    const int per = scaling.workers_per_machine;
    request.nproc_per_node = per;
    request.nnodes = fmt::format("{}:{}", (scaling.num_workers.min + per - 1) / per, scaling.num_workers.max / per);
    // "etcd://a:2379,b:2379,...": the rendezvous kept by an etcd cluster; otherwise c10d's, served by a machine.
    const std::string etcd = "etcd://";
    const bool in_etcd = scaling.rendezvous_endpoint.rfind(etcd, 0) == 0;
    request.rdzv_backend = in_etcd ? "etcd" : "c10d";
    request.rdzv_endpoint = in_etcd ? scaling.rendezvous_endpoint.substr(etcd.size()) : scaling.rendezvous_endpoint;
    request.rdzv_id = name;
    if (!scaling.rendezvous_conf.empty()) request.rdzv_conf = scaling.rendezvous_conf;
  } else {
    request.num_processes = workers_here(scaling);
  }
  request.cpu = !scaling.use_gpu;
  request.max_restarts = run.failure_config.max_failures < 0 ? std::numeric_limits<int>::max()
                                                             : run.failure_config.max_failures;
  if (scaling.resources_per_worker.cpus > 0) request.num_cpu_threads_per_process = scaling.resources_per_worker.cpus;
  return request;
}

// Each fit() logs into its own folder: a driver that resumes a run keeps the logs of the one before.
// Several machines: each its own logs (the workers' folders are named by local rank).
std::string next_log_dir(const fs::path& run_dir, bool machines) {
  fs::path logs = run_dir / "logs";
  if (machines) {
    logs /= fmt::format("{}-{}", os::host_name(), ::getpid());
  }
  int fits = 0;
  while (fs::exists(logs / fmt::format("fit_{}", fits))) ++fits;
  return (logs / fmt::format("fit_{}", fits)).string();
}

TrainingFailedError failure_of(const LaunchOutcome& outcome) {
  TrainingFailedError error{.failures = outcome.restarts + 1, .how = fmt::format("exit code {}", outcome.exit_code)};
  if (outcome.failure) {
    const auto& f = *outcome.failure;
    error.rank = f.rank;
    error.how = f.how;
    error.error_message = f.error_message.empty() ? f.headline : f.error_message;
    if (!f.error_message.empty()) error.error_file = f.error_file;
    error.stderr_tail = f.stderr_tail;
  } else if (!outcome.stalled.empty()) {
    error.how = outcome.stalled;
  } else {
    error.how = fmt::format("stopped by a signal (exit code {})", outcome.exit_code);
  }
  return error;
}

}  // namespace

Result Trainer::drive() {
  // Under a launcher every rank would start a group of its own.
  if (env_var("XLR8_LAUNCHED") == "1")
    throw ConfigError("Trainer::fit() starts its own workers: run this program directly, not under xlr8 launch "
                      "(ScalingConfig.num_workers sets how many)");
  check(scaling_);
  detail::validate(run_.checkpoint_config);
  if (run_.failure_config.max_failures < -1)
    throw ConfigError(fmt::format("FailureConfig.max_failures {} must be -1 (without limit), 0 or more",
                                  run_.failure_config.max_failures));
  const std::string name = run_.name.empty() ? default_run_name() : run_.name;
  // One directory under storage_path: a name with '/' or '..' would put the run (its checkpoints, lock, logs) elsewhere.
  if (name == "." || name == ".." || name.find('/') != std::string::npos)
    throw ConfigError(fmt::format("RunConfig.name {:?} must be one directory name under storage_path (no '/', not '.' "
                                  "or '..'); give the parent directory as storage_path instead",
                                  name));
  std::string storage = run_.storage_path;
  if (storage.empty()) {
    storage = (fs::path(env_var("HOME").value_or(".")) / "xlr8_results").string();
  }
  const fs::path run_dir = fs::absolute(fs::path(storage) / name);
  fs::create_directories(run_dir);
  // Several machines: one driver on each, by design; and one that joins late must not touch a report in
  // progress.
  const bool machines = !scaling_.rendezvous_endpoint.empty();
  std::optional<RunLock> lock;
  if (!machines) lock.emplace(run_dir);
  const fs::path error_path = run_dir / detail::kFitErrorFile;
  fs::remove(error_path);  // the error of an earlier fit() is not this one's
  // Left by a report() that died mid-copy (it starts from an empty one anyway).
  if (!machines)
    for (const auto& entry : fs::directory_iterator(run_dir))
      if (entry.path().filename().string().rfind(".staging_", 0) == 0) fs::remove_all(entry.path());
  if (auto snapshot = detail::RunSnapshot::load(run_dir); !snapshot.kept.empty())
    log::info("xlr8 train: run {:?} exists: its workers resume from {} (or, if it fails its check, the newest intact "
              "checkpoint before it)",
              name, snapshot.kept.back().dir_name);

  LaunchRequest request = launch_request(scaling_, run_, name);
  request.log_dir = next_log_dir(run_dir, machines);
  request.command = own_command();
  LaunchOptions options = plan_launch(request);
  options.extra_env[kWorkerVar] = "1";
  options.extra_env[kRunDirVar] = run_dir.string();
  options.extra_env[kNameVar] = name;
  options.extra_env[kStorageVar] = fs::absolute(storage).string();
  const fs::path loop_config_file = run_dir / "loop_config.json";
  std::ofstream(loop_config_file) << loop_config_.dump(2) << "\n";
  options.extra_env[kLoopConfigVar] = loop_config_file.string();
  options.extra_env[kCheckpointConfigVar] = detail::to_json(run_.checkpoint_config).dump();

  const LaunchOutcome outcome = launch_with_outcome(options);
  Result result = Result::from_path(run_dir.string());
  if (outcome.exit_code != 0) {
    result.error = failure_of(outcome);
    std::ofstream(error_path) << to_json(*result.error).dump(2) << "\n";
  }
  return result;
}

}  // namespace xlr8::train
