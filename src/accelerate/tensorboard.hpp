#pragma once
// The "tensorboard" tracker: events.out.tfevents.<time>.<host> files TensorBoard reads. Each record is
// TFRecord-framed (length, masked CRC32C of the length, an Event protobuf, masked CRC32C of it).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/trackers.hpp"

namespace xlr8::accelerate {

std::unique_ptr<Tracker> make_tensorboard_tracker(const std::string& run_dir);
// The scalars (simple values) of one event file, by tag: (step, value) in the order written. A last
// record cut short (the run is still writing) ends the file; a record whose checksum fails is an Error
// naming the file and the byte.
std::map<std::string, std::vector<std::pair<int64_t, double>>> read_tensorboard_scalars(const std::string& path);
// CRC32C (Castagnoli), and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

}  // namespace xlr8::accelerate
