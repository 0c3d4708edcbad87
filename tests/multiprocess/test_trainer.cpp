// xlr8::train::Trainer with real processes (examples/trainer: Fashion-MNIST, the program is its own driver):
// checkpoints registered by report() and kept by score, a worker killed mid-run that the group survives with
// the straight run's result, failures past max_failures ending the fit with the root cause, a new driver
// resuming a run, a group of another size resharding an FSDP checkpoint, one driver per run, a loop without
// end_training() ending cleanly, and a corrupt newest checkpoint set aside for the one before it.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"
#include "xlr8/train.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {


struct Fit {
  ProcessResult process;
  nlohmann::json summary;  // the driver's last line
};

Fit fit(const std::string& storage, const std::string& name, Args extra, double timeout_s = 150) {
  Args args{kTrainer, "--storage_path", storage, "--name", name};
  if (std::find(extra.begin(), extra.end(), "--steps") == extra.end()) args.insert(args.end(), {"--steps", "40"});
  if (std::find(extra.begin(), extra.end(), "--checkpoint_every") == extra.end())
    args.insert(args.end(), {"--checkpoint_every", "10"});
  args.insert(args.end(), extra.begin(), extra.end());
  Fit f{run(args, timeout_s), {}};
  if (f.process.out.find('{') != std::string::npos) f.summary = last_json(f.process.out);  // none: an early error
  return f;
}

// The reported metrics of each checkpoint of a run that kept them all.
std::vector<nlohmann::json> all_reports(const std::string& storage) {
  auto straight = fit(storage, "all", {"--num_workers", "2"});
  EXPECT_EQ(straight.process.exit_code, 0) << straight.process.err;
  std::vector<nlohmann::json> reports;
  for (auto& entry : straight.summary["best_checkpoints"]) reports.push_back(entry["metrics"]);
  std::sort(reports.begin(), reports.end(), [](auto& a, auto& b) { return a["step"] < b["step"]; });
  return reports;
}

// Same step, loss and parameters' squared norm; a resumed run with the same ranks is bit for bit the same.
void expect_same_end(const nlohmann::json& a, const nlohmann::json& b, double relative = 1e-9) {
  EXPECT_EQ(a["step"], b["step"]);
  EXPECT_NEAR(a["loss"].get<double>(), b["loss"].get<double>(), relative * std::abs(b["loss"].get<double>()));
  EXPECT_NEAR(a["param_sq_norm"].get<double>(), b["param_sq_norm"].get<double>(),
              relative * b["param_sq_norm"].get<double>());
}

std::vector<std::string> checkpoint_dirs(const std::string& run_dir) {
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(run_dir))
    if (e.is_directory() && e.path().filename().string().rfind("checkpoint_", 0) == 0)
      names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST(Trainer, ReportRegistersCheckpointsKeepsTheBestByScoreAndResultReadsBackFromPath) {
  const auto storage = temp_dir("trainer-keep");
  const auto reports = all_reports(storage);
  ASSERT_EQ(reports.size(), 4u);  // steps 10, 20, 30, 40
  for (size_t i = 0; i < reports.size(); ++i) EXPECT_EQ(reports[i]["step"], 10 * (i + 1));

  auto kept = fit(storage, "kept", {"--num_workers", "2", "--num_to_keep", "2", "--score", "loss"});
  ASSERT_EQ(kept.process.exit_code, 0) << kept.process.err;
  // The two lowest losses, and the latest (always kept until a newer one comes).
  std::vector<size_t> order{0, 1, 2, 3};
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return reports[a]["loss"].get<double>() < reports[b]["loss"].get<double>(); });
  std::set<std::string> expected{fmt::format("checkpoint_{:06d}", order[0]), fmt::format("checkpoint_{:06d}", order[1]),
                                 "checkpoint_000003"};
  const auto run_dir = storage + "/kept";
  auto on_disk = checkpoint_dirs(run_dir);
  EXPECT_EQ(std::set<std::string>(on_disk.begin(), on_disk.end()), expected);
  EXPECT_EQ(kept.summary["checkpoint"], run_dir + "/checkpoint_000003");
  expect_same_end(kept.summary["metrics"], reports[3]);
  // Best first, by the lowest loss.
  const auto& best = kept.summary["best_checkpoints"];
  ASSERT_EQ(best.size(), expected.size());
  for (size_t i = 1; i < best.size(); ++i)
    EXPECT_LE(best[i - 1]["metrics"]["loss"].get<double>(), best[i]["metrics"]["loss"].get<double>());
  // A checkpoint is a whole save_state directory: the Accelerator's manifest and the model are there.
  EXPECT_TRUE(fs::exists(run_dir + "/checkpoint_000003/MANIFEST.json")) << run_dir;

  // The same from storage alone.
  const auto again = xlr8::train::Result::from_path(run_dir);
  ASSERT_TRUE(again.checkpoint);
  EXPECT_EQ(again.checkpoint->path, run_dir + "/checkpoint_000003");
  EXPECT_EQ(again.metrics, kept.summary["metrics"]);
  ASSERT_EQ(again.best_checkpoints.size(), best.size());
  for (size_t i = 0; i < best.size(); ++i) EXPECT_EQ(again.best_checkpoints[i].first.path, best[i]["path"]);
  EXPECT_FALSE(again.error);
  fs::remove_all(storage);
}

TEST(Trainer, AWorkerKilledMidRunRestartsTheGroupWhichResumesAndEndsAsTheStraightRun) {
  const auto storage = temp_dir("trainer-kill");
  auto straight = fit(storage, "straight", {"--num_workers", "2"});
  ASSERT_EQ(straight.process.exit_code, 0) << straight.process.err;
  for (std::string how : {"kill", "throw", "exit"}) {
    SCOPED_TRACE(how);
    auto crashed = fit(storage, "crash_" + how, {"--num_workers", "2", "--max_failures", "1", "--crash", "1:25:" + how});
    ASSERT_EQ(crashed.process.exit_code, 0) << crashed.process.err;
    EXPECT_NE(crashed.process.err.find("xlr8 launch: rank 1 (local rank 1"), std::string::npos) << crashed.process.err;
    EXPECT_NE(crashed.process.err.find("restarting all 2 local worker(s) (restart 1 of 1)"), std::string::npos)
        << crashed.process.err;
    // The second group starts from the checkpoint of step 20, the last one before the failure.
    EXPECT_NE(crashed.process.out.find("resumed from " + storage + "/crash_" + how + "/checkpoint_000001 at step 20"),
              std::string::npos)
        << crashed.process.out;
    expect_same_end(crashed.summary["metrics"], straight.summary["metrics"]);
    EXPECT_FALSE(crashed.summary.contains("error"));
  }
  fs::remove_all(storage);
}

TEST(Trainer, FailuresBeyondMaxFailuresEndTheFitWithTheRootCause) {
  const auto storage = temp_dir("trainer-fail");
  auto failed = fit(storage, "thrown", {"--num_workers", "2", "--max_failures", "0", "--crash", "0:15:throw"});
  EXPECT_EQ(failed.process.exit_code, 1) << failed.process.err;
  const auto error = failed.summary.value("error", std::string());
  EXPECT_NE(error.find("training failed 1 time(s); the last time rank 0 failed first"), std::string::npos) << error;
  EXPECT_NE(error.find("xlr8::Error: injected failure at step 15 on rank 0 (from " + storage +
                       "/thrown/logs/fit_0/attempt_0/0/error.json)"),
            std::string::npos)
      << error;
  // The checkpoint of step 10 stays registered; the run reads back with its error.
  const auto result = xlr8::train::Result::from_path(storage + "/thrown");
  ASSERT_TRUE(result.error);
  EXPECT_EQ(result.error->rank, 0);
  EXPECT_EQ(result.error->failures, 1);
  EXPECT_NE(result.error->error_message.find("injected failure at step 15"), std::string::npos);
  ASSERT_TRUE(result.checkpoint);
  EXPECT_EQ(result.metrics["step"], 10);

  auto killed = fit(storage, "killed", {"--num_workers", "2", "--max_failures", "1", "--crash", "1:15:kill"});
  EXPECT_EQ(killed.process.exit_code, 0) << killed.process.err;  // one failure is within max_failures 1
  auto twice = fit(storage, "twice", {"--num_workers", "2", "--max_failures", "0", "--crash", "1:5:kill"});
  EXPECT_EQ(twice.process.exit_code, 1);
  EXPECT_NE(twice.summary.value("error", "").find("rank 1 failed first (killed by SIGKILL (signal 9))"),
            std::string::npos)
      << twice.summary.dump();
  EXPECT_FALSE(xlr8::train::Result::from_path(storage + "/twice").checkpoint);  // it died before step 10
  fs::remove_all(storage);
}

TEST(Trainer, ANewDriverWithTheSameNameResumesTheRunAndAnotherGroupSizeReshardsIt) {
  const auto storage = temp_dir("trainer-resume");
  auto straight = fit(storage, "straight", {"--num_workers", "2"});
  ASSERT_EQ(straight.process.exit_code, 0) << straight.process.err;
  auto first = fit(storage, "resumed", {"--num_workers", "2", "--steps", "20"});
  ASSERT_EQ(first.process.exit_code, 0) << first.process.err;
  EXPECT_NE(first.process.out.find("no checkpoint registered yet: starting fresh"), std::string::npos);
  auto second = fit(storage, "resumed", {"--num_workers", "2"});
  ASSERT_EQ(second.process.exit_code, 0) << second.process.err;
  EXPECT_NE(second.process.err.find("run \"resumed\" exists: its workers resume from checkpoint_000001"),
            std::string::npos)
      << second.process.err;
  expect_same_end(second.summary["metrics"], straight.summary["metrics"]);
  EXPECT_TRUE(fs::exists(storage + "/resumed/logs/fit_0") && fs::exists(storage + "/resumed/logs/fit_1"));

  // FSDP, sharded state: 2 workers save it, 3 load it (resharded) and go on with the same global batch
  // (2 x 48 = 3 x 32): the trajectory of 2 workers throughout, up to the reduction order's rounding.
  const auto config = storage + "/fsdp.yaml";
  std::ofstream(config) << "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                           "  fsdp_state_dict_type: SHARDED_STATE_DICT\n";
  const Args two_workers{"--num_workers", "2", "--batch_size", "48", "--config_file", config};
  Args straight_fsdp = two_workers, first_part = two_workers;
  straight_fsdp.insert(straight_fsdp.end(), {"--steps", "30"});
  first_part.insert(first_part.end(), {"--steps", "20"});
  auto whole = fit(storage, "fsdp_straight", straight_fsdp);
  ASSERT_EQ(whole.process.exit_code, 0) << whole.process.err;
  auto two = fit(storage, "reshard", first_part);
  ASSERT_EQ(two.process.exit_code, 0) << two.process.err;
  auto three = fit(storage, "reshard", {"--num_workers", "3", "--batch_size", "32", "--config_file", config, "--steps", "30"});
  ASSERT_EQ(three.process.exit_code, 0) << three.process.err;
  EXPECT_NE(three.process.out.find("checkpoint_000001 at step 20"), std::string::npos) << three.process.out;
  expect_same_end(three.summary["metrics"], whole.summary["metrics"], 1e-4);
  fs::remove_all(storage);
}

TEST(Trainer, ALoopWithoutEndTrainingThatReportsEveryStepFinishesCleanlyOnTwoRanks) {
  // The README's loop: save_state and report every step, no end_training(). Rank 0 serves the store that
  // report()'s last broadcast goes through; until fit() ended the group itself, rank 0 could exit while rank 1
  // still read it ("Broken pipe", 5 of 5 runs for the reporter; a race, so three runs here).
  const auto storage = temp_dir("trainer-no-end");
  for (int attempt = 0; attempt < 3; ++attempt) {
    SCOPED_TRACE(attempt);
    auto f = fit(storage, fmt::format("no_end_{}", attempt),
                 {"--num_workers", "2", "--max_failures", "0", "--model", "tiny", "--steps", "8", "--checkpoint_every",
                  "1", "--no_end_training"});
    EXPECT_EQ(f.process.exit_code, 0) << f.process.err;
    EXPECT_EQ(f.process.err.find("Broken pipe"), std::string::npos) << f.process.err;
    EXPECT_FALSE(f.summary.contains("error")) << f.summary.dump();
    EXPECT_EQ(f.summary["metrics"]["step"], 8);
    EXPECT_EQ(f.summary["checkpoint"], fmt::format("{}/no_end_{}/checkpoint_000007", storage, attempt));
  }
  fs::remove_all(storage);
}

TEST(Trainer, ACorruptNewestCheckpointIsSetAsideAndTheRunResumesFromTheOneBefore) {
  const auto storage = temp_dir("trainer-corrupt");
  const auto run_dir = storage + "/run";
  auto first = fit(storage, "run", {"--num_workers", "2"});  // checkpoints 0 to 3: steps 10 to 40
  ASSERT_EQ(first.process.exit_code, 0) << first.process.err;
  // One byte of the newest checkpoint's model data flipped, its size kept: only its CRC32 tells.
  const auto model = run_dir + "/checkpoint_000003/model.safetensors";
  ASSERT_TRUE(fs::exists(model));
  {
    std::fstream file(model, std::ios::in | std::ios::out | std::ios::binary);
    char byte = 0;
    file.seekg(-16, std::ios::end);
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x5a);
    file.seekp(-16, std::ios::end);
    file.write(&byte, 1);
  }
  // max_failures 0: a group that tried to load the corrupt checkpoint would end the fit.
  auto resumed = fit(storage, "run", {"--num_workers", "2", "--max_failures", "0"});
  ASSERT_EQ(resumed.process.exit_code, 0) << resumed.process.err;
  EXPECT_NE(resumed.process.err.find("checkpoint checkpoint_000003 fails its check ("), std::string::npos)
      << resumed.process.err;
  EXPECT_NE(resumed.process.err.find("model.safetensors fails its CRC32 check); it is kept as " + run_dir +
                                     "/checkpoint_000003.corrupt for inspection"),
            std::string::npos)
      << resumed.process.err;
  EXPECT_NE(resumed.process.out.find("resumed from " + run_dir + "/checkpoint_000002 at step 30"), std::string::npos)
      << resumed.process.out;
  // Kept for inspection, out of the run's record; the resumed run ends as the first one did.
  EXPECT_TRUE(fs::exists(run_dir + "/checkpoint_000003.corrupt/model.safetensors"));
  EXPECT_FALSE(fs::exists(run_dir + "/checkpoint_000003"));
  expect_same_end(resumed.summary["metrics"], first.summary["metrics"]);
  EXPECT_EQ(resumed.summary["checkpoint"], run_dir + "/checkpoint_000004");
  for (const auto& entry : resumed.summary["best_checkpoints"])
    EXPECT_EQ(entry["path"].get<std::string>().find("checkpoint_000003"), std::string::npos) << entry.dump();
  fs::remove_all(storage);
}

TEST(Trainer, ASecondDriverOfARunThatIsBeingDrivenIsRefused) {
  const auto storage = temp_dir("trainer-lock");
  Process first({kTrainer, "--storage_path", storage, "--name", "busy", "--num_workers", "2", "--steps", "400",
                 "--checkpoint_every", "100"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(storage + "/busy/logs/fit_0") && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(fs::exists(storage + "/busy/logs/fit_0"));
  auto second = fit(storage, "busy", {"--num_workers", "2"});
  EXPECT_EQ(second.process.exit_code, 1);
  EXPECT_NE(second.process.err.find("run " + storage + "/busy is being driven by another fit() now"), std::string::npos)
      << second.process.err;
  EXPECT_FALSE(fs::exists(storage + "/busy/logs/fit_1"));  // it launched nothing
  first.signal(SIGINT);  // the first driver's launcher stops its workers
  auto ended = first.wait(60);
  EXPECT_FALSE(ended.timed_out);
  fs::remove_all(storage);
}

TEST(Trainer, ConfigurationErrorsAreOneLineBeforeAnyWorkerStarts) {
  const auto storage = temp_dir("trainer-config");
  auto bad_workers = fit(storage, "bad", {"--num_workers", "0"});
  EXPECT_EQ(bad_workers.process.exit_code, 1);
  EXPECT_NE(bad_workers.process.err.find("ScalingConfig.num_workers 0 must be at least 1"), std::string::npos)
      << bad_workers.process.err;
  auto bad_keep = fit(storage, "bad", {"--num_to_keep", "-2"});
  EXPECT_NE(bad_keep.process.err.find("CheckpointConfig.num_to_keep -2 must be at least 1"), std::string::npos)
      << bad_keep.process.err;
  EXPECT_FALSE(fs::exists(storage + "/bad/logs"));  // nothing was launched
  // A score attribute the workers never report: every rank fails at the first report, naming what there is.
  auto bad_score = fit(storage, "score", {"--num_workers", "2", "--score", "accuracy"});
  EXPECT_EQ(bad_score.process.exit_code, 1);
  EXPECT_NE(bad_score.summary.value("error", "").find("checkpoint_score_attribute \"accuracy\" is not a number in the "
                                                     "metrics reported with checkpoint_000000 (they have: loss, "
                                                     "param_sq_norm, step, world_size)"),
            std::string::npos)
      << bad_score.summary.dump();
  EXPECT_TRUE(checkpoint_dirs(storage + "/score").empty());  // nothing half-registered
  // Under a launcher each rank would start a group of its own.
  auto launched = run({XLR8_BIN, "launch", "--num_processes", "1", kTrainer, "--storage_path", storage}, 60);
  EXPECT_NE(launched.exit_code, 0);
  EXPECT_NE(launched.err.find("Trainer::fit() starts its own workers: run this program directly, not under xlr8 launch"),
            std::string::npos)
      << launched.err;
  fs::remove_all(storage);
}

TEST(Trainer, AnElasticRangeOnOneMachineTakesTheWorkersItsCoresOfferAndRefusesTooFew) {
  auto storage = temp_dir("trainer-range");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto ranged = fit(storage, "ranged", {"--num_workers", "1:4", "--cpus_per_worker", "1", "--steps", "10"});
  ASSERT_EQ(ranged.process.exit_code, 0) << ranged.process.err;
  EXPECT_EQ(ranged.summary["metrics"]["world_size"], std::min(cores, 4)) << ranged.process.out;
  // Without --cpus_per_worker too: one core a worker (it took all 4 on 2 cores, which the fixed count warns against).
  auto unstated = fit(storage, "unstated", {"--num_workers", "1:4", "--steps", "2"});
  ASSERT_EQ(unstated.process.exit_code, 0) << unstated.process.err;
  EXPECT_EQ(unstated.summary["metrics"]["world_size"], std::min(cores, 4)) << unstated.process.out;
  auto few = fit(storage, "few", {"--num_workers", fmt::format("{}:{}", cores + 1, cores + 2), "--cpus_per_worker", "1"});
  EXPECT_NE(few.process.exit_code, 0);
  EXPECT_NE(few.process.err.find(fmt::format("ScalingConfig.num_workers {{{}, {}}}: this machine offers {} worker(s) ({} "
                                             "cores, resources_per_worker.cpus 1), fewer than the minimum",
                                             cores + 1, cores + 2, cores, cores)),
            std::string::npos)
      << few.process.err;
  // A fixed count above the cores trains (the program chose it) with a warning naming both numbers and the range form.
  auto over = fit(storage, "over", {"--num_workers", std::to_string(cores + 1), "--cpus_per_worker", "1", "--steps", "2"});
  ASSERT_EQ(over.process.exit_code, 0) << over.process.err;
  EXPECT_NE(over.process.err.find(fmt::format("ScalingConfig.num_workers {} (resources_per_worker.cpus 1) needs {} cores "
                                              "and this machine has {}",
                                              cores + 1, cores + 1, cores)),
            std::string::npos)
      << over.process.err;
}

// The example's own flags: a worker count that is not whole and a crash that cannot happen are refused before any
// worker starts (they were read as 2, 1 and 1:2, or injected nothing, or failed in every worker).
TEST(Trainer, TheExamplesCountsAndCrashesThatCannotBeAreRefusedAtTheDriver) {
  for (const char* workers : {"2x", "1.5", "1:2:3"}) {
    auto r = run({kTrainer, "--num_workers", workers, "--steps", "1"}, 30);
    EXPECT_EQ(r.exit_code, 2) << workers;
    EXPECT_NE(r.err.find("give N or MIN:MAX"), std::string::npos) << r.err;
  }
  for (const char* crash : {"1:5:boom", "5:5:kill", "1:5"}) {
    auto r = run({kTrainer, "--num_workers", "2", "--crash", crash, "--steps", "1"}, 30);
    EXPECT_EQ(r.exit_code, 2) << crash;
    EXPECT_NE(r.err.find("give RANK:STEP:kill|throw|exit with a rank below the workers (2)"), std::string::npos) << r.err;
  }
}
