#pragma once
// `xlr8 advise`'s recorder in the workers. tools/cli/cmd_advise.cpp runs the program under each candidate
// strategy with XLR8_ADVISE_DIR, XLR8_ADVISE_WARMUP=W, XLR8_ADVISE_STEPS=T and XLR8_ADVISE_MIN_SECONDS=S: after
// optimizer step W the clock starts; after step W + T, and once rank 0's clock says S seconds passed (one
// flag all-reduced per step, so every rank stops at the same step), rank 0 writes <dir>/result.json (seconds, samples per step, the parameters,
// the largest static bytes of a rank: unique storages of parameters, gradients and optimizer state, and
// the largest peak RSS) and every rank writes <dir>/done.<rank>. With T = 0 (a probe) the parameter count is
// written at the first prepare() and the ranks are done at once.
#include <chrono>
#include <memory>
#include <string>

namespace torch::nn {
class Module;
}

namespace xlr8 {
struct AcceleratorImpl;

namespace detail {

class AdviseRecorder {
 public:
  static std::unique_ptr<AdviseRecorder> from_env();  // nullptr unless XLR8_ADVISE_DIR is set
  void on_prepare(AcceleratorImpl& impl, torch::nn::Module& module);  // before the strategy shards it
  void after_step(AcceleratorImpl& impl, int64_t step);               // collective at W + T

 private:
  void finish(AcceleratorImpl& impl, const std::string& file, const std::string& text);
  std::string dir_;
  int64_t warmup_ = 2, steps_ = 3;
  double min_seconds_ = 0;  // the timed steps go on until this much time has passed (rank 0's clock)
  double parameters_ = 0;
  std::chrono::steady_clock::time_point started_;
  bool measured_ = false;
};

}  // namespace detail
}  // namespace xlr8
