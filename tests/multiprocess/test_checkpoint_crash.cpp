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

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

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
