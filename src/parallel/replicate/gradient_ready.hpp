#pragma once
// The hook DDP and the sharded model share: a post-hook on a parameter's AccumulateGrad node, which runs
// once `.grad` holds this backward's sum for it.
#include <functional>
#include <memory>
#include <vector>

#include "compat/torch_compat.hpp"

namespace xlr8::replicate {

class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> ready) : ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ready_();
    return outputs;
  }

 private:
  std::function<void()> ready_;
};

// Calls ready(k) whenever parameter k's gradient is accumulated. The hooks fire only while the returned
// accumulators live: keep them as long as the hooks are wanted.
inline std::vector<compat::GradAccumulatorPtr> on_gradient_ready(const std::vector<at::Tensor>& params,
                                                                 const std::function<void(size_t)>& ready) {
  std::vector<compat::GradAccumulatorPtr> accumulators;
  for (size_t k = 0; k < params.size(); ++k) {
    auto acc = compat::grad_accumulator(params[k]);
    acc->add_post_hook(std::make_unique<GradientReadyHook>([ready, k] { ready(k); }));
    accumulators.push_back(acc);
  }
  return accumulators;
}

}  // namespace xlr8::replicate
