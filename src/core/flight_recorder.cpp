// The flight recorder's ring buffer, its file and its SIGUSR1 trigger.
#include "core/flight_recorder.hpp"
#include "xlr8/env.hpp"
#include "xlr8/error.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace xlr8::core {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

size_t capacity_from_env() {
  const auto text = env_var("XLR8_TRACE_BUFFER_SIZE");
  if (!text) return 64;
  char* end = nullptr;
  const long n = std::strtol(text->c_str(), &end, 10);
  // Bounded: the buffer is allocated whole when the process state starts.
  if (text->empty() || *end != '\0' || n < 0 || n > (1L << 20))
    throw ConfigError(fmt::format("XLR8_TRACE_BUFFER_SIZE={:?} must be a whole number of collectives from 0 (no record) "
                                  "to 1048576; the default is 64",
                                  *text));
  return static_cast<size_t>(n);
}

// "all_reduce(float32[4], SUM) on group 'world' (rank 1 of 2)" -> "all_reduce(float32[4], SUM)": the part
// every rank of the group must agree on.
std::string operation_of(const std::string& description) {
  const auto at = description.find(" on group '");
  return at == std::string::npos ? description : description.substr(0, at);
}

int trigger_pipe[2] = {-1, -1};
void on_sigusr1(int) {
  const int saved_errno = errno;
  const char byte = 1;
  [[maybe_unused]] auto ignored = ::write(trigger_pipe[1], &byte, 1);  // async-signal-safe, non-blocking
  errno = saved_errno;
}

}  // namespace

FlightRecorder& FlightRecorder::instance() {
  // Never destroyed: the dump thread and a late SIGUSR1 may use it while the process exits.
  static FlightRecorder* recorder = new FlightRecorder();
  return *recorder;
}

FlightRecorder::FlightRecorder() : capacity_(capacity_from_env()) { ring_.reserve(capacity_); }

uint64_t FlightRecorder::enqueued(const std::string& group, uint64_t sequence, const std::string& description) {
  if (capacity_ == 0) return 0;
  Entry e{0, sequence, group, operation_of(description), "enqueued", now_s(), 0};
  std::lock_guard<std::mutex> lock(mutex_);
  e.id = next_id_++;
  const uint64_t id = e.id;
  if (ring_.size() < capacity_) ring_.push_back(std::move(e));
  else ring_[(id - 1) % capacity_] = std::move(e);
  return id;
}

void FlightRecorder::completed(uint64_t id, bool ok) {
  if (id == 0) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& e = ring_[(id - 1) % capacity_];
    if (e.id != id || e.state != "enqueued") return;  // overwritten since, or already finished
    e.state = ok ? "completed" : "failed";
    e.finished_at = now_s();
  }
  if (ok) beat();
}

void FlightRecorder::failed(uint64_t id, bool timed_out, const std::string& what) {
  completed(id, false);
  dump((timed_out ? "timed out in " : "failed in ") + what);
}

std::string FlightRecorder::heartbeat_file(const std::string& trace_dir, int pid) {
  return (std::filesystem::path(trace_dir) / fmt::format(".heartbeat.{}", pid)).string();
}
std::string FlightRecorder::armed_file(const std::string& trace_dir, int pid) {
  return (std::filesystem::path(trace_dir) / fmt::format(".armed.{}", pid)).string();
}
std::string FlightRecorder::dump_file(const std::string& trace_dir, int rank) {
  return (std::filesystem::path(trace_dir) / fmt::format("rank{}.json", rank)).string();
}

void FlightRecorder::beat() {
  const double now = now_s();
  if (now - last_beat_.load(std::memory_order_relaxed) < 1.0) return;
  last_beat_.store(now, std::memory_order_relaxed);
  const auto dir = env_var("XLR8_TRACE_DIR");
  if (!dir) return;
  // The file's modification time is the beat: created once, then its times set to now.
  const auto path = heartbeat_file(*dir, ::getpid());
  if (::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) != 0) {
    const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    if (fd >= 0) ::close(fd);
  }
}

nlohmann::json FlightRecorder::to_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const Entry*> order;
  for (const auto& e : ring_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->id < b->id; });
  nlohmann::json entries = nlohmann::json::array();
  for (const auto* e : order)
    entries.push_back({{"id", e->id},
                       {"group", e->group},
                       {"sequence", e->sequence},
                       {"op", e->op},
                       {"state", e->state},
                       {"enqueued_at", e->enqueued_at},
                       {"finished_at", e->finished_at}});
  return entries;
}

void FlightRecorder::dump(const std::string& reason) const {
  const auto dir = env_var("XLR8_TRACE_DIR");
  if (!dir || capacity_ == 0) return;
  static std::mutex one_at_a_time;  // a timeout's dump and SIGUSR1's would share the partial file
  std::lock_guard<std::mutex> lock(one_at_a_time);
  try {
    const auto rank_text = env_var("RANK");
    const int rank = rank_text ? std::atoi(rank_text->c_str()) : 0;
    nlohmann::json record{{"rank", rank}, {"pid", ::getpid()}, {"reason", reason}, {"dumped_at", now_s()},
                          {"capacity", capacity_}, {"entries", to_json()}};
    namespace fs = std::filesystem;
    fs::create_directories(*dir);
    const fs::path path = dump_file(*dir, rank);
    const fs::path partial = fs::path(*dir) / fmt::format(".rank{}.json.{}", rank, ::getpid());
    std::ofstream(partial) << record.dump(1) << "\n";
    fs::rename(partial, path);  // whole or absent: the launcher may read it any time
  } catch (...) {  // a dump must never turn into the failure
  }
}

void FlightRecorder::install_signal_trigger() {
  static std::atomic<bool> installed{false};
  const auto dir = env_var("XLR8_TRACE_DIR");
  if (!dir || capacity_ == 0 || installed.exchange(true)) return;
  // A program that handles SIGUSR1 itself (Slurm's --signal=USR1 before preemption, say) keeps it: no trigger,
  // and no .armed file, so the launcher never sends it.
  struct sigaction current {};
  if (sigaction(SIGUSR1, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
  if (::pipe2(trigger_pipe, O_CLOEXEC) != 0) return;
  ::fcntl(trigger_pipe[1], F_SETFL, O_NONBLOCK);  // the handler never blocks; a full pipe already asks for a dump
  try {
    std::thread([this] {
      char byte = 0;
      while (::read(trigger_pipe[0], &byte, 1) == 1) dump("SIGUSR1 from the launcher");
    }).detach();
  } catch (const std::exception&) {  // no thread, no trigger: the recorder still dumps on timeouts
    return;
  }
  struct sigaction action {};
  action.sa_handler = on_sigusr1;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &action, nullptr);
  // Tells the launcher this process handles SIGUSR1 (to a program that does not, it would be fatal).
  try {
    std::filesystem::create_directories(*dir);
    std::ofstream{armed_file(*dir, ::getpid())};
  } catch (...) {
  }
}

}  // namespace xlr8::core
