// Resuming through the Accelerator: a run resumed with another accumulation over the same global batch, and which
// automatic checkpoint counts as the latest.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"

using namespace xlr8;
namespace fs = std::filesystem;

namespace {

std::string empty_resume_dir(const std::string& tag) {
  auto d = fs::temp_directory_path() / ("xlr8_resume_" + tag + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

}  // namespace

// A run resumed with another gradient_accumulation_steps (the same global batch in other micro-batches) starts its
// windows where the saved run's ended: saved after 4 micro-steps of accumulation 2 and loaded under 3, the third
// micro-step syncs (before, the saved count modulo 3 put a sync on the second). One saved partway through a window of
// another size starts it again and says so; under the same accumulation a partly filled window goes on.
TEST(Accelerator, AResumeUnderAnotherAccumulationStartsItsWindowsWhereTheSavedRunsEnded) {
  const auto dir = empty_resume_dir("accumulation");
  auto run = [&](int accumulation, int micro_steps, bool load, bool save) {
    AcceleratorOptions o;
    o.gradient_accumulation_steps = accumulation;
    Accelerator acc(o);
    auto model = acc.prepare(torch::nn::Linear(2, 1));
    auto opt = acc.prepare(torch::optim::SGD(model->parameters(), 0.1));
    if (load) acc.load_state(dir);
    std::vector<bool> syncs;
    for (int i = 0; i < micro_steps; ++i) {
      auto scope = acc.accumulate(model);
      syncs.push_back(acc.sync_gradients());
      acc.backward(model->forward(at::ones({1, 2})).sum());
      opt.step();
      opt.zero_grad();
    }
    if (save) acc.save_state(dir);
    return syncs;
  };
  EXPECT_EQ(run(2, 4, false, true), (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(run(3, 3, true, false), (std::vector<bool>{false, false, true}));
  EXPECT_EQ(run(2, 2, true, false), (std::vector<bool>{false, true}));
  EXPECT_EQ(run(2, 1, true, true), (std::vector<bool>{false}));  // saved one micro-step into a window of 2
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(3, 3, true, false), (std::vector<bool>{false, false, true}));
  const auto warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("saved 1 micro-step(s) into a window of 2 and gradient_accumulation_steps is now 3"),
            std::string::npos)
      << warned;
  EXPECT_EQ(run(2, 1, true, false), (std::vector<bool>{true}));
  fs::remove_all(dir);
}

// latest_checkpoint(): none on a first start, nor where a save was cut short (only its .partial directory is there);
// the newest completed one otherwise, which load_state() without a directory loads.
TEST(Accelerator, LatestCheckpointIsTheNewestCompletedSaveAndNoneBeforeOrForAPartialOne) {
  AcceleratorOptions o;
  o.project_dir = empty_resume_dir("latest");
  o.automatic_checkpoint_naming = true;
  Accelerator acc(o);
  auto model = acc.prepare(torch::nn::Linear(2, 2));
  EXPECT_FALSE(acc.latest_checkpoint().has_value());
  fs::create_directories(o.project_dir + "/checkpoints/checkpoint_0.partial");
  EXPECT_FALSE(acc.latest_checkpoint().has_value());
  EXPECT_THROW(acc.load_state(), Error);
  fs::remove_all(o.project_dir + "/checkpoints/checkpoint_0.partial");
  acc.save_state();
  acc.save_state();
  fs::create_directories(o.project_dir + "/checkpoints/checkpoint_2.partial");
  ASSERT_TRUE(acc.latest_checkpoint().has_value());
  EXPECT_EQ(fs::path(*acc.latest_checkpoint()).filename(), "checkpoint_1");
  fs::remove_all(o.project_dir);
}
