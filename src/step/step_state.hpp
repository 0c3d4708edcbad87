#pragma once
// Where a training step is, as FSDP2's TrainingState: backward fills the gradients, a sync step's first
// unscale (fp16: divided by the scale, overflow agreed over the world) readies them, and each prepared
// optimizer then applies or skips them. Every transition says which phases it may come from; a call out of
// order is an Error naming both (an xlr8 bug: the public calls cannot produce one). A backward may start a
// new step from any phase, as PyTorch's: a program that zeroes overflowed gradients and goes on without a
// step is legal. Observers see each transition (StepObserver::on_phase): where a pipeline schedule or fp8's
// scale update joins the step.
#include <string>

namespace xlr8::step {

enum class StepPhase {
  idle,        // no gradients of this step yet: built, after free_memory
  gradients,   // backward ran: gradients hold loss / accumulation steps, times the fp16 scale
  unscaled,    // a sync step's gradients are ready (divided by the scale), finite on every rank
  overflowed,  // ... inf/NaN on some rank: every optimizer skips this step
  updated,     // an optimizer applied them (another optimizer of the same step may still)
  skipped,     // an optimizer skipped the step on the overflow
};

const char* to_string(StepPhase phase);

class StepState {
 public:
  StepPhase phase() const { return phase_; }
  // The gradients of this step were unscaled (and the overflow agreed): unscaled, overflowed, updated, skipped.
  bool ready() const;
  // Some rank found inf/NaN in this step's gradients: overflowed or skipped.
  bool overflow() const { return phase_ == StepPhase::overflowed || phase_ == StepPhase::skipped; }
  // Moves to `next` (Error naming `caller` and both phases when `next` may not follow it); returns the phase
  // it left.
  StepPhase enter(StepPhase next, const char* caller);

  // Whether `next` may follow `from`; the one table of the step's order.
  static bool allowed(StepPhase from, StepPhase next);

 private:
  StepPhase phase_ = StepPhase::idle;
};

}  // namespace xlr8::step
