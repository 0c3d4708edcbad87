// Stage-3 shards in a swap file between uses (shard_store.hpp).
#include "parallel/shard/shard_store.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>

#include "core/log.hpp"
#include "os/swap_directory.hpp"

namespace xlr8::shard {

ShardStore::ShardStore(const ZeroOptions::Disk& disk, const std::vector<Shard>& shards) {
  std::vector<TensorSwapper::Slot> slots;
  int64_t largest = os::AlignedBuffer::kAlignment;
  for (const auto& s : shards) {
    slots.push_back({s.name, s.dtype, {s.numel}});
    largest = std::max<int64_t>(largest, s.numel * static_cast<int64_t>(c10::elementSize(s.dtype)));
  }
  os::SwapDirectoryClaim claim(disk.path);
  stale_removed_ = claim.removed().size();
  if (stale_removed_ > 0)
    log::info("xlr8: removed {} stale swap file(s) ({} bytes) from {}: runs that ended without removing them",
              stale_removed_, claim.removed_bytes(), disk.path);
  const int64_t a = os::AlignedBuffer::kAlignment;
  SwapOptions options{.file = claim.new_file("parameters"),
                      .buffer_size = (largest + a - 1) / a * a,
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
  return {{"swap_file", swapper_->file_path().string()},
          {"swap_file_bytes", swapper_->file_bytes()},
          {"swap_pool_bytes", swapper_->pool_bytes()},
          {"swap_bytes_read", swapper_->bytes_read()},
          {"swap_bytes_written", swapper_->bytes_written()},
          {"shard_reads", reads_},
          {"shard_writes", writes_},
          {"stale_swap_files_removed", stale_removed_}};
}

}  // namespace xlr8::shard
