#include "xlr8/device_mesh.hpp"

#include <fmt/format.h>

#include "core/text.hpp"
#include "distributed/comm_state.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

namespace {
constexpr MeshDim kMeshDimNames[] = {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp,         MeshDim::sp,
                                 MeshDim::tp, MeshDim::dp,           MeshDim::dp_shard_cp, MeshDim::dp_cp};
bool is_flattened_dim(MeshDim dim) { return dim == MeshDim::dp || dim == MeshDim::dp_shard_cp || dim == MeshDim::dp_cp; }
}  // namespace

const char* to_string(MeshDim dim) {
  switch (dim) {
    case MeshDim::pp: return "pp";
    case MeshDim::dp_replicate: return "dp_replicate";
    case MeshDim::dp_shard: return "dp_shard";
    case MeshDim::cp: return "cp";
    case MeshDim::sp: return "sp";
    case MeshDim::tp: return "tp";
    case MeshDim::dp: return "dp";
    case MeshDim::dp_shard_cp: return "dp_shard_cp";
    case MeshDim::dp_cp: return "dp_cp";
  }
  return "?";
}

MeshDim parse_mesh_dim(std::string_view name) {
  std::vector<std::string> known;
  for (auto dim : kMeshDimNames) {
    if (name == to_string(dim)) return dim;
    known.emplace_back(to_string(dim));
  }
  throw Error(fmt::format("mesh has no dimension {:?}; known: {}", name, text::join(known)));
}

MeshLayout::MeshLayout(std::vector<Dim> dims, int world_size) : dims_(std::move(dims)), world_size_(world_size) {
  long product = 1;
  std::vector<std::string> terms;
  for (const auto& d : dims_) {
    if (is_flattened_dim(d.dim))
      throw Error(fmt::format("mesh dimension {} is a flattened group of others, not a dimension of its own", to_string(d.dim)));
    if (d.size < 1)
      throw ConfigError(fmt::format("mesh dimension {} has size {}; sizes must be at least 1", to_string(d.dim), d.size));
    product *= d.size;
    terms.push_back(fmt::format("{} {}", to_string(d.dim), d.size));
  }
  if (product != world_size)
    throw ConfigError(fmt::format("mesh sizes {} multiply to {}, but the world size is {}; make the product equal the "
                                  "number of processes",
                                  text::join(terms, " x "), product, world_size));
}

MeshLayout MeshLayout::from(const ParallelismSettings& p, int world_size) {
  check_sequence_split(p);
  return MeshLayout({{MeshDim::pp, p.pp},
                     {MeshDim::dp_replicate, p.dp_replicate},
                     {MeshDim::dp_shard, p.dp_shard},
                     {MeshDim::cp, p.cp},
                     {MeshDim::sp, p.sp},
                     {MeshDim::tp, p.tp}},
                    world_size);
}

const std::vector<MeshDim>& MeshLayout::flattened_names() {
  static const std::vector<MeshDim> names = {MeshDim::dp, MeshDim::dp_shard_cp, MeshDim::dp_cp};
  return names;
}

int MeshLayout::index_of(MeshDim dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].dim == dim) return static_cast<int>(i);
  return -1;
}

std::vector<MeshDim> MeshLayout::resolve(MeshDim name) const {
  if (index_of(name) >= 0) return {name};
  std::vector<MeshDim> parts;
  if (name == MeshDim::dp) parts = {MeshDim::dp_replicate, MeshDim::dp_shard};
  // Ulysses peers, like context-parallel ones, share the weights and split the sequence: sp joins cp here
  // (DeepSpeed's sequence-data-parallel group; the two are never both above 1).
  else if (name == MeshDim::dp_shard_cp) parts = {MeshDim::dp_shard, MeshDim::cp, MeshDim::sp};
  else if (name == MeshDim::dp_cp) parts = {MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp, MeshDim::sp};
  std::vector<MeshDim> present;
  for (auto p : parts)
    if (index_of(p) >= 0) present.push_back(p);
  if (present.empty()) {
    std::vector<std::string> all;
    for (auto& d : dims_) all.emplace_back(to_string(d.dim));
    for (auto f : flattened_names()) all.emplace_back(to_string(f));
    throw Error(fmt::format("this mesh has no dimension {}; it has: {}", to_string(name), text::join(all)));
  }
  return present;
}

int MeshLayout::size(MeshDim name) const {
  int n = 1;
  for (auto d : resolve(name)) n *= dims_[index_of(d)].size;
  return n;
}

int MeshLayout::coordinate(int rank, MeshDim dim) const {
  int i = index_of(dim);
  if (i < 0) throw Error(fmt::format("this mesh has no dimension {}", to_string(dim)));
  int stride = 1;
  for (size_t j = i + 1; j < dims_.size(); ++j) stride *= dims_[j].size;
  return (rank / stride) % dims_[i].size;
}

std::vector<int> MeshLayout::group_ranks(int rank, MeshDim name) const {
  if (rank < 0 || rank >= world_size_) throw Error(fmt::format("rank {} is outside the mesh of {} ranks", rank, world_size_));
  auto span = resolve(name);
  std::vector<bool> in_span(dims_.size(), false);
  for (auto d : span) in_span[index_of(d)] = true;
  std::vector<int> ranks;
  for (int other = 0; other < world_size_; ++other) {
    bool same = true;
    for (size_t i = 0; i < dims_.size() && same; ++i)
      if (!in_span[i]) same = coordinate(other, dims_[i].dim) == coordinate(rank, dims_[i].dim);
    if (same) ranks.push_back(other);
  }
  return ranks;
}

int MeshLayout::rank_in(int rank, MeshDim name) const {
  auto ranks = group_ranks(rank, name);
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

DeviceMesh::DeviceMesh(const Communicator& world, MeshLayout layout)
    : layout_(std::move(layout)), world_rank_(world.rank()) {
  if (world.size() != layout_.world_size())
    throw ConfigError(fmt::format("mesh is laid out for {} ranks but the communicator has {}", layout_.world_size(),
                                  world.size()));
  // pp last: until pipeline stages exist its group is every rank's own, named after the first size-1 dimension
  // as before it was added.
  std::vector<MeshDim> names;
  for (auto& d : layout_.dims())
    if (d.dim != MeshDim::pp) names.push_back(d.dim);
  for (auto f : MeshLayout::flattened_names()) names.push_back(f);
  for (auto& d : layout_.dims())
    if (d.dim == MeshDim::pp) names.push_back(d.dim);
  // Same rank set, same communicator: e.g. "dp" is "dp_shard" when dp_replicate is 1.
  std::map<std::vector<int>, Communicator> by_ranks;
  for (const auto name : names) {
    auto ranks = layout_.group_ranks(world_rank_, name);
    auto found = by_ranks.find(ranks);
    if (found == by_ranks.end()) {
      // A group of everyone is the world (no second set of buffers; its collectives keep one program
      // order, so never issue on two such names from different threads). A group of one needs no network,
      // but the world's device backend.
      const std::string label = to_string(name);
      Communicator group = static_cast<int>(ranks.size()) == world.size() ? world
                           : ranks.size() == 1
                               ? distributed::make_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                                           world.name() + "/" + label, "127.0.0.1", world.timeout(),
                                                           world.backend() == "nccl", false)
                               : world.new_group(ranks, label);
      found = by_ranks.emplace(ranks, group).first;
    }
    groups_[name] = found->second;
  }
}

Communicator& DeviceMesh::group(MeshDim name) {
  auto it = groups_.find(name);
  if (it == groups_.end()) layout_.resolve(name);  // throws with the known names
  if (it == groups_.end()) throw Error(fmt::format("mesh has no group {}", to_string(name)));
  return it->second;
}

}  // namespace xlr8
