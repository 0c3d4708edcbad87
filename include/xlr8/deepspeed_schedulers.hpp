#pragma once
// DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py) as LibTorch schedulers, with
// DeepSpeed's formulas and quirks: the learning rate is set at construction (WarmupLR / WarmupDecayLR:
// warmup_min_lr; WarmupCosineLR: 0), each step() moves to the next batch iteration, warm-up is "log"
// (log(i + 1) / log(W)) unless warmup_type is "linear" (i / W), and W is at least 2.
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/deepspeed_config.hpp"

namespace xlr8::deepspeed {

// One value for every parameter group, or one per group (DeepSpeed's list form: "warmup_max_lr": [1e-3, 1e-4]).
class PerGroup {
 public:
  PerGroup(double value) : values_{value} {}  // NOLINT(google-explicit-constructor): a scalar, as in the JSON
  PerGroup(std::vector<double> values) : values_(std::move(values)), listed_(true) {}  // NOLINT: a list, likewise
  // The value of each of `groups` groups; a list of another length is a ConfigError naming `key`.
  std::vector<double> for_groups(size_t groups, const std::string& key) const;

 private:
  std::vector<double> values_;
  bool listed_ = false;
};

struct WarmupOptions {
  PerGroup warmup_min_lr = 0.0;
  std::optional<PerGroup> warmup_max_lr;  // WarmupLR: each group's own lr when unset; WarmupDecayLR: 0.001
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // log | linear
};

// From warmup_min_lr to warmup_max_lr over warmup_num_steps, then constant.
class WarmupLR : public torch::optim::LRScheduler {
 public:
  WarmupLR(torch::optim::Optimizer& optimizer, WarmupOptions options);

 protected:
  std::vector<double> get_lrs() override;
  virtual double gamma(int64_t iteration) const;  // the fraction of the way from min to max
  double warmup_gamma(int64_t iteration) const;

  int64_t warmup_num_steps_;
  std::string warmup_type_;
  std::vector<double> min_lrs_, delta_lrs_;
};

// WarmupLR, then linear decay to 0 at total_num_steps.
class WarmupDecayLR : public WarmupLR {
 public:
  WarmupDecayLR(torch::optim::Optimizer& optimizer, int64_t total_num_steps, WarmupOptions options);

 protected:
  double gamma(int64_t iteration) const override;

 private:
  int64_t total_num_steps_;
};

// A ratio of each group's initial lr: warmup_min_ratio to 1 over warmup_num_steps, then a cosine to
// cos_min_ratio at total_num_steps (held there after).
class WarmupCosineLR : public torch::optim::LRScheduler {
 public:
  WarmupCosineLR(torch::optim::Optimizer& optimizer, int64_t total_num_steps, double warmup_min_ratio = 0.0,
                 int64_t warmup_num_steps = 1000, double cos_min_ratio = 0.0001, std::string warmup_type = "log");

 protected:
  std::vector<double> get_lrs() override;

 private:
  double ratio(int64_t iteration) const;
  int64_t total_num_steps_, warmup_num_steps_;
  double warmup_min_ratio_, cos_min_ratio_;
  std::string warmup_type_;
  std::vector<double> initial_lrs_;
};

// DeepSpeed's 1Cycle: the lr rises from cycle_min_lr to cycle_max_lr over cycle_first_step_size steps and
// falls back over cycle_second_step_size (default: the first), in stairs when a stair count is given; after
// the cycle it decays as cycle_min_lr / (1 + decay_lr_rate * steps_since / decay_step_size) (no decay when
// either is 0). With cycle_momentum, Adam's beta1 moves the opposite way between cycle_min_mom and
// cycle_max_mom and beta2 becomes 0.99 (DeepSpeed's quirk); optimizers without betas (SGD) keep theirs,
// with a warning.
struct OneCycleOptions {
  PerGroup cycle_min_lr = 0.0, cycle_max_lr = 0.0;
  double decay_lr_rate = 0;
  int64_t cycle_first_step_size = 2000;
  std::optional<int64_t> cycle_second_step_size;
  int64_t cycle_first_stair_count = 0;
  std::optional<int64_t> cycle_second_stair_count;
  int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  PerGroup cycle_min_mom = 0.8, cycle_max_mom = 0.9;
  double decay_mom_rate = 0;
};

class OneCycle : public torch::optim::LRScheduler {
 public:
  OneCycle(torch::optim::Optimizer& optimizer, OneCycleOptions options);

 protected:
  std::vector<double> get_lrs() override;  // also sets beta1 when momentum cycles

 private:
  double scale_factor(int64_t iteration) const;
  void set_beta1(const std::vector<double>& beta1);
  torch::optim::Optimizer& optimizer_;
  OneCycleOptions o_;
  std::vector<double> min_lrs_, max_lrs_, min_moms_, max_moms_;
  double first_, second_, total_, ratio_;
  int64_t first_stairs_, second_stairs_;
  bool cycle_momentum_;
};

// DeepSpeed's LR range test: lr = min_lr * (1 + step_rate * interval), interval = (i + 1) / step_size
// (floored with staircase).
class LRRangeTest : public torch::optim::LRScheduler {
 public:
  LRRangeTest(torch::optim::Optimizer& optimizer, const PerGroup& min_lr = 1e-3, int64_t step_size = 2000,
              double step_rate = 1.0, bool staircase = false);

 protected:
  std::vector<double> get_lrs() override;

 private:
  std::vector<double> min_lrs_;
  double step_rate_;
  int64_t step_size_;
  bool staircase_;
};

// The scheduler a config's "scheduler" section describes (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
// LRRangeTest), over
// `optimizer`; a ConfigError names a missing or unknown parameter, or a type xlr8 does not build.
std::shared_ptr<torch::optim::LRScheduler> make_scheduler(const TypedSection& section, torch::optim::Optimizer& optimizer);

}  // namespace xlr8::deepspeed
