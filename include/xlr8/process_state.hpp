#pragma once
// xlr8::ProcessState (Accelerate's PartialState): created once per process from the environment,
// then immutable. It rendezvouses with the other ranks and owns the world communicator and the device
// mesh (parallelism_config's dp_replicate x dp_shard x cp x tp; by default every rank a data-parallel
// replica).
#include <chrono>
#include <memory>
#include <string>

#include "xlr8/communicator.hpp"
#include "xlr8/device_mesh.hpp"
#include "xlr8/settings.hpp"

namespace xlr8 {

struct ProcessStateOptions {
  // Defaults: XLR8_RDZV_TIMEOUT (seconds, else 300) and XLR8_COLLECTIVE_TIMEOUT (seconds, else 1800).
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  std::optional<std::chrono::milliseconds> collective_timeout;
};

class ProcessState {
 public:
  // The process-wide state, created on first use from the current environment.
  static const ProcessState& instance();
  static bool exists();
  // Builds a state from `env` without registering it as the process-wide one (tests, tools).
  static std::unique_ptr<ProcessState> create(const Env& env, const ProcessStateOptions& options = {});

  const Topology& topology() const { return topology_; }
  const Settings& settings() const { return settings_; }
  int rank() const { return topology_.rank; }
  int world_size() const { return topology_.world_size; }
  int local_rank() const { return topology_.local_rank; }
  int local_world_size() const { return topology_.local_world_size; }
  int node_rank() const { return topology_.node_rank; }
  int num_nodes() const { return topology_.num_nodes; }
  bool is_main_process() const { return topology_.rank == 0; }
  bool is_local_main_process() const { return topology_.local_rank == 0; }
  DistributedType distributed_type() const { return distributed_type_; }
  MixedPrecision mixed_precision() const { return settings_.mixed_precision; }
  const std::string& device() const { return device_; }    // "cpu" or "cuda:<local_rank % gpus>"
  const std::string& backend() const { return backend_; }  // "gloo" or "nccl"
  int intra_op_threads() const { return threads_; }
  // Whether glibc's allocator was tuned for training loops (XLR8_MALLOC_TUNING, default on).
  bool allocator_tuned() const { return allocator_tuned_; }
  Communicator& world() const { return world_; }
  // Groups by mesh dimension: "dp" (data parallel: the data loader shards over it, metrics gather over it), "dp_cp",
  // "dp_shard", "dp_replicate", "cp", "sp", "tp". Groups that span the world are the world communicator.
  DeviceMesh& mesh() const { return *mesh_; }

  ~ProcessState();
  ProcessState(const ProcessState&) = delete;
  ProcessState& operator=(const ProcessState&) = delete;

 private:
  ProcessState() = default;
  Topology topology_;
  Settings settings_;
  DistributedType distributed_type_ = DistributedType::NO;
  std::string device_ = "cpu";
  std::string backend_ = "gloo";
  int threads_ = 1;
  bool allocator_tuned_ = false;
  mutable Communicator world_;
  std::unique_ptr<DeviceMesh> mesh_;
};

// For long-lived workers that never pass through a launcher (Accelerate's notebook-launcher case): sets
// the variables `xlr8 launch` would set. Must run before the ProcessState exists; calling it afterwards with a
// different strategy or precision throws, because the state has already locked them in.
void configure_environment(const Settings& settings, const Topology& topology);

}  // namespace xlr8
