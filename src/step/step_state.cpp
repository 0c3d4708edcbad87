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

bool StepState::allowed(StepPhase from, StepPhase next) {
  using enum StepPhase;
  switch (next) {
    case idle: return true;
    case gradients: return true;  // a backward starts or continues a step, whatever came before
    case unscaled:
    case overflowed: return from == idle || from == gradients;
    case updated: return from == unscaled || from == updated;  // several optimizers share one step
    case skipped: return from == overflowed || from == skipped;
  }
  return false;
}

StepPhase StepState::enter(StepPhase next, const char* caller) {
  if (!allowed(phase_, next))
    throw Error(fmt::format("{}: the training step is {}, which {} cannot follow (an xlr8 bug)", caller,
                            to_string(phase_), to_string(next)));
  const auto from = phase_;
  phase_ = next;
  return from;
}

}  // namespace xlr8::step
