// The everyday Accelerator API on real ranks through the real launcher: collectives over nested values
// (3 ranks, so that shards and batches are uneven) and free_memory under DDP and the sharded strategies.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <numeric>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

using Args = std::vector<std::string>;

namespace {


std::vector<nlohmann::json> rank_reports(const ProcessResult& r) {
  std::vector<nlohmann::json> out;
  const auto report = last_json(r.out);  // kept: a range-for over last_json(...)["ranks"] would dangle
  for (const auto& text : report["ranks"]) out.push_back(nlohmann::json::parse(text.get<std::string>()));
  return out;
}

ProcessResult launch(int processes, Args launcher_flags, Args worker_args) {
  Args a{kXlr8, "launch", "--num_processes", std::to_string(processes)};
  a.insert(a.end(), launcher_flags.begin(), launcher_flags.end());
  a.push_back(kTrain);
  a.insert(a.end(), worker_args.begin(), worker_args.end());
  return run(a, 120);
}

}  // namespace

TEST(NestedCollectives, GatherReduceAndPadKeepTheStructureOnThreeRanks) {
  auto r = launch(3, {}, {"--mode", "nested"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto ranks = rank_reports(r);
  ASSERT_EQ(ranks.size(), 3u) << r.out;
  for (int rank = 0; rank < 3; ++rank) {
    const auto& g = ranks[rank];
    SCOPED_TRACE(fmt::format("rank {}", rank));
    // Rank r contributed r, 10 + r (twice), -r, r % 2 == 0 ...: concatenated on dim 0 in rank order.
    EXPECT_EQ(g["list"], nlohmann::json::parse("[[0,1,2],[10,10,11,11,12,12]]"));
    EXPECT_EQ(g["b0"], nlohmann::json::parse("[[0,0],[1,1],[2,2]]"));
    EXPECT_EQ(g["b1"], nlohmann::json::parse("[0,1,2,3,4,5]"));  // int64 stays int64
    EXPECT_EQ(g["a0"], nlohmann::json::parse("[0,-1,-2]"));
    EXPECT_EQ(g["a1"], nlohmann::json::parse("[true,false,true]"));
    // The unordered_map was filled in different orders on even and odd ranks: gathered by key anyway.
    EXPECT_EQ(g["by_id"], nlohmann::json::parse(R"({"1":[100,101,102],"2":[200,201,202],"3":[300,301,302]})"));
    EXPECT_EQ(g["user_first"], nlohmann::json::parse("[0,1,4]"));
    EXPECT_EQ(g["user_input"], nlohmann::json::parse("[[0,0],[1,1],[2,2]]"));
    EXPECT_EQ(g["user_extras"], nlohmann::json::parse("[[5,6,7]]"));
    EXPECT_EQ(g["user_tag"], 42);  // a plain field passes through
    EXPECT_EQ(g["reduced"], nlohmann::json::parse("[3,3]"));  // 0 + 1 + 2
    // pad_across_processes: rank r held r + 1 values of r, padded with -1 to the longest (3).
    std::vector<double> padded(3, -1.0);
    std::fill_n(padded.begin(), rank + 1, static_cast<double>(rank));
    EXPECT_EQ(g["padded"].get<std::vector<double>>(), padded);
    // 10 samples, batches of 2 on 3 ranks: even_batches pads the last round; gather_for_metrics drops
    // the padding from the data and the target alike.
    std::vector<int64_t> ids(10), targets(10);
    std::iota(ids.begin(), ids.end(), 0);
    for (int i = 0; i < 10; ++i) targets[i] = 10 * i;
    EXPECT_EQ(g["ids"].get<std::vector<int64_t>>(), ids);
    EXPECT_EQ(g["targets"].get<std::vector<int64_t>>(), targets);
    EXPECT_EQ(g["text"], "tensor([10.0, 10.0, 11.0, 11.0, 12.0, 12.0]) [6] cpu");
  }
}

TEST(NestedCollectives, AShapeThatDiffersOnOneRankIsNamedOnEveryRank) {
  auto r = launch(3, {}, {"--mode", "nested-mismatch"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.err.find("gather(): tensor 1 is float32[2, 3] on rank 2 but float32[1, 3] on rank 0"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("pad_across_processes"), std::string::npos) << r.err;
  // An undefined tensor on one rank: every rank learns it (none throws alone and leaves the others waiting).
  auto undefined = launch(3, {}, {"--mode", "nested-undefined"});
  EXPECT_NE(undefined.exit_code, 0);
  EXPECT_LT(undefined.seconds, 60);
  EXPECT_NE(undefined.err.find("tensor 0 is undefined on rank 1 but float32[1] on rank 0"), std::string::npos)
      << undefined.err;
}

// free_memory gives back what the Accelerator held (the optimizer's state, the strategy's buffers), leaves
// each model whole, current and fp32 on every rank, refuses the old optimizer, and lets the model be
// prepared again. The control run (the caller's handles dropped, no free_memory) keeps it all.
class FreeMemory : public ::testing::TestWithParam<std::pair<std::string, Args>> {};

TEST_P(FreeMemory, ReturnsTheOptimizerStateAndStrategyBuffersAndLeavesTheModelWhole) {
  const auto& [name, flags] = GetParam();
  auto freed = launch(2, flags, {"--mode", "free-memory", "--accum", "2"});
  auto control = launch(2, flags, {"--mode", "free-control", "--accum", "2"});
  ASSERT_EQ(freed.exit_code, 0) << freed.err;
  ASSERT_EQ(control.exit_code, 0) << control.err;
  // 4.2 M parameters: AdamW's two moments are 34 MB on one rank, 17 MB per rank when sharded over 2.
  const double least_drop_mb = name == "ddp" ? 40 : 8;
  for (const auto& rank : rank_reports(freed)) {
    SCOPED_TRACE(rank.dump());
    EXPECT_GE(rank["rss_before_mb"].get<double>() - rank["rss_after_mb"].get<double>(), least_drop_mb);
    EXPECT_EQ(rank["max_difference"], 0.0);  // exactly the values summon_full_params showed
    EXPECT_TRUE(rank["grads_dropped"]);
    EXPECT_TRUE(rank["float32"]);
    EXPECT_NE(rank["refused"].get<std::string>().find("free_memory() released it"), std::string::npos);
    EXPECT_NE(rank["refused_zero_grad"].get<std::string>().find("free_memory() released it"), std::string::npos);
    EXPECT_NE(rank["refused_in_scope"].get<std::string>().find("inside accumulate()"), std::string::npos);
    EXPECT_EQ(rank["accumulation_after"], 2);  // the Accelerator's settings stay
    EXPECT_EQ(rank["step_after"], 1);  // prepared again, one window of 2 micro-steps: the count restarted
  }
  for (const auto& rank : rank_reports(control)) {
    SCOPED_TRACE(rank.dump());
    EXPECT_LT(std::abs(rank["rss_before_mb"].get<double>() - rank["rss_after_mb"].get<double>()), 4.0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FreeMemory,
    ::testing::Values(std::pair<std::string, Args>{"ddp", {}},
                      std::pair<std::string, Args>{"zero2", {"--use_deepspeed", "--zero_stage", "2"}},
                      std::pair<std::string, Args>{"full_shard", {"--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD"}}),
    [](const auto& info) { return info.param.first; });

// Progress as people see it: `xlr8 launch` on a terminal (a real pseudo-terminal from script(1)) shows the
// main process's bar redrawn in place, prefixed; through a pipe it prints plain lines; off prints nothing.
namespace {

ProcessResult gpt_with_progress(const std::string& how, const std::string& progress) {
  const std::string dir = temp_dir("progress");
  const std::string command = fmt::format(
      "XLR8_PROGRESS={} {} launch --num_processes 2 {} --max_steps 6 --n_layer 1 --d_model 32 --n_head 2 --seq_len 32 "
      "--batch_size 4 --log_every 2 --output_dir {}",
      progress, kXlr8, GPT_BIN, dir);
  if (how == "terminal") return run({"script", "-qec", command, "/dev/null"}, 120);
  return run({"/bin/sh", "-c", command}, 120);
}


}  // namespace

TEST(Progress, OnATerminalTheMainProcessDrawsABarInPlace) {
  auto r = gpt_with_progress("terminal", "auto");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto& screen = r.out;  // script(1) merges the terminal's output
  // The first frame (0/6) and the last, on one line: each frame starts with \r and the rank prefix.
  EXPECT_GE(occurrences(screen, "\r[rank0]: train "), 2u) << screen;
  EXPECT_NE(screen.find("0/6 [00:00<?"), std::string::npos) << screen;
  EXPECT_NE(screen.find("6/6 ["), std::string::npos) << screen;
  EXPECT_NE(screen.find("step/s, loss="), std::string::npos) << screen;
  EXPECT_NE(screen.find("100%|"), std::string::npos) << screen;
  EXPECT_NE(screen.find("\x1b[K"), std::string::npos) << screen;
  EXPECT_EQ(screen.find("[rank1]: train"), std::string::npos) << screen;  // the main process only
  EXPECT_EQ(screen.find("train 2/6 (33%)"), std::string::npos) << screen;  // no plain lines
}

TEST(Progress, ThroughAPipeItPrintsPlainLinesAndOffPrintsNothing) {
  auto lines = gpt_with_progress("pipe", "auto");
  ASSERT_EQ(lines.exit_code, 0) << lines.err;
  EXPECT_EQ(lines.err.find('\r'), std::string::npos) << lines.err;
  for (const char* step : {"train 2/6 (33%)", "train 4/6 (67%)", "train 6/6 (100%)"})
    EXPECT_NE(lines.err.find(fmt::format("[rank0]: {}", step)), std::string::npos) << step << "\n" << lines.err;
  EXPECT_NE(lines.err.find("ETA 00:00 loss="), std::string::npos) << lines.err;
  auto off = gpt_with_progress("pipe", "off");
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_EQ(off.err.find("train "), std::string::npos) << off.err;
  auto bad = gpt_with_progress("pipe", "sometimes");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("XLR8_PROGRESS=\"sometimes\" is not a progress mode"), std::string::npos) << bad.err;
}

namespace {

// A real 30-step run on 2 ranks logging with `log_with`; the run directories its trackers made.
std::vector<std::string> tracked_runs(const std::string& out, const std::string& log_with) {
  auto trained = run({kXlr8, "launch", "--num_processes", "2", "--log_with", log_with, kTrain, "--steps", "30",
                      "--track", "--out", out},
                     120);
  EXPECT_EQ(trained.exit_code, 0) << trained.err;
  std::vector<std::string> runs;
  for (const auto& entry : std::filesystem::directory_iterator(out + "/oracle")) runs.push_back(entry.path().string());
  return runs;
}

// The PNG read back by an independent decoder: the curve colour fills both panels (loss left, lr right).
void expect_both_curves(const std::string& png, int width, int height) {
  auto read = run({"/usr/bin/python3", READ_PNG, png, "1f77b4", "1", "2"});
  ASSERT_EQ(read.exit_code, 0) << read.err;
  auto image = last_json(read.out);
  EXPECT_EQ(image["width"], width);
  EXPECT_EQ(image["height"], height);
  EXPECT_GT(image["cells"][0][0].get<int>(), 300) << image;  // the loss curve
  EXPECT_GT(image["cells"][0][1].get<int>(), 300) << image;  // the learning-rate steps
}

}  // namespace

// `xlr8 plot` on what a real run's trackers wrote, read back by an independent PNG decoder: the image has
// the asked size and the curve colour fills both panels (loss on the left, the learning rate on the right).
TEST(Plot, DrawsEachLoggedScalarOfARunIntoAPngOfTheAskedSize) {
  const auto out = temp_dir("plot");
  const auto runs = tracked_runs(out, "jsonl,csv");
  ASSERT_EQ(runs.size(), 1u);
  for (const std::string& source : {runs[0], runs[0] + "/metrics.csv"}) {
    SCOPED_TRACE(source);
    const auto png = out + "/curves.png";
    std::filesystem::remove(png);
    auto plotted = run({kXlr8, "plot", source, "-o", png, "--size", "640,480"});
    ASSERT_EQ(plotted.exit_code, 0) << plotted.err;
    EXPECT_NE(plotted.out.find("(640x480; loss, lr; up to 30 points each)"), std::string::npos) << plotted.out;
    expect_both_curves(png, 640, 480);
  }
  auto empty = run({kXlr8, "plot", temp_dir("plot-empty")});
  EXPECT_NE(empty.exit_code, 0);
  EXPECT_NE(empty.err.find("has no metrics.jsonl or metrics.csv"), std::string::npos) << empty.err;
  auto unknown = run({kXlr8, "plot", runs[0], "--keys", "accuracy"});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.err.find("logged no scalar \"accuracy\"; it has loss, lr"), std::string::npos) << unknown.err;
}

// Given a project_dir (or a project), `xlr8 plot` draws the newest run below it instead of refusing.
TEST(Plot, AProjectDirDrawsItsNewestRun) {
  const auto out = temp_dir("plot-project");
  for (auto [log_with, steps] : {std::pair{"jsonl", "5"}, std::pair{"csv", "8"}}) {
    auto trained = run({kXlr8, "launch", "--num_processes", "1", "--log_with", log_with, kTrain, "--steps", steps,
                        "--track", "--out", out},
                       120);
    ASSERT_EQ(trained.exit_code, 0) << trained.err;
  }
  for (const std::string& where : {out, out + "/oracle"}) {
    SCOPED_TRACE(where);
    auto plotted = run({kXlr8, "plot", where, "-o", out + "/curves.png", "--size", "640,480"});
    ASSERT_EQ(plotted.exit_code, 0) << plotted.err;
    EXPECT_NE(plotted.out.find("up to 8 points each) from " + out + "/oracle/"), std::string::npos) << plotted.out;
    EXPECT_NE(plotted.out.find("/metrics.csv"), std::string::npos) << plotted.out;
  }
}

// A run that logged with TensorBoard only: `xlr8 plot` reads the event file the tracker wrote (TFRecord
// framing, Event and Summary messages), drawn and read back as above.
TEST(Plot, DrawsARunThatLoggedWithTensorBoardOnly) {
  const auto out = temp_dir("plot-tensorboard");
  const auto runs = tracked_runs(out, "tensorboard");
  ASSERT_EQ(runs.size(), 1u);
  ASSERT_FALSE(std::filesystem::exists(runs[0] + "/metrics.jsonl"));
  ASSERT_FALSE(std::filesystem::exists(runs[0] + "/metrics.csv"));
  const auto png = out + "/curves.png";
  auto plotted = run({kXlr8, "plot", runs[0], "-o", png, "--size", "640,480"});
  ASSERT_EQ(plotted.exit_code, 0) << plotted.err;
  EXPECT_NE(plotted.out.find("(640x480; loss, lr; up to 30 points each) from " + runs[0] + "/events.out.tfevents."),
            std::string::npos)
      << plotted.out;
  expect_both_curves(png, 640, 480);
}
