#include "checkpoint/files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <system_error>
#include <thread>
#include <vector>

#include "xlr8/error.hpp"

namespace xlr8::files {

void fsync_directory(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}

DurableFile::DurableFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  fd_ = open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(fmt::format("cannot write {:?}: {}", tmp_, std::strerror(errno)));
}

DurableFile::~DurableFile() {
  if (fd_ < 0) return;
  close(fd_);
  unlink(tmp_.c_str());
}

void DurableFile::append(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  size_t done = 0;
  while (done < size) {
    ssize_t n = write(fd_, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(fmt::format("cannot write {:?}: {}", tmp_, std::strerror(errno)));
    done += static_cast<size_t>(n);
  }
}

void DurableFile::commit() {
  const int fd = fd_;
  fd_ = -1;
  if (auto* batch = SyncBatch::current()) {  // the batch flushes it with the others
    if (close(fd) != 0) {
      int err = errno;
      unlink(tmp_.c_str());
      throw Error(fmt::format("cannot write {:?}: {}", tmp_, std::strerror(err)));
    }
    std::filesystem::rename(tmp_, path_);
    batch->add(path_);
    return;
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    int err = errno;
    unlink(tmp_.c_str());
    throw Error(fmt::format("cannot flush {:?}: {}", tmp_, std::strerror(err)));
  }
  std::filesystem::rename(tmp_, path_);
  auto parent = std::filesystem::path(path_).parent_path();
  fsync_directory(parent.empty() ? "." : parent.string());
}

void write_durably(const std::string& path, const std::string& bytes) {
  DurableFile file(path);
  file.append(bytes);
  file.commit();
}

void sync_all(const std::vector<std::string>& paths) {
  std::vector<std::string> errors(paths.size());
  auto sync_one = [&](size_t i) {
    const int fd = open(paths[i].c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      errors[i] = std::error_code(errno, std::generic_category()).message();
      return;
    }
    struct stat st {};
    const int failed = fsync(fd) != 0 ? errno : 0;
    // A folder's flush failing is ignored, as fsync_directory does (some filesystems refuse it).
    if (failed && !(fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)))
      errors[i] = std::error_code(failed, std::generic_category()).message();
    close(fd);
  };
  // The flushes overlap in the kernel: a thread each, up to 16 (this thread takes its share).
  const size_t threads = std::min<size_t>(paths.size(), 16);
  std::vector<std::jthread> pool;  // joined on the way out should starting one fail
  for (size_t t = 1; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = t; i < paths.size(); i += threads) sync_one(i);
    });
  for (size_t i = 0; i < paths.size(); i += threads) sync_one(i);
  for (auto& thread : pool) thread.join();
  for (size_t i = 0; i < paths.size(); ++i)
    if (!errors[i].empty()) throw Error(fmt::format("cannot flush {:?}: {}", paths[i], errors[i]));
}

namespace {
thread_local SyncBatch* t_batch = nullptr;
}  // namespace

SyncBatch::SyncBatch() : outer_(t_batch) { t_batch = this; }
SyncBatch::~SyncBatch() { t_batch = outer_; }
SyncBatch* SyncBatch::current() { return t_batch; }

void SyncBatch::add(const std::string& file) {
  files_.push_back(file);
  const auto parent = std::filesystem::path(file).parent_path();
  folders_.insert(parent.empty() ? "." : parent.string());
}

void SyncBatch::sync() {
  // A folder flushed with its files: it records entries made before, the renames included.
  std::vector<std::string> paths = files_;
  paths.insert(paths.end(), folders_.begin(), folders_.end());
  files_.clear();
  folders_.clear();
  sync_all(paths);
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {:?}: {}", path, std::filesystem::exists(path) ? "permission denied" : "missing"));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {  // zlib takes 32-bit lengths
    uInt chunk = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, data, chunk);
    data += chunk;
    left -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

namespace {
struct Descriptor {
  int fd;
  explicit Descriptor(const std::string& path) : fd(open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) throw Error(fmt::format("cannot read {:?}: {}", path, std::strerror(errno)));
  }
  ~Descriptor() { close(fd); }
};
}  // namespace

void read_range(const std::string& path, size_t offset, size_t size, void* out) {
  Descriptor file(path);
  auto* dst = static_cast<char*>(out);
  size_t done = 0;
  while (done < size) {
    ssize_t n = pread(file.fd, dst + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(fmt::format("cannot read {} bytes at {} of {:?}: {}", size, offset, path,
                                        n == 0 ? "the file is shorter" : std::strerror(errno)));
    done += static_cast<size_t>(n);
  }
}

FileChecksum crc32_of_file(const std::string& path) {
  Descriptor file(path);
  std::vector<char> buffer(16 << 20);
  FileChecksum out;
  uLong crc = crc32(0L, Z_NULL, 0);
  for (;;) {
    ssize_t n = read(file.fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(fmt::format("cannot read {:?}: {}", path, std::strerror(errno)));
    if (n == 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(n));
    out.size += static_cast<size_t>(n);
  }
  out.crc32 = static_cast<uint32_t>(crc);
  return out;
}

}  // namespace xlr8::files
