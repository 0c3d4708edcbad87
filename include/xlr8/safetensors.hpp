#pragma once
// The safetensors format (readable by Python's `safetensors` and `transformers`): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the data.
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace xlr8 {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct SafetensorsContent {
  NamedTensors tensors;  // in file order, on the CPU
  std::map<std::string, std::string> metadata;
};

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});
// Written to a temporary file, fsynced, then renamed over `path`.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Validates the header, dtypes, shapes and offsets; an error names the file and what is wrong.
SafetensorsContent load_safetensors(const std::string& path);
SafetensorsContent parse_safetensors(const std::string& bytes, const std::string& origin);

}  // namespace xlr8
