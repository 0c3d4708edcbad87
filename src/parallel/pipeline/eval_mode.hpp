#pragma once
// Eval mode (dropout off) for a scope, as DeepSpeed's eval_batch runs; after it every module has its own mode back
// (a BatchNorm the user keeps in eval stays so; train(bool) alone would set the whole tree alike).
#include <torch/nn/module.h>

#include <memory>
#include <utility>
#include <vector>

namespace xlr8::pp {

class EvalModeScope {
 public:
  explicit EvalModeScope(torch::nn::Module& root) {
    for (const auto& module : root.modules(/*include_self=*/true)) modes_.emplace_back(module, module->is_training());
    root.eval();
  }
  // In module order, parents first: each train() call sets its subtree, and a later one (a descendant) its own.
  ~EvalModeScope() {
    for (const auto& [module, training] : modes_) module->train(training);
  }
  EvalModeScope(const EvalModeScope&) = delete;
  EvalModeScope& operator=(const EvalModeScope&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> modes_;
};

}  // namespace xlr8::pp
