#pragma once
// Direct I/O for offload's disk tier (issue 47, ZeRO-Infinity's design): scratch files opened O_DIRECT and
// preallocated, buffers aligned to the block the kernel transfers, and reads and writes queued to a pool of threads
// (DeepSpeed's aio intra_op_parallelism) that cut each request into block_size pieces, so that a transfer runs while
// the caller computes and waits only for the ticket it needs. The page cache is bypassed: a swapped-out tensor costs
// no host memory, and throughput is the disk's.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "os/scratch_files.hpp"

namespace xlr8 {
class WorkerPool;
}

namespace xlr8::os {

// What DeepSpeed's "aio" section sets of the transfers (block_size, intra_op_parallelism). Each thread issues one
// blocking pread / pwrite at a time, so the threads are the queue's depth.
struct AioOptions {
  int64_t block_size = 1 << 20;  // bytes one system call moves (a multiple of the alignment)
  int intra_op_parallelism = 1;  // threads issuing them
};

// Host memory aligned for O_DIRECT (its start and size a multiple of kAlignment).
class AlignedBuffer {
 public:
  static constexpr int64_t kAlignment = 4096;
  explicit AlignedBuffer(int64_t bytes);  // rounded up to the alignment
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
};

// One scratch file of a fixed size, its blocks allocated now: an unwritable directory or a disk without room fails
// here (Error naming the path, the size and the system's reason), before training. Locked (flock) while it lives;
// removed when destroyed.
class SwapFile {
 public:
  SwapFile(std::filesystem::path path, int64_t bytes);
  ~SwapFile();
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;
  int fd() const { return fd_; }
  int64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int64_t size_ = 0;
  int fd_ = -1;
  std::unique_ptr<RemovedOnTermination> removed_on_termination_;  // a stopped rank leaves no swap file behind
};

// A queued transfer: wait() returns once every piece of it is done, or throws the first piece's error.
class IoTicket {
 public:
  IoTicket() = default;
  void wait() const;
  bool done() const;
  struct State;

 private:
  friend class DirectIo;
  explicit IoTicket(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class DirectIo {
 public:
  explicit DirectIo(AioOptions options = {});
  ~DirectIo();  // finishes what is queued
  DirectIo(const DirectIo&) = delete;
  DirectIo& operator=(const DirectIo&) = delete;
  // `bytes` at `offset` of `file` from / into `buffer` (offset and bytes multiples of the alignment, within both);
  // the file and the buffer must live until the ticket is done.
  IoTicket write(const SwapFile& file, int64_t offset, const AlignedBuffer& buffer, int64_t bytes);
  IoTicket read(const SwapFile& file, int64_t offset, AlignedBuffer& buffer, int64_t bytes);
  // Bytes moved each way so far.
  int64_t bytes_written() const { return written_; }
  int64_t bytes_read() const { return read_; }

 private:
  IoTicket submit(bool writing, const SwapFile& file, int64_t offset, void* data, int64_t bytes);
  AioOptions options_;
  std::atomic<int64_t> written_{0}, read_{0};
  std::unique_ptr<WorkerPool> pool_;  // last: destroyed first, finishing its tasks while the counters live
};

}  // namespace xlr8::os
