#pragma once
// Durable file writes and integrity checks for checkpoints.
#include <cstdint>
#include <cstddef>
#include <string>

namespace xlr8::files {

// A file written through a temporary sibling (`path`.tmp): appended to, then commit() fsyncs it, renames
// it over `path` and fsyncs the directory. Destroyed uncommitted, it removes the temporary.
class DurableFile {
 public:
  explicit DurableFile(std::string path);
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  void append(const void* data, size_t size);
  void append(const std::string& bytes) { append(bytes.data(), bytes.size()); }
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

// Writes `bytes` to `path` through a temporary file: write, fsync, rename, fsync the directory.
void write_durably(const std::string& path, const std::string& bytes);
std::string read_all(const std::string& path);
uint32_t crc32_of(const std::string& bytes);
struct FileChecksum {
  size_t size = 0;
  uint32_t crc32 = 0;
};
// Streams the file through CRC32 in chunks: memory independent of its size.
FileChecksum crc32_of_file(const std::string& path);
// Reads exactly `size` bytes at `offset` into `out` (throws naming the file when it is shorter).
void read_range(const std::string& path, size_t offset, size_t size, void* out);
void fsync_directory(const std::string& dir);

}  // namespace xlr8::files
