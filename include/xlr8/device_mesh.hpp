#pragma once
// DeviceMesh: the ranks laid out on named dimensions, outermost first: pp (pipeline stages; 1 until pipeline
// parallelism lands), then Accelerate's dp_replicate, dp_shard, cp, sp, tp, row-major (tp fastest); one
// communicator per dimension plus the flattened ones Accelerate uses: dp (dp_replicate x dp_shard),
// dp_shard_cp (dp_shard x cp x sp) and dp_cp (dp_replicate x dp_shard x cp x sp). sp (Ulysses) splits the
// sequence as cp does and is never above 1 together with it.
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/settings.hpp"

namespace xlr8 {

// A mesh dimension, or a flattened group of several (dp, dp_shard_cp, dp_cp). The names are torchtitan's and
// Accelerate's; to_string gives them, parse_mesh_dim reads them back.
enum class MeshDim { pp, dp_replicate, dp_shard, cp, sp, tp, dp, dp_shard_cp, dp_cp };
const char* to_string(MeshDim dim);
// Error naming the known names when `name` is none of them.
MeshDim parse_mesh_dim(std::string_view name);

// The arithmetic of a mesh, without any communication.
class MeshLayout {
 public:
  struct Dim {
    MeshDim dim;
    int size;
  };
  // Throws ConfigError unless the sizes are positive and multiply to `world_size`; Error for a flattened name.
  MeshLayout(std::vector<Dim> dims, int world_size);
  // pp 1 (no pipeline stages yet), then the settings' sizes in their order.
  static MeshLayout from(const ParallelismSettings& sizes, int world_size);

  const std::vector<Dim>& dims() const { return dims_; }
  int world_size() const { return world_size_; }
  // A dimension or a flattened one to the mesh dimensions it spans (those present in this mesh).
  std::vector<MeshDim> resolve(MeshDim name) const;
  int size(MeshDim name) const;
  int coordinate(int rank, MeshDim dim) const;
  // Ranks that share every coordinate of `rank` outside `name`'s dimensions, in increasing order.
  std::vector<int> group_ranks(int rank, MeshDim name) const;
  // This rank's index inside its group along `name`.
  int rank_in(int rank, MeshDim name) const;
  static const std::vector<MeshDim>& flattened_names();

 private:
  int index_of(MeshDim dim) const;
  std::vector<Dim> dims_;
  int world_size_;
};

class DeviceMesh {
 public:
  // Collective over `world`: every rank builds the same mesh; groups are created eagerly in a fixed order.
  DeviceMesh(const Communicator& world, MeshLayout layout);
  const MeshLayout& layout() const { return layout_; }
  Communicator& group(MeshDim name);
  int size(MeshDim name) const { return layout_.size(name); }
  int rank(MeshDim name) const { return layout_.rank_in(world_rank_, name); }

 private:
  MeshLayout layout_;
  int world_rank_;
  std::map<MeshDim, Communicator> groups_;
};

}  // namespace xlr8
