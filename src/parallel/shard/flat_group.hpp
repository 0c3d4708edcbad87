#pragma once
// Parameters laid end to end in one flat buffer (the design of FSDP1's FlatParameter; a ShardingUnit
// holds one or two of them), padded to a multiple of the shard group's size, of which rank r owns the
// r-th contiguous chunk. What each tensor is: [Note: a unit's tensors] in parallel/sharding_unit.hpp. The
// user's parameter tensors become views of that buffer (same tensors, same autograd identity), so a
// gather is one all-gather into it and freeing it keeps their shapes. The optimizer gets, per
// parameter, a leaf over the part of it that lies in this rank's chunk (possibly empty): padding never
// reaches the optimizer, a checkpoint or a result.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8::shard {

// Which of a group's tensors live in host memory while its parameters are on an accelerator (offload;
// ZeroOptions::offload_optimizer / offload_params): `master` (and with it the optimizer's leaves, their
// gradients and state), and, stage 3 only, `shard` too. `pin`: page-locked when `full` is on CUDA.
struct HostPlacement {
  bool master = false;
  bool shard = false;
  bool pin = true;
};

class ShardStore;

struct FlatGroup {
  std::string label;                         // the unit's module path, "(root)", or "bucket k"
  std::vector<std::string> names;
  std::vector<at::Tensor> params;            // the user's parameters: views of `full`
  std::vector<int64_t> offsets;              // element offset of each parameter in the flat buffer
  int64_t numel = 0;                         // real elements, without padding
  int64_t shard_numel = 0;                   // elements per rank: padded size / ranks
  int rank = 0, ranks = 1;
  bool owns_shard = false;                   // stage 3: `shard` is its own tensor, `full` may be freed
  bool frozen = false;                       // no parameter requires gradients: no hooks, no reduction
  HostPlacement host;                        // what lives in host memory (offload)
  at::Tensor full;                           // the gathered parameters, padded, in the compute dtype
  at::Tensor shard;                          // this rank's chunk of them (a view of `full` unless owns_shard)
  at::Tensor master;                         // the chunk the optimizer updates: `shard` itself, or its fp32
                                             // master copy when parameters compute in a lower precision, or
                                             // (offload) its copy in host memory
  at::Tensor grad_full;                      // gradients laid out like `full` (while reducing; stage 1 keeps it)
  std::vector<at::Tensor> shard_params;      // per parameter: the leaf the optimizer updates (a view of `master`;
                                             // frozen: a leaf that requires no gradient, which optimizers skip)
  // Parameters on disk (stage 3, ZeroOptions::params_on_disk): `shard` (and `master`, when it is `shard`) holds
  // memory only while resident; otherwise its values are in `disk`'s slot and its storage is empty. Whoever
  // changes the shard makes it resident first; storing a resident shard writes it back.
  std::shared_ptr<ShardStore> disk;
  std::string disk_slot;  // its name in `disk`
  bool shard_on_disk = false;

  bool mixed() const { return !master.is_same(shard); }

  // `shard` where `full` lives: itself, or (parameters offloaded) a copy of it on the device.
  at::Tensor shard_on_device() const;

  int64_t padded() const { return shard_numel * ranks; }
  bool gathered() const;
  int64_t full_bytes() const;
  // Parameter i's elements inside this rank's chunk: {offset in the chunk, offset in the parameter, count}.
  struct Overlap {
    int64_t in_shard = 0, in_param = 0, count = 0;
  };
  Overlap owned_part(size_t i) const;

  // Allocates `full` again and all-gathers the shards into it (owns_shard only; no-op when gathered).
  void gather(Communicator& comm);
  // The same, asynchronously: `full` holds the values once the returned Work completes.
  Work gather_async(Communicator& comm);
  // Frees `full`'s memory; the parameters keep their shapes but hold no data until the next gather.
  void release();
  // After the optimizer updated `master`: copies it into `shard` when they differ, then all-gathers every
  // chunk into `full` (in place for stages 1-2; stage 3 only when gathered).
  Work refresh_async(Communicator& comm);
  // The whole parameters in the master dtype, whatever `full` holds now (collective).
  at::Tensor gather_master(Communicator& comm);

  // Parameters on disk (no-ops without): the shard read back into memory of its own; written back (after
  // `master`'s values are copied into it when they differ) and its memory freed; freed unchanged.
  void load_shard();
  void store_shard();
  void drop_shard();
  // Starts reading the shard back from disk (when it is there), for a load_shard soon to find it in memory.
  void read_ahead() const;
};

// Lays `params` (same dtype and device; all requiring gradients, or none: a frozen group) out in a new group. With a
// `compute_dtype` other than theirs, the parameters become tensors of that dtype (views of `full`) and
// the optimizer's leaves stay in theirs. Collective when `owns_shard` (the shard is allocated in memory
// the group's peers can read directly). `values_from_rank0`: only rank 0's parameters hold values (the
// others' are never read); the group's are broadcast from it (collective).
FlatGroup make_flat_group(std::string label, std::vector<std::string> names,
                          std::vector<at::Tensor> params, Communicator& comm, bool owns_shard,
                          std::optional<at::ScalarType> compute_dtype = std::nullopt, bool values_from_rank0 = false,
                          HostPlacement host = {});

}  // namespace xlr8::shard
