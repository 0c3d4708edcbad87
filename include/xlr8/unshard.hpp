#pragma once
// The one change a model needs for stage-3 sharding (ZeRO-3 / FSDP FULL_SHARD). LibTorch modules have no
// forward hooks, so a sharded unit says where its forward begins and ends:
//
//   torch::Tensor BlockImpl::forward(torch::Tensor x) {
//     auto unit = xlr8::unshard(*this);   // gathers this unit's parameters (a no-op when not sharded)
//     x = x + attn(ln1(x));
//     return unit.done(x + mlp(ln2(x)));  // frees them again, and gathers them for the backward pass
//   }
//
// `done` marks the output so that the backward pass gathers the parameters again just before it reaches
// this unit; they are freed once their gradients are reduced. Put the same two lines in the model's own
// forward so that the parameters no unit owns (embeddings, final norm) are sharded too; a module that
// never opens a guard keeps its parameters whole on every rank, which is always correct. Without
// sharding, or for a module that is not a unit, both calls do nothing.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>

namespace xlr8 {

namespace detail {
class ShardedUnit;
}

class [[nodiscard]] UnshardScope {
 public:
  UnshardScope() = default;
  explicit UnshardScope(std::shared_ptr<detail::ShardedUnit> unit);
  UnshardScope(UnshardScope&& other) noexcept;
  UnshardScope& operator=(UnshardScope&&) = delete;
  UnshardScope(const UnshardScope&) = delete;
  UnshardScope& operator=(const UnshardScope&) = delete;
  // Without done() (an exception left the forward), the parameters are freed again.
  ~UnshardScope();
  // The unit's output, returned through this: frees the gathered parameters (except the root's, whose
  // backward comes first) and arms their gathering for backward.
  at::Tensor done(const at::Tensor& output);

 private:
  std::shared_ptr<detail::ShardedUnit> unit_;
};

// Gathers `unit`'s parameters when it is a stage-3 unit of a prepared model.
UnshardScope unshard(const torch::nn::Module& unit);

}  // namespace xlr8
