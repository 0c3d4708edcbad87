#pragma once
// Collectives over a c10d process group, the same on every backend and LibTorch version: where Gloo
// lacks an operation (reduce_scatter, bf16 reductions, AVG) it is provided by a ring over send/recv,
// so no operation silently doubles its traffic. Every wait has a timeout whose error names the
// collective, the tensor, this rank and the group.
#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace xlr8 {

enum class ReduceOp { SUM, AVG, MIN, MAX, PRODUCT };
std::string to_string(ReduceOp op);

namespace detail {
struct CommState;
struct WorkState;
}  // namespace detail

// Handle of an asynchronous collective. wait() rethrows its error (xlr8::TimeoutError on expiry).
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}
  void wait();
  bool is_completed() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

class Communicator {
 public:
  Communicator() = default;
  explicit Communicator(std::shared_ptr<detail::CommState> state) : state_(std::move(state)) {}

  // N ranks in one process (threads), over an in-process store: for tests and tools. Every thread
  // calls it with its rank and the same `store_key`.
  static Communicator in_process(const std::string& store_key, int rank, int size,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(60),
                                 bool shared_memory = true);

  int rank() const;
  int size() const;
  const std::string& name() const;
  std::string backend() const;  // "gloo" or "nccl"
  std::chrono::milliseconds timeout() const;
  bool valid() const { return state_ != nullptr; }
  // True when CPU collectives go through shared memory: every rank of the group is on this host
  // (and XLR8_SHM is not 0). Gloo carries them otherwise; NCCL always carries CUDA tensors.
  bool uses_shared_memory() const;

  // Collective (every rank calls it with the same sizes). With shared memory, a CPU tensor that
  // lives in a segment mapped by the whole group: all_reduce, reduce_scatter and all_gather on it (or
  // on a view of it) read the peers' copies directly, with no copy in or out. Otherwise, or when
  // /dev/shm runs short, an ordinary tensor. Either way its contents start uninitialised.
  at::Tensor symmetric_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

  // In place on `tensor`.
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::SUM) { all_reduce_async(tensor, op).wait(); }
  Work all_reduce_async(at::Tensor& tensor, ReduceOp op = ReduceOp::SUM);
  // all_reduce of `inputs` laid end to end (flattened, same dtype and device, output.numel() elements
  // in all) into the contiguous `output`: like copying them in and calling all_reduce(output), but over
  // shared memory into a symmetric_empty() output this rank's own shard is reduced straight from the
  // inputs, on the communication thread. Keep the inputs alive and unchanged until the work completes.
  // An input may already be its own part of `output`.
  void all_reduce_into(at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op = ReduceOp::SUM) {
    all_reduce_into_async(output, inputs, op).wait();
  }
  Work all_reduce_into_async(at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op = ReduceOp::SUM);
  void broadcast(at::Tensor& tensor, int root) { broadcast_async(tensor, root).wait(); }
  Work broadcast_async(at::Tensor& tensor, int root);
  // `output` holds size() * input.numel() elements, rank-major.
  void all_gather(at::Tensor& output, const at::Tensor& input) { all_gather_async(output, input).wait(); }
  Work all_gather_async(at::Tensor& output, const at::Tensor& input);
  // `outputs` gets one tensor per rank, shaped like `input` (allocated when empty).
  void all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input);
  // `input` holds size() * output.numel() elements; rank r receives the reduction of chunk r.
  void reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::SUM) {
    reduce_scatter_async(output, input, op).wait();
  }
  Work reduce_scatter_async(at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::SUM);
  // Equal splits: chunk j of `input` goes to rank j; chunk i of `output` comes from rank i.
  void all_to_all(at::Tensor& output, const at::Tensor& input) { all_to_all_async(output, input).wait(); }
  Work all_to_all_async(at::Tensor& output, const at::Tensor& input);
  void send(const at::Tensor& tensor, int dst, int tag = 0) { send_async(tensor, dst, tag).wait(); }
  Work send_async(const at::Tensor& tensor, int dst, int tag = 0);
  void recv(at::Tensor& tensor, int src, int tag = 0) { recv_async(tensor, src, tag).wait(); }
  Work recv_async(at::Tensor& tensor, int src, int tag = 0);
  void barrier();

  // Small metadata (strings, JSON text, shapes), exchanged through the group's store.
  std::string broadcast_object(const std::string& payload, int root);
  std::vector<std::string> all_gather_object(const std::string& payload);

  // A sub-group of this group's ranks (ranks as numbered in this group). Only the members call it,
  // all with the same `ranks` and `name`; the returned group numbers its members 0..n-1 in order.
  Communicator new_group(const std::vector<int>& ranks, const std::string& name) const;

 private:
  std::shared_ptr<detail::CommState> state_;
};

}  // namespace xlr8
