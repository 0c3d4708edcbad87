#pragma once
// Placeholders for an optimizer and a scheduler that a DeepSpeed JSON config defines, as Accelerate's
// DummyOptim and DummyScheduler: under `xlr8 launch --use_deepspeed --deepspeed_config_file ds.json`, a
// program whose JSON has an "optimizer" (or "scheduler") section prepares one of these instead of its own,
// and Accelerator::prepare builds the JSON's, filling its "auto" values from the placeholder:
//
//   auto* ds = acc.deepspeed_config();
//   auto opt = ds && ds->contains("optimizer")
//                  ? acc.prepare(xlr8::DummyOptim(model->parameters(), lr, weight_decay))
//                  : acc.prepare(torch::optim::AdamW(model->parameters(), lr));
//   if (ds && ds->contains("scheduler"))
//     acc.prepare(xlr8::DummyScheduler(opt.optimizer(), total_steps, warmup_steps));
//
// optimizer.params.lr / weight_decay take the DummyOptim's; scheduler.params.warmup_min_lr takes 0,
// warmup_max_lr the optimizer's lr, warmup_num_steps and total_num_steps the DummyScheduler's (the totals as
// given: unlike Accelerate's, they are not divided by the number of processes; README, DeepSpeed). Neither can
// step itself.
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <optional>
#include <vector>

namespace xlr8 {

class DummyOptim : public torch::optim::Optimizer {
 public:
  explicit DummyOptim(const std::vector<at::Tensor>& parameters, double lr = 1e-3, double weight_decay = 0.0);
  at::Tensor step(LossClosure closure = nullptr) override;  // an Error: prepare it under a DeepSpeed config
  double lr() const { return lr_; }
  double weight_decay() const { return weight_decay_; }

 private:
  double lr_, weight_decay_;
};

class DummyScheduler : public torch::optim::LRScheduler {
 public:
  // `optimizer`: the DummyOptim (or the optimizer prepare() returned for it).
  DummyScheduler(torch::optim::Optimizer& optimizer, std::optional<int64_t> total_num_steps = std::nullopt,
                 int64_t warmup_num_steps = 0);
  std::optional<int64_t> total_num_steps() const { return total_num_steps_; }
  int64_t warmup_num_steps() const { return warmup_num_steps_; }
  torch::optim::Optimizer& optimizer() { return optimizer_of_; }

 protected:
  std::vector<double> get_lrs() override;  // an Error: prepare it under a DeepSpeed config

 private:
  torch::optim::Optimizer& optimizer_of_;
  std::optional<int64_t> total_num_steps_;
  int64_t warmup_num_steps_;
};

}  // namespace xlr8
