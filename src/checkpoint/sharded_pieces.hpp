#pragma once
// The sharded part of a checkpoint: every rank writes the slices it holds of each logical tensor
// (parameters and optimizer state, by name) into its own safetensors file, in parallel, and rank 0 an
// index of which rank holds which element range of which tensor. Slices are ranges of the tensor
// flattened, the way every strategy lays parameters out, so any strategy on any number of processes
// reads back exactly the ranges it holds (resharding on load), and merge-weights streams whole tensors.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/safetensors.hpp"

namespace xlr8::checkpoints {

class Verified;

// Elements [start, start + data.numel()) of the tensor `key` (shape `shape`) flattened; or, for a
// tensor-parallel slice, of the box at `box_offsets` of size `box_sizes` (per dimension, as DCP's chunk
// metadata) flattened on its own. Empty box vectors: the box is the whole tensor.
struct Piece {
  std::string key;
  std::vector<int64_t> shape;
  at::Tensor data;
  int64_t start = 0;
  std::vector<int64_t> box_offsets = {}, box_sizes = {};
};

struct RankPieces {
  std::vector<Piece> pieces;
  std::map<std::string, int64_t> counters;  // per-tensor scalars (an optimizer's step), equal where repeated
};

std::string pieces_file(int rank);     // "shards_rank<r>.safetensors"
std::string model_key(size_t model, const std::string& name);  // "model<i>/<name>"
extern const char* const kPiecesIndex;  // "sharded_index.json"

// Collective over `world`: writes this rank's file into `dir`; rank 0 also the index. Every rank checks
// that the pieces of all ranks cover each tensor exactly once (so all fail together when they do not).
void write_pieces(const std::filesystem::path& dir, const RankPieces& mine, Communicator& world);

struct IndexedTensor {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  struct Range {
    std::string file, entry;  // where its elements lie: a file of the checkpoint and a tensor in it
    int64_t start, count;     // within the box flattened (the whole tensor when the box is empty)
    std::vector<int64_t> box_offsets = {}, box_sizes = {};
  };
  std::vector<Range> ranges;  // sorted by box, then start; the boxes tile the tensor, the ranges each box
  int64_t numel() const;
  bool boxed() const;  // some range lies in a box smaller than the tensor (a tensor-parallel slice)
};

// Reads ranges of a verified checkpoint's tensors, opening only the files it needs: the sharded ones of
// the index (when there is one) and each whole model file's tensors as "model<i>/<name>".
class PieceReader {
 public:
  explicit PieceReader(const Verified& checkpoint);  // throws when the index is malformed
  const std::map<std::string, IndexedTensor>& tensors() const { return tensors_; }
  const IndexedTensor* find(const std::string& key) const;
  // Elements [start, start + count) of `key` flattened, in its saved dtype (1-D).
  at::Tensor read(const std::string& key, int64_t start, int64_t count) const;
  // Elements [start, start + count) of the box of `key` at `offsets` of size `sizes`, flattened on its own
  // (a tensor-parallel slice, or a shard of one), whatever boxes it was saved in.
  at::Tensor read_box(const std::string& key, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                      int64_t start, int64_t count) const;
  std::optional<int64_t> counter(const std::string& key) const;
  std::string describe(const std::string& key) const;  // "tensor K of <dir>"

 private:
  const std::map<std::string, SafetensorsEntry>& entries_of(const std::string& file) const;
  // Elements [a, b) of the saved range `r` of `key` into `out`.
  void read_range(const std::string& key, const IndexedTensor::Range& r, int64_t a, int64_t b, void* out) const;
  // The whole tensor assembled from its boxes (the last one is kept: pieces of one tensor come in a row).
  const at::Tensor& whole(const std::string& key) const;
  mutable std::pair<std::string, at::Tensor> last_whole_;
  const Verified& checkpoint_;
  std::map<std::string, IndexedTensor> tensors_;
  std::map<std::string, int64_t> counters_;
  mutable std::map<std::string, std::map<std::string, SafetensorsEntry>> headers_;  // by rank file
};

}  // namespace xlr8::checkpoints
