#pragma once
// Internal state behind xlr8::Communicator and xlr8::Work (not a public header: it exposes c10d).
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "compat/torch_compat.hpp"
#include "core/worker_pool.hpp"
#include "distributed/shm_transport.hpp"
#include "core/tensor_text.hpp"
#include "xlr8/communicator.hpp"
#include "xlr8/error.hpp"

namespace xlr8::detail {

// Like PyTorch's "cuda:nccl,cpu:gloo": Gloo always (CPU tensors, rings, barriers), NCCL for CUDA tensors
// when the build and the machine have it.
struct CommState {
  compat::BackendPtr gloo;
  compat::BackendPtr nccl;  // null without NCCL
  std::shared_ptr<void> nccl_at_exit;  // its registration for exit (torch_compat.hpp); declared after it: dropped first
  compat::StorePtr store;  // this group's namespace in the job's store
  int rank = 0;
  int size = 1;
  std::string name = "world";
  // Unique among the job's groups, for the flight recorder: disjoint mesh groups share a name ("world/tp" is
  // ranks {0,1} on some ranks and {2,3} on others); this adds the members, and the generation when re-made.
  std::string identity = "world";
  std::string master_addr = "127.0.0.1";
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // The backend for `t`, and whether it is NCCL (which reduces every dtype, AVG included).
  compat::Backend& backend_for(const at::Tensor& t, const std::string& what) const;
  bool uses_nccl(const at::Tensor& t) const {
    if (!t.is_cuda() || !nccl) return false;
    nccl_in_use();
    return true;
  }
  static void nccl_in_use();  // the first time: NCCL's groups are aborted at exit, before CUDA's teardown
  std::uint64_t object_sequence = 0;
  std::uint64_t collective_sequence = 0;  // this group's collectives issued so far (the flight recorder's numbering)
  std::uint64_t ring_sequence = 0;
  std::map<std::string, int> subgroups_made;
  // Shared memory between the group's ranks when they all run on this host (null otherwise, or
  // with XLR8_SHM=0); its operations run on the executor.
  bool shared_memory_wanted = true;
  std::unique_ptr<distributed::ShmTransport> shm;
  bool uses_shm(const at::Tensor& t) const { return shm && !t.is_cuda(); }
  // Composite operations (rings over send/recv) run on one background thread, so their async form
  // really overlaps with the caller, and they complete in issue order. Started on first use; declared
  // last so it is joined before anything it uses is destroyed.
  std::unique_ptr<WorkerPool> executor;
  std::shared_future<void> run_composite(std::function<void()> task);
};

struct WorkState {
  std::string what;  // e.g. "all_reduce(bfloat16[1024], SUM) on group 'world' (rank 1 of 2)"
  std::chrono::milliseconds timeout{0};
  compat::WorkPtr work;               // a native c10d operation, or
  std::shared_future<void> future;    // a composite one on the executor
  std::function<void()> finish;       // runs once after a successful wait (AVG division, copy back)
  std::mutex mutex;
  bool done = false;
  uint64_t trace_id = 0;  // its flight-recorder entry
};
}  // namespace xlr8::distributed

namespace xlr8::distributed {

// The world communicator over an established store (rendezvous.cpp makes the store).
Communicator make_communicator(compat::StorePtr store, int rank, int size, const std::string& name,
                               const std::string& master_addr, std::chrono::milliseconds timeout, bool use_nccl,
                               bool use_shared_memory);

// Rethrows a c10d/gloo failure as xlr8::TimeoutError or xlr8::Error naming `what`.
[[noreturn]] void rethrow_with_context(const std::string& what, std::chrono::milliseconds timeout,
                                       const std::exception& cause);

// Calls `fn` with the raw c10d error converted to an xlr8 error naming `description`.
template <class Fn>
auto guarded(const detail::CommState& s, const std::string& description, Fn&& fn) {
  try {
    return fn();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow_with_context(description, s.timeout, e);
  }
}

// Throws xlr8::Error "<description>: <why>" unless `ok`.
inline void require(bool ok, const std::string& description, const std::string& why) {
  if (!ok) throw Error(description + ": " + why);
}

// acc = acc (op) other, elementwise; AVG accumulates as SUM. divide_for_average finishes an AVG
// (truncating for integers, as NCCL does).
void combine(at::Tensor& acc, const at::Tensor& other, ReduceOp op);
void divide_for_average(at::Tensor& t, int size);

}  // namespace xlr8::distributed
