// `xlr8 launch`'s argument rules, with real programs: `--` ends the launcher's options, and everything
// from the program's name on is the program's, even words that look like launcher options or --help. And what
// keeps two launches apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"
#include "xlr8/launcher.hpp"

using Args = std::vector<std::string>;

TEST(LaunchArguments, DoubleDashEndsTheLauncherOptions) {
  auto r = run({kXlr8, "launch", "--num_processes", "2", "--", "sh", "-c", "echo rank=$RANK of $WORLD_SIZE"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("rank=0 of 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank=1 of 2"), std::string::npos) << r.out;
  auto t = run({kXlr8, "launch", "--num_processes", "1", "--", "true"});
  EXPECT_EQ(t.exit_code, 0) << t.err;
  auto f = run({kXlr8, "launch", "--num_processes", "1", "--", "sh", "-c", "exit 7"});
  EXPECT_EQ(f.exit_code, 7) << f.err;  // the program's own code, not the launcher's
}

TEST(LaunchArguments, WordsAfterTheProgramAreTheProgramsEvenLauncherOptions) {
  // With and without `--`, with `--opt=value` and a flag before the program.
  const Args script{"sh", "-c", "echo \"[$RANK/$WORLD_SIZE] $*\"", "sh", "--num_processes", "7", "--", "--cpu"};
  for (Args options : {Args{"--num_processes", "2"}, Args{"--num_processes=2", "--cpu"},
                       Args{"--cpu", "--num_processes", "2", "--"}}) {
    Args a{kXlr8, "launch"};
    a.insert(a.end(), options.begin(), options.end());
    a.insert(a.end(), script.begin(), script.end());
    auto r = run(a);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(occurrences(r.out, "/2] --num_processes 7 -- --cpu"), 2u) << r.out;
    EXPECT_EQ(occurrences(r.out, "/7]"), 0u) << r.out;
  }
}

TEST(LaunchArguments, HelpAfterTheProgramIsTheProgramsHelp) {
  auto r = run({kXlr8, "launch", "--num_processes", "1", kTrain, "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("xlr8 oracle worker"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Start the worker processes"), std::string::npos) << r.out;
  auto own = run({kXlr8, "launch", "--help"});
  EXPECT_EQ(own.exit_code, 0) << own.err;
  EXPECT_NE(own.out.find("Start the worker processes"), std::string::npos) << own.out;
}

TEST(LaunchArguments, AnUnknownOptionBeforeTheProgramIsOneClearLine) {
  auto r = run({kXlr8, "launch", "--num_process", "2", "--", "true"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("unknown option --num_process (did you mean --num_processes?)"), std::string::npos) << r.err;
  auto none = run({kXlr8, "launch", "--num_processes", "2", "--"});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("no program given"), std::string::npos) << none.err;
}

// A misspelt option that begins a real one, or shares most of its start, is named too; a value of the wrong kind is
// one xlr8 line naming the option, the value and what it takes (CLI11's own "Could not convert" before, exit 104);
// a bad XLR8_TRACE_BUFFER_SIZE stops each worker instead of being ignored.
TEST(LaunchArguments, MisspeltOptionsAndValuesOfTheWrongKindAreOneClearLine) {
  auto config = run({kXlr8, "launch", "--config", "x.yaml", "--", "true"});
  EXPECT_EQ(config.exit_code, 1);
  EXPECT_NE(config.err.find("unknown option --config (did you mean --config_file?)"), std::string::npos) << config.err;
  auto procs = run({kXlr8, "launch", "--num_procs", "2", "--", "true"});
  EXPECT_NE(procs.err.find("unknown option --num_procs (did you mean --num_processes?)"), std::string::npos) << procs.err;
  auto port = run({kXlr8, "launch", "--num_processes", "1", "--main_process_port", "abc", "--", "true"});
  EXPECT_EQ(port.exit_code, 1);
  EXPECT_NE(port.err.find("xlr8: error: --main_process_port takes a whole number, not \"abc\""), std::string::npos)
      << port.err;
  auto steps = run({kXlr8, "launch", "--num_processes", "1", "--gradient_accumulation_steps", "2.5", "--", "true"});
  EXPECT_NE(steps.err.find("--gradient_accumulation_steps takes a whole number, not \"2.5\""), std::string::npos)
      << steps.err;
  auto trace = run({kXlr8, "launch", "--num_processes", "1", kTrain, "--steps", "1"}, 60, {{"XLR8_TRACE_BUFFER_SIZE", "abc"}});
  EXPECT_NE(trace.exit_code, 0);
  EXPECT_NE(trace.err.find("XLR8_TRACE_BUFFER_SIZE=\"abc\" must be a whole number of collectives from 0"),
            std::string::npos)
      << trace.err;
}

// What the other commands were given wrongly, each one line before any work: an option given twice (CLI11's own
// text, exit 114, before), advise's --budget_s 0 and a negative --max_memory_per_rank (which named other things),
// verify's --rtol nan (which passed every comparison), merge-weights into the checkpoint it
// reads (it overwrote the checkpoint's model file), a Trainer run name that leaves storage_path, and examples/gpt
// with nothing held out (it stopped with "the text has 1 bytes").
TEST(LaunchArguments, OtherCommandsRefuseWhatTheyWereGivenWronglyInOneLine) {
  auto twice = run({kXlr8, "launch", "--num_processes", "2", "--num_processes", "1", "--", "true"});
  EXPECT_EQ(twice.exit_code, 1);
  EXPECT_NE(twice.err.find("was given more than once; give it once"), std::string::npos) << twice.err;
  auto budget = run({kXlr8, "advise", "--num_processes", "2", "--budget_s", "0", kTrain});
  EXPECT_NE(budget.err.find("xlr8: error: --budget_s: must be above 0, not 0"), std::string::npos) << budget.err;
  auto memory = run({kXlr8, "advise", "--num_processes", "2", "--max_memory_per_rank", "-1GB", kTrain, "--batch", "8"});
  EXPECT_NE(memory.err.find("--max_memory_per_rank \"-1GB\" must be a size above 0"), std::string::npos) << memory.err;
  auto rtol = run({kXlr8, "verify", "--num_processes", "2", "--rtol", "nan", kTrain, "--batch", "8"});
  EXPECT_EQ(rtol.exit_code, 1);
  EXPECT_NE(rtol.err.find("--rtol nan must be a finite relative tolerance"), std::string::npos) << rtol.err;
  const auto dir = temp_dir("bad-tool-input");
  const Args tiny{"--n_layer", "1", "--d_model", "16", "--n_head", "2", "--seq_len", "16", "--batch_size", "2"};
  Args gpt{kGpt, "--max_steps", "1", "--checkpoint_every", "1", "--val_windows", "0", "--output_dir", dir};
  gpt.insert(gpt.end(), tiny.begin(), tiny.end());
  auto trained = run(gpt, 120);
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  EXPECT_TRUE(last_json(trained.out)["val_loss"].is_null()) << trained.out;
  gpt.push_back("--pipeline");
  auto piped = run(gpt, 120);
  ASSERT_EQ(piped.exit_code, 0) << piped.err;
  EXPECT_TRUE(last_json(piped.out)["val_loss"].is_null()) << piped.out;
  const auto checkpoint = dir + "/checkpoints/checkpoint_0";
  const auto model_before = read_file(checkpoint + "/model.safetensors");
  for (const auto& into : {checkpoint, checkpoint + "/inside"}) {
    auto merged = run({kXlr8, "merge-weights", checkpoint, into, "--dtype", "bf16"});
    EXPECT_EQ(merged.exit_code, 1) << merged.out;
    EXPECT_NE(merged.err.find("is the checkpoint " + checkpoint + " or inside it"), std::string::npos) << merged.err;
  }
  EXPECT_EQ(read_file(checkpoint + "/model.safetensors"), model_before);
  EXPECT_EQ(run({kXlr8, "merge-weights", checkpoint, dir + "/merged"}).exit_code, 0);
  auto escaped = run({kTrainer, "--num_workers", "1", "--steps", "1", "--storage_path", dir + "/runs", "--name", ".."});
  EXPECT_NE(escaped.exit_code, 0);
  EXPECT_NE(escaped.err.find("RunConfig.name \"..\" must be one directory name under storage_path"), std::string::npos)
      << escaped.err;
}

// `accelerate launch`'s TorchDynamo and TPU flags are options here too (as often copied from its command lines):
// off is accepted, on is refused in one line as the config file's keys are.
TEST(LaunchArguments, AccelerateLaunchsDynamoFlagsAreAcceptedOffAndRefusedOn) {
  auto off = run({kXlr8, "launch", "--num_processes", "1", "--dynamo_backend", "no", "--dynamo_mode", "default",
                  "--main_training_function", "main", "--", "true"});
  EXPECT_EQ(off.exit_code, 0) << off.err;
  auto on = run({kXlr8, "launch", "--num_processes", "1", "--dynamo_backend", "inductor", "--", "true"});
  EXPECT_EQ(on.exit_code, 1);
  EXPECT_NE(on.err.find("asks for torch.compile (TorchDynamo)"), std::string::npos) << on.err;
  auto tpu = run({kXlr8, "launch", "--num_processes", "1", "--downcast_bf16", "--", "true"});
  EXPECT_EQ(tpu.exit_code, 1);
  EXPECT_NE(tpu.err.find("downcast_bf16"), std::string::npos) << tpu.err;
}

// torchrun's --nproc_per_node cpu and auto (no GPU here: the cores) start one worker per core; gpu, with none, is one
// clear line.
TEST(LaunchArguments, NprocPerNodeTakesTorchrunsCpuGpuAndAuto) {
  const auto cores = std::to_string(std::max(1u, std::thread::hardware_concurrency()));
  const bool gpus = std::filesystem::exists("/proc/driver/nvidia/gpus");  // then auto means the GPUs
  for (const char* words : {"cpu", "auto"}) {
    if (gpus && std::string(words) == "auto") continue;
    auto r = run({kXlr8, "launch", "--nproc_per_node", words, "--", "sh", "-c", "echo world=$WORLD_SIZE"});
    ASSERT_EQ(r.exit_code, 0) << words << ": " << r.err;
    EXPECT_NE(r.out.find("world=" + cores), std::string::npos) << words << ": " << r.out;
  }
  auto typo = run({kXlr8, "launch", "--nproc_per_node", "abc", "--", "true"});
  EXPECT_NE(typo.err.find("takes a whole number, not \"abc\""), std::string::npos) << typo.err;  // not INT:N|auto...
  if (!gpus) {
    auto gpu = run({kXlr8, "launch", "--nproc_per_node", "gpu", "--", "true"});
    EXPECT_EQ(gpu.exit_code, 1);
    EXPECT_NE(gpu.err.find("this machine shows no NVIDIA GPU"), std::string::npos) << gpu.err;
  }
}

TEST(LaunchJobs, ARankOfAnotherJobThatReachesThisJobsRendezvousIsRefusedNamingBothAndThisJobTrainsOn) {
  // Job A on one machine; then a rank of job B (machine 1 of 2, one process each, told A's port, as two launches
  // that picked one free port at once would be) reaches A's rendezvous. Both are "2 ranks": only A's own run id
  // tells them apart.
  const int port = xlr8::pick_free_port();
  const std::string out = temp_dir("two-jobs");
  Process a({kXlr8, "launch", "--num_processes", "2", "--main_process_port", std::to_string(port), kTrain, "--batch", "8",
             "--steps", "30", "--step_sleep_ms", "100", "--print_steps", "--out", out + "/a"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (a.out_so_far().find("step 1") == std::string::npos && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_NE(a.out_so_far().find("step 1"), std::string::npos) << a.err_so_far();
  auto b = run({kXlr8, "launch", "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2", "--main_process_ip",
                "127.0.0.1", "--main_process_port", std::to_string(port), kTrain, "--batch", "8", "--steps", "2", "--out",
                out + "/b"},
               60);
  EXPECT_NE(b.exit_code, 0) << b.out << b.err;
  EXPECT_NE(b.err.find("rank 1 (this job with 2 ranks) reached the rendezvous server"), std::string::npos) << b.err;
  EXPECT_NE(b.err.find("of another job (torchelastic:xlr8-"), std::string::npos) << b.err;
  auto done = a.wait(120);
  EXPECT_EQ(done.exit_code, 0) << done.out << done.err;
  EXPECT_NE(done.out.find("step 30"), std::string::npos) << done.out;
}

// Accelerate's fp8 flags, through the real launcher to a real worker's environment: the variables
// `accelerate launch` exports (the backend upper-cased, which Accelerate's own Accelerator requires).
TEST(LaunchArguments, Fp8FlagsReachTheWorkersAsAccelerateLaunchExportsThem) {
  auto r = run({kXlr8, "launch", "--num_processes", "1", "--mixed_precision", "fp8", "--fp8_backend", "te", "--fp8_format",
                "e4m3", "--fp8_override_linear_precision", "true,false,1", "--fp8_use_autocast_during_eval",
                "--fp8_pad_inner_dim", "no", "--", "sh", "-c", "env | grep ^ACCELERATE_"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (auto line : {"ACCELERATE_MIXED_PRECISION=fp8", "ACCELERATE_FP8_BACKEND=TE", "ACCELERATE_FP8_FORMAT=E4M3",
                    "ACCELERATE_FP8_OVERRIDE_FPROP=True", "ACCELERATE_FP8_OVERRIDE_DGRAD=False",
                    "ACCELERATE_FP8_OVERRIDE_WGRAD=True", "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL=True",
                    "ACCELERATE_FP8_PAD_INNER_DIM=False", "ACCELERATE_FP8_AMAX_HISTORY_LEN=1024"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  auto msamp = run({kXlr8, "launch", "--num_processes", "1", "--mixed_precision", "fp8", "--fp8_backend", "msamp", "--",
                    "true"});
  EXPECT_NE(msamp.exit_code, 0);
  EXPECT_NE(msamp.err.find("fp8_config.backend: MSAMP"), std::string::npos) << msamp.err;
}
