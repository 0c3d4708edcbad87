#pragma once
// The flight recorder (PyTorch's NCCL flight recorder, for every backend): each process keeps its last
// XLR8_TRACE_BUFFER_SIZE collectives (default 64; 0 turns it off) — group, sequence number in that group,
// operation with dtype and shape, state and times — in a ring buffer. It is written to
// $XLR8_TRACE_DIR/rank<R>.json (the launcher sets the variable) when a collective times out, and when the
// process receives SIGUSR1 (the launcher sends it to the ranks still running when one fails), so the
// launcher can say who was where (trace_diagnosis.hpp). It is also the heartbeat the launcher watches under
// XLR8_HEARTBEAT_TIMEOUT: $XLR8_TRACE_DIR/.heartbeat.<pid>, touched at most once a second when a collective
// completes (from the first one on, so a long start-up is not a stall).
#include <atomic>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace xlr8::core {

class FlightRecorder {
 public:
  static FlightRecorder& instance();
  // `description` as the communicator names a collective: "<op>(<tensor>) on group '<g>' (rank r of n)".
  // Returns the entry's id for completed(); 0 when the recorder is off.
  uint64_t enqueued(const std::string& group, uint64_t sequence, const std::string& description);
  void completed(uint64_t id, bool ok);
  // The collective `what` ended in an exception, and the dump is written (this rank's part of the picture the
  // launcher puts together): on a timeout, and on any other failure (a peer that exited first), or this rank's
  // part was lost whenever its peer's timeout fired a moment before its own.
  void failed(uint64_t id, bool timed_out, const std::string& what);
  nlohmann::json to_json() const;
  // Writes the buffer to $XLR8_TRACE_DIR/rank<RANK>.json (nothing when unset); `reason` says why. Never throws.
  void dump(const std::string& reason) const;
  // SIGUSR1 dumps, from a thread of ours (the handler only wakes it), and <dir>/.armed.<pid> tells the
  // launcher so. Only when XLR8_TRACE_DIR is set.
  void install_signal_trigger();
  size_t capacity() const { return capacity_; }
  // The files under XLR8_TRACE_DIR, named here once for the recorder and the launcher.
  static std::string heartbeat_file(const std::string& trace_dir, int pid);
  static std::string armed_file(const std::string& trace_dir, int pid);
  static std::string dump_file(const std::string& trace_dir, int rank);

 private:
  FlightRecorder();
  struct Entry {
    uint64_t id = 0, sequence = 0;
    std::string group, op;
    std::string state;  // "enqueued", "completed", "failed"
    double enqueued_at = 0, finished_at = 0;
  };
  size_t capacity_;
  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  uint64_t next_id_ = 1;
  std::atomic<double> last_beat_{0};
  void beat();
};

}  // namespace xlr8::core
