// Stage-3 shards in a swap file between uses (shard_store.hpp).
#include "parallel/shard/shard_store.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "os/swap_directory.hpp"

namespace xlr8::shard {

ShardStore::ShardStore(const ZeroOptions::Disk& disk, const std::vector<Shard>& shards) {
  std::vector<TensorSwapper::Slot> slots;
  for (const auto& s : shards) slots.push_back({s.name, s.dtype, {s.numel}});
  os::SwapDirectoryClaim claim(disk.path);
  stale_removed_ = claim.removed().size();
  SwapOptions options{.file = claim.new_file("parameters"),
                      .buffer_size = 0,  // the largest shard's
                      .buffer_count = std::max(disk.buffer_count, 2),  // one read while one write drains
                      .aio = {.block_size = disk.aio_block_size, .intra_op_parallelism = disk.aio_threads}};
  swapper_ = std::make_unique<TensorSwapper>(std::move(options), slots);
}

void ShardStore::write(const std::string& name, const at::Tensor& values) {
  swapper_->swap_out(name, values);
  ++writes_;
}

void ShardStore::read(const std::string& name, at::Tensor& into) {
  at::NoGradGuard no_grad;
  into.copy_(swapper_->swap_in(name));  // the buffer goes back to the pool at once
  ++reads_;
}

void ShardStore::prefetch(const std::string& name) { swapper_->prefetch(name); }

nlohmann::json ShardStore::stats() const {
  auto out = swapper_->stats();
  out.update({{"shard_reads", reads_}, {"shard_writes", writes_}, {"stale_swap_files_removed", stale_removed_}});
  return out;
}

}  // namespace xlr8::shard
