#pragma once
// A training checkpoint as plain data and its crash-safe directory format, for any strategy. Nothing
// here knows the Accelerator: it passes in what to write (its counters, each strategy's state dicts,
// optimizer archives, this rank's RNG) and applies what it reads.
//
// Written into <dir>.partial, every file fsynced, MANIFEST.json (size + CRC32 of each file) last, then
// renamed into place: a previous checkpoint at <dir> survives any failure before that rename. Reading
// verifies every file against the manifest before anything is returned.
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/error.hpp"
#include "checkpoint/sharded_pieces.hpp"
#include "xlr8/safetensors.hpp"

namespace xlr8::checkpoints {

struct Content {
  nlohmann::json state;                 // counters, loss scaler, data loaders (accelerator_state.json)
  std::vector<NamedTensors> models;     // full state dicts; the main process writes them
  // Or: called on every rank with the temporary directory, writes the model files there (streaming a
  // sharded model collectively) and returns their names (on the main process).
  std::function<std::vector<std::string>(const std::filesystem::path&)> write_models;
  std::map<size_t, std::string> optimizers;  // optimizer archives by index (optimizer_bytes); the main process writes them
  std::map<std::string, std::string> main_files;  // other files by name (registered objects); the main process writes them
  // Archives of optimizers over sharded models: this rank's (each rank writes its own), by optimizer index.
  std::map<size_t, std::string> rank_optimizers;
  NamedTensors rng;                     // this rank's generator states
  RankPieces pieces;                    // what this rank holds of sharded tensors (every rank writes its own)
};

// Collective over `world`: every rank writes its RNG file, the main process the rest. Returns the
// directory written.
std::string save(const std::filesystem::path& dir, const Content& content, Communicator& world);

// A checkpoint whose files match the manifest: on construction every listed file exists with its size;
// a file is checked against its CRC32 when first touched (so each rank reads only the shards it needs).
// Small files are kept in memory (file()); shards are read in ranges (read_into()), so reading a
// checkpoint never holds more of it than the caller asks for.
class Verified {
 public:
  explicit Verified(const std::filesystem::path& dir);  // throws naming the first missing or truncated file
  const std::filesystem::path& dir() const { return dir_; }
  int saved_world_size() const { return manifest_.value("world_size", 0); }
  size_t models() const;  // how many model files it holds
  nlohmann::json state() const;
  SafetensorsContent model(size_t index) const;
  const std::string& optimizer(size_t index) const;
  const std::string& rank_optimizer(size_t index, int rank) const;  // throws naming the file when absent
  std::optional<SafetensorsContent> rng(int rank) const;  // absent when saved by fewer ranks
  bool has(const std::string& name) const { return manifest_.at("files").contains(name); }
  // The verified bytes of a listed file; throws naming it when it is unlisted or fails its CRC32.
  const std::string& file(const std::string& name) const;
  // `size` bytes at `offset` of a listed file into `out`, after streaming it once through its CRC32.
  void read_into(const std::string& name, size_t offset, size_t size, void* out) const;
  // Streams a listed file once through its CRC32 (throws naming it when it fails); read_into does it first too.
  void verify(const std::string& name) const;
  size_t size_of(const std::string& name) const { return manifest_.at("files").at(name).at("size").get<size_t>(); }

 private:
  mutable std::map<std::string, bool> verified_;
  std::filesystem::path dir_;
  nlohmann::json manifest_;
  mutable std::map<std::string, std::string> files_;
};

// Throws unless `saved` has exactly `expected`'s names, dtypes and shapes (naming every difference).
void check_matches(const NamedTensors& expected, const SafetensorsContent& saved, const std::string& path);

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer);
// Parses an optimizer archive; throws naming `path` when it is not one. Changes nothing, so a loader can
// read every archive before it applies any.
torch::serialize::InputArchive read_optimizer_archive(const std::string& bytes, const std::string& path);
void load_optimizer(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive, const std::string& path);

// "ckpt/" and "ckpt" name the same directory; the temporary and backup siblings need the bare name.
std::filesystem::path directory_path(const std::string& dir);
// <project_dir>/checkpoints/checkpoint_<N>, oldest first.
std::vector<std::filesystem::path> automatic_checkpoints(const std::string& project_dir);
// total_limit: all but the newest `keep` automatic checkpoints go (renamed first, so that a crash while deleting
// never leaves a half-deleted checkpoint_<N>; a crash's leftovers go too).
void prune_automatic_checkpoints(const std::string& project_dir, int64_t keep);
std::string model_file(size_t index);      // "model.safetensors", "model_1.safetensors", ...
std::string optimizer_file(size_t index);  // "optimizer.bin", "optimizer_1.bin", ...
std::string rank_optimizer_file(size_t index, int rank);  // "optimizer_rank0.bin", "optimizer_1_rank2.bin", ...

// Filesystem failures (permissions, a full disk) become xlr8 errors that name the operation.
template <class Fn>
auto filesystem_guard(const std::string& what, Fn&& fn) {
  try {
    return fn();
  } catch (const std::filesystem::filesystem_error& e) {
    throw Error(what + ": " + e.what());
  }
}

}  // namespace xlr8::checkpoints
