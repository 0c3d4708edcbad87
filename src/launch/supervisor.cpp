// The worker supervisor behind `xlr8 launch`: one poll loop over the workers' output pipes and a
// signalfd, so output, exits and signals are handled in one thread with no races.
#include "launch/supervisor.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "core/error_file.hpp"
#include "core/flight_recorder.hpp"
#include "core/log.hpp"
#include "launch/failure_report.hpp"
#include "launch/spawn.hpp"
#include "os/net.hpp"
#include "launch/trace_diagnosis.hpp"
#include "launch/worker_output.hpp"
#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace xlr8 {

namespace {

struct Worker {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  launcher::WorkerStream out, err;
  launcher::FailureNotes notes;  // from stderr, for the failure report
  std::string err_log_path;    // with --log_dir
  std::string error_file;      // its TORCHELASTIC_ERROR_FILE
};

using launcher::describe_status;
using launcher::signal_name;

int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

class Supervisor final : public launcher::WorkerGroup {
 public:
  Supervisor(const LaunchOptions& o, std::string program) : o_(o), program_(std::move(program)) {
    if (const auto text = env_var("XLR8_HEARTBEAT_TIMEOUT")) {
      char* end = nullptr;
      const double seconds = std::strtod(text->c_str(), &end);
      if (!end || *end != '\0' || !(seconds > 0))
        throw ConfigError(fmt::format("XLR8_HEARTBEAT_TIMEOUT={:?} must be a positive number of seconds (how long the "
                                      "job may go without any rank completing a collective)",
                                      *text));
      heartbeat_timeout_s_ = seconds;
    }
    if (o_.log_dir.empty()) {  // error files and traces still need a place (before any signal is blocked)
      std::error_code no_tmp;
      const fs::path tmp = fs::temp_directory_path(no_tmp);
      std::random_device random;
      scratch_dir_ = (no_tmp ? fs::path("/tmp") : tmp) / fmt::format("xlr8-launch-{}-{:08x}", ::getpid(), random());
    }
    sigset_t mask;
    sigemptyset(&mask);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&mask, s);
    sigprocmask(SIG_BLOCK, &mask, &saved_mask_);
    signal_fd_ = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signal_fd_ < 0) {
      const int why = errno;
      sigprocmask(SIG_SETMASK, &saved_mask_, nullptr);  // no destructor will run to restore it
      throw Error(fmt::format("signalfd failed: {}", std::strerror(why)));
    }
  }
  ~Supervisor() {
    close(signal_fd_);
    sigprocmask(SIG_SETMASK, &saved_mask_, nullptr);
    if (!scratch_dir_.empty()) {
      std::error_code ignored;
      fs::remove_all(scratch_dir_, ignored);
    }
  }

  int run_attempt(int attempt, const launcher::GroupPlacement& placement,
                  std::function<std::string()> stop_check) override {
    placement_ = placement;
    stop_check_ = std::move(stop_check);
    stopped_for_.clear();
    next_stop_check_ = {};
    // A master that is not loopback: Gloo binds the interface holding this machine's address toward it, not
    // whatever the host name resolves to (another interface, or nothing inside a network namespace).
    gloo_interface_ = os::interface_with_address(os::local_address_toward(placement_.master_addr));
    workers_.clear();
    open_line_ = nullptr;
    workers_.resize(o_.nproc_per_node);
    first_failure_ = -1;
    interrupted_by_ = 0;
    kill_deadline_.reset();
    term_deadline_.reset();
    trace_deadline_.reset();
    stalled_.clear();
    attempt_ = attempt;
    std::error_code ignored;
    fs::remove_all(trace_dir(attempt), ignored);  // an earlier launch into the same log_dir left its own
    for (int i = 0; i < o_.nproc_per_node; ++i) start(workers_[i], i, attempt);
    supervise();
    if (interrupted_by_) {
      report_interrupted();
      return 128 + interrupted_by_;
    }
    if (!stopped_for_.empty()) return 0;  // not a failure: the caller restarts the group
    if (!stalled_.empty()) return 124;  // as timeout(1) reports a command it had to stop
    if (first_failure_ >= 0) return exit_code_of(workers_[first_failure_].status);
    return 0;
  }

  // How each worker ended after an interruption: a worker that needed the SIGTERM or SIGKILL escalation
  // ignored or handled the forwarded signal, which the user should know.
  void report_interrupted() const {
    std::string ends;
    for (const auto& w : workers_)
      ends += fmt::format("{}rank {} {}", ends.empty() ? "" : ", ", w.rank, describe_status(w.status));
    log::warning("xlr8 launch: workers stopped: {}", ends);
  }

  void report_failure() const override {
    if (!stalled_.empty()) {
      log::error("xlr8 launch: {}", stalled_);
      print_diagnosis();
      return;
    }
    if (first_failure_ < 0) return;
    std::vector<launcher::WorkerEnd> ends;
    for (const auto& w : workers_)
      ends.push_back({.rank = w.rank, .local_rank = w.local_rank, .pid = w.pid, .status = w.status, .notes = &w.notes,
                      .err_log_path = w.err_log_path, .error_file = w.error_file});
    launcher::report_first_failure(ends, static_cast<size_t>(first_failure_), o_.log_dir);
    print_diagnosis();
  }
  // A hang's picture: after a collective timed out, or a stall. A rank that failed on its own (an exception, a
  // signal) is the cause already named; where the others happened to be then would only blame them.
  void print_diagnosis() const {
    const auto diagnosis = launcher::diagnose_traces(
        trace_dir(attempt_).string(),
        {// Only this machine's ranks leave their trace here: name the missing ones only when that is all of them.
         .world_size = placement_.num_nodes == 1 ? placement_.world_size : 0,
         .only_after_timeout = stalled_.empty(),
         // The scratch folder goes with the launch: do not name it.
         .shown_as = o_.log_dir.empty() ? "pass --log_dir to keep them" : ""});
    if (!diagnosis.empty()) log::error("xlr8 launch: {}", diagnosis);
  }
  bool failed() const override { return (first_failure_ >= 0 || !stalled_.empty()) && !interrupted_by_ && stopped_for_.empty(); }
  const std::string& stalled() const override { return stalled_; }
  const std::string& stopped_for() const override { return stopped_for_; }
  int interrupted_by() const override { return interrupted_by_; }

  int wait_signal(int timeout_ms) override {
    pollfd fd{signal_fd_, POLLIN, 0};
    if (poll(&fd, 1, timeout_ms) <= 0) return 0;
    signalfd_siginfo info{};
    while (read(signal_fd_, &info, sizeof(info)) == sizeof(info))
      if (info.ssi_signo != SIGCHLD) return static_cast<int>(info.ssi_signo);
    return 0;
  }

  std::optional<WorkerFailure> first_failure() const override {
    if (first_failure_ < 0) return std::nullopt;  // a stall: no worker failed, the launcher stopped them all
    const auto& w = workers_.at(static_cast<size_t>(first_failure_));
    WorkerFailure f{.rank = w.rank,
                    .local_rank = w.local_rank,
                    .pid = w.pid,
                    .exit_code = exit_code_of(w.status),
                    .how = describe_status(w.status),
                    .error_file = w.error_file,
                    .headline = w.notes.headline(),
                    .stderr_tail = {w.notes.tail().begin(), w.notes.tail().end()}};
    if (auto recorded = core::read_error_file(w.error_file)) f.error_message = recorded->message;
    return f;
  }

 private:
  void start(Worker& w, int local_rank, int attempt) {
    w.local_rank = local_rank;
    w.rank = placement_.rank_offset + local_rank;
    Topology t;
    t.rank = w.rank;
    t.world_size = placement_.world_size;
    t.local_rank = local_rank;
    t.local_world_size = o_.nproc_per_node;
    t.node_rank = placement_.node_rank;
    t.num_nodes = placement_.num_nodes;
    t.master_addr = placement_.master_addr;
    t.master_port = placement_.master_port;

    std::map<std::string, std::string> env = Env::current().vars();
    for (const auto& vars : {topology_to_env(t), settings_to_env(o_.settings), o_.extra_env})
      for (const auto& [k, v] : vars) env[k] = v;
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o_.max_restarts);
    env["TORCHELASTIC_RUN_ID"] = o_.run_id;
    env["XLR8_LAUNCHED"] = "1";
    if (!gloo_interface_.empty() && !env.count("GLOO_SOCKET_IFNAME")) env["GLOO_SOCKET_IFNAME"] = gloo_interface_;
    // Best effort: a folder that cannot be made costs the report its error file and traces, not the launch.
    std::error_code unusable;
    const fs::path error_dir = attempt_dir(attempt) / std::to_string(local_rank);
    fs::create_directories(error_dir, unusable);
    w.error_file = unusable ? "" : (error_dir / "error.json").string();
    if (!w.error_file.empty()) {
      fs::remove(w.error_file, unusable);  // a file left by an earlier launch into the same log_dir is not this worker's
      env["TORCHELASTIC_ERROR_FILE"] = w.error_file;
      env["XLR8_TRACE_DIR"] = trace_dir(attempt).string();
    }
    env["XLR8_SHM_JOB"] = std::to_string(::getpid());  // names the workers' shared memory, for clean-up below
    // Workers write into pipes; a progress bar still belongs on the launcher's terminal (rank prefix aside).
    if (winsize size{}; !env.count("XLR8_TERMINAL_COLUMNS") && isatty(2)) {
      const int columns = ioctl(2, TIOCGWINSZ, &size) == 0 && size.ws_col > 0 ? size.ws_col : 80;  // 0: an unsized pty
      env["XLR8_TERMINAL_COLUMNS"] = std::to_string(std::max(20, columns - static_cast<int>(rank_tag(t.rank).size())));
    }
    if (env["OMP_NUM_THREADS"].empty()) {  // unset or empty: cores / local workers, never oversubscribed
      unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(o_.nproc_per_node)));
    }
    const auto child = launcher::spawn_worker(program_, o_.command, env);
    w.pid = child.pid;
    w.running = true;
    std::string tag = rank_tag(w.rank);
    w.out.fd = child.out_fd;
    w.out.console_fd = 1;
    w.out.prefix = tag;
    w.err.fd = child.err_fd;
    w.err.console_fd = 2;
    w.err.prefix = tag;
    w.err.notes = &w.notes;
    w.out.open_line = w.err.open_line = &open_line_;
    if (!o_.log_dir.empty()) {
      fs::path dir = fs::path(o_.log_dir) / fmt::format("attempt_{}", attempt) / std::to_string(local_rank);
      fs::create_directories(dir);
      w.out.log.open(dir / "stdout.log");
      w.err_log_path = (dir / "stderr.log").string();
      w.err.log.open(w.err_log_path);
    }
  }

  // torchrun's layout: <log_dir>/attempt_<n>/<local_rank>/; without a log_dir, a scratch folder of this launch.
  fs::path attempt_dir(int attempt) const {
    return (o_.log_dir.empty() ? scratch_dir_ : fs::path(o_.log_dir)) / fmt::format("attempt_{}", attempt);
  }
  // The workers' flight-recorder dumps (core/flight_recorder.hpp).
  fs::path trace_dir(int attempt) const { return attempt_dir(attempt) / "trace"; }

  std::string rank_tag(int rank) const {
    return o_.prefix_output && placement_.world_size > 1 ? fmt::format("[rank{}]: ", rank) : "";
  }

  // XLR8_HEARTBEAT_TIMEOUT: when no rank has completed a collective for that long (each beats at most once a
  // second, from its first collective on), the job is stalled: every rank is asked for its trace, then stopped.
  void check_heartbeats() {
    if (!heartbeat_timeout_s_ || first_failure_ >= 0 || interrupted_by_ || !stalled_.empty()) return;
    if (Clock::now() < next_heartbeat_check_) return;
    next_heartbeat_check_ = Clock::now() + std::chrono::milliseconds(500);
    double newest = 0;
    for (const auto& w : workers_) {
      struct stat st {};
      if (w.running && ::stat(core::FlightRecorder::heartbeat_file(trace_dir(attempt_).string(), w.pid).c_str(), &st) == 0)
        newest = std::max(newest, static_cast<double>(st.st_mtim.tv_sec) + st.st_mtim.tv_nsec * 1e-9);
    }
    if (newest == 0) return;  // no collective completed yet: nothing to measure progress by
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    if (now - newest <= *heartbeat_timeout_s_) return;
    stalled_ = fmt::format("no rank completed a collective for {:.0f} s (XLR8_HEARTBEAT_TIMEOUT={}): the job is "
                           "stalled; stopping it",
                           now - newest, *heartbeat_timeout_s_);
    log::warning("xlr8 launch: {}", stalled_);
    request_traces();
  }

  // The rendezvous asked for a new group (a machine left or is waiting to join): every local worker stops;
  // that is not a failure.
  void check_stop_request() {
    if (!stop_check_ || first_failure_ >= 0 || interrupted_by_ || !stalled_.empty() || !stopped_for_.empty()) return;
    // Every worker exited (their output is draining): the attempt is over, a late request must not undo it.
    if (std::none_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) return;
    if (Clock::now() < next_stop_check_) return;
    next_stop_check_ = Clock::now() + std::chrono::milliseconds(100);
    std::string why = stop_check_();
    if (why.empty()) return;
    stopped_for_ = std::move(why);
    log::warning("xlr8 launch: {}: stopping the {} local worker(s)", stopped_for_, workers_.size());
    begin_stop(SIGTERM);
  }

  // A worker failed: the ones still running that record collectives (they said so with an .armed file)
  // dump their flight recorder on SIGUSR1 before they are stopped; at most 2 s is spent waiting for it.
  void request_traces() {
    bool asked = false;
    for (auto& w : workers_)
      if (armed(w)) {
        kill(w.pid, SIGUSR1);
        asked = true;
      }
    if (asked) trace_deadline_ = Clock::now() + std::chrono::seconds(2);
    else begin_stop(SIGTERM);
  }
  bool armed(const Worker& w) const {
    return w.running && fs::exists(core::FlightRecorder::armed_file(trace_dir(attempt_).string(), w.pid));
  }
  bool traces_written() const {
    for (const auto& w : workers_)
      if (armed(w) && !fs::exists(core::FlightRecorder::dump_file(trace_dir(attempt_).string(), w.rank))) return false;
    return true;
  }

  void signal_all(int sig) {
    for (auto& w : workers_)
      if (w.running) kill(-w.pid, sig);
  }

  // Escalates: `sig` now, SIGTERM after half the grace period (for workers that handle `sig` and go
  // on), SIGKILL at its end.
  void begin_stop(int sig) {
    signal_all(sig);
    if (!kill_deadline_) {
      const auto grace = std::chrono::milliseconds(static_cast<long>(o_.grace_period_s * 1000));
      kill_deadline_ = Clock::now() + grace;
      if (sig != SIGTERM) term_deadline_ = Clock::now() + grace / 2;
    }
  }

  void reap() {
    for (;;) {
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (size_t i = 0; i < workers_.size(); ++i) {
        auto& w = workers_[i];
        if (w.pid != pid || !w.running) continue;
        w.running = false;
        w.status = status;
        bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && first_failure_ < 0 && !interrupted_by_ && stalled_.empty() && stopped_for_.empty()) {
          first_failure_ = static_cast<int>(i);
          request_traces();
        }
        // Anything the worker left in its process group goes with it.
        kill(-pid, SIGKILL);
      }
    }
  }

  void supervise() {
    auto any_running = [&] {
      for (auto& w : workers_)
        if (w.running) return true;
      return false;
    };
    std::optional<Clock::time_point> drain_deadline;
    for (;;) {
      std::vector<pollfd> fds{{signal_fd_, POLLIN, 0}};
      std::vector<launcher::WorkerStream*> streams;
      for (auto& w : workers_)
        for (launcher::WorkerStream* s : {&w.out, &w.err})
          if (s->fd >= 0) fds.push_back({s->fd, POLLIN, 0}), streams.push_back(s);
      bool running = any_running();
      if (!running && streams.empty()) return;
      if (!running && !drain_deadline) drain_deadline = Clock::now() + std::chrono::seconds(2);
      if (drain_deadline && Clock::now() > *drain_deadline) {
        // A grandchild still holds a pipe open after every worker exited: stop reading.
        for (launcher::WorkerStream* s : streams) close(s->fd), s->fd = -1;
        return;
      }
      poll(fds.data(), fds.size(), 100);
      if (fds[0].revents & POLLIN) {
        signalfd_siginfo info{};
        while (read(signal_fd_, &info, sizeof(info)) == sizeof(info)) {
          int sig = static_cast<int>(info.ssi_signo);
          if (sig == SIGCHLD) continue;  // reaped below
          if (!interrupted_by_) {  // also after a failure: the user's Ctrl-C means no restart
            interrupted_by_ = sig;
            log::warning("xlr8 launch: received {}, stopping {} worker(s)", signal_name(sig), workers_.size());
          }
          begin_stop(sig == SIGINT ? SIGINT : SIGTERM);
        }
      }
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) streams[i - 1]->pump();
      reap();
      check_heartbeats();
      check_stop_request();
      if (trace_deadline_ && (Clock::now() > *trace_deadline_ || traces_written())) {
        trace_deadline_.reset();
        begin_stop(SIGTERM);
      }
      if (term_deadline_ && Clock::now() > *term_deadline_) {
        signal_all(SIGTERM);
        term_deadline_.reset();
      }
      if (kill_deadline_ && Clock::now() > *kill_deadline_) signal_all(SIGKILL);
    }
  }

  const LaunchOptions& o_;
  std::string program_;
  int signal_fd_ = -1;
  sigset_t saved_mask_{};
  std::vector<Worker> workers_;
  const launcher::WorkerStream* open_line_ = nullptr;  // the worker stream whose in-place line is on the console
  int first_failure_ = -1;
  int interrupted_by_ = 0;
  fs::path scratch_dir_;  // error files and traces when there is no log_dir
  int attempt_ = 0;
  std::optional<double> heartbeat_timeout_s_;  // XLR8_HEARTBEAT_TIMEOUT
  Clock::time_point next_heartbeat_check_{};
  std::string stalled_;  // why the launcher stopped a job that made no progress
  std::optional<Clock::time_point> trace_deadline_;  // stop the workers then, or once their traces are written
  std::optional<Clock::time_point> kill_deadline_, term_deadline_;
  launcher::GroupPlacement placement_;
  std::function<std::string()> stop_check_;  // why the group must restart (elastic rendezvous), or ""
  std::string stopped_for_;
  Clock::time_point next_stop_check_{};
  std::string gloo_interface_;  // GLOO_SOCKET_IFNAME for the workers (none with a loopback master)
};

}  // namespace

std::unique_ptr<launcher::WorkerGroup> launcher::WorkerGroup::create(const LaunchOptions& options, std::string program) {
  return std::make_unique<Supervisor>(options, std::move(program));
}

}  // namespace xlr8
