// The flight recorder's ring buffer, its file and its SIGUSR1 trigger.
#include "core/flight_recorder.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace xlr8::detail {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

size_t capacity_from_env() {
  const char* text = std::getenv("XLR8_TRACE_BUFFER_SIZE");
  if (!text || !*text) return 64;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  return (end && *end == '\0' && n >= 0) ? static_cast<size_t>(n) : 64;
}

// "all_reduce(float32[4], SUM) on group 'world' (rank 1 of 2)" -> "all_reduce(float32[4], SUM)": the part
// every rank of the group must agree on.
std::string operation_of(const std::string& description) {
  const auto at = description.find(" on group '");
  return at == std::string::npos ? description : description.substr(0, at);
}

int trigger_pipe[2] = {-1, -1};
void on_sigusr1(int) {
  const char byte = 1;
  [[maybe_unused]] auto ignored = ::write(trigger_pipe[1], &byte, 1);  // async-signal-safe; the thread dumps
}

}  // namespace

FlightRecorder& FlightRecorder::instance() {
  static FlightRecorder recorder;
  return recorder;
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
  std::lock_guard<std::mutex> lock(mutex_);
  auto& e = ring_[(id - 1) % capacity_];
  if (e.id != id || e.state != "enqueued") return;  // overwritten since, or already finished
  e.state = ok ? "completed" : "failed";
  e.finished_at = now_s();
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
  const char* dir = std::getenv("XLR8_TRACE_DIR");
  if (!dir || !*dir || capacity_ == 0) return;
  try {
    const char* rank_text = std::getenv("RANK");
    const int rank = rank_text ? std::atoi(rank_text) : 0;
    nlohmann::json record{{"rank", rank}, {"pid", ::getpid()}, {"reason", reason}, {"dumped_at", now_s()},
                          {"capacity", capacity_}, {"entries", to_json()}};
    namespace fs = std::filesystem;
    fs::create_directories(dir);
    const fs::path path = fs::path(dir) / fmt::format("rank{}.json", rank);
    const fs::path partial = fs::path(dir) / fmt::format(".rank{}.json.{}", rank, ::getpid());
    std::ofstream(partial) << record.dump(1) << "\n";
    fs::rename(partial, path);  // whole or absent: the launcher may read it any time
  } catch (...) {  // a dump must never turn into the failure
  }
}

void FlightRecorder::install_signal_trigger() {
  static std::atomic<bool> installed{false};
  const char* dir = std::getenv("XLR8_TRACE_DIR");
  if (!dir || !*dir || capacity_ == 0 || installed.exchange(true)) return;
  if (::pipe2(trigger_pipe, O_CLOEXEC) != 0) return;
  std::thread([this] {
    char byte = 0;
    while (::read(trigger_pipe[0], &byte, 1) == 1) dump("SIGUSR1 from the launcher");
  }).detach();
  struct sigaction action {};
  action.sa_handler = on_sigusr1;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &action, nullptr);
  // Tells the launcher this process handles SIGUSR1 (to a program that does not, it would be fatal).
  try {
    std::filesystem::create_directories(dir);
    std::ofstream(std::filesystem::path(dir) / fmt::format(".armed.{}", ::getpid()));
  } catch (...) {
  }
}

}  // namespace xlr8::detail
