// Pipeline parallelism's first part (issue 46): the schedules' action lists, the cut of a sequence of layers into
// stages, and stages on 2, 3 and 4 ranks (threads) running GPipe and 1F1B over 4 and 8 micro-batches that
// accumulate one process's gradients of the same global batch.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <map>

#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace {

using namespace xlr8;

// Each micro-batch's forward comes before its backward, each once; and the most micro-batches whose activations a
// stage holds at once.
int most_in_flight(const std::vector<pp::Action>& actions, int micro_batches) {
  std::vector<int> forward(micro_batches, 0), backward(micro_batches, 0);
  int held = 0, most = 0;
  for (const auto& a : actions) {
    if (a.kind == pp::Action::Forward) {
      ++forward[a.micro_batch];
      most = std::max(most, ++held);
    } else {
      EXPECT_EQ(forward[a.micro_batch], 1) << "backward before forward, micro-batch " << a.micro_batch;
      ++backward[a.micro_batch];
      --held;
    }
  }
  for (int k = 0; k < micro_batches; ++k) EXPECT_TRUE(forward[k] == 1 && backward[k] == 1) << "micro-batch " << k;
  return most;
}

TEST(PipelineSchedule, GPipeHoldsEveryMicroBatchAndOneFOneBAtMostTheStagesAfterIt) {
  for (int stages : {2, 3, 4})
    for (int m : {4, 8})
      for (int s = 0; s < stages; ++s) {
        EXPECT_EQ(most_in_flight(pp::actions(pp::Schedule::GPipe, stages, m, s), m), m);
        EXPECT_EQ(most_in_flight(pp::actions(pp::Schedule::OneFOneB, stages, m, s), m), std::min(stages - s, m));
      }
  // Stage 1 of 4 with 4 micro-batches: two forwards to fill the pipe, one of each in turn, two backwards.
  using A = pp::Action;
  EXPECT_EQ(pp::actions(pp::Schedule::OneFOneB, 4, 4, 1),
            (std::vector<A>{{A::Forward, 0}, {A::Forward, 1}, {A::Forward, 2}, {A::Backward, 0}, {A::Forward, 3},
                            {A::Backward, 1}, {A::Backward, 2}, {A::Backward, 3}}));
  EXPECT_DOUBLE_EQ(pp::bubble_fraction(pp::Schedule::OneFOneB, 4, 8), 3.0 / 11);
  EXPECT_EQ(pp::parse_schedule("1f1b"), pp::Schedule::OneFOneB);
  try {
    pp::parse_schedule("Interleaved");
    FAIL() << "an unknown schedule was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use GPipe or 1F1B"), std::string::npos) << e.what();
  }
}

TEST(PipelinePartition, UniformAndByParametersKeepALayerForEveryStageAndRefuseMoreStagesThanLayers) {
  using Cuts = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(pp::partition({1, 1, 1, 1, 1, 1, 1}, 3, pp::Partition::Uniform), (Cuts{{0, 3}, {3, 5}, {5, 7}}));
  // One big layer first: by parameters it is a stage of its own.
  EXPECT_EQ(pp::partition({900, 100, 100, 100, 100}, 2, pp::Partition::Parameters), (Cuts{{0, 1}, {1, 5}}));
  EXPECT_EQ(pp::partition({10, 10, 10, 10}, 2, pp::Partition::Parameters), (Cuts{{0, 2}, {2, 4}}));
  EXPECT_EQ(pp::partition({0, 5, 0, 5, 0, 5}, 3, pp::Partition::Parameters).size(), 3u);
  EXPECT_EQ(pp::partition({1000, 1, 1}, 3, pp::Partition::Parameters), (Cuts{{0, 1}, {1, 2}, {2, 3}}));
  try {
    pp::partition({1, 1}, 3, pp::Partition::Uniform);
    FAIL() << "3 stages of 2 layers were accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("3 stages for a model of 2 layers"), std::string::npos) << e.what();
  }
}

// Seven layers of uneven widths (3 stages cut them unevenly).
torch::nn::Sequential model() {
  at::manual_seed(46);
  return torch::nn::Sequential(torch::nn::Linear(12, 24), torch::nn::Tanh(), torch::nn::Linear(24, 16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

at::Tensor mse(const at::Tensor& y, const at::Tensor& target) { return at::mse_loss(y, target); }

// Every stage's gradients equal one process's on the global batch, and so does the loss.
void expect_pipeline_equals_one_process(pp::Schedule schedule, int stages, int micro_batches) {
  at::manual_seed(7);
  auto x = at::randn({micro_batches * 3, 12}), target = at::randn({micro_batches * 3, 4});
  auto whole = model();
  auto expected_loss = mse(whole->forward(x), target);
  expected_loss.backward();
  std::map<std::string, at::Tensor> expected;
  for (const auto& p : whole->named_parameters()) expected[p.key()] = p.value().grad();
  std::atomic<int> compared{0};  // every parameter of the model, each on one stage
  xlr8::testing::run_ranks(stages, [&](Communicator& comm) {
    torch::nn::Sequential stage;
    {
      std::lock_guard<std::mutex> lock(xlr8::testing::generator_lock());
      stage = pp::stage_of(model(), stages, comm.rank());
    }
    pp::Pipeline pipeline(stage, comm, schedule, micro_batches);
    const auto inputs = x.chunk(micro_batches), targets = target.chunk(micro_batches);
    const double loss = pipeline.step(comm.rank() == 0 ? inputs : std::vector<at::Tensor>{},
                                      comm.rank() == stages - 1 ? targets : std::vector<at::Tensor>{}, mse);
    EXPECT_NEAR(loss, expected_loss.item<double>(), 1e-6);
    compared += static_cast<int>(stage->named_parameters().size());
    for (const auto& p : stage->named_parameters())
      EXPECT_TRUE(at::allclose(p.value().grad(), expected.at(p.key()), 1e-5, 1e-6))
          << pp::to_string(schedule) << " pp " << stages << " m " << micro_batches << ": " << p.key();
  });
  EXPECT_EQ(compared.load(), static_cast<int>(expected.size()));
}

TEST(Pipeline, EachScheduleOnTwoThreeAndFourStagesWithFourAndEightMicroBatchesEqualsOneProcess) {
  for (auto schedule : {pp::Schedule::GPipe, pp::Schedule::OneFOneB})
    for (int stages : {2, 3, 4})
      for (int micro_batches : {4, 8}) expect_pipeline_equals_one_process(schedule, stages, micro_batches);
}

TEST(Pipeline, AMicroBatchOfAnotherShapeIsRefusedByNameBeforeItIsSent) {
  std::vector<std::string> errors(2);
  try {
    xlr8::testing::run_ranks(
        2,
        [&](Communicator& comm) {
          torch::nn::Sequential stage;
          {
            std::lock_guard<std::mutex> lock(xlr8::testing::generator_lock());
            stage = pp::stage_of(model(), 2, comm.rank());
          }
          pp::Pipeline pipeline(stage, comm, pp::Schedule::GPipe, 2);
          try {
            pipeline.step({at::randn({3, 12}), at::randn({2, 12})}, {at::randn({3, 4}), at::randn({2, 4})}, mse);
          } catch (const Error& e) {
            errors[comm.rank()] = e.what();
            throw;
          }
        },
        std::chrono::seconds(3));
    FAIL() << "a change of shape went through";
  } catch (const Error&) {
  }
  EXPECT_NE(errors[0].find("pipeline stage 0: its output has shape [2, 16] in this micro-batch and [3, 16] in the "
                           "step's first"),
            std::string::npos)
      << errors[0];
  EXPECT_FALSE(errors[1].empty());  // its wait for the activation ends (here at the group's timeout)
}

}  // namespace
