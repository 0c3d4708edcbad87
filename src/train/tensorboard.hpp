#pragma once
// The "tensorboard" tracker: events.out.tfevents.<time>.<host> files TensorBoard reads. Each record is
// TFRecord-framed (length, masked CRC32C of the length, an Event protobuf, masked CRC32C of it).
#include <cstdint>
#include <memory>
#include <string>

#include "xlr8/trackers.hpp"

namespace xlr8::detail {

std::unique_ptr<Tracker> make_tensorboard_tracker(const std::string& run_dir);
// CRC32C (Castagnoli), and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

}  // namespace xlr8::detail
