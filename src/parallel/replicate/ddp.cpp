#include "xlr8/ddp.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "compat/torch_compat.hpp"
#include "distributed/comm_state.hpp"
#include "parallel/recompute/recompute.hpp"
#include "parallel/replicate/gradient_ready.hpp"
#include "parallel/replicate/replica_sync.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace xlr8 {

struct DistributedDataParallel::Core : std::enable_shared_from_this<Core> {
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // element offset of each parameter in `flat`
    at::Tensor flat;
    at::Tensor wire;  // the bf16 copy sent instead of `flat` when compressing
    bool reduce_from_grads = false;  // shared memory: all_reduce_into `flat` straight from the gradients
    std::vector<at::Tensor> sources;  // then: each parameter's gradient (or its own view of `flat`)
    size_t pending = 0;
    Work work;
    at::Tensor scratch;  // XLR8_TEST_ONLY_SKIP_GRAD_BUCKET: what is reduced instead of the gradients
  };

  // Tests only: a strategy with a bug xlr8 verify must catch. This bucket's gradients stay each rank's own
  // (a one-element all-reduce keeps the collective sequence of every rank the same).
  const int skip_bucket = [] {
    const auto k = env_var("XLR8_TEST_ONLY_SKIP_GRAD_BUCKET");
    return k ? std::atoi(k->c_str()) : -1;
  }();

  std::shared_ptr<torch::nn::Module> module;
  Communicator comm;
  DDPOptions options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<size_t> bucket_of, slot_of;  // per parameter: its bucket and position in it
  std::vector<Bucket> buckets;
  std::vector<compat::GradAccumulatorPtr> accumulators;  // hooks only fire while these live

  std::mutex mutex;
  bool sync = true;
  bool detached = false;
  bool in_backward = false;
  std::vector<bool> ready;
  size_t next_launch = 0;
  size_t ready_count = 0;
  size_t overlapped = 0;
  size_t launched = 0;
  double exposed_comm_seconds = 0;

  void assign_buckets() {
    // ZeRO-1/2's buckets: consecutive parameters in reverse order (the last layers' gradients are ready first).
    std::unordered_map<const c10::TensorImpl*, size_t> index;
    for (size_t k = 0; k < params.size(); ++k) index[params[k].unsafeGetTensorImpl()] = k;
    for (const auto& plan : shard::plan_buckets(*module, options.first_bucket_mb, options.bucket_cap_mb)) {
      auto& b = buckets.emplace_back();
      int64_t offset = 0;
      for (const auto& p : plan.groups.front().params) {
        const size_t k = index.at(p.unsafeGetTensorImpl());
        bucket_of[k] = buckets.size() - 1;
        slot_of[k] = b.params.size();
        b.params.push_back(k);
        b.offsets.push_back(offset);
        offset += p.numel();
      }
    }
    for (auto& b : buckets) {
      const auto& last = params[b.params.back()];
      // In shared memory when the ranks share a host, so its all-reduce needs no copy in or out.
      b.flat = comm.symmetric_empty({b.offsets.back() + last.numel()}, last.options().requires_grad(false)).zero_();
      b.reduce_from_grads = comm.uses_shared_memory() && b.flat.device().is_cpu() &&
                            !(options.compress_bf16 && b.flat.scalar_type() == at::kFloat) &&
                            &b - buckets.data() != skip_bucket;
      b.sources.resize(b.params.size());
    }
  }

  // From a destructor, perhaps while this thread holds the lock: gives up rather than wait.
  void backward_abandoned() {
    std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
    if (lock.owns_lock() && in_backward) reset_backward_state();
  }

  void reset_backward_state() {
    ready.assign(params.size(), false);
    for (auto& b : buckets) {
      b.pending = b.params.size();
      b.work = Work();
      std::fill(b.sources.begin(), b.sources.end(), at::Tensor());
    }
    next_launch = 0;
    ready_count = 0;
    in_backward = false;
  }

  at::Tensor view_of(size_t k) {
    auto& b = buckets[bucket_of[k]];
    return b.flat.narrow(0, b.offsets[slot_of[k]], params[k].numel());
  }

  // Buckets are launched strictly in index order on every rank: the same collective sequence everywhere.
  // Dividing before the SUM keeps the averaging inside the window where communication overlaps backward
  // (on the CPU; NCCL's AVG divides inside the reduction).
  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      auto& b = buckets[next_launch++];
      if (static_cast<int>(next_launch) - 1 == skip_bucket) {
        b.scratch = at::zeros({1}, b.flat.options());
        b.work = comm.all_reduce_async(b.scratch, ReduceOp::SUM);
        ++launched;
        continue;
      }
      const bool compress = options.compress_bf16 && b.flat.scalar_type() == at::kFloat;
      if (b.reduce_from_grads) {
        // Shared memory averages each block of this rank's shard while it is in cache, reading that
        // shard straight from the gradients: only the peers' shards are copied into the bucket.
        b.work = comm.all_reduce_into_async(b.flat, b.sources, ReduceOp::AVG);
      } else {
        // On a GPU NCCL averages float32 inside the reduction (ncclAvg): no pass of its own over the bucket.
        // Not 16-bit values: NCCL scales them by 1/n rounded to their type, a bias when n is not a power of two.
        const bool average_in_reduction = b.flat.is_cuda() && !compress && b.flat.scalar_type() == at::kFloat;
        if (!average_in_reduction) b.flat.div_(comm.size());
        const auto op = average_in_reduction ? ReduceOp::AVG : ReduceOp::SUM;
        if (compress) {
          b.wire = b.flat.to(at::kBFloat16);
          b.work = comm.all_reduce_async(b.wire, op);
        } else {
          b.work = comm.all_reduce_async(b.flat, op);
        }
      }
      ++launched;
      if (ready_count < params.size()) ++overlapped;  // started while other gradients are still being computed
    }
  }

  void mark_ready(size_t k) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sync || detached) return;
    if (!in_backward) {
      in_backward = true;
      std::weak_ptr<Core> weak = shared_from_this();
      // A pass that fails (a node throws) ends without the callback: forget it, or every later backward
      // would find this one armed and never average its gradients.
      recompute::at_end_of_backward(
          [weak] {
            if (auto self = weak.lock()) self->finish_backward();
          },
          [weak] {
            if (auto self = weak.lock()) self->backward_abandoned();
          });
    }
    if (ready[k]) throw Error(recompute::accumulated_twice(names[k]));
    // After zero_grad(set_to_none = false), .grad is still a view into its bucket: AccumulateGrad wrote it
    // in place and nothing needs copying. Otherwise it is a fresh tensor: over shared memory the bucket's
    // all_reduce_into reads it directly (this rank's shard) on the communication thread; elsewhere it is
    // copied in here.
    take_gradient(k);
  }

  // Parameter k's gradient into its bucket (or, on shared memory, held as the bucket's source); then (`launch`)
  // the buckets whose every gradient is in start their all-reduces, in order.
  void take_gradient(size_t k, bool launch = true) {
    const auto& grad = params[k].grad();
    auto& b = buckets[bucket_of[k]];
    auto view = view_of(k);
    if (!grad.defined()) view.zero_();
    else if (grad.data_ptr() != view.data_ptr()) {
      if (b.reduce_from_grads) b.sources[slot_of[k]] = grad;  // held until finish_backward() replaces .grad
      else view.copy_(grad.reshape(-1));
    }
    if (b.reduce_from_grads && !b.sources[slot_of[k]].defined()) b.sources[slot_of[k]] = view;
    ready[k] = true;
    ++ready_count;
    --b.pending;
    if (launch) launch_ready();
  }

  void finish_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::string> unused;
    for (size_t k = 0; k < params.size(); ++k)
      if (!ready[k]) unused.push_back(names[k]);
    if (!unused.empty()) {
      if (!options.find_unused_parameters) {
        reset_backward_state();
        throw replicate::unused_parameters_error(comm.rank(), unused, "all-reduce");
      }
      for (size_t k = 0; k < params.size(); ++k)
        if (!ready[k]) {
          auto& b = buckets[bucket_of[k]];
          auto view = view_of(k).zero_();
          if (b.reduce_from_grads) b.sources[slot_of[k]] = view;
          ready[k] = true;
          ++ready_count;
          --b.pending;
        }
      launch_ready();
    }
    complete_reduction();
  }

  void reduce_accumulated_now() {
    std::lock_guard<std::mutex> lock(mutex);
    if (in_backward) throw Error("DDP: reduce_accumulated_now() during a backward; call it after the backwards");
    std::vector<std::string> unused;  // as a synchronising backward would say of them
    for (size_t k = 0; k < params.size(); ++k)
      if (!params[k].grad().defined()) unused.push_back(names[k]);
    if (!unused.empty() && !options.find_unused_parameters)
      throw replicate::unused_parameters_error(comm.rank(), unused, "all-reduce");
    try {
      for (size_t k = 0; k < params.size(); ++k) take_gradient(k, /*launch=*/false);
      launch_ready();  // every bucket, none of them overlapping a backward
      complete_reduction();
    } catch (...) {  // a collective failed: the next backward must not find this reduction's half-counted state
      reset_backward_state();
      throw;
    }
  }

  // Waits for every bucket's all-reduce; each parameter's .grad becomes its averaged view of the bucket.
  void complete_reduction() {
    const auto waiting_since = std::chrono::steady_clock::now();
    for (auto& b : buckets) {
      b.work.wait();
      if (b.wire.defined()) b.flat.copy_(b.wire), b.wire = at::Tensor();
    }
    exposed_comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting_since).count();
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < params.size(); ++k) {
      auto averaged = view_of(k).view(params[k].sizes());
      auto& grad = params[k].mutable_grad();
      if (!grad.defined() || grad.data_ptr() != averaged.data_ptr()) grad = averaged;  // .grad becomes the bucket view
    }
    reset_backward_state();
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, Communicator comm,
                                                 DDPOptions options)
    : core_(std::make_shared<Core>()) {
  if (!module) throw Error("DistributedDataParallel: the module is null");
  auto& c = *core_;
  c.module = std::move(module);
  c.comm = std::move(comm);
  c.options = options;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied parameter once, under its first name
  for (const auto& item : c.module->named_parameters()) {
    if (!item.value().requires_grad() || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    c.names.push_back(item.key());
    c.params.push_back(item.value());
  }
  if (c.comm.size() > 1) replicate::make_replicas_equal(c.comm, *c.module);
  c.bucket_of.resize(c.params.size());
  c.slot_of.resize(c.params.size());
  c.assign_buckets();
  c.reset_backward_state();
  std::weak_ptr<Core> weak = core_;
  c.accumulators = replicate::on_gradient_ready(c.params, [weak](size_t k) {
    if (auto core = weak.lock()) core->mark_ready(k);
  });
}

DistributedDataParallel::~DistributedDataParallel() {
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->detached = true;
}

void DistributedDataParallel::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->sync = enabled;
}

bool DistributedDataParallel::sync_enabled() const { return core_->sync; }

void DistributedDataParallel::reduce_accumulated_now() { core_->reduce_accumulated_now(); }

void DistributedDataParallel::sync_buffers() {
  if (!core_->options.broadcast_buffers || core_->comm.size() == 1) return;
  std::vector<at::Tensor> buffers;
  for (auto& b : core_->module->buffers()) buffers.push_back(b);
  if (!buffers.empty()) replicate::broadcast_from_rank0(core_->comm, buffers);
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const { return core_->module; }

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_layout() const {
  std::vector<std::vector<size_t>> layout;
  for (auto& b : core_->buckets) layout.push_back(b.params);
  return layout;
}

size_t DistributedDataParallel::launches() const { return core_->launched; }
size_t DistributedDataParallel::overlapped_launches() const { return core_->overlapped; }
double DistributedDataParallel::exposed_comm_seconds() const {
  std::lock_guard<std::mutex> lock(core_->mutex);
  return core_->exposed_comm_seconds;
}

}  // namespace xlr8
