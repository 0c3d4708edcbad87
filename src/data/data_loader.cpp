#include "xlr8/data_loader.hpp"

#include <fmt/format.h>

#include <numeric>

#include "core/log.hpp"
#include "core/worker_pool.hpp"
#include "data/batch_copies.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

DataLoaderBase::DataLoaderBase(int64_t dataset_size, DataLoaderOptions options, ShardingOptions sharding,
                               uint64_t default_seed, std::shared_ptr<GradientState> gradient_state, at::Device device)
    : device_(device),
      dataset_size_(dataset_size),
      options_(options),
      sharding_(sharding),
      seed_(options.seed.value_or(default_seed)),
      gradient_state_(std::move(gradient_state)) {
  if (options_.batch_size < 1) throw ConfigError(fmt::format("batch_size {} must be at least 1", options_.batch_size));
  if (options_.num_workers < 0) throw ConfigError(fmt::format("num_workers {} must be 0 or more", options_.num_workers));
  sharding_.batch_size = options_.batch_size;
  sharding_.drop_last = options_.drop_last;
  if (dataset_size_ == 0) throw Error("the dataset is empty");
  if (options_.num_workers > 0) pool_ = std::make_unique<WorkerPool>(options_.num_workers);
  if (options_.pin_memory && device_.is_cuda()) copies_ = std::make_unique<BatchCopies>(device_);
  else if (options_.pin_memory)  // as torch's DataLoader does without an accelerator
    log::warning("pin_memory: the data loader's device is {}, not a CUDA GPU, so its batches are not page-locked "
                 "(pinned memory speeds up copies to a GPU only)", device_.str());
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  std::iota(order.begin(), order.end(), 0);
  batches_per_epoch_ = static_cast<int64_t>(shard_batches(order, sharding_).size());
}

DataLoaderBase::~DataLoaderBase() = default;

std::vector<std::vector<int64_t>> DataLoaderBase::plan_epoch() const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  if (options_.shuffle) {
    // One permutation per (seed, epoch), identical on every rank and for any number of ranks: torch.randperm
    // seeded with seed + epoch, the order of Accelerate's seedable sampler (use_seedable_sampler) for that seed.
    at::Generator generator = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    auto perm = at::randperm(dataset_size_, generator, at::kLong);
    auto data = perm.data_ptr<int64_t>();
    order.assign(data, data + dataset_size_);
  } else {
    std::iota(order.begin(), order.end(), 0);
  }
  return shard_batches(order, sharding_);
}

std::shared_ptr<DataLoaderBase::Pass> DataLoaderBase::start_pass() {
  auto pass = std::make_shared<Pass>();
  pass->loader = this;
  pass->batches = plan_epoch();
  pass->progress.remainder = padding_remainder(dataset_size_, sharding_);
  if (skip_ > 0) {
    pass->next = static_cast<size_t>(std::min<int64_t>(skip_, static_cast<int64_t>(pass->batches.size())));
    position_ = static_cast<int64_t>(pass->next);
    skip_ = 0;
  } else {
    position_ = 0;
  }
  if (gradient_state_) gradient_state_->push(&pass->progress);
  return pass;
}

void DataLoaderBase::Pass::yielded(size_t index) {
  progress.end_of_dataloader = index + 1 == batches.size();
  loader->position_ = static_cast<int64_t>(index) + 1;
}

DataLoaderBase::Pass::~Pass() {
  if (loader->gradient_state_) loader->gradient_state_->pop(&progress);
  if (finished) {  // a complete pass ends the epoch
    loader->epoch_ += 1;
    loader->position_ = 0;
  }
}

void DataLoaderBase::run_async(std::function<void()> task) { pool_->submit(std::move(task)); }

int64_t DataLoaderBase::global_batch() const {
  // Verify's run 3 yields each global batch in micro_batches parts, one rank's share each.
  return sharding_.split_batches ? sharding_.batch_size / std::max(1, sharding_.micro_batches)
                                 : sharding_.batch_size * sharding_.num_processes;
}

nlohmann::json DataLoaderBase::state() const {
  // The global sample position too: a run resumed with another global batch (another number of
  // processes at the same per-process batch) continues at the same sample.
  return {{"epoch", epoch_}, {"position", position_}, {"samples", position_ * global_batch()}};
}

void DataLoaderBase::load_state(const nlohmann::json& state) {
  epoch_ = state.at("epoch").get<int64_t>();
  position_ = state.at("position").get<int64_t>();
  if (state.contains("samples")) {
    const int64_t samples = state.at("samples").get<int64_t>();
    if (samples % global_batch() != 0)
      throw ConfigError(fmt::format("load_state: the data loader stopped after {} samples of epoch {}, which is not a "
                                    "whole number of global batches of {} ({} per process on {} processes); resume "
                                    "with a global batch that divides it",
                                    samples, epoch_, global_batch(), sharding_.batch_size, sharding_.num_processes));
    position_ = samples / global_batch();
  }
  skip_ = position_;
}

}  // namespace xlr8
