#include "parallel/replicate/replica_sync.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/tensor_text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::replicate {
namespace {

void verify_same_model(Communicator& comm, const std::vector<std::string>& mine) {
  auto all = comm.all_gather_object(nlohmann::json(mine).dump());
  auto reference = nlohmann::json::parse(all[0]).get<std::vector<std::string>>();
  for (int r = 1; r < comm.size(); ++r) {
    auto theirs = nlohmann::json::parse(all[r]).get<std::vector<std::string>>();
    for (size_t i = 0; i < std::max(reference.size(), theirs.size()); ++i) {
      std::string a = i < reference.size() ? reference[i] : "(nothing)";
      std::string b = i < theirs.size() ? theirs[i] : "(nothing)";
      if (a != b)
        throw Error(fmt::format("the model differs across ranks: entry {} is {} on rank 0 but {} on rank {}. Every "
                                "rank must build the same model",
                                i, a, b, r));
    }
  }
}

}  // namespace

void make_replicas_equal(Communicator& comm, const torch::nn::Module& module, bool parameters) {
  std::vector<std::string> signatures;
  std::vector<at::Tensor> tensors;
  for (const auto& item : module.named_parameters()) {
    // Frozen or not decides how sharding groups a parameter: every rank must agree.
    signatures.push_back(fmt::format("{} {}{}", item.key(), core::describe(item.value()),
                                     item.value().requires_grad() ? "" : " (frozen)"));
    if (parameters) tensors.push_back(item.value());
  }
  for (const auto& item : module.named_buffers()) {
    signatures.push_back(fmt::format("buffer {} {}", item.key(), core::describe(item.value())));
    tensors.push_back(item.value());
  }
  if (comm.size() == 1) return;
  verify_same_model(comm, signatures);
  broadcast_from_rank0(comm, tensors);
}

Error unused_parameters_error(int rank, const std::vector<std::string>& names, const std::string& reduction) {
  return Error(fmt::format("rank {}: parameter{} {} received no gradient in this backward pass, so the gradient {} "
                           "cannot complete. Use every parameter in forward, set requires_grad(false) on it, or set "
                           "find_unused_parameters = true",
                           rank, names.size() == 1 ? "" : "s", fmt::join(names, ", "), reduction));
}

void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  // Small tensors travel packed, one broadcast per ~4 MB of one dtype; a contiguous tensor of 1 MB or more
  // is broadcast in place. The packing copy is the only transient, and it stays small: at start-up every
  // rank already holds the model (a 64 MB packing cost as much as the slices of a tensor-parallel model).
  constexpr int64_t kChunkBytes = 4 << 20, kInPlaceBytes = 1 << 20;
  std::map<at::ScalarType, std::vector<at::Tensor>> pending;
  std::map<at::ScalarType, int64_t> pending_bytes;
  auto flush = [&](at::ScalarType type) {
    auto& group = pending[type];
    if (group.empty()) return;
    std::vector<at::Tensor> flat_parts;
    for (auto& t : group) flat_parts.push_back(t.detach().reshape(-1));
    auto flat = at::cat(flat_parts);
    comm.broadcast(flat, 0);
    int64_t offset = 0;
    for (auto& t : group) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
    group.clear();
    pending_bytes[type] = 0;
  };
  for (const auto& t : tensors) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (bytes >= kInPlaceBytes && t.is_contiguous()) {
      auto in_place = t.detach();
      comm.broadcast(in_place, 0);
      continue;
    }
    pending[t.scalar_type()].push_back(t);
    if ((pending_bytes[t.scalar_type()] += bytes) >= kChunkBytes) flush(t.scalar_type());
  }
  for (auto& [type, group] : pending) flush(type);
}

}  // namespace xlr8::replicate
