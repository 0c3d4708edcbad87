// O_DIRECT scratch files and a thread pool that moves aligned blocks to and from them (direct_io.hpp).
#include "os/direct_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>

#include "core/worker_pool.hpp"
#include "xlr8/error.hpp"

namespace xlr8::os {

namespace {

// strerror is not safe on the pool's threads.
std::string reason(int error) { return std::system_category().message(error); }

int64_t aligned_up(int64_t bytes) {
  return (bytes + AlignedBuffer::kAlignment - 1) / AlignedBuffer::kAlignment * AlignedBuffer::kAlignment;
}

}  // namespace

AlignedBuffer::AlignedBuffer(int64_t bytes) : size_(aligned_up(std::max<int64_t>(bytes, 1))) {
  if (posix_memalign(&data_, kAlignment, static_cast<size_t>(size_)) != 0)
    throw Error(fmt::format("direct I/O: cannot allocate an aligned buffer of {} bytes", size_));
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

SwapFile::SwapFile(std::filesystem::path path, int64_t bytes) : path_(std::move(path)), size_(aligned_up(bytes)) {
  // O_EXCL, never O_TRUNC: a name that exists is someone else's file, perhaps alive (another PID namespace).
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd_ < 0)
    throw Error(fmt::format("offload to disk: cannot create the swap file {} ({}); give a writable nvme_path on a "
                            "file system with O_DIRECT (not tmpfs)",
                            path_.string(), reason(errno)));
  // Held while the file lives: whoever finds it unlocked knows its maker died (swap_directory.hpp).
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(fd_);
    std::filesystem::remove(path_);
    throw Error(fmt::format("offload to disk: cannot lock the swap file {} ({})", path_.string(), reason(e)));
  }
  removed_on_termination_ = std::make_unique<RemovedOnTermination>(path_);
  // Every block now: a disk without room says so before training, not in the middle of a swap. (fallocate, not
  // posix_fallocate: glibc's fallback writes single bytes, which O_DIRECT refuses.)
  if (::fallocate(fd_, 0, 0, size_) != 0) {
    const int e = errno;
    ::close(fd_);
    std::filesystem::remove(path_);
    throw Error(fmt::format("offload to disk: cannot reserve {} bytes for the swap file {} ({}); {}", size_,
                            path_.string(), reason(e),
                            e == EOPNOTSUPP ? "its file system cannot reserve blocks: give an nvme_path on ext4 or xfs"
                                            : "free space under nvme_path or point it at a larger disk"));
  }
}

SwapFile::~SwapFile() {
  ::close(fd_);
  std::error_code ignored;  // scratch: gone at exit however the run ends normally
  std::filesystem::remove(path_, ignored);
  removed_on_termination_.reset();  // after the removal: a signal before it still removes the file
}

struct IoTicket::State {
  std::mutex mutex;
  std::condition_variable cv;
  int64_t pending = 0;
  std::string error;  // the first piece's failure
};

void IoTicket::wait() const {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->pending == 0; });
  if (!state_->error.empty()) throw Error(state_->error);
}

bool IoTicket::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->pending == 0;
}

DirectIo::DirectIo(AioOptions options) : options_(options) {
  if (options_.block_size <= 0 || options_.block_size % AlignedBuffer::kAlignment != 0)
    throw ConfigError(fmt::format("aio.block_size {} must be a positive multiple of {}", options_.block_size,
                                  AlignedBuffer::kAlignment));
  if (options_.intra_op_parallelism < 1)
    throw ConfigError(fmt::format("aio.intra_op_parallelism {} must be 1 or more", options_.intra_op_parallelism));
  try {
    pool_ = std::make_unique<WorkerPool>(options_.intra_op_parallelism);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("aio.intra_op_parallelism {}: {}", options_.intra_op_parallelism, e.what()));
  }
}

DirectIo::~DirectIo() = default;  // the pool finishes its queue before the threads join

IoTicket DirectIo::write(const SwapFile& file, int64_t offset, const AlignedBuffer& buffer, int64_t bytes) {
  if (bytes > buffer.size()) throw Error(fmt::format("direct I/O: writing {} bytes from a buffer of {}", bytes, buffer.size()));
  return submit(true, file, offset, buffer.data(), bytes);
}

IoTicket DirectIo::read(const SwapFile& file, int64_t offset, AlignedBuffer& buffer, int64_t bytes) {
  if (bytes > buffer.size()) throw Error(fmt::format("direct I/O: reading {} bytes into a buffer of {}", bytes, buffer.size()));
  return submit(false, file, offset, buffer.data(), bytes);
}

IoTicket DirectIo::submit(bool writing, const SwapFile& file, int64_t offset, void* data, int64_t bytes) {
  const int64_t a = AlignedBuffer::kAlignment;
  if (offset % a != 0 || bytes % a != 0 || offset < 0 || bytes < 0 || offset + bytes > file.size())
    throw Error(fmt::format("direct I/O: {} bytes at offset {} of {} ({} bytes) are not aligned to {} or lie outside; "
                            "transfers of O_DIRECT files start and end on {}-byte boundaries inside the file",
                            bytes, offset, file.path().string(), file.size(), a, a));
  auto state = std::make_shared<IoTicket::State>();
  state->pending = (bytes + options_.block_size - 1) / options_.block_size;
  if (state->pending == 0) return IoTicket(state);
  const int fd = file.fd();
  const std::string path = file.path().string();
  for (int64_t at = 0; at < bytes; at += options_.block_size) {
    const int64_t count = std::min(options_.block_size, bytes - at);
    auto* base = static_cast<char*>(data) + at;
    pool_->submit([this, state, writing, fd, path, base, off = offset + at, count] {
      int64_t moved = 0;
      std::string failure;
      try {
        while (moved < count && failure.empty()) {  // a short transfer goes on where it stopped
          const auto n = writing ? ::pwrite(fd, base + moved, static_cast<size_t>(count - moved), off + moved)
                                 : ::pread(fd, base + moved, static_cast<size_t>(count - moved), off + moved);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0)
            failure = fmt::format("offload to disk: {} {} bytes at offset {} of {} failed ({})",
                                  writing ? "writing" : "reading", count, off, path,
                                  n < 0 ? reason(errno) : std::string("end of file"));
          else moved += n;
        }
      } catch (const std::exception& e) {  // nothing may escape a pool thread
        failure = e.what();
      }
      (writing ? written_ : read_) += moved;
      std::lock_guard<std::mutex> lock(state->mutex);
      if (!failure.empty() && state->error.empty()) state->error = failure;
      if (--state->pending == 0) state->cv.notify_all();
    });
  }
  return IoTicket(state);
}

}  // namespace xlr8::os
