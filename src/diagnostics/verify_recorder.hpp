#pragma once
// `xlr8 verify`'s recorder in the workers. tools/cli/cmd_verify.cpp runs the program with XLR8_VERIFY_DIR and
// XLR8_VERIFY_STEPS=K; then, per optimizer step, the loss given to backward() (the mean of the accumulated
// micro-steps, averaged over the ranks as over the global batch) and the global gradient norm (before the
// program's clipping: what its clip_grad_norm returned), and after step
// K the whole parameters (gathered from shards); at prepare, what could make N ranks differ from one process
// (parameters that differ across ranks before the strategy syncs them, dropout, BatchNorm). Rank 0 writes
// <dir>/record.json after every step and <dir>/model_<i>/ at step K; every rank then writes <dir>/done.<rank>,
// and the tool stops the job.
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "step/step_observer.hpp"

namespace xlr8::diagnostics {

class VerifyRecorder final : public step::StepObserver {
 public:
  // nullptr unless XLR8_VERIFY_DIR is set.
  static std::unique_ptr<VerifyRecorder> from_env();
  // XLR8_VERIFY_MICRO_SPLIT=N, verify's third run: one process that repeats N ranks' arithmetic, their shares of
  // each global batch as N micro-batches accumulated into one step (Accelerator::sharding, the accumulation).
  int micro_split() const { return micro_split_; }
  // Parameters that differ across ranks before the strategy syncs them (unless only the main process built the
  // values), dropout, BatchNorm.
  void on_prepare(const step::TrainingView& training, torch::nn::Module& module, bool values_everywhere) override;
  void on_backward(const at::Tensor& loss) override;
  // The program clipped: what clip_grad_norm returned (the norm before clipping) is this step's.
  void on_clip_grad_norm(const GradNorm& norm) override { clipped_from_ = norm.value(); }
  void before_update(const step::TrainingView& training, const std::vector<at::Tensor>& parameters, ParallelStrategy* owner) override;
  // The record, and at step K the parameters (collective).
  void after_update(const step::TrainingView& training, int64_t step) override;

 private:
  std::string dir_;
  int64_t steps_ = 5;
  double pending_loss_ = 0;
  int pending_micro_ = 0;
  double grad_norm_ = 0, loss_ = 0;
  std::optional<double> clipped_from_;
  int64_t short_batch_ = 0;  // the step ended an epoch whose last global batch (this many samples) the ranks share unevenly
  int models_ = 0;
  nlohmann::json record_;
  int micro_split_ = 1;
  int micro_steps_ = 0;  // backward() calls of the step (on N ranks, of this rank)
  // One process only: each parameter's largest |gradient| per element over the steps, by the name the
  // parameters are saved under ("model <i>: " before the names of a second model): elements whose gradient is
  // only rounding are not compared (cmd_verify.cpp).
  std::map<std::string, at::Tensor> grad_max_;
};

}  // namespace xlr8::diagnostics
