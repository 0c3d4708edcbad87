#pragma once
// Collectives between the ranks of one host through shared memory (as NCCL's and DeepSpeed's CPU
// backends do): each rank reduces its own shard straight out of every rank's buffer and writes the
// result into every buffer, so an all-reduce is one reduce-scatter plus all-gather in place.
// Tensors from symmetric_empty() already live in shared memory and are reduced with no copy at all;
// other tensors pass through a per-rank staging slot in chunks. Used by the Communicator for CPU
// tensors when every rank of the group is on this host; Gloo and NCCL carry everything else.
#include <mutex>
#include <vector>

#include "compat/torch_compat.hpp"
#include "os/shm_segment.hpp"
#include "xlr8/communicator.hpp"

namespace xlr8::distributed {

class ShmTransport {
 public:
  // Collective over the group's store. Null on every rank alike when the ranks do not all share this
  // host or the segment cannot be made (with a note on stderr from rank 0 saying why).
  static std::unique_ptr<ShmTransport> connect(compat::StorePtr store, int rank, int size, const std::string& group,
                                               std::chrono::milliseconds timeout);

  // Collective: an uninitialised tensor in this rank's slot of a new segment shared with the group.
  // Undefined (on every rank alike) when shared memory runs short.
  at::Tensor symmetric_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

  // Run on the Communicator's executor thread, in issue order; tensors are contiguous CPU tensors.
  void all_reduce(const at::Tensor& tensor, ReduceOp op, const std::string& what);
  // all_reduce of the inputs laid end to end, into `output` (their total size). When `output` is
  // symmetric, this rank's own shard is reduced straight from the inputs: a quarter less memory
  // traffic than copying them in first (2 ranks). An input may be `output`'s own region.
  void all_reduce_into(const at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op,
                       const std::string& what);
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op, const std::string& what);
  void all_gather(const at::Tensor& output, const at::Tensor& input, const std::string& what);

  std::size_t staging_bytes() const { return stride_; }

 private:
  // Where each rank's copy of an operand lives: rank j's element i is at bases[j] + i * element size.
  struct Placement {
    std::vector<std::byte*> bases;
    std::uint64_t buffer = 0;  // symmetric buffer id, 0 for the staging slots
    std::uint64_t offset = 0;  // byte offset inside the symmetric buffer
    std::shared_ptr<os::SharedSegment> keep;
  };
  struct SymmetricBuffer {
    std::weak_ptr<os::SharedSegment> segment;
    std::uint64_t id;
    std::size_t stride, bytes;
  };

  ShmTransport(compat::StorePtr store, int rank, int size, std::chrono::milliseconds timeout);
  // Collective: rank 0 creates, everyone maps, rank 0 unlinks once all have. Null on every rank alike
  // when some rank cannot; `why_not` says which and why.
  std::shared_ptr<os::SharedSegment> make_segment(std::size_t bytes, const std::function<void(std::byte*)>& init,
                                              std::string& why_not);
  std::optional<Placement> find_symmetric(const at::Tensor& t);
  Placement staging() const;
  // Runs `body` with the group failed (and the others released) if it throws.
  template <class Body>
  void guarded(const std::string& what, Body&& body);
  // Every rank publishes `op` and waits for all (mismatches are errors), runs `body` on the shared
  // buffers, then waits for all again, so no buffer is reused while a peer still reads it.
  template <class Body>
  void in_step(const os::OpDescriptor& op, const std::string& what, Body&& body);
  void reduce_shard(const Placement& where, std::int64_t numel, at::ScalarType dtype, ReduceOp op);
  // `count` elements at `byte_offset` of every rank's copy, this rank's read from `own`, reduced into
  // `out` and into every peer's copy.
  void reduce_to_all(const Placement& where, std::int64_t byte_offset, const std::byte* own, std::byte* out,
                     std::int64_t count, at::ScalarType dtype, ReduceOp op);
  // [lo, hi): the elements this rank reduces, whole 64-byte lines.
  std::pair<std::int64_t, std::int64_t> own_shard(std::int64_t numel, std::int64_t es) const;
  std::vector<std::byte*> peer_copies(const Placement& where, std::int64_t byte_offset) const;
  // Every rank's copy at `byte_offset`, this rank's first (reduce_blocks starts from it).
  std::vector<const std::byte*> own_first(const Placement& where, std::int64_t byte_offset) const;

  compat::StorePtr store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::uint64_t segments_made_ = 0;
  std::shared_ptr<os::SharedSegment> segment_;  // control block, then one staging slot per rank
  std::unique_ptr<os::ShmControl> control_;
  std::size_t control_bytes_ = 0, stride_ = 0;
  std::mutex mutex_;  // guards symmetric_
  std::vector<SymmetricBuffer> symmetric_;
};

}  // namespace xlr8::distributed
