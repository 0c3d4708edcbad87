// Pipeline parallelism (issue 46): the schedules' action lists (each runs to its end), the cut of a sequence of
// layers into stages, and stages on 2, 3 and 4 ranks (threads) running GPipe, 1F1B, Interleaved1F1B and
// InterleavedZeroBubble that accumulate one process's gradients of the same global batch.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <map>
#include <set>
#include <tuple>

#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace {

using namespace xlr8;

// Each micro-batch's forward comes before its backward (and that before its weights' part, in a split list), each
// once; and the most micro-batches whose activations a stage holds at once (until its backward, or its weights').
int most_in_flight(const std::vector<pp::Action>& actions, int micro_batches) {
  std::vector<int> forward(micro_batches, 0), backward(micro_batches, 0), weight(micro_batches, 0);
  const bool split = std::any_of(actions.begin(), actions.end(), [](const auto& a) { return a.kind == pp::Action::Weight; });
  int held = 0, most = 0;
  for (const auto& a : actions) {
    if (a.kind == pp::Action::Forward) {
      ++forward[a.micro_batch];
      most = std::max(most, ++held);
    } else if (a.kind == pp::Action::Backward) {
      EXPECT_EQ(forward[a.micro_batch], 1) << "backward before forward, micro-batch " << a.micro_batch;
      ++backward[a.micro_batch];
      if (!split) --held;
    } else {
      EXPECT_EQ(backward[a.micro_batch], 1) << "weights before backward, micro-batch " << a.micro_batch;
      ++weight[a.micro_batch];
      --held;
    }
  }
  for (int k = 0; k < micro_batches; ++k) {
    EXPECT_TRUE(forward[k] == 1 && backward[k] == 1) << "micro-batch " << k;
    EXPECT_EQ(weight[k], split ? 1 : 0) << "micro-batch " << k;
  }
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
    EXPECT_NE(std::string(e.what()).find("use GPipe, 1F1B, Interleaved1F1B or InterleavedZeroBubble"), std::string::npos)
        << e.what();
  }
}

// Runs every stage's actions as Pipeline::step does (a forward waits for the previous virtual stage's forward of
// its micro-batch, a backward for its own forward and the next virtual stage's backward; sends never wait): true
// when every stage reaches its end, each forward and backward of each virtual stage done once.
bool runs_to_the_end(pp::Schedule schedule, int stages, int m, int chunks) {
  using A = pp::Action;
  const int virtual_stages = stages * chunks;
  std::vector<std::vector<A>> lists;
  size_t total = 0;
  for (int r = 0; r < stages; ++r) {
    lists.push_back(pp::actions(schedule, stages, m, r, chunks));
    total += lists.back().size();
  }
  std::set<std::tuple<int, int, int>> done;  // (kind, micro-batch, virtual stage)
  std::vector<size_t> next(stages, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < stages; ++r)
      for (; next[r] < lists[r].size(); ++next[r]) {
        const auto& a = lists[r][next[r]];
        const int vs = a.chunk * stages + r;
        const bool ready = a.kind == A::Forward  ? vs == 0 || done.count({A::Forward, a.micro_batch, vs - 1})
                           : a.kind == A::Weight ? done.count({A::Backward, a.micro_batch, vs}) > 0
                                                 : done.count({A::Forward, a.micro_batch, vs}) &&
                                                       (vs == virtual_stages - 1 ||
                                                        done.count({A::Backward, a.micro_batch, vs + 1}));
        if (!ready) break;
        progress = done.insert({a.kind, a.micro_batch, vs}).second || progress;
      }
  }
  for (int r = 0; r < stages; ++r)
    if (next[r] != lists[r].size()) return false;
  const int parts = schedule == pp::Schedule::InterleavedZeroBubble ? 3 : 2;
  return done.size() == total && total == static_cast<size_t>(parts * m * virtual_stages);
}

// Whether each rank receives from each neighbour in the order that neighbour sends (NCCL matches a pair's transfers
// by order, not by tag).
bool same_order_between_each_pair(pp::Schedule schedule, int stages, int m, int chunks) {
  using A = pp::Action;
  using Message = std::tuple<int, int, int>;  // (kind, micro-batch, receiving virtual stage)
  std::map<std::pair<int, int>, std::vector<Message>> sent, received;
  const int last = stages * chunks - 1;
  for (int r = 0; r < stages; ++r)
    for (const auto& a : pp::actions(schedule, stages, m, r, chunks)) {
      const int vs = a.chunk * stages + r, previous = (r + stages - 1) % stages, next = (r + 1) % stages;
      if (a.kind == A::Forward) {
        if (vs > 0) received[{previous, r}].push_back({A::Forward, a.micro_batch, vs});
        if (vs < last) sent[{r, next}].push_back({A::Forward, a.micro_batch, vs + 1});
      } else if (a.kind == A::Backward) {  // a Weight sends nothing
        if (vs < last) received[{next, r}].push_back({A::Backward, a.micro_batch, vs});
        if (vs > 0) sent[{r, previous}].push_back({A::Backward, a.micro_batch, vs - 1});
      }
    }
  return sent == received;
}

TEST(PipelineSchedule, EverySchedulesStagesRunToTheEndWithoutWaitingOnEachOther) {
  for (int stages : {2, 3, 4})
    for (int m : {stages, 2 * stages, 8}) {
      for (auto schedule : {pp::Schedule::GPipe, pp::Schedule::OneFOneB})
        EXPECT_TRUE(runs_to_the_end(schedule, stages, m, 1) && same_order_between_each_pair(schedule, stages, m, 1))
            << pp::to_string(schedule) << " " << stages << " " << m;
      EXPECT_TRUE(runs_to_the_end(pp::Schedule::InterleavedZeroBubble, stages, m, 1) &&
                  same_order_between_each_pair(pp::Schedule::InterleavedZeroBubble, stages, m, 1))
          << "zero bubble " << stages << " " << m;
      if (m % stages != 0) continue;
      for (int chunks : {2, 3})
        for (auto schedule : {pp::Schedule::Interleaved1F1B, pp::Schedule::InterleavedZeroBubble})
          EXPECT_TRUE(runs_to_the_end(schedule, stages, m, chunks) &&
                      same_order_between_each_pair(schedule, stages, m, chunks))
              << pp::to_string(schedule) << " " << stages << " stages, " << m << " micro-batches, " << chunks
              << " chunks";
    }
  // Stage 0 of 2 with 2 chunks and 4 micro-batches: four forwards fill both chunks' pipes, then the backwards begin
  // on the later chunk.
  using A = pp::Action;
  EXPECT_EQ(pp::actions(pp::Schedule::Interleaved1F1B, 2, 4, 0, 2),
            (std::vector<A>{{A::Forward, 0, 0}, {A::Forward, 1, 0}, {A::Forward, 0, 1}, {A::Forward, 1, 1},
                            {A::Forward, 2, 0}, {A::Backward, 0, 1}, {A::Forward, 3, 0}, {A::Backward, 1, 1},
                            {A::Forward, 2, 1}, {A::Backward, 0, 0}, {A::Forward, 3, 1}, {A::Backward, 1, 0},
                            {A::Backward, 2, 1}, {A::Backward, 3, 1}, {A::Backward, 2, 0}, {A::Backward, 3, 0}}));
  EXPECT_DOUBLE_EQ(pp::bubble_fraction(pp::Schedule::Interleaved1F1B, 4, 8, 2), 3.0 / 19);
  EXPECT_THROW(pp::actions(pp::Schedule::Interleaved1F1B, 4, 6, 0, 2), ConfigError);  // 6 is not a multiple of 4
  EXPECT_THROW(pp::actions(pp::Schedule::OneFOneB, 4, 8, 0, 2), ConfigError);        // chunks need Interleaved1F1B
}

// The zero-bubble lists are 1F1B's (or Interleaved1F1B's) with each backward's weights `stage` backwards later: a
// stage holds at most `stages` micro-batches, and the bubble is a third of the part times' ramp.
TEST(PipelineSchedule, ZeroBubbleDefersEachStagesWeightsByItsIndexAndHoldsAtMostTheStageCount) {
  using A = pp::Action;
  for (int stages : {2, 3, 4})
    for (int m : {4, 8})
      for (int s = 0; s < stages; ++s)
        for (int chunks : {1, 2}) {
          if (chunks > 1 && m % stages != 0) continue;
          auto split = pp::actions(pp::Schedule::InterleavedZeroBubble, stages, m, s, chunks);
          if (chunks == 1) {
            EXPECT_EQ(most_in_flight(split, m), std::min(stages, m)) << stages << " " << m << " " << s;
          }
          std::erase_if(split, [](const A& a) { return a.kind == A::Weight; });
          const auto base = chunks == 1 ? pp::Schedule::OneFOneB : pp::Schedule::Interleaved1F1B;
          EXPECT_EQ(split, pp::actions(base, stages, m, s, chunks)) << stages << " " << m << " " << s;
        }
  // Stage 1 of 3 with 4 micro-batches: 1F1B's order, each Weight one backward late, the last at the end.
  EXPECT_EQ(pp::actions(pp::Schedule::InterleavedZeroBubble, 3, 4, 1),
            (std::vector<A>{{A::Forward, 0}, {A::Forward, 1}, {A::Backward, 0}, {A::Forward, 2}, {A::Backward, 1},
                            {A::Weight, 0}, {A::Forward, 3}, {A::Backward, 2}, {A::Weight, 1}, {A::Backward, 3},
                            {A::Weight, 2}, {A::Weight, 3}}));
  // The first stage, whose backwards nobody waits for, weighs each at once.
  EXPECT_EQ(pp::actions(pp::Schedule::InterleavedZeroBubble, 2, 2, 0),
            (std::vector<A>{{A::Forward, 0}, {A::Forward, 1}, {A::Backward, 0}, {A::Weight, 0}, {A::Backward, 1},
                            {A::Weight, 1}}));
  EXPECT_DOUBLE_EQ(pp::bubble_fraction(pp::Schedule::InterleavedZeroBubble, 4, 8), 3.0 / 27);
  EXPECT_DOUBLE_EQ(pp::bubble_fraction(pp::Schedule::InterleavedZeroBubble, 4, 8, 2), 3.0 / 51);
  EXPECT_EQ(pp::parse_schedule("interleavedzerobubble"), pp::Schedule::InterleavedZeroBubble);
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

// Nine layers of uneven widths (3 stages cut them unevenly; 4 stages of 2 chunks need 8).
torch::nn::Sequential model() {
  at::manual_seed(46);
  return torch::nn::Sequential(torch::nn::Linear(12, 24), torch::nn::Tanh(), torch::nn::Linear(24, 16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 20),
                               torch::nn::Tanh(), torch::nn::Linear(20, 4));
}

at::Tensor mse(const at::Tensor& y, const at::Tensor& target) { return at::mse_loss(y, target); }

// Every stage's gradients equal one process's on the global batch, and so does the loss.
void expect_pipeline_equals_one_process(pp::Schedule schedule, int stages, int micro_batches, int chunks = 1,
                                        int checkpoint_interval = 0) {
  at::manual_seed(7);
  auto x = at::randn({micro_batches * 3, 12}), target = at::randn({micro_batches * 3, 4});
  auto whole = model();
  auto expected_loss = mse(whole->forward(x), target);
  expected_loss.backward();
  std::map<std::string, at::Tensor> expected;
  for (const auto& p : whole->named_parameters()) expected[p.key()] = p.value().grad();
  std::atomic<int> compared{0};  // every parameter of the model, each on one stage
  xlr8::testing::run_ranks(stages, [&](Communicator& comm) {
    pp::StageLayers layers;
    {
      std::lock_guard<std::mutex> lock(xlr8::testing::generator_lock());
      layers = pp::stage_layers(model(), stages, comm.rank(), chunks);
    }
    auto stage = layers.layers;
    pp::Pipeline pipeline(stage, comm, schedule, micro_batches, layers.chunk_sizes);
    pipeline.set_activation_checkpoint_interval(checkpoint_interval);
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

TEST(Pipeline, InterleavedOnTwoThreeAndFourStagesOfTwoChunksEqualsOneProcess) {
  for (int stages : {2, 3, 4})
    for (int micro_batches : {stages, 2 * stages})
      expect_pipeline_equals_one_process(pp::Schedule::Interleaved1F1B, stages, micro_batches, 2);
  expect_pipeline_equals_one_process(pp::Schedule::Interleaved1F1B, 2, 4, 3);
}

TEST(Pipeline, ZeroBubbleOnTwoThreeAndFourStagesOfOneAndTwoChunksEqualsOneProcess) {
  for (int stages : {2, 3, 4})
    for (int micro_batches : {4, 8}) expect_pipeline_equals_one_process(pp::Schedule::InterleavedZeroBubble, stages, micro_batches);
  for (int stages : {2, 3, 4})
    expect_pipeline_equals_one_process(pp::Schedule::InterleavedZeroBubble, stages, 2 * stages, 2);
  // Checkpointed regions of 2 layers: their recomputation runs in the input's part, which gives their weights too.
  expect_pipeline_equals_one_process(pp::Schedule::InterleavedZeroBubble, 2, 4, 1, 2);
}

// evaluate() runs in eval mode, as DeepSpeed's eval_batch: with dropout at 0.9 its loss is the one without dropout,
// twice alike. The stages' mode and the last step's figures are as they were.
TEST(Pipeline, EvaluateRunsWithoutDropoutAndLeavesTheModeAndTheLastStepsFigures) {
  at::manual_seed(5);
  auto x = at::randn({4, 12}), target = at::randn({4, 4});
  auto whole = model();
  whole->eval();
  const double expected = mse(whole->forward(x), target).item<double>();
  xlr8::testing::run_ranks(2, [&](Communicator& comm) {
    pp::StageLayers layers;
    {
      std::lock_guard<std::mutex> lock(xlr8::testing::generator_lock());
      at::manual_seed(46);  // model()'s weights, and a dropout before the first Tanh (on stage 0)
      auto dropped = torch::nn::Sequential(torch::nn::Linear(12, 24), torch::nn::Dropout(0.9), torch::nn::Tanh(),
                                           torch::nn::Linear(24, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                                           torch::nn::Tanh(), torch::nn::Linear(16, 20), torch::nn::Tanh(),
                                           torch::nn::Linear(20, 4));
      layers = pp::stage_layers(dropped, 2, comm.rank(), 1);
    }
    pp::Pipeline pipeline(layers.layers, comm, pp::Schedule::OneFOneB, 2, layers.chunk_sizes);
    const auto inputs = comm.rank() == 0 ? x.chunk(2) : std::vector<at::Tensor>{};
    const auto targets = comm.rank() == 1 ? target.chunk(2) : std::vector<at::Tensor>{};
    pipeline.step(inputs, targets, mse);
    const auto held = pipeline.last_peak_held();
    const auto sent = pipeline.last_bytes_sent();
    const auto waited = pipeline.last_wait_seconds();
    for (int i = 0; i < 2; ++i) EXPECT_NEAR(pipeline.evaluate(inputs, targets, mse), expected, 1e-6);
    EXPECT_TRUE(layers.layers->is_training());
    EXPECT_EQ(pipeline.last_peak_held(), held);
    EXPECT_EQ(pipeline.last_bytes_sent(), sent);
    EXPECT_EQ(pipeline.last_wait_seconds(), waited);
  });
}

// Interleaved: the parts are stages x chunks, and the message says so (it spoke of 12 stages for pp 4).
TEST(PipelinePartition, MoreInterleavedPartsThanLayersNameTheVirtualStages) {
  try {
    pp::stage_layers(model(), 4, 0, 3);
    FAIL() << "4 stages of 3 chunks over 9 layers were accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("4 stages x 3 chunks a stage (parallelism_config_pp_virtual_stages) cut the "
                                         "model into 12 parts, but it has 9 layers"),
              std::string::npos)
        << e.what();
  }
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
