// examples/gpt with its optimizer's state on disk (issue 47; DeepSpeed's offload_optimizer device nvme through
// Accelerate's keys and through a JSON), launched for real: the same training as in memory, bitwise; checkpoints
// hold the real state; a job killed with SIGKILL leaves its swap files, which the resumed job removes, and ends as
// the straight run.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "gpt_runs.hpp"

namespace {

using namespace gpt_runs;
namespace fs = std::filesystem;

Args tiny_gpt(const std::string& dir, int steps, Args more = {}) {
  return concat({"--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32", "--batch_size", "2",
                 "--lr", "3e-3", "--val_windows", "16", "--gradient_accumulation_steps", "2", "--max_grad_norm",
                 "0.5", "--output_dir", dir, "--max_steps", std::to_string(steps)},
                more);
}

Args on_disk(const std::string& swap_dir, bool params = false) {
  Args a{"--offload_optimizer_device", "nvme", "--offload_optimizer_nvme_path", swap_dir};
  return params ? concat(a, {"--offload_param_device", "nvme", "--offload_param_nvme_path", swap_dir}) : a;
}

size_t swap_files_in(const std::string& dir) {
  size_t n = 0;
  if (fs::exists(dir))
    for (const auto& e : fs::directory_iterator(dir)) n += e.path().extension() == ".swap";
  return n;
}

void expect_same_training(const nlohmann::json& got, const nlohmann::json& want, const std::string& got_dir,
                          const std::string& want_dir) {
  ASSERT_TRUE(got.contains("final_train_loss") && want.contains("final_train_loss")) << got << want;
  EXPECT_EQ(got["final_train_loss"], want["final_train_loss"]);
  EXPECT_EQ(got["val_loss"], want["val_loss"]);
  expect_same_params(got_dir, want_dir, 0.0);
}

}  // namespace

// ZeRO-3 on 1, 2 and 3 ranks with the parameters on disk too, ZeRO-3 and ZeRO-2 (a JSON with its buffers and aio
// section) on 2, with accumulation and clipping: the run with the state on disk equals the one in memory; the swap
// files are gone at exit.
TEST(GptOffloadDisk, ZeroThreeAndTwoOnOneTwoAndThreeRanksEqualTheRunInMemory) {
  // The same JSON in memory: nothing but the offload differs (bucket sizes would change the reductions' rounding).
  const auto json = temp_dir("gpt-disk-json") + "/zero2.json", json_in_memory = temp_dir("gpt-disk-json") + "/mem.json";
  const auto json_swap = temp_dir("gpt-disk-json-swap");
  const std::string head = R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 2)";
  std::ofstream(json) << head << R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" << json_swap
                      << R"(", "buffer_count": 8, "pipeline_read": true, "pipeline_write": true}},
      "aio": {"block_size": 262144, "intra_op_parallelism": 2}})";
  std::ofstream(json_in_memory) << head << "}}";
  struct Layout {
    std::string name;
    int ranks;
    Args in_memory, with_disk;
  };
  const auto swap = temp_dir("gpt-disk-swap");
  std::vector<Layout> layouts;
  const Args zero3{"--use_deepspeed", "--zero_stage", "3"};
  for (int ranks : {1, 2, 3})
    layouts.push_back({fmt::format("zero 3 on {}, parameters on disk too", ranks), ranks, zero3,
                       concat(zero3, on_disk(swap, /*params=*/true))});
  // DeepSpeed's zero.Init (zero3_init_flag, unset: on at ZeRO-3) has the processes record their build and each
  // group's values computed when it is made; they are the whole build's, so every run equals the one in memory,
  // and so does the model built whole.
  layouts.push_back({"zero 3 on 1, parameters on disk, zero3_init_flag false", 1, zero3,
                     concat(concat(zero3, on_disk(swap, /*params=*/true)), {"--zero3_init_flag", "false"})});
  layouts.push_back({"zero 3 on 2", 2, zero3, concat(zero3, on_disk(swap))});
  layouts.push_back({"zero 2 (JSON) on 2", 2, {"--use_deepspeed", "--deepspeed_config_file", json_in_memory},
                     {"--use_deepspeed", "--deepspeed_config_file", json}});
  for (const auto& [name, ranks, in_memory, with_disk] : layouts) {
    SCOPED_TRACE(name);
    const auto memory_dir = temp_dir("gpt-disk-off"), disk_dir = temp_dir("gpt-disk-on");
    const auto want = json_of(launch_gpt(ranks, in_memory, tiny_gpt(memory_dir, 6)));
    const auto got = json_of(launch_gpt(ranks, with_disk, tiny_gpt(disk_dir, 6)));
    expect_same_training(got, want, disk_dir, memory_dir);
    const auto disk = got.value("optimizer_on_disk", nlohmann::json());
    ASSERT_TRUE(disk.is_object()) << got.dump();
    EXPECT_EQ(disk["swapped_steps"], 6);
    EXPECT_GT(disk["swap_bytes_read"].get<int64_t>(), 0);
    EXPECT_GT(disk["swap_bytes_written"].get<int64_t>(), 0);
    const bool recorded = name.rfind("zero 3", 0) == 0 && name.find("zero3_init_flag false") == std::string::npos;
    EXPECT_EQ(got.value("groups_computed_when_made", -1) > 0, recorded) << got.dump();
    if (name.find("parameters on disk") != std::string::npos) {
      EXPECT_GT(got.value("parameters_on_disk", nlohmann::json::object()).value("shard_reads", 0), 0) << got.dump();
    }
    EXPECT_EQ(swap_files_in(swap) + swap_files_in(json_swap), 0u);
  }
}

// Parameters and state on disk. Saved at step 3 and resumed to 40: the checkpoint held what was on disk, and the
// resumed run's went back there. Killed with SIGKILL mid-run, the job leaves its swap files; the resumed one removes them and ends as
// the straight run.
TEST(GptOffloadDisk, ACheckpointHoldsTheStateAndAJobKilledMidRunResumesAsTheStraightOne) {
  const Args zero3{"--use_deepspeed", "--zero_stage", "3"};
  const auto swap = temp_dir("gpt-disk-resume-swap");
  const auto straight_dir = temp_dir("gpt-disk-straight");
  const auto both = on_disk(swap, /*params=*/true);
  const auto straight = json_of(launch_gpt(2, concat(zero3, both), tiny_gpt(straight_dir, 40)));
  const auto split_dir = temp_dir("gpt-disk-split");
  const auto saved = json_of(launch_gpt(2, concat(zero3, both), tiny_gpt(split_dir, 3, {"--checkpoint_every", "3"})));
  const auto resumed = json_of(launch_gpt(2, concat(zero3, both), tiny_gpt(split_dir, 40, {"--resume_from", "latest"})));
  expect_same_training(resumed, straight, split_dir, straight_dir);
  // The save read the state one group at a time and the load wrote it so: never the whole state in memory, and each
  // group read once (the save), or at most once (the load: a group whose state was on disk).
  for (const auto& run : {saved, resumed}) {
    const auto disk = run.value("optimizer_on_disk", nlohmann::json::object());
    EXPECT_EQ(disk.value("checkpoint_groups_in_memory_most", 0), 1) << run.dump();
    EXPECT_GT(disk.value("swapped_groups", 0), 2) << run.dump();
    EXPECT_LE(disk.value("checkpoint_group_reads", 0), disk.value("swapped_groups", 0)) << run.dump();
  }
  EXPECT_EQ(saved["optimizer_on_disk"].value("checkpoint_group_reads", 0),
            saved["optimizer_on_disk"].value("swapped_groups", 0));

  const auto killed_dir = temp_dir("gpt-disk-killed");
  {
    auto command = concat(concat({kXlr8, "launch", "--num_processes", "2"}, concat(zero3, both)), {kGpt});
    Process job(concat(command, tiny_gpt(killed_dir, 40, {"--checkpoint_every", "2"})));
    const auto first = killed_dir + "/checkpoints/checkpoint_0/MANIFEST.json";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!fs::exists(first) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(fs::exists(first));
    kill(-job.pid(), SIGKILL);
    job.wait(30);
  }
  EXPECT_EQ(swap_files_in(swap), 4u);  // each rank's two (state and parameters), left by the kill
  auto r = launch_gpt(2, concat(zero3, both), tiny_gpt(killed_dir, 40, {"--resume_from", "latest"}));
  EXPECT_NE((r.out + r.err).find("stale swap file(s)"), std::string::npos) << r.err;
  expect_same_training(json_of(r), straight, killed_dir, straight_dir);
  EXPECT_EQ(swap_files_in(swap), 0u);
}

// The gradients on disk too (XLR8_GRADIENTS_ON_DISK=1), ZeRO-3 with everything on disk on 2 ranks with accumulation
// and clipping, in fp32, in fp16 (whose unscaling and overflow check are queued for, or read from, the gradients on
// disk), and in fp16 from a JSON whose initial loss scale overflows (the first steps skipped: their gradients are never
// read): the same training as with the gradients in memory, bitwise. Without the optimizer's state on disk, or with a
// pipeline, the variable is one clear error.
TEST(GptOffloadDisk, GradientsOnDiskTooTrainAsInMemory) {
  const Args zero3{"--use_deepspeed", "--zero_stage", "3"};
  const auto swap = temp_dir("gpt-disk-gradients-swap");
  // On the CPU the gradients stay fp32 under fp16's autocast: only a scale near fp32's limit overflows (2^128: twice).
  const auto json = temp_dir("gpt-disk-gradients-json") + "/fp16.json";
  std::ofstream(json) << R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "fp16": {"enabled": true, "initial_scale_power": 128, "hysteresis": 1},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" << swap << R"("},
                            "offload_param": {"device": "nvme", "nvme_path": ")" << swap << R"("}}})";
  const std::map<std::string, std::string> gradients_on_disk{{"XLR8_GRADIENTS_ON_DISK", "1"}};
  struct Variant {
    std::string name;
    Args launcher;
  };
  const std::vector<Variant> variants{
      {"fp32", concat(concat(zero3, on_disk(swap, true)), {"--mixed_precision", "no"})},
      {"fp16", concat(concat(zero3, on_disk(swap, true)), {"--mixed_precision", "fp16"})},
      {"fp16 overflowing", {"--use_deepspeed", "--deepspeed_config_file", json}}};
  for (const auto& [name, launcher] : variants) {
    SCOPED_TRACE(name);
    const auto memory_dir = temp_dir("gpt-gradients-in-memory"), disk_dir = temp_dir("gpt-gradients-on-disk");
    const auto want = json_of(launch_gpt(2, launcher, tiny_gpt(memory_dir, 6)));
    const auto got = json_of(launch_gpt(2, launcher, tiny_gpt(disk_dir, 6), true, gradients_on_disk));
    expect_same_training(got, want, disk_dir, memory_dir);
    const auto disk = got.value("optimizer_on_disk", nlohmann::json::object());
    EXPECT_TRUE(disk.value("gradients_on_disk", false)) << got.dump();
    // Written once per group and synchronising backward (accumulation writes at the sync micro-batch only), read once
    // per group by each of the 6 steps applied; a step fp16 skips (the example trains on until 6 apply) reads none.
    const int64_t writes = disk.value("gradient_writes", 0), reads = disk.value("gradient_reads", 0);
    const int64_t groups = disk.value("swapped_groups", 0);
    EXPECT_EQ(reads, 6 * groups) << got.dump();
    if (name == "fp16 overflowing") {
      // At 2^128 a gradient above 1 overflows, at 2^127 above 2, ...: how many steps skip depends on the batches
      // (two or three here); each skipped step wrote its gradients and read none.
      EXPECT_GT(writes, reads) << got.dump();
      EXPECT_EQ((writes - reads) % std::max<int64_t>(groups, 1), 0) << got.dump();
    } else {
      EXPECT_EQ(writes, reads) << got.dump();
    }
    // fp32's norms are the ones taken at the writes; fp16's clip follows the queued unscaling, and reads.
    if (name == "fp32") EXPECT_EQ(disk.value("gradient_reads_for_norms", -1), 0) << got.dump();
    else EXPECT_GT(disk.value("gradient_reads_for_norms", 0), 0) << got.dump();
    EXPECT_EQ(swap_files_in(swap), 0u);
  }
  const auto r = launch_gpt(2, zero3, tiny_gpt(temp_dir("gpt-gradients-refused"), 2), false, gradients_on_disk);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("XLR8_GRADIENTS_ON_DISK=1: the gradients go to the optimizer's swap file"), std::string::npos)
      << r.err;
  // Nor with a pipeline (its stages clip their gradients in memory).
  const auto pp = launch_gpt(2, concat(concat(zero3, on_disk(swap)), {"--parallelism_config_pp_size", "2"}),
                             tiny_gpt(temp_dir("gpt-gradients-refused-pp"), 2), false, gradients_on_disk);
  EXPECT_NE(pp.exit_code, 0);
  EXPECT_NE(pp.err.find("XLR8_GRADIENTS_ON_DISK=1 with parallelism_config_pp_size 2"), std::string::npos) << pp.err;
}

// DeepSpeed's zero3_init_flag with its blocks as leaf modules and everything on disk (one process): each block's
// values are computed as its unit is made and the unit starts freed (its shard on disk), so the first forward
// reads every block from disk where a model built whole finds them still gathered; the training is the same.
TEST(GptOffloadDisk, Zero3InitFlagComputesEachLeafUnitAsMadeAndStartsItFreed) {
  const auto dir = temp_dir("gpt-zero3-init-json"), swap = temp_dir("gpt-zero3-init-swap");
  const std::string head = R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "leaf_module": {"classes": ["Block"]})";
  std::ofstream(dir + "/disk.json") << head << R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" << swap
                                    << R"("}, "offload_param": {"device": "nvme", "nvme_path": ")" << swap << R"("}}})";
  std::ofstream(dir + "/memory.json") << head << "}}";
  const Args disk{"--use_deepspeed", "--deepspeed_config_file", dir + "/disk.json"};
  const auto memory_dir = temp_dir("gpt-z3i-mem"), whole_dir = temp_dir("gpt-z3i-whole"), made_dir = temp_dir("gpt-z3i");
  const auto want = json_of(launch_gpt(1, {"--use_deepspeed", "--deepspeed_config_file", dir + "/memory.json"},
                                       tiny_gpt(memory_dir, 4)));
  const auto whole = json_of(launch_gpt(1, concat(disk, {"--zero3_init_flag", "false"}), tiny_gpt(whole_dir, 4)));
  const auto made = json_of(launch_gpt(1, concat(disk, {"--zero3_init_flag", "true"}), tiny_gpt(made_dir, 4)));
  expect_same_training(made, want, made_dir, memory_dir);
  expect_same_training(whole, want, whole_dir, memory_dir);
  EXPECT_EQ(whole.value("groups_computed_when_made", -1), 0) << whole;
  EXPECT_GE(made.value("groups_computed_when_made", 0), 3) << made;  // both blocks and the root
  auto reads = [](const nlohmann::json& r) { return r.value("parameters_on_disk", nlohmann::json::object()).value("shard_reads", 0); };
  EXPECT_EQ(reads(made), reads(whole) + 2) << "each block read once more, at the first forward: " << made << whole;
  EXPECT_EQ(swap_files_in(swap), 0u);
}

// DeepSpeed's zero.Init on 3 ranks (the flag unset: on at ZeRO-3, as Accelerate's default): every rank records its
// build, rank 0 computes each group's values as the group is made and sends them, the blocks (leaf modules) start
// freed, so no rank holds the whole model; the training equals the run that builds it whole on every rank (with
// dropout: every rank's generator continues as after building whole).
TEST(GptZero3Init, EveryRankRecordsItsBuildAndHoldsTheWholeModelNowhere) {
  const auto json = temp_dir("gpt-z3i-ranks-json") + "/zero3.json";
  std::ofstream(json) << R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Block"]}}})";
  auto gpt = [&](const Args& flag, const std::string& dir) {
    // 14.3 M parameters (57 MB in fp32).
    return json_of(launch_gpt(3, concat({"--use_deepspeed", "--deepspeed_config_file", json}, flag),
                              {"--n_layer", "8", "--d_model", "384", "--n_head", "6", "--seq_len", "32", "--batch_size",
                               "1", "--max_steps", "2", "--val_windows", "8", "--dropout", "0.1", "--output_dir", dir}));
  };
  const auto on_dir = temp_dir("gpt-z3i-ranks-on"), off_dir = temp_dir("gpt-z3i-ranks-off");
  const auto on = gpt({}, on_dir), off = gpt({"--zero3_init_flag", "false"}, off_dir);
  const auto peaks = gpt_runs::same_training_and_setup_peaks(on, off, on_dir, off_dir, 3);
  EXPECT_GE(on.value("groups_computed_when_made", 0), 9) << on;  // 8 blocks and more
  EXPECT_EQ(off.value("groups_computed_when_made", -1), 0) << off;
  for (size_t r = 0; r < 3; ++r) EXPECT_GT(peaks.off[r] - peaks.on[r], 0.5 * peaks.model_mb) << "rank " << r << on << off;
}
