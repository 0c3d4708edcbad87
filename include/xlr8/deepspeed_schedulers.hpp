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
#include <vector>

#include "xlr8/deepspeed_config.hpp"

namespace xlr8::deepspeed {

struct WarmupOptions {
  double warmup_min_lr = 0.0;
  std::optional<double> warmup_max_lr;  // WarmupLR: the optimizer's lr when unset; WarmupDecayLR: 0.001
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

// The scheduler a config's "scheduler" section describes (WarmupLR, WarmupDecayLR, WarmupCosineLR), over
// `optimizer`; a ConfigError names a missing or unknown parameter, or a type xlr8 does not build.
std::shared_ptr<torch::optim::LRScheduler> make_scheduler(const TypedSection& section, torch::optim::Optimizer& optimizer);

}  // namespace xlr8::deepspeed
