#pragma once
// `xlr8 advise`'s recorder in the workers. tools/cli/cmd_advise.cpp runs the program under each candidate
// strategy with XLR8_ADVISE_DIR, XLR8_ADVISE_WARMUP=W, XLR8_ADVISE_STEPS=T, XLR8_ADVISE_MIN_SECONDS=S and
// XLR8_ADVISE_CUT_BELOW=C. Rank 0 writes <dir>/probe.json (the parameter count) at the first prepare(). After
// optimizer step W the clock starts; after each later step one flag is all-reduced (rank 0's clock decides for
// all, so every rank stops at the same step): stop once W + T steps and S seconds passed, or early once the
// throughput so far is below C (samples/s; the candidate cannot win). Then rank 0 writes <dir>/result.json
// (seconds, steps, samples per step, whether it was cut, the largest static bytes of a rank: unique storages of
// parameters, gradients and optimizer state, the largest peak of tensor bytes over the timed steps: the static
// bytes when they started plus the most the memory meter counted above that moment, and the largest peak RSS)
// and every rank writes <dir>/done.<rank>. It also writes compute_seconds: the timed window less every optimizer
// step and every wait for a collective outside them (the smallest over the ranks): the forward and backward
// arithmetic that another strategy of the same precision and mesh must do as well. Waits are counted on every
// thread, so one on a background thread that overlapped arithmetic makes it smaller: the bound looser.
// With T = 0 (a probe) the ranks are done at prepare().
#include <chrono>
#include <memory>
#include <string>

#include "step/step_observer.hpp"

namespace xlr8::diagnostics {

class AdviseRecorder final : public step::StepObserver {
 public:
  static std::unique_ptr<AdviseRecorder> from_env();  // nullptr unless XLR8_ADVISE_DIR is set
  void on_prepare(const step::TrainingView& training, torch::nn::Module& module, bool values_everywhere) override;
  void optimizer_step_begins() override;
  void optimizer_step_ends() override;
  void after_update(const step::TrainingView& training, int64_t step) override;  // collective at W + T

 private:
  void finish(const step::TrainingView& training, const std::string& file, const std::string& text);
  // Agrees on rank 0's verdict (2: measured, 1: cut, 0: go on); on 1 or 2 writes the result and waits to be stopped.
  void conclude(const step::TrainingView& training, double verdict, int64_t timed, double seconds, double compute_seconds);
  void start_window(const step::TrainingView& training);  // the clock and the memory peak start here
  std::string dir_;
  int64_t warmup_ = 2, steps_ = 3;
  double min_seconds_ = 0;  // the timed steps go on until this much time has passed (rank 0's clock)
  double cut_below_ = 0;    // samples/s (steps/s without a prepared loader): stop early under it
  double parameters_ = 0;
  std::chrono::steady_clock::time_point started_;
  bool measured_ = false, probed_ = false;
  double state_at_start_ = 0;  // static bytes when the clock started
  int64_t live_at_start_ = 0;  // the memory meter's live bytes then
  // Inside the window: time in optimizer steps, and collective waits (all of them, and those inside the steps).
  bool in_window_ = false;
  std::chrono::steady_clock::time_point optimizer_began_;
  int64_t optimizer_wait_began_ = 0, waited_at_start_ = 0, optimizer_waited_ns_ = 0;
  double optimizer_seconds_ = 0;
};

}  // namespace xlr8::diagnostics
