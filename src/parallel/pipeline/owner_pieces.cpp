// A tied parameter held as pieces by an owner stage's ranks (owner_pieces.hpp).
#include "parallel/pipeline/owner_pieces.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "xlr8/error.hpp"

namespace xlr8::pp {

namespace {

// `chunk` (the placement's elements, 1-D) written where they lie in `whole` (of the placement's whole shape).
void put(const Placement& placement, const at::Tensor& chunk, at::Tensor& whole) {
  for (const auto& span : placement.spans()) {
    auto region = whole;
    for (size_t d = 0; d < span.box.offsets.size(); ++d)
      region = region.narrow(static_cast<int64_t>(d), span.box.offsets[d], span.box.sizes[d]);
    auto box = region.contiguous();  // the box flattened, its span overwritten, then back in place
    box.view(-1).narrow(0, span.begin, span.count).copy_(chunk.narrow(0, span.at, span.count));
    region.copy_(box);
  }
}

}  // namespace

OwnerPieces::OwnerPieces(const ParallelStrategy& strategy, Communicator data_parallel, Communicator tensor_parallel,
                         at::Device device)
    : data_parallel_(std::move(data_parallel)),
      tensor_parallel_(std::move(tensor_parallel)),
      device_(device),
      replicated_(strategy.replicated()) {
  for (auto& p : strategy.parameter_pieces()) {
    const auto name = p.name;
    pieces_.emplace(name, std::move(p));
  }
}

const ParameterPiece& OwnerPieces::piece(const std::string& name) const {
  const auto it = pieces_.find(name);
  if (it == pieces_.end()) throw Error(fmt::format("pipeline: the stage holds no parameter {:?} of a tied layer", name));
  return it->second;
}

at::Tensor OwnerPieces::whole(const std::string& name) const {
  at::NoGradGuard no_grad;
  const auto& p = piece(name);
  auto whole = at::zeros(p.placement.whole(), p.values.options().device(device_).requires_grad(false));
  // Each element once over the stage: a replica's from dp rank 0, a shard's from its writer (HSDP's first replica),
  // and a tensor tp does not split (a row-wise layer's bias) from tp rank 0.
  const bool contributes = (replicated_ ? data_parallel_.rank() == 0 : p.writes) &&
                           (!p.placement.unsplit() || tensor_parallel_.rank() == 0);
  if (contributes && p.placement.count() > 0) put(p.placement, p.values.detach().reshape(-1).to(device_), whole);
  if (data_parallel_.size() > 1) data_parallel_.all_reduce(whole, ReduceOp::SUM);
  if (tensor_parallel_.size() > 1) tensor_parallel_.all_reduce(whole, ReduceOp::SUM);
  return whole;
}

at::Tensor OwnerPieces::empty_whole(const std::string& name) const {
  const auto& p = piece(name);
  return at::empty(p.placement.whole(), p.values.options().device(device_).requires_grad(false));
}

void OwnerPieces::add_gradient(const std::string& name, const at::Tensor& whole_grad) const {
  at::NoGradGuard no_grad;
  const auto& p = piece(name);
  if (p.placement.count() == 0) return;
  auto part = p.placement.take(whole_grad).to(p.values.device(), p.values.scalar_type()).view(p.values.sizes());
  auto& grad = p.values.mutable_grad();
  if (grad.defined()) grad.add_(part);
  else grad = part.clone();
}

std::string OwnerPieces::describe(const std::string& name) const {
  const auto& p = piece(name);
  return fmt::format("{}[{}]", c10::toString(p.values.scalar_type()), fmt::join(p.placement.whole(), ","));
}

}  // namespace xlr8::pp
