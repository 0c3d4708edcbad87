#pragma once
// Offload's disk tier (issue 47), its second layer: tensors kept on disk between uses, as DeepSpeed's swapper keeps
// optimizer state and parameter shards there. Every named tensor has a fixed slot in this rank's swap file.
// swap_out copies a tensor into one of a few aligned buffers and writes it from there in the background (the
// tensor may be freed at once); prefetch starts reading one back; swap_in waits for that read (or makes it) and
// returns a tensor over its buffer, which returns to the pool when the tensor is freed. Host memory stays at
// buffer_count x buffer_size whatever the total on disk.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "os/direct_io.hpp"

namespace xlr8::shard {

struct SwapOptions {
  std::filesystem::path file;  // this rank's swap file (created, reserved, and removed with the swapper)
  int64_t buffer_size = 0;     // bytes of each buffer (DeepSpeed's buffer_size): at least the largest tensor's; 0: that
  int buffer_count = 4;        // reads ahead plus writes behind (DeepSpeed's buffer_count)
  os::AioOptions aio;
};

class TensorSwapper {
 public:
  struct Slot {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  TensorSwapper(SwapOptions options, const std::vector<Slot>& slots);
  ~TensorSwapper();  // waits for every transfer
  TensorSwapper(const TensorSwapper&) = delete;
  TensorSwapper& operator=(const TensorSwapper&) = delete;

  // Writes `values` (the slot's dtype and shape, on the CPU) to the slot; returns once they are copied out.
  void swap_out(const std::string& name, const at::Tensor& values);
  // Starts reading the slot back (after its last write) into a free buffer, unless it is already coming.
  void prefetch(const std::string& name);
  // The slot's values, in a buffer of the pool until the returned tensor (and every view of it) is freed.
  at::Tensor swap_in(const std::string& name);
  // Waits until every write so far is on disk (their buffers are free again).
  void flush();

  int64_t file_bytes() const { return file_.size(); }
  const std::filesystem::path& file_path() const { return file_.path(); }
  int64_t pool_bytes() const { return options_.buffer_size * options_.buffer_count; }
  // The file, its bytes, the pool's and the bytes moved so far (each counted once on disk).
  nlohmann::json stats() const;
  int64_t bytes_written() const { return io_.bytes_written(); }
  int64_t bytes_read() const { return io_.bytes_read(); }

 private:
  struct Placed {
    Slot slot;
    int64_t offset = 0, bytes = 0;  // in the file (bytes rounded up to the alignment)
    os::IoTicket last_write;
  };
  struct Pool;  // the buffers, shared with the tensors lent out (a tensor may outlive the swapper)
  Placed& placed(const std::string& name);
  // A buffer no transfer or tensor holds: a free one, else the oldest write's or prefetch's once done.
  size_t acquire(std::unique_lock<std::mutex>& lock);
  size_t start_read(Placed& p, std::unique_lock<std::mutex>& lock);
  void drop_reads_of(const std::string& name);  // prefetched values a new write makes stale
  // Waits for a transfer; a write that failed breaks the swap (below) and says so. Under pool_'s mutex.
  void wait_for(const os::IoTicket& ticket, bool write);
  void throw_if_broken() const;
  static void wait_unneeded(const os::IoTicket& ticket);  // a discarded read's: its failure is ignored

  SwapOptions options_;
  std::map<std::string, Placed> slots_;
  os::DirectIo io_;
  os::SwapFile file_;
  std::shared_ptr<Pool> pool_;
  // Reads started ahead by prefetch, and swap_ins that found their read already started (under pool_'s mutex).
  int64_t reads_ahead_ = 0, found_ahead_ = 0;
  // Set when a write failed: the file no longer holds what it should (the values written behind were let go), so
  // every later use fails with this, naming the first failure and the way on (under pool_'s mutex).
  std::string broken_;
};

}  // namespace xlr8::shard
