#pragma once
// DeepSpeed's DynamicLossScaler state machine, exactly (deepspeed/runtime/fp16/loss_scaler.py): initial 2^16, window
// 1000, hysteresis 2, min scale 1. An overflow skips the step; the scale halves once hysteresis is used
// up (it is not refilled by a decrease); a full clean window doubles it and refills hysteresis. With a
// static scale every step is checked too (an overflow still skips it), and the scale stays.
// deepspeed::loss_scaler_options builds the options from a DeepSpeed config's fp16 section.
#include <nlohmann/json.hpp>

namespace xlr8 {

struct LossScalerOptions {
  double initial_scale_power = 16;
  int scale_window = 1000;
  int hysteresis = 2;
  double min_scale = 1;
  bool consecutive_hysteresis = false;
  bool raise_error_at_min_scale = true;
  double static_scale = 0;  // > 0: DeepSpeed's static LossScaler (fp16.loss_scale): the scale never changes
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions options = {});
  double scale() const { return scale_; }
  // Call once per optimizer step with whether any gradient (on any rank) was inf/NaN.
  // Throws xlr8::Error when an overflow happens at the minimum scale and raising is enabled.
  void update(bool overflow);
  int64_t iteration() const { return iteration_; }
  int hysteresis_left() const { return hysteresis_; }
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int hysteresis_;
  int64_t iteration_ = 0;
  int64_t last_overflow_iteration_ = -1;
};

}  // namespace xlr8
