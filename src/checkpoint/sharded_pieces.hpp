#pragma once
// The sharded part of a checkpoint: every rank writes the slices it holds of each logical tensor
// (parameters and optimizer state, by name) into its own safetensors file, in parallel, and rank 0 an
// index of which rank holds which element range of which box of which tensor (xlr8/placement.hpp: a
// box is a tensor-parallel slice or the whole, a range a flat shard of it), so any strategy on any number
// of processes reads back exactly the placement it holds (resharding on load), and merge-weights streams
// whole tensors.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/placement.hpp"
#include "xlr8/safetensors.hpp"

namespace xlr8::checkpoints {

class Verified;

// Part of the tensor `key`: a placement of one box (the whole tensor unless tensor-parallel), whose
// count() elements of `dtype` `data` returns when the piece is written (offload's disk tier reads them only then,
// so that a rank's pieces never need to be in memory together).
struct Piece {
  std::string key;
  Placement placement;
  at::ScalarType dtype;
  std::function<at::Tensor()> data;
};

struct RankPieces {
  std::vector<Piece> pieces;
  std::map<std::string, int64_t> counters;  // per-tensor scalars (an optimizer's step), equal where repeated
  // `values` (placement.count() elements, any shape) as one piece per box the placement reaches (a tensor
  // without elements as one empty piece, so that it is saved).
  void add(const std::string& key, const Placement& placement, const at::Tensor& values);
  // The same with the values made when written (called once per box the placement reaches).
  void add_later(const std::string& key, const Placement& placement, at::ScalarType dtype,
                 std::function<at::Tensor()> values);
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
    Box box;                  // the whole tensor unless a tensor-parallel slice
    int64_t start, count;     // within the box flattened
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
  // The elements of `key` that `placement` names (placement.count() of them, 1-D, in the saved dtype),
  // whatever layout saved it: read from the same boxes when it was saved alike, cut out of the whole
  // otherwise. Error naming both when the placement does not fit the saved shape.
  at::Tensor read(const std::string& key, const Placement& placement) const;
  // Every check read() makes, the files it would read verified (their CRC32), without reading the values: a load
  // that reads them later, one at a time, finds nothing wrong after it began to change things.
  void check(const std::string& key, const Placement& placement) const;
  std::optional<int64_t> counter(const std::string& key) const;
  std::string describe(const std::string& key) const;  // "tensor K of <dir>"

 private:
  const std::map<std::string, SafetensorsEntry>& entries_of(const std::string& file) const;
  // Elements [start, start + count) of the box of `key` flattened on its own.
  at::Tensor read_box(const std::string& key, const Box& box, int64_t start, int64_t count) const;
  // Elements [a, b) of the saved range `r` of `key` into `out`.
  void read_range(const std::string& key, const IndexedTensor::Range& r, int64_t a, int64_t b, void* out) const;
  // The entry holding the saved range `r`, its file verified; throws when it does not match the index.
  const SafetensorsEntry& entry_of(const std::string& key, const IndexedTensor::Range& r) const;
  // The placement fits the saved shape (else an error naming both).
  const IndexedTensor& fitting(const std::string& key, const Placement& placement) const;
  // The whole tensor assembled from its boxes (the last one is kept: pieces of one tensor come in a row).
  const at::Tensor& whole(const std::string& key) const;
  mutable std::pair<std::string, at::Tensor> last_whole_;
  const Verified& checkpoint_;
  std::map<std::string, IndexedTensor> tensors_;
  std::map<std::string, int64_t> counters_;
  mutable std::map<std::string, std::map<std::string, SafetensorsEntry>> headers_;  // by rank file
};

}  // namespace xlr8::checkpoints
