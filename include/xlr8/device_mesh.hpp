#pragma once
// DeviceMesh: named dimensions in Accelerate's order (dp_replicate, dp_shard, cp, sp, tp), ranks laid out
// row-major (tp fastest), one communicator per dimension plus the flattened ones Accelerate uses:
// dp (dp_replicate x dp_shard), dp_shard_cp (dp_shard x cp x sp) and dp_cp (dp_replicate x dp_shard x cp
// x sp). sp (Ulysses) splits the sequence as cp does and is never above 1 together with it.
#include <map>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/settings.hpp"

namespace xlr8 {

// The arithmetic of a mesh, without any communication.
class MeshLayout {
 public:
  struct Dim {
    std::string name;
    int size;
  };
  // Throws ConfigError unless the sizes are positive and multiply to `world_size`.
  MeshLayout(std::vector<Dim> dims, int world_size);
  static MeshLayout from(const ParallelismSettings& sizes, int world_size);

  const std::vector<Dim>& dims() const { return dims_; }
  int world_size() const { return world_size_; }
  // A dimension or a flattened name ("dp", "dp_shard_cp", "dp_cp") to the mesh dimensions it spans.
  std::vector<std::string> resolve(const std::string& name) const;
  int size(const std::string& name) const;
  int coordinate(int rank, const std::string& dim) const;
  // Ranks that share every coordinate of `rank` outside `name`'s dimensions, in increasing order.
  std::vector<int> group_ranks(int rank, const std::string& name) const;
  // This rank's index inside its group along `name`.
  int rank_in(int rank, const std::string& name) const;
  static const std::vector<std::string>& flattened_names();

 private:
  int index_of(const std::string& dim) const;
  std::vector<Dim> dims_;
  int world_size_;
};

class DeviceMesh {
 public:
  // Collective over `world`: every rank builds the same mesh; groups are created eagerly in a fixed order.
  DeviceMesh(const Communicator& world, MeshLayout layout);
  const MeshLayout& layout() const { return layout_; }
  Communicator& group(const std::string& name);
  int size(const std::string& name) const { return layout_.size(name); }
  int rank(const std::string& name) const { return layout_.rank_in(world_rank_, name); }

 private:
  MeshLayout layout_;
  int world_rank_;
  std::map<std::string, Communicator> groups_;
};

}  // namespace xlr8
