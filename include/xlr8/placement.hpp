#pragma once
// Which part of a logical tensor one rank holds: the one answer every parallelism gives (a replica holds
// the whole, tensor parallelism boxes of it, ZeRO / FSDP a flat chunk, and they compose), and the one
// question checkpoints ask, as PyTorch's DCP reads a DTensor's placements. A new way of splitting a
// tensor adds a placement here, not a code path in the checkpoint.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace xlr8 {

// A rectangular block of a tensor: offset and size per dimension (DCP's chunk metadata).
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const;
  bool operator==(const Box&) const = default;
};

// Part of a logical tensor of shape whole(). Tensor parallelism cuts boxes out of the whole (one per fused
// part, stacked in the rank's slice; a replica: one box, the whole); the rank's local tensor is those
// boxes, each flattened, end to end. A flat sharding (ZeRO, FSDP) then keeps local elements
// [start(), start() + count()) of that. Every strategy's ParameterPiece carries one, the checkpoint's
// pieces are single-box ones, and loading cuts any placement out of whatever layout saved the tensor.
class Placement {
 public:
  Placement() = default;
  // The whole tensor, every element.
  static Placement whole_tensor(std::vector<int64_t> shape);
  // Split along `dim` over `ranks` (this is rank `rank`): the tensor is `parts` stacked on `dim` (a fused
  // layer's widths; one part when not fused), each split in equal shares on its own. Several parts only on
  // dimension 0, where the shares stacked flatten to the boxes end to end. ConfigError otherwise, or when a
  // part's width is not a multiple of `ranks`.
  static Placement split(std::vector<int64_t> shape, int64_t dim, const std::vector<int64_t>& parts, int rank, int ranks);
  // One box of the tensor (a piece of a checkpoint). Error when it lies outside `shape`.
  static Placement of_box(std::vector<int64_t> shape, Box box);
  // A flat range of this placement's elements: [start, start + count) of them (a sharding on top of a
  // split). Error when it reaches past count().
  Placement chunk(int64_t start, int64_t count) const;
  // Every element of the boxes: what the chunks of this placement divide.
  Placement unchunked() const;

  const std::vector<int64_t>& whole() const { return whole_; }
  const std::vector<Box>& boxes() const { return boxes_; }
  int64_t start() const { return start_; }
  int64_t count() const { return count_; }
  int64_t whole_numel() const;
  // One box covering the whole tensor: not split (maybe chunked).
  bool unsplit() const;

  // The chunk box by box: each box it reaches, the range [begin, begin + count) of that box flattened,
  // and where that range starts in the chunk.
  struct Span {
    Box box;
    int64_t begin = 0, count = 0, at = 0;
  };
  std::vector<Span> spans() const;
  // This placement's elements of a whole tensor (of shape whole()), 1-D, count() of them; no communication.
  at::Tensor take(const at::Tensor& whole) const;
  // "[4, 6] box [0, 3]+[4, 3] elements 2..10" for messages.
  std::string describe() const;

 private:
  std::vector<int64_t> whole_;
  std::vector<Box> boxes_;
  int64_t start_ = 0, count_ = 0;
};

}  // namespace xlr8
