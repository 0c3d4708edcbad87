#pragma once
// POSIX shared memory for the ranks of one host: named segments that are unlinked as soon as every
// rank has mapped them (so a crash leaks nothing), and a control block holding a barrier that names
// the rank it waits for, notices a peer that died, and lets a failing rank release the others.
// No LibTorch here: the launcher links it to clean up after crashed jobs.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace xlr8::os {

// Equal for two processes exactly when they can share POSIX shared memory and see each other's
// pids: same boot, same mount and pid namespaces. Empty when it cannot be determined.
std::string shared_memory_host_key();

// Segment names are "xlr8.<job>.<creator pid>.<n>"; <job> is XLR8_SHM_JOB (set by `xlr8 launch` to
// its own pid, so it can remove what crashed workers left) or "0".
std::string shared_memory_job();
std::string new_segment_name();
// Removes the segments of `job` still named in /dev/shm; returns how many it removed.
int remove_job_segments(const std::string& job);

class SharedSegment {
 public:
  // A new segment whose pages are reserved now: a full /dev/shm is an error here, not SIGBUS later.
  static std::shared_ptr<SharedSegment> create(const std::string& name, std::size_t bytes);
  static std::shared_ptr<SharedSegment> open(const std::string& name, std::size_t bytes);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // Removes the name (idempotent); the mappings stay valid until every process unmaps.
  void unlink();
  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedSegment(std::string name, std::byte* data, std::size_t size, bool linked)
      : name_(std::move(name)), data_(data), size_(size), linked_(linked) {}
  std::string name_;
  std::byte* data_;
  std::size_t size_;
  bool linked_;  // created here and not yet unlinked
};

// What a rank is about to do, compared across ranks at the start of every shared-memory collective:
// a mismatch (different op, dtype, size or buffer) is an error naming both sides instead of corrupt data.
struct OpDescriptor {
  std::uint64_t kind = 0, dtype = 0, numel = 0, reduce = 0, buffer = 0, offset = 0;
  bool operator==(const OpDescriptor& o) const {
    return kind == o.kind && dtype == o.dtype && numel == o.numel && reduce == o.reduce && buffer == o.buffer &&
           offset == o.offset;
  }
};

// The per-group control block, laid out in a segment of bytes(size) bytes.
class ShmControl {
 public:
  static std::size_t bytes(int size);
  // `base` points at the block; rank 0 initialises it before publishing the segment.
  ShmControl(std::byte* base, int rank, int size);
  void initialise();  // rank 0 only
  void register_self();  // records this process's pid for liveness checks

  // Publishes `op` with its description, waits for every rank, and checks they all agree.
  void enter(const OpDescriptor& op, const std::string& what, std::chrono::milliseconds timeout);
  // Waits until every rank has arrived. Throws TimeoutError naming the ranks that did not arrive,
  // Error when one of them has exited, or when one has abandoned the group (fail()).
  void barrier(const std::string& what, std::chrono::milliseconds timeout);
  // Marks the group unusable and wakes the others, so they fail now instead of at their timeout.
  // (const: it writes the shared block, not this handle.)
  void fail(const std::string& reason) const noexcept;
  // Throws when some rank has failed the group.
  void check_not_failed(const std::string& what) const;

 private:
  struct Header;
  struct RankSlot;
  Header& header() const;
  RankSlot& slot(int r) const;
  [[noreturn]] void throw_failed(const std::string& what, int failed) const;
  void check_laggards_alive(std::uint64_t generation, const std::string& what) const;
  std::byte* base_;
  int rank_, size_;
};

}  // namespace xlr8::os
