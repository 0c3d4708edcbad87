#pragma once
// What happens in a training step, for whoever watches it: xlr8 verify's and advise's recorders today, a pipeline
// schedule or fp8's scale update next. The Accelerator tells its subscribed observers, in subscription order; the
// step's own logic (sync gating, unscaling, clipping, the strategy's update) knows none of them.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include <vector>

#include "step/step_state.hpp"
#include "xlr8/grad_norm.hpp"

namespace torch::nn {
class Module;
}

namespace xlr8 {
class ParallelStrategy;

namespace step {
struct TrainingView;  // step/training_view.hpp

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // A model as prepare() has it after its tensor-parallel split, before its strategy syncs or shards it
  // (collective). `values_everywhere` false: only the main process holds its values (rank-0 loading).
  virtual void on_prepare(const TrainingView& training, torch::nn::Module& module, bool values_everywhere) {}
  virtual void on_backward(const at::Tensor& loss) {}  // the loss backward() was given, before scaling
  virtual void on_clip_grad_norm(const GradNorm& norm) {}        // a sync step's clip_grad_norm: the norm before clipping
  virtual void optimizer_step_begins() {}               // any prepared optimizer's step() on a sync step
  virtual void optimizer_step_ends() {}                 // ... once it is applied or skipped
  // The first prepared optimizer's step updates: gradients synchronised and unscaled, not applied yet (collective).
  virtual void before_update(const TrainingView& training, const std::vector<at::Tensor>& parameters,
                             ParallelStrategy* owner) {}
  virtual void after_update(const TrainingView& training, int64_t step) {}  // ... and once applied: optimizer step `step`
  virtual void on_phase(StepPhase from, StepPhase to) {}  // every transition of the step (step_state.hpp), once made
};

}  // namespace step
}  // namespace xlr8
