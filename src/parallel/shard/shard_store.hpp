#pragma once
// Offload's disk tier for parameters (ZeroOptions::params_on_disk; issue 47): the stage-3 groups' shards in one
// swap file per rank, a slot each. FlatGroup::load_shard / store_shard / drop_shard move a group's shard between
// this file and its own memory.
#include <ATen/core/Tensor.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/shard/tensor_swapper.hpp"
#include "xlr8/zero.hpp"

namespace xlr8::shard {

class ShardStore {
 public:
  struct Shard {
    std::string name;
    at::ScalarType dtype;
    int64_t numel = 0;
  };
  // Reserves the file now (the stale files of dead runs in the directory removed first): a full or unwritable
  // nvme_path fails before training.
  ShardStore(const ZeroOptions::Disk& disk, const std::vector<Shard>& shards);
  void write(const std::string& name, const at::Tensor& values);  // returns once copied into the pool
  void read(const std::string& name, at::Tensor& into);           // `into` (the shard's memory) filled
  void prefetch(const std::string& name);
  nlohmann::json stats() const;

 private:
  std::unique_ptr<TensorSwapper> swapper_;
  size_t stale_removed_ = 0;
  int64_t reads_ = 0, writes_ = 0;
};

}  // namespace xlr8::shard
