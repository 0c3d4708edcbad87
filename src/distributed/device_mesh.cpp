#include "xlr8/device_mesh.hpp"

#include <fmt/format.h>

#include "core/text.hpp"
#include "distributed/comm_state.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

MeshLayout::MeshLayout(std::vector<Dim> dims, int world_size) : dims_(std::move(dims)), world_size_(world_size) {
  long product = 1;
  std::vector<std::string> terms;
  for (const auto& d : dims_) {
    if (d.size < 1) throw ConfigError(fmt::format("mesh dimension {} has size {}; sizes must be at least 1", d.name, d.size));
    product *= d.size;
    terms.push_back(fmt::format("{} {}", d.name, d.size));
  }
  if (product != world_size)
    throw ConfigError(fmt::format("mesh sizes {} multiply to {}, but the world size is {}; make the product equal the "
                                  "number of processes",
                                  text::join(terms, " x "), product, world_size));
}

MeshLayout MeshLayout::from(const ParallelismSettings& p, int world_size) {
  check_sequence_split(p);
  return MeshLayout({{"dp_replicate", p.dp_replicate}, {"dp_shard", p.dp_shard}, {"cp", p.cp}, {"sp", p.sp}, {"tp", p.tp}},
                    world_size);
}

const std::vector<std::string>& MeshLayout::flattened_names() {
  static const std::vector<std::string> names = {"dp", "dp_shard_cp", "dp_cp"};
  return names;
}

int MeshLayout::index_of(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].name == dim) return static_cast<int>(i);
  return -1;
}

std::vector<std::string> MeshLayout::resolve(const std::string& name) const {
  if (index_of(name) >= 0) return {name};
  std::vector<std::string> parts;
  if (name == "dp") parts = {"dp_replicate", "dp_shard"};
  // Ulysses peers, like context-parallel ones, share the weights and split the sequence: sp joins cp here
  // (DeepSpeed's sequence-data-parallel group; the two are never both above 1).
  else if (name == "dp_shard_cp") parts = {"dp_shard", "cp", "sp"};
  else if (name == "dp_cp") parts = {"dp_replicate", "dp_shard", "cp", "sp"};
  std::vector<std::string> present;
  for (auto& p : parts)
    if (index_of(p) >= 0) present.push_back(p);
  if (present.empty()) {
    std::vector<std::string> all;
    for (auto& d : dims_) all.push_back(d.name);
    all.insert(all.end(), flattened_names().begin(), flattened_names().end());
    throw Error(fmt::format("mesh has no dimension {:?}; known: {}", name, text::join(all)));
  }
  return present;
}

int MeshLayout::size(const std::string& name) const {
  int n = 1;
  for (auto& d : resolve(name)) n *= dims_[index_of(d)].size;
  return n;
}

int MeshLayout::coordinate(int rank, const std::string& dim) const {
  int i = index_of(dim);
  if (i < 0) throw Error(fmt::format("mesh has no dimension {:?}", dim));
  int stride = 1;
  for (size_t j = i + 1; j < dims_.size(); ++j) stride *= dims_[j].size;
  return (rank / stride) % dims_[i].size;
}

std::vector<int> MeshLayout::group_ranks(int rank, const std::string& name) const {
  if (rank < 0 || rank >= world_size_) throw Error(fmt::format("rank {} is outside the mesh of {} ranks", rank, world_size_));
  auto span = resolve(name);
  std::vector<bool> in_span(dims_.size(), false);
  for (auto& d : span) in_span[index_of(d)] = true;
  std::vector<int> ranks;
  for (int other = 0; other < world_size_; ++other) {
    bool same = true;
    for (size_t i = 0; i < dims_.size() && same; ++i)
      if (!in_span[i]) same = coordinate(other, dims_[i].name) == coordinate(rank, dims_[i].name);
    if (same) ranks.push_back(other);
  }
  return ranks;
}

int MeshLayout::rank_in(int rank, const std::string& name) const {
  auto ranks = group_ranks(rank, name);
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

DeviceMesh::DeviceMesh(const Communicator& world, MeshLayout layout)
    : layout_(std::move(layout)), world_rank_(world.rank()) {
  if (world.size() != layout_.world_size())
    throw ConfigError(fmt::format("mesh is laid out for {} ranks but the communicator has {}", layout_.world_size(),
                                  world.size()));
  std::vector<std::string> names;
  for (auto& d : layout_.dims()) names.push_back(d.name);
  for (auto& f : MeshLayout::flattened_names()) names.push_back(f);
  // Same rank set, same communicator: e.g. "dp" is "dp_shard" when dp_replicate is 1.
  std::map<std::vector<int>, Communicator> by_ranks;
  for (const auto& name : names) {
    auto ranks = layout_.group_ranks(world_rank_, name);
    auto found = by_ranks.find(ranks);
    if (found == by_ranks.end()) {
      // A group of everyone is the world (no second set of buffers; its collectives keep one program
      // order, so never issue on two such names from different threads). A group of one needs no network,
      // but the world's device backend.
      Communicator group = static_cast<int>(ranks.size()) == world.size() ? world
                           : ranks.size() == 1
                               ? detail::make_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                                           world.name() + "/" + name, "127.0.0.1", world.timeout(),
                                                           world.backend() == "nccl", false)
                               : world.new_group(ranks, name);
      found = by_ranks.emplace(ranks, group).first;
    }
    groups_[name] = found->second;
  }
}

Communicator& DeviceMesh::group(const std::string& name) {
  auto it = groups_.find(name);
  if (it == groups_.end()) layout_.resolve(name);  // throws with the known names
  if (it == groups_.end()) throw Error(fmt::format("mesh has no group {:?}", name));
  return it->second;
}

}  // namespace xlr8
