#pragma once
// Durable file writes and integrity checks for checkpoints.
#include <cstdint>
#include <cstddef>
#include <set>
#include <string>
#include <vector>

namespace xlr8::files {

// A file written through a temporary sibling (`path`.tmp): appended to, then commit() fsyncs it, renames
// it over `path` and fsyncs the directory (under a SyncBatch: renames it, and the batch syncs it). Destroyed
// uncommitted, it removes the temporary.
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

// Flushes `paths` (files, or folders: their entries) to disk concurrently. Each flush costs milliseconds on
// a virtual disk, more than a small model's training step; overlapped they cost less than half (8 small
// files on the 2-core VM: 65-78 ms one after the other, 33 ms together). Throws naming the first failure.
void sync_all(const std::vector<std::string>& paths);

// While one lives on this thread, DurableFile::commit (write_durably, save_safetensors) writes and renames
// but defers its flushes to the batch; sync() then flushes every file so written and their folders at once.
// Only for files in a folder that becomes visible after sync() (a checkpoint's .partial folder, renamed
// into place afterwards): until then none of them is durable.
class SyncBatch {
 public:
  SyncBatch();
  ~SyncBatch();  // what was not synced stays as it is (a failed save removes its folder)
  SyncBatch(const SyncBatch&) = delete;
  SyncBatch& operator=(const SyncBatch&) = delete;
  void sync();  // flushes what was committed since the last sync()
  static SyncBatch* current();  // this thread's innermost batch, or null
  void add(const std::string& file);

 private:
  std::vector<std::string> files_;
  std::set<std::string> folders_;
  SyncBatch* outer_;
};
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
