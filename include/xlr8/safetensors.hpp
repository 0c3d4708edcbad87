#pragma once
// The safetensors format (readable by Python's `safetensors` and `transformers`): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the data.
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/named_tensors.hpp"

namespace xlr8 {
namespace files {
class DurableFile;
}


struct SafetensorsContent {
  NamedTensors tensors;  // in file order, on the CPU
  std::map<std::string, std::string> metadata;
};

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});
// Written to a temporary file, fsynced, then renamed over `path`.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// A file written tensor by tensor, so that only one tensor need be in memory at a time: the names,
// dtypes and shapes are announced first (the header), the data follows in that order. Durable as
// save_safetensors once commit()ed; dropped unfinished, it leaves no file at `path`.
struct SafetensorsSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write(const at::Tensor& tensor);  // the next announced tensor (any device; copied to the CPU)
  void commit();

 private:
  std::string path_;
  std::vector<SafetensorsSpec> specs_;
  size_t next_ = 0;
  std::unique_ptr<files::DurableFile> out_;
};

// Validates the header, dtypes, shapes and offsets; an error names the file and what is wrong.
SafetensorsContent load_safetensors(const std::string& path);
SafetensorsContent parse_safetensors(const std::string& bytes, const std::string& origin);

// "F32", "BF16", ... (throws for a dtype safetensors cannot hold); nullopt for an unknown code.
std::string safetensors_dtype_code(at::ScalarType type);
std::optional<at::ScalarType> safetensors_dtype_from_code(const std::string& code);

// The validated header alone: where each tensor's bytes lie, to read parts of tensors without copying
// the whole file into tensors.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  size_t begin = 0, bytes = 0;  // absolute offsets in the file
};
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in file order
  std::map<std::string, std::string> metadata;
  size_t data_start = 0;
};
// `bytes` needs to hold at least the header; `file_size` is the whole file's (offsets are checked against it).
SafetensorsHeader parse_safetensors_header(const std::string& bytes, size_t file_size, const std::string& origin);
// Reads just the header of a file of `file_size` bytes through `read(offset, size, destination)`.
SafetensorsHeader read_safetensors_header(size_t file_size, const std::function<void(size_t, size_t, void*)>& read,
                                          const std::string& origin);

}  // namespace xlr8
