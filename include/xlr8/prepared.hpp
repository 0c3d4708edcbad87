#pragma once
// What Accelerator::prepare returns for optimizers and schedulers, and the scopes of one step: a micro-step
// (accumulate, no_sync, micro_step) and FSDP's summon_full_params.
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <memory>
#include <vector>

#include "xlr8/autocast.hpp"
#include "xlr8/parallel_strategy.hpp"

namespace xlr8 {

struct AcceleratorImpl;

// step() and zero_grad() act only on sync steps. With fp16 the step unscales the gradients, checks them
// for inf/NaN on every rank, and is skipped (and reported) on overflow.
class PreparedOptimizer {
 public:
  struct State;
  PreparedOptimizer() = default;
  explicit PreparedOptimizer(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void step();
  void zero_grad(bool set_to_none = true);  // as PyTorch 2.x: .grad becomes undefined, or zeros in place
  torch::optim::Optimizer& optimizer();
  bool step_was_skipped() const;  // the last sync step was skipped for fp16 overflow
  int64_t steps_taken() const;
  torch::optim::Optimizer* operator->() { return &optimizer(); }

 private:
  std::shared_ptr<State> state_;
};

// Advances once per optimizer step that really happened.
class PreparedScheduler {
 public:
  struct State;
  PreparedScheduler() = default;
  explicit PreparedScheduler(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void step();
  torch::optim::LRScheduler& scheduler();
  int64_t steps_taken() const;

 private:
  std::shared_ptr<State> state_;
};

// The body of one micro-step (Accelerate's `with accelerator.accumulate(model)`): decides whether this
// step syncs gradients, tells the models' strategies, and runs the forward under autocast.
class StepScope {
 public:
  // `suspend_sync`: no_sync() (or micro_step's sync false); otherwise the GradientState's decision applies.
  StepScope(AcceleratorImpl* impl, std::vector<ParallelStrategy*> models, bool suspend_sync, AutocastScope autocast);
  StepScope(StepScope&&) noexcept;
  StepScope(const StepScope&) = delete;
  ~StepScope();
  bool sync_gradients() const;

 private:
  AcceleratorImpl* impl_;
  std::vector<ParallelStrategy*> models_;
  bool suspend_sync_;
  AutocastScope autocast_;
  bool active_ = true;
};

// FSDP's summon_full_params: while it lives, a sharded model's parameters are whole and current on
// every rank (a no-op for replicas). With `writeback`, changes made to them are kept.
class FullParametersScope {
 public:
  FullParametersScope(ParallelStrategy* strategy, bool writeback);
  FullParametersScope(FullParametersScope&& other) noexcept;
  FullParametersScope(const FullParametersScope&) = delete;
  ~FullParametersScope();

 private:
  ParallelStrategy* strategy_;
  bool writeback_;
};

}  // namespace xlr8
