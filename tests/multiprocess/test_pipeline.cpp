// Pipeline parallelism through the real launcher (issue 46, first part): examples/pipeline on 2, 3 and 4 stages
// with GPipe and 1F1B over 4 and 8 micro-batches trains step for step as one process; a pipeline that cannot be
// formed is one line before training.
#include <gtest/gtest.h>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace {

using Args = std::vector<std::string>;

ProcessResult launch_pipeline(int processes, Args launcher) {
  Args command{kXlr8, "launch", "--num_processes", std::to_string(processes)};
  command.insert(command.end(), launcher.begin(), launcher.end());
  command.push_back(kPipeline);
  return run(command, 120);
}

std::vector<double> losses_of(const ProcessResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  if (r.exit_code != 0) return {};
  return last_json(r.out).value("losses", std::vector<double>{});
}

}  // namespace

// Losses within 1e-6 of one process's at every step (8 SGD steps): the micro-batches' mean losses are summed in
// another order than the whole batch's, nothing more.
TEST(PipelineLaunch, EachScheduleOnTwoThreeAndFourStagesWithFourAndEightMicroBatchesTrainsAsOneProcess) {
  const auto one = losses_of(launch_pipeline(1, {}));
  ASSERT_EQ(one.size(), 8u);
  EXPECT_LT(one.back(), one.front());  // it learns
  for (const std::string schedule : {"GPipe", "1F1B"})
    for (int stages : {2, 3, 4})
      for (int micro_batches : {4, 8}) {
        SCOPED_TRACE(schedule + " pp " + std::to_string(stages) + ", " + std::to_string(micro_batches) + " micro-batches");
        const auto got = losses_of(launch_pipeline(
            stages, {"--parallelism_config_pp_size", std::to_string(stages), "--parallelism_config_pp_schedule", schedule,
                     "--parallelism_config_pp_microbatches", std::to_string(micro_batches)}));
        expect_close(got, one, 1e-6);
      }
}

// Clipping spans every stage: the global norm (each stage's part summed over the pp group) is one process's, and
// clipping at half of it trains as one process does.
TEST(PipelineLaunch, ClippingTheGradientNormSpansEveryStage) {
  auto one = launch_pipeline(1, {});
  Args clip{"--max_grad_norm", "0.05"};
  auto run_with = [&](int processes, Args launcher) {
    launcher.push_back(kPipeline);
    Args command{kXlr8, "launch", "--num_processes", std::to_string(processes)};
    command.insert(command.end(), launcher.begin(), launcher.end());
    command.insert(command.end(), clip.begin(), clip.end());
    auto r = run(command, 120);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
  };
  const auto whole = run_with(1, {});
  const auto norms = whole.value("grad_norms", std::vector<double>{});
  ASSERT_EQ(norms.size(), 8u);
  EXPECT_GT(norms.front(), 0.05);  // clipping acts
  for (int stages : {2, 3}) {
    SCOPED_TRACE("pp " + std::to_string(stages));
    const auto got = run_with(stages, {"--parallelism_config_pp_size", std::to_string(stages)});
    expect_close(got.value("grad_norms", std::vector<double>{}), norms, 1e-6);
    expect_close(got.value("losses", std::vector<double>{}), whole.value("losses", std::vector<double>{}), 1e-6);
  }
  EXPECT_NE(losses_of(one), whole.value("losses", std::vector<double>{}));  // clipping changed the training
}

TEST(PipelineLaunch, APipelineThatCannotBeFormedIsOneLineBeforeTraining) {
  auto unknown = launch_pipeline(2, {"--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule", "zb"});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.err.find("parallelism_config_pp_schedule"), std::string::npos) << unknown.err;
  EXPECT_NE(unknown.err.find("allowed: gpipe, 1f1b"), std::string::npos) << unknown.err;
  auto sizes = launch_pipeline(3, {"--parallelism_config_pp_size", "2"});
  EXPECT_NE(sizes.exit_code, 0);
  EXPECT_NE(sizes.err.find("parallelism_config sizes multiply to 2 (pp 2 x"), std::string::npos) << sizes.err;
  auto uneven = launch_pipeline(2, {"--parallelism_config_pp_size", "2", "--parallelism_config_pp_microbatches", "5"});
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_NE(uneven.err.find("does not split into 5 equal micro-batches"), std::string::npos) << uneven.err;
  // What a pipeline cannot do yet is refused, never done wrong: a checkpoint holds every stage's part.
  auto save = run({kXlr8, "launch", "--num_processes", "2", "--parallelism_config_pp_size", "2", kPipeline, "--steps",
                   "1", "--save_state", temp_dir("pp-save")},
                  120);
  EXPECT_NE(save.exit_code, 0);
  EXPECT_NE(save.err.find("save_state() under parallelism_config_pp_size 2 is not built yet"), std::string::npos)
      << save.err;
}
