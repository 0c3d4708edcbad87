#include "step/step_state.hpp"

#include <fmt/format.h>

#include "xlr8/error.hpp"

namespace xlr8::step {

const char* to_string(StepPhase phase) {
  switch (phase) {
    case StepPhase::idle: return "idle";
    case StepPhase::gradients: return "gradients";
    case StepPhase::unscaled: return "unscaled";
    case StepPhase::overflowed: return "overflowed";
    case StepPhase::updated: return "updated";
    case StepPhase::skipped: return "skipped";
  }
  return "?";
}

bool StepState::ready() const {
  return phase_ == StepPhase::unscaled || phase_ == StepPhase::overflowed || phase_ == StepPhase::updated ||
         phase_ == StepPhase::skipped;
}

bool StepState::allowed(StepPhase from, StepPhase next, bool scaled) {
  using enum StepPhase;
  switch (next) {
    case idle: return true;
    // A backward starts or continues a step; over gradients already divided by the fp16 scale it would add
    // new ones at the scale.
    case gradients: return !scaled || (from != unscaled && from != overflowed);
    case unscaled:
    case overflowed: return from == idle || from == gradients;
    case updated: return from == unscaled || from == updated;  // several optimizers share one step
    case skipped: return from == overflowed || from == skipped;
  }
  return false;
}

StepPhase StepState::enter(StepPhase next, const char* caller) {
  if (!allowed(phase_, next, scaled_)) {
    if (next == StepPhase::gradients)
      throw Error(fmt::format("{}: this step's gradients were already unscaled (by clip_grad_norm, clip_grad_value or "
                              "optimizer.step()), so under fp16 the new ones would be added at another scale; call "
                              "every prepared optimizer's step() and zero_grad() before the next backward",
                              caller));
    throw Error(fmt::format("{}: the training step is {}, which {} cannot follow (an xlr8 bug)", caller,
                            to_string(phase_), to_string(next)));
  }
  const auto from = phase_;
  phase_ = next;
  return from;
}

}  // namespace xlr8::step
