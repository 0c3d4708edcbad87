#pragma once
// Hugging Face's model layout: model.safetensors, or model-0000i-of-0000n.safetensors shards plus
// model.safetensors.index.json when the tensors exceed max_shard_size. What transformers' and Python
// safetensors' loaders read.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "xlr8/safetensors.hpp"

namespace xlr8::checkpoints {

// Writes `tensors` (in their order) into `dir`, shards of at most `max_shard_bytes` (a single tensor may
// exceed it), replacing an earlier export there. No communication: the caller picks the process that writes.
void export_hf_model(const NamedTensors& tensors, const std::string& dir, int64_t max_shard_bytes);
// The same for tensors produced one at a time: `fetch(i)` returns the i-th announced tensor when its turn
// comes, so only one need be in memory (merge-weights, save_model of a sharded model).
void export_hf_model(const std::vector<SafetensorsSpec>& specs, const std::function<at::Tensor(size_t)>& fetch,
                     const std::string& dir, int64_t max_shard_bytes);
// The same pushed one tensor at a time in the announced order (a collective visit of a sharded model
// feeds it on the main process): each file is written under a hidden name as its last tensor arrives, and
// finish() puts them in place of an earlier export; until then (and after a failure) that export is intact.
class HfModelWriter {
 public:
  HfModelWriter(std::string dir, std::vector<SafetensorsSpec> specs, int64_t max_shard_bytes);
  ~HfModelWriter();
  void write(const at::Tensor& tensor);  // converted to the announced dtype
  void finish();                         // the index, when there are several files

 private:
  std::string file_name(size_t k) const;
  std::string staged_path(size_t k) const;
  std::string dir_;
  bool made_dir_ = false;  // removed again, when empty, if no export finished
  std::vector<SafetensorsSpec> specs_;
  std::vector<std::vector<size_t>> files_;  // tensor indices per file
  int64_t total_ = 0;
  size_t next_ = 0, file_ = 0;
  bool finished_ = false;
  std::unique_ptr<SafetensorsWriter> current_;
};

// Reads what save_model (or transformers) wrote: model.safetensors, or model.safetensors.index.json
// with its shards; `path` is the directory or either file. Headers are read on construction; tensors
// one at a time, each from its byte range only.
class HfModelReader {
 public:
  explicit HfModelReader(const std::string& path);  // throws naming the path when it holds no model
  const std::map<std::string, SafetensorsEntry>& tensors() const { return entries_; }
  const std::string& file_of(const std::string& name) const { return files_.at(name); }
  at::Tensor read(const std::string& name) const;
  // Into `out` (contiguous, of the tensor's dtype and number of elements), so a caller can reuse one buffer.
  void read_into(const std::string& name, at::Tensor& out) const;

 private:
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> files_;  // tensor -> file path
};

// "10GB", "500MB", "2GiB", "1000": bytes. ConfigError for anything else.
int64_t parse_size(const std::string& text);

}  // namespace xlr8::checkpoints
