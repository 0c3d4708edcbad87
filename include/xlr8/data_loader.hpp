#pragma once
// A sharded data loader over a map-style dataset (torch::data::Dataset, or any type with size() and
// get(i)): each rank gets its batches with Accelerate's BatchSamplerShard semantics, shuffled from one
// seed + epoch shared by all ranks, loaded ahead by worker threads and moved to the device. With
// pin_memory on a CUDA device, batches are page-locked and copied on a stream of their own, so the next
// batch's copy overlaps the current step (torch's DataLoader pin_memory, with the copy done ahead).
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/data/example.h>

#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <vector>

#include "xlr8/batch_sharding.hpp"
#include "xlr8/error.hpp"
#include "xlr8/gradient_state.hpp"
#include "xlr8/tensor_tree.hpp"
#include "xlr8/to_device.hpp"

namespace xlr8 {

struct DataLoaderOptions {
  int64_t batch_size = 1;  // per process (the global batch with split_batches)
  bool shuffle = false;
  bool drop_last = false;
  int num_workers = 0;     // threads loading batches ahead of the training loop; 0: load inline
  int prefetch_per_worker = 2;
  // Page-locked host batches, copied to a CUDA device on the loader's own stream; the step's stream waits
  // for a batch's copies when it takes the batch. On another device: a warning, and batches are not pinned.
  bool pin_memory = false;
  std::optional<uint64_t> seed{};  // shuffle seed; default: the Accelerator's seed (set_seed). {}: designated
                                  // initialisers that leave it out do not warn (-Wmissing-field-initializers)
};

// Stacks tensors and Examples into one batch; any other item type gives a std::vector of items.
template <class Item>
struct DefaultCollate {
  using Batch = std::vector<Item>;
  static Batch collate(std::vector<Item>&& items) { return std::move(items); }
};
template <>
struct DefaultCollate<at::Tensor> {
  using Batch = at::Tensor;
  static Batch collate(std::vector<at::Tensor>&& items) { return at::stack(items); }
};
template <>
struct DefaultCollate<torch::data::Example<>> {
  using Batch = torch::data::Example<>;
  static Batch collate(std::vector<torch::data::Example<>>&& items) {
    std::vector<at::Tensor> data, target;
    for (auto& e : items) data.push_back(e.data), target.push_back(e.target);
    return {at::stack(data), at::stack(target)};
  }
};

class WorkerPool;
struct BatchCopies;

// Everything that does not depend on the dataset type: sharding, epochs, position, resumption.
class DataLoaderBase {
 public:
  DataLoaderBase(int64_t dataset_size, DataLoaderOptions options, ShardingOptions sharding, uint64_t default_seed,
                 std::shared_ptr<GradientState> gradient_state, at::Device device);
  virtual ~DataLoaderBase();

  int64_t size() const { return batches_per_epoch_; }  // batches this rank yields per epoch
  int64_t dataset_size() const { return dataset_size_; }
  int64_t epoch() const { return epoch_; }
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  // The next iteration starts after its first n batches (resuming mid-epoch).
  void skip_first_batches(int64_t n) { skip_ = n; }
  int64_t batches_yielded() const { return position_; }  // within the current epoch
  const DataLoaderOptions& options() const { return options_; }
  const ShardingOptions& sharding() const { return sharding_; }

  // For checkpoints: {"epoch", "position", "samples"}. Loading makes the next iteration resume at that
  // sample, also with another number of processes.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 protected:
  struct Pass;  // one iteration over the epoch
  std::shared_ptr<Pass> start_pass();
  std::vector<std::vector<int64_t>> plan_epoch() const;
  void run_async(std::function<void()> task);
  int64_t global_batch() const;  // samples all processes take per batch
  // pin_memory on a CUDA device: page-locked copies of host tensors, and copies to the device that run on
  // the loader's stream (copy_aside runs `copy` with that stream current and returns what marks its end).
  bool pins() const { return copies_ != nullptr; }
  at::Tensor pinned(const at::Tensor& t) const;
  std::shared_ptr<void> copy_aside(const std::function<void()>& copy) const;
  // On the thread that takes the batch: its current stream waits for the copies, and the tensors' memory
  // (allocated on the loader's stream) is marked as used by it, so it is not reused too early.
  void hand_over(const std::shared_ptr<void>& copies_done, const std::vector<at::Tensor>& tensors) const;
  at::Device device_;

 private:
  friend struct Pass;
  int64_t dataset_size_;
  DataLoaderOptions options_;
  ShardingOptions sharding_;
  uint64_t seed_;
  std::shared_ptr<GradientState> gradient_state_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
  int64_t skip_ = 0;
  int64_t batches_per_epoch_ = 0;  // does not depend on the order, so computed once
  std::unique_ptr<BatchCopies> copies_;  // before pool_: the workers that use it stop first
  std::unique_ptr<WorkerPool> pool_;
};

struct DataLoaderBase::Pass {
  DataLoaderBase* loader = nullptr;
  std::vector<std::vector<int64_t>> batches;
  size_t next = 0;
  bool finished = false;
  LoaderProgress progress;
  ~Pass();
  void yielded(size_t index);  // marks end_of_dataloader on the last batch, advances the position
};

template <class Dataset, class Collate = DefaultCollate<std::decay_t<decltype(std::declval<Dataset&>().get(0))>>>
class DataLoader : public DataLoaderBase {
 public:
  using Item = std::decay_t<decltype(std::declval<Dataset&>().get(0))>;
  using Batch = typename Collate::Batch;

 private:
  struct Loaded {
    Batch batch;
    std::shared_ptr<void> copies_done;  // set when the batch was copied on the loader's stream
  };

 public:
  DataLoader(Dataset dataset, DataLoaderOptions options, ShardingOptions sharding, uint64_t default_seed,
             std::shared_ptr<GradientState> gradient_state, at::Device device)
      : DataLoaderBase(size_of(dataset), options, sharding, default_seed, std::move(gradient_state), device),
        dataset_(std::make_shared<Dataset>(std::move(dataset))) {}

  class iterator {
   public:
    using value_type = Batch;
    iterator() = default;
    iterator(DataLoader* owner, std::shared_ptr<Pass> pass) : owner_(owner), pass_(std::move(pass)) { advance(); }
    Batch& operator*() { return current_; }
    Batch* operator->() { return &current_; }
    iterator& operator++() {
      advance();
      return *this;
    }
    bool operator==(const iterator& other) const { return done() == other.done(); }
    bool operator!=(const iterator& other) const { return !(*this == other); }

   private:
    bool done() const { return !pass_ || pass_->finished; }
    void advance() {
      auto& p = *pass_;
      if (p.next >= p.batches.size()) {
        p.finished = true;
        current_ = Batch();
        pending_.clear();
        return;
      }
      // Keep the prefetch window full, then take the oldest.
      size_t window = owner_->options().num_workers > 0
                          ? static_cast<size_t>(owner_->options().num_workers * owner_->options().prefetch_per_worker)
                          : 1;
      while (pending_.size() < window && p.next + pending_.size() < p.batches.size())
        pending_.push_back(owner_->load_async(p.batches[p.next + pending_.size()]));
      auto loaded = pending_.front().get();
      pending_.pop_front();
      if (loaded.copies_done) owner_->hand_over(loaded.copies_done, tensors_of(loaded.batch));
      current_ = std::move(loaded.batch);
      p.yielded(p.next++);
    }
    DataLoader* owner_ = nullptr;
    std::shared_ptr<Pass> pass_;
    std::deque<std::future<Loaded>> pending_;
    Batch current_;
  };

  iterator begin() { return iterator(this, start_pass()); }
  iterator end() { return iterator(); }
  const Dataset& dataset() const { return *dataset_; }

 private:
  static int64_t size_of(const Dataset& d) {
    auto s = d.size();
    if constexpr (std::is_integral_v<decltype(s)>) {
      return static_cast<int64_t>(s);
    } else {
      if (!s) throw Error("the dataset has no size(); xlr8 data loaders need a map-style dataset");
      return static_cast<int64_t>(*s);
    }
  }
  Loaded load(const std::vector<int64_t>& indices) const {
    std::vector<Item> items;
    items.reserve(indices.size());
    for (auto i : indices) items.push_back(dataset_->get(static_cast<size_t>(i)));
    Batch batch = Collate::collate(std::move(items));
    if (!pins()) return {to_device(batch, device_), nullptr};
    batch = map_tensors(batch, [this](const at::Tensor& t) { return pinned(t); });
    // A batch with tensors map_tensors cannot see (a struct with only to(device)) is copied on this thread's
    // stream: the taker could not mark memory it cannot see.
    if constexpr (!is_tensor_tree_v<Batch>) {
      return {to_device(batch, device_), nullptr};
    } else {
      Loaded loaded;
      loaded.copies_done = copy_aside([&] { loaded.batch = to_device(batch, device_); });
      return loaded;
    }
  }
  std::future<Loaded> load_async(const std::vector<int64_t>& indices) {
    auto task = std::make_shared<std::packaged_task<Loaded()>>([this, indices] { return load(indices); });
    auto future = task->get_future();
    if (options().num_workers > 0) run_async([task] { (*task)(); });
    else (*task)();
    return future;
  }
  std::shared_ptr<Dataset> dataset_;
};

}  // namespace xlr8
