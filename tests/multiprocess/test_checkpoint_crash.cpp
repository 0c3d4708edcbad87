// Crash safety of sharded checkpoints: a job killed with SIGKILL at any moment while it saves leaves a
// complete, loadable checkpoint (the previous or the new one, never a mixture); a rank that dies as the
// others save ends the job with an error naming it instead of a hang; the checkpoint it leaves loads.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "gpt_runs.hpp"
#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;
using gpt_runs::concat;
using gpt_runs::json_of;
using gpt_runs::launch_gpt;

namespace {

const Args kFullShardSharded{"--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_state_dict_type",
                             "SHARDED_STATE_DICT"};

Args job(int processes, const Args& flags, const std::string& out, Args extra) {
  Args a{kXlr8, "launch", "--num_processes", std::to_string(processes)};
  a.insert(a.end(), flags.begin(), flags.end());
  a.insert(a.end(), {kTrain, "--batch", "4", "--out", out});
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Loads `checkpoint` on one process (resharding it) without training: the step it holds, or -1.
int64_t loadable_step(const std::string& checkpoint) {
  auto r = run(job(1, {}, temp_dir("crash-load"), {"--steps", "0", "--resume", checkpoint}), 60);
  if (r.exit_code != 0) {
    ADD_FAILURE() << "the checkpoint does not load: " << r.err;
    return -1;
  }
  return last_json(r.out)["resumed_step"].get<int64_t>();
}

// The GPT example's smallest model (2 layers, d_model 32), with its batch and output directory.
Args tiny_gpt(int batch, const std::string& dir) {
  return {"--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32", "--batch_size", std::to_string(batch),
          "--lr", "3e-3", "--val_windows", "48", "--output_dir", dir};
}

}  // namespace

TEST(CheckpointCrash, SigkillAtTwentyMomentsOfSavingAlwaysLeavesALoadableCheckpoint) {
  int mid_save = 0;
  int64_t previous_step = 0;
  for (int attempt = 0; attempt < 20; ++attempt) {
    SCOPED_TRACE(fmt::format("attempt {}", attempt));
    auto out = temp_dir("crash");
    const auto checkpoint = out + "/checkpoint";
    Process p(job(3, kFullShardSharded, out, {"--steps", "1000000", "--save_every", "1"}));
    // Once the first checkpoint exists, every step overwrites it; kill the whole job (the launcher's
    // workers die with it) at a different moment each time.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!fs::exists(checkpoint + "/MANIFEST.json") && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(fs::exists(checkpoint + "/MANIFEST.json"));
    std::this_thread::sleep_for(std::chrono::milliseconds(7 + (attempt * 53) % 300));
    kill(-p.pid(), SIGKILL);
    auto r = p.wait(30);
    EXPECT_FALSE(r.timed_out);
    if (fs::exists(out + "/checkpoint.partial")) ++mid_save;  // killed while writing the next one
    const int64_t step = loadable_step(checkpoint);
    EXPECT_GE(step, 1);
    previous_step = std::max(previous_step, step);
  }
  // The kill points really fell inside saves (a save is most of each step's time here).
  EXPECT_GE(mid_save, 5) << "only " << mid_save << " of 20 kills interrupted a save";
  std::printf("%d of 20 kills interrupted a save; the newest checkpoint that loaded held step %ld\n", mid_save,
              static_cast<long>(previous_step));
  EXPECT_GT(previous_step, 1);
}

TEST(CheckpointCrash, ARankThatDiesAsTheOthersSaveFailsTheJobNamingItAndTheLastCheckpointLoads) {
  auto out = temp_dir("crash-rank");
  auto r = run(job(3, kFullShardSharded, out, {"--steps", "20", "--save_every", "1", "--die_at", "4", "--die_rank", "1"}),
               60);
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r.err;
  EXPECT_EQ(loadable_step(out + "/checkpoint"), 3);  // the save of step 4 never completed
}

// A run resumed with another accumulation over the same global batch (2 ranks x batches of 3 windows x accumulation 2
// saved, 2 x 2 x 3 resumed) equals the straight run: before, the first step after the resume took one micro-batch, as the
// saved micro-step count modulo the new accumulation fell. Its first start, with --resume_from latest over a save cut
// short (only checkpoint_0.partial there), starts fresh, as does the pipeline path's (before: "no checkpoints under").
TEST(GptExample, ResumingUnderAnotherAccumulationOrAfterACutShortFirstSaveContinuesTheRun) {
  const auto whole_dir = temp_dir("gpt-gas-whole"), split_dir = temp_dir("gpt-gas-split");
  const Args three{"--gradient_accumulation_steps", "3"};
  const auto whole = json_of(launch_gpt(2, {}, concat(concat(tiny_gpt(2, whole_dir), three), {"--max_steps", "8"})));
  std::filesystem::create_directories(split_dir + "/checkpoints/checkpoint_0.partial");
  const auto first_run = launch_gpt(2, {}, concat(tiny_gpt(3, split_dir), {"--gradient_accumulation_steps", "2", "--max_steps",
                                                                            "4", "--checkpoint_every", "4", "--resume_from",
                                                                            "latest"}));
  EXPECT_NE(first_run.out.find("--resume_from latest: no checkpoint under"), std::string::npos) << first_run.out;
  EXPECT_EQ(json_of(first_run)["global_step"], 4);
  const auto resumed = json_of(
      launch_gpt(2, {}, concat(concat(tiny_gpt(2, split_dir), three), {"--max_steps", "8", "--resume_from", "latest"})));
  ASSERT_TRUE(whole.contains("final_train_loss") && resumed.contains("final_train_loss"));
  EXPECT_EQ(resumed["global_step"], 8);
  EXPECT_NEAR(resumed["final_train_loss"].get<double>(), whole["final_train_loss"].get<double>(), 1e-6);
  EXPECT_NEAR(resumed["val_loss"].get<double>(), whole["val_loss"].get<double>(), 1e-6);
  const auto pipeline_dir = temp_dir("gpt-pp-latest");
  const auto pipeline = launch_gpt(2, {"--parallelism_config_pp_size", "2"},
                                   concat(tiny_gpt(4, pipeline_dir), {"--max_steps", "2", "--resume_from", "latest"}));
  EXPECT_NE(pipeline.out.find("--resume_from latest: no checkpoint under"), std::string::npos) << pipeline.out;
  EXPECT_EQ(json_of(pipeline)["global_step"], 2);
  // Fewer held-out windows than a batch: nothing scored, said so, and val_loss null (before: a plausible 0.0).
  const auto unscored = launch_gpt(1, {}, {"--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32",
                                           "--batch_size", "4", "--val_windows", "3", "--output_dir",
                                           temp_dir("gpt-pp-noval"), "--pipeline", "--max_steps", "1"});
  EXPECT_NE(unscored.out.find("validation: no held-out batch is whole (--val_windows 3 under --batch_size 4"),
            std::string::npos)
      << unscored.out;
  EXPECT_TRUE(json_of(unscored)["val_loss"].is_null()) << unscored.out;
}
