#include "checkpoint/files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
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
