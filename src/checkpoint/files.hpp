#pragma once
// Durable file writes and integrity checks for checkpoints.
#include <cstdint>
#include <string>

namespace xlr8::files {

// Writes `bytes` to `path` through a temporary file: write, fsync, rename, fsync the directory.
void write_durably(const std::string& path, const std::string& bytes);
std::string read_all(const std::string& path);
uint32_t crc32_of(const std::string& bytes);
void fsync_directory(const std::string& dir);

}  // namespace xlr8::files
