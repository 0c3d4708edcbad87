// `xlr8 launch` and the CLI, with real processes: environment, fail-fast, signals, restarts,
// rendezvous failures, two "machines" on loopback, output handling and bad input.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "os/cpu_affinity.hpp"
#include "process_runner.hpp"
#include "programs.hpp"
#include "xlr8/config.hpp"
#include "xlr8/launcher.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {


Args launch(Args options, Args program) {
  Args a{kXlr8, "launch"};
  a.insert(a.end(), options.begin(), options.end());
  a.push_back(kWorker);
  a.insert(a.end(), program.begin(), program.end());
  return a;
}

// One of two launchers ("machines" on loopback) of a job with `processes` ranks in all.
Args two_machines(int port, int machine_rank, int processes, Args program) {
  return launch({"--num_processes", std::to_string(processes), "--num_machines", "2", "--machine_rank",
                 std::to_string(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
                 std::to_string(port)},
                std::move(program));
}

std::map<std::string, std::string> read_env_file(const std::string& path) {
  std::map<std::string, std::string> vars;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq != std::string::npos) vars[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return vars;
}

std::vector<pid_t> read_pids(const std::string& dir) {
  std::vector<pid_t> pids;
  for (auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().rfind("pid", 0) == 0) pids.push_back(std::stoi(read_file(entry.path())));
  return pids;
}

void wait_for_files(const std::string& dir, size_t count, double timeout_s = 30) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    size_t n = 0;
    for (auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().rfind("pid", 0) == 0;
    if (n >= count) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void expect_all_dead(const std::vector<pid_t>& pids) {
  // The launcher reaps its workers before it exits; give the kernel a moment for anything reparented.
  for (int i = 0; i < 50; ++i) {
    bool any = false;
    for (pid_t p : pids) any = any || process_alive(p);
    if (!any) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t p : pids) EXPECT_FALSE(process_alive(p)) << "worker pid " << p << " was left behind";
}


}  // namespace

class WorkerEnvironment : public ::testing::TestWithParam<int> {};

TEST_P(WorkerEnvironment, EachWorkerSeesTheTorchrunAndAccelerateVariables) {
  const int n = GetParam();
  auto dir = temp_dir("env");
  // A strategy under fsdp_reshard_after_forward (how `accelerate config` writes FSDP1's) loses to the explicit
  // --fsdp_sharding_strategy, as FSDP_SHARDING_STRATEGY wins in Accelerate.
  auto r = run(launch({"--num_processes", std::to_string(n), "--mixed_precision", "bf16", "--use_fsdp",
                       "--fsdp_reshard_after_forward", "FULL_SHARD", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
                       "--num_cpu_threads_per_process", "3"},
                      {"env", dir}),
               60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string port;
  for (int rank = 0; rank < n; ++rank) {
    auto vars = read_env_file(fmt::format("{}/rank{}.env", dir, rank));
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(vars["WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(vars["NODE_RANK"], "0");
    EXPECT_EQ(vars["GROUP_RANK"], "0");
    EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(vars["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(vars["ACCELERATE_MIXED_PRECISION"], "bf16");
    EXPECT_EQ(vars["ACCELERATE_USE_FSDP"], "true");
    EXPECT_EQ(vars["FSDP_SHARDING_STRATEGY"], "SHARD_GRAD_OP");
    EXPECT_EQ(vars["OMP_NUM_THREADS"], "3");
    EXPECT_EQ(vars["XLR8_LAUNCHED"], "1");
    EXPECT_FALSE(vars["MASTER_PORT"].empty());
    if (rank == 0) port = vars["MASTER_PORT"];
    EXPECT_EQ(vars["MASTER_PORT"], port);  // one free port, shared
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Launcher, WorkerEnvironment, ::testing::Values(2, 4));

// `accelerate launch` flags that ask nothing of xlr8 launch are accepted, as their config-file keys are.
TEST(Launcher, AccelerateLaunchFlagsThatAskNothingOfXlr8AreAccepted) {
  auto dir = temp_dir("compat_flags");
  auto r = run(launch({"--num_processes", "1", "--use_deepspeed", "--deepspeed_multinode_launcher", "standard",
                       "--use_parallelism_config", "--parallelism_config_cp_backend", "torch"},
                      {"env", dir}),
               60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_env_file(dir + "/rank0.env")["ACCELERATE_USE_DEEPSPEED"], "true");
  fs::remove_all(dir);
}

TEST(Launcher, ADeepSpeedConfigFileThatIsMissingOrWrongStopsTheLaunchBeforeAnyWorker) {
  auto dir = temp_dir("ds-json");
  std::ofstream(dir + "/typo.json") << R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": true}})";
  std::ofstream(dir + "/good.json") << R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})";
  std::ofstream(dir + "/batches.json")
      << R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1})";
  const std::vector<std::pair<std::string, std::string>> refused = {
      {dir + "/missing.json", "does not exist or cannot be read"},
      {dir + "/batches.json", "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 10 != "
                              "4 * 1 * 2"},
      {dir + "/typo.json", "DeepSpeed has no key \"zero_optimization.overlap_com\" (did you mean"}};
  for (const auto& [file, message] : refused) {
    auto r = run(launch({"--num_processes", "2", "--use_deepspeed", "--deepspeed_config_file", file}, {"env", dir}), 60);
    EXPECT_NE(r.exit_code, 0) << r.out;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir + "/rank0.env")) << "a worker started";
  }
  auto ok = run(launch({"--num_processes", "2", "--use_deepspeed", "--deepspeed_config_file", dir + "/good.json"}, {"env", dir}), 60);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(read_env_file(dir + "/rank0.env")["ACCELERATE_DEEPSPEED_CONFIG_FILE"], dir + "/good.json");
  fs::remove_all(dir);
}

TEST(Launcher, ThreadsDefaultToCoresOverLocalWorkers) {
  auto dir = temp_dir("threads");
  auto r = run(launch({"--num_processes", "2"}, {"env", dir}), 60, {{"OMP_NUM_THREADS", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(read_env_file(dir + "/rank1.env")["OMP_NUM_THREADS"], std::to_string(std::max(1, cores / 2)));
  fs::remove_all(dir);
}

// "0-3,8 4" from the affinity mode: the CPUs a worker may use, then its intra-op threads.
std::pair<std::set<int>, int> read_affinity(const std::string& path) {
  std::istringstream in(read_file(path));
  std::string list;
  int threads = 0;
  in >> list >> threads;
  std::set<int> cpus;
  std::istringstream parts(list);
  for (std::string part; std::getline(parts, part, ',');) {
    auto dash = part.find('-');
    int lo = std::stoi(part.substr(0, dash)), hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) cpus.insert(c);
  }
  return {cpus, threads};
}

TEST(Launcher, EnableCpuAffinityGivesEachLocalRankItsOwnCpus) {
  std::set<int> allowed;
  for (const auto& c : xlr8::os::allowed_cpus()) allowed.insert(c.id);
  auto config = temp_dir("affinity_config") + "/config.yaml";
  std::ofstream(config) << "enable_cpu_affinity: true\nnum_processes: 2\n";
  for (Args how : {Args{"--num_processes", "2", "--enable_cpu_affinity"}, Args{"--config_file", config}}) {
    auto dir = temp_dir("affinity");
    auto r = run(launch(how, {"affinity", dir}), 60, {{"OMP_NUM_THREADS", ""}});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto [first, first_threads] = read_affinity(dir + "/affinity0");
    auto [second, second_threads] = read_affinity(dir + "/affinity1");
    std::set<int> both(first.begin(), first.end());
    both.insert(second.begin(), second.end());
    EXPECT_FALSE(first.empty());
    EXPECT_FALSE(second.empty());
    if (allowed.size() >= 2) {  // every allowed CPU used by exactly one rank
      EXPECT_EQ(both, allowed) << how[0];
      EXPECT_EQ(first.size() + second.size(), allowed.size()) << how[0];
    } else {
      EXPECT_EQ(first, allowed);
      EXPECT_EQ(second, allowed);
    }
    // The launcher's thread default (cores / local workers) still applies.
    EXPECT_EQ(first_threads, std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2));
    EXPECT_EQ(second_threads, first_threads);
    fs::remove_all(dir);
  }
  // Without it, every worker may use every CPU the launcher may.
  auto dir = temp_dir("no_affinity");
  auto r = run(launch({"--num_processes", "2"}, {"affinity", dir}), 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_affinity(dir + "/affinity0").first, allowed);
  EXPECT_EQ(read_affinity(dir + "/affinity1").first, allowed);
  fs::remove_all(dir);
  fs::remove_all(fs::path(config).parent_path());
}

TEST(Launcher, WorkerExitCodeStopsTheOthersPromptly) {
  auto dir = temp_dir("exit");
  auto r = run(launch({"--num_processes", "4"}, {"exit", "3", "1", dir}), 60);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 15.0);
  EXPECT_NE(r.err.find("rank 1 (local rank 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("failed first: exit code 3"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("giving up with code 3"), std::string::npos) << r.err;  // stderr tail in the report
  auto pids = read_pids(dir);
  EXPECT_EQ(pids.size(), 3u);
  expect_all_dead(pids);
  fs::remove_all(dir);
}

TEST(Launcher, AFailuresSummaryShowsTheErrorNotTheBacktrace) {
  // A shape mismatch deep inside LibTorch: c10::Error's what() carries a backtrace of many frames after
  // the message, uncaught (the runtime's terminate report) or printed by the program. The summary names
  // the message; the frames stay on the console and in the log.
  for (std::string how : {"uncaught", "caught"}) {
    SCOPED_TRACE(how);
    auto dir = temp_dir("failure-summary");
    auto r = run(launch({"--num_processes", "2", "--log_dir", dir}, {"matmul-mismatch", how}), 60);
    EXPECT_NE(r.exit_code, 0);
    const auto at = r.err.find("xlr8 launch: rank 1 (local rank 1");
    ASSERT_NE(at, std::string::npos) << r.err;
    const std::string summary = r.err.substr(at);
    // LibTorch 2.x names the operator first ("addmm: mat1 and mat2 ..."); 1.13 does not.
    const std::regex error(how == "uncaught" ? R"(rank 1's error: c10::Error: (addmm: )?mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\)\n)"
                                             : R"(rank 1's error: worker: error: (addmm: )?mat1 and mat2 shapes cannot be multiplied \(2x3 and 4x5\)\n)");
    EXPECT_TRUE(std::regex_search(summary, error)) << summary;
    EXPECT_EQ(summary.find("frame #"), std::string::npos) << summary;
    EXPECT_NE(summary.find("backtrace lines left out: they are above and in " + dir + "/attempt_0/1/stderr.log"),
              std::string::npos)
        << summary;
    EXPECT_NE(r.err.substr(0, at).find("[rank1]: frame #0: c10::Error::Error"), std::string::npos) << r.err;
    EXPECT_NE(read_file(dir + "/attempt_0/1/stderr.log").find("frame #0: c10::Error::Error"), std::string::npos);
    fs::remove_all(dir);
  }
}

// Object collectives of empty payloads (report()'s "no error") take about a store round trip, not the 200 ms
// LibTorch 1.13's TCPStore held an empty value's reply corked for: 20 of each well under a second on 2 ranks.
TEST(Launcher, ObjectCollectivesOfEmptyPayloadsTakeMillisecondsNotTheCorkLimit) {
  auto r = run(launch({"--num_processes", "2"}, {"empty-objects", "20"}), 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto at = r.out.find("objects ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const double ms = std::stod(r.out.substr(at + 8));
  EXPECT_LT(ms, 1000.0) << r.out;  // 40 collectives: 8 s with the corked replies
}

// Every rank refusing the same input (tp 3 over 2 attention heads) is one line in the summary, naming the
// ranks that said it, not the same error once per rank.
TEST(Launcher, RanksFailingWithTheSameMessageAreSummarisedOnce) {
  const std::string gpt = GPT_BIN;
  auto r = run({kXlr8, "launch", "--num_processes", "3", "--parallelism_config_tp_size", "3", gpt, "--max_steps", "1",
                "--n_layer", "1", "--d_model", "32", "--n_head", "2", "--seq_len", "32", "--val_windows", "8"},
               120);
  EXPECT_NE(r.exit_code, 0) << r.err;
  const auto at = r.err.find("failed first:");
  ASSERT_NE(at, std::string::npos) << r.err;
  const std::string summary = r.err.substr(at);
  const auto error_at = summary.find("'s error");
  ASSERT_NE(error_at, std::string::npos) << summary;
  const auto line_end = summary.find('\n', error_at);
  const auto colon = summary.find(": ", error_at);
  const std::string message = summary.substr(colon + 2, line_end - colon - 2);
  ASSERT_GT(message.size(), 10u) << summary;
  size_t count = 0;
  for (auto pos = summary.find(message); pos != std::string::npos; pos = summary.find(message, pos + 1)) ++count;
  EXPECT_EQ(count, 1u) << summary;
  EXPECT_NE(summary.find("said the same)"), std::string::npos) << summary;  // each rank printed it before exiting
}

TEST(Launcher, AnUncaughtExceptionReachesTheLauncherThroughTheWorkersErrorFile) {
  // torchelastic's protocol: each worker gets TORCHELASTIC_ERROR_FILE; an exception nobody catches is written
  // there in torch's format, and the launcher names it as the root cause.
  auto dir = temp_dir("error-file");
  auto r = run(launch({"--num_processes", "2", "--log_dir", dir}, {"throw-uncaught", "1"}), 60);
  EXPECT_EQ(r.exit_code, 128 + SIGABRT) << r.err;
  const std::string file = dir + "/attempt_0/1/error.json";
  EXPECT_NE(r.err.find("xlr8 launch: rank 1's error: xlr8::ConfigError: bad value 7 for key 'lr_warmup': give 0 or "
                       "more\nxlr8 launch: (recorded in its error file " + file + ")"),
            std::string::npos)
      << r.err;
  auto record = nlohmann::json::parse(read_file(file));
  EXPECT_EQ(record["message"]["message"], "xlr8::ConfigError: bad value 7 for key 'lr_warmup': give 0 or more");
  EXPECT_GT(std::stoll(record["message"]["extraInfo"]["timestamp"].get<std::string>()), 1700000000);
  EXPECT_FALSE(fs::exists(dir + "/attempt_0/0/error.json"));  // rank 0 was stopped, it did not fail
  fs::remove_all(dir);
  // Without a log_dir the files live in a scratch folder of the launch, gone when it ends: not named.
  auto scratch = run(launch({"--num_processes", "2"}, {"throw-uncaught", "0"}), 60);
  EXPECT_NE(scratch.err.find("xlr8 launch: rank 0's error: xlr8::ConfigError: bad value 7 for key 'lr_warmup': give 0 "
                             "or more\nxlr8 launch: (recorded in its error file; pass --log_dir to keep it)"),
            std::string::npos)
      << scratch.err;
  // An ordinary failure is its own cause: no collective-trace paragraph blaming where the others were.
  EXPECT_EQ(scratch.err.find("collective trace"), std::string::npos) << scratch.err;
}

TEST(Launcher, ErrorFilesAreTorchelasticsOwnBothWays) {
  // The real torch (the wheel whose LibTorch the build uses): a Python worker under @record writes the file
  // xlr8 launch reads, and torchelastic's own ProcessFailure reads the file an xlr8 worker writes.
  const std::string python = TORCH_PYTHON;
  if (python.empty() || python == "OFF") GTEST_SKIP() << "built without XLR8_PYTHON: no Python torch to run";
  auto dir = temp_dir("torch-error-file");
  std::ofstream(dir + "/worker.py") << "from torch.distributed.elastic.multiprocessing.errors import record\n"
                                       "@record\ndef main():\n    raise ValueError(\"bad key 'lr': give a number\")\nmain()\n";
  auto from_torch = run({kXlr8, "launch", "--num_processes", "1", "--log_dir", dir + "/py", python, dir + "/worker.py"}, 120);
  EXPECT_NE(from_torch.err.find("xlr8 launch: rank 0's error: ValueError: bad key 'lr': give a number\nxlr8 launch: "
                                "(recorded in its error file " + dir + "/py/attempt_0/0/error.json)"),
            std::string::npos)
      << from_torch.err;
  run(launch({"--num_processes", "2", "--log_dir", dir + "/ours"}, {"throw-uncaught", "1"}), 60);
  auto by_torch = run({python, "-c",
                       "from torch.distributed.elastic.multiprocessing.errors import ProcessFailure\n"
                       "f = ProcessFailure(local_rank=1, pid=1, exitcode=134, error_file='" + dir +
                           "/ours/attempt_0/1/error.json')\n"
                       "print(f.message['message']); print(f.timestamp > 1700000000)"},
                      120);
  EXPECT_EQ(by_torch.exit_code, 0) << by_torch.err;
  EXPECT_EQ(by_torch.out, "xlr8::ConfigError: bad value 7 for key 'lr_warmup': give 0 or more\nTrue\n") << by_torch.err;
  fs::remove_all(dir);
}

TEST(Launcher, AHangIsDiagnosedFromEveryRanksFlightRecorder) {
  // Rank 1 sleeps before the third all_reduce, or issues a broadcast there, or skips it: rank 0 times out
  // (3 s), its recorder is written, the launcher asks rank 1 for its own (SIGUSR1) and names who was where.
  const std::map<std::string, std::vector<std::string>> expected{
      {"sleep",
       {"rank 0 reached world #", " all_reduce(float32[4], SUM) (failed or timed out waiting for the others)",
        "rank 1 never arrived at world #", "(completed), so it was outside any collective"}},
      {"different",
       {"the ranks issued different collectives at world #", "rank 0 issued all_reduce(float32[4], SUM); rank 1 issued broadcast(float32[4]"}},
      {"skip", {"the ranks issued different collectives at world #", "rank 0 issued all_reduce(float32[4], SUM); rank 1 issued barrier"}},
      {"skip-object",
       {"the ranks issued different collectives at world #", "rank 0 issued broadcast_object(root 1); rank 1 issued all_reduce(float32[4], SUM)"}}};
  for (const auto& [how, lines] : expected) {
    SCOPED_TRACE(how);
    auto dir = temp_dir("trace");
    const auto began = std::chrono::steady_clock::now();
    auto r = run(launch({"--num_processes", "2", "--log_dir", dir}, {"trace", how}), 90,
                 {{"XLR8_COLLECTIVE_TIMEOUT", "3"}});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    EXPECT_NE(r.exit_code, 0);
    EXPECT_LT(seconds, 30) << "the timeout is 3 s";
    const auto at = r.err.find("xlr8 launch: collective trace (2 of 2 ranks, " + dir + "/attempt_0/trace): ");
    ASSERT_NE(at, std::string::npos) << r.err;
    const auto paragraph = r.err.substr(at, r.err.find('\n', at) - at);
    for (const auto& line : lines) EXPECT_NE(paragraph.find(line), std::string::npos) << line << "\n" << paragraph;
    // The same from the dumps on disk.
    auto offline = run({kXlr8, "trace", dir + "/attempt_0/trace"}, 30);
    EXPECT_EQ(offline.exit_code, 0) << offline.err;
    EXPECT_NE(offline.out.find(paragraph.substr(std::string("xlr8 launch: ").size())), std::string::npos) << offline.out;
    fs::remove_all(dir);
  }
}

TEST(Launcher, AJobWithNoProgressForTheHeartbeatTimeoutIsStoppedAndDiagnosed) {
  // The collective timeout is 10 minutes: without the heartbeat nothing would end this hang for that long.
  auto dir = temp_dir("heartbeat");
  const auto began = std::chrono::steady_clock::now();
  auto r = run(launch({"--num_processes", "2", "--log_dir", dir}, {"trace", "sleep"}), 90,
               {{"XLR8_COLLECTIVE_TIMEOUT", "600"}, {"XLR8_HEARTBEAT_TIMEOUT", "3"}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_LT(seconds, 30);
  EXPECT_NE(r.err.find("xlr8 launch: no rank completed a collective for "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(XLR8_HEARTBEAT_TIMEOUT=3): the job is stalled; stopping it"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 0 reached world #3 all_reduce(float32[4], SUM) (waiting for the others); rank 1 never "
                       "arrived at world #3: its last world collective was world #2 all_reduce(float32[4], SUM) "
                       "(completed), so it was outside any collective"),
            std::string::npos)
      << r.err;
  fs::remove_all(dir);
  // A bad value is refused before any worker starts.
  auto bad = run(launch({"--num_processes", "2"}, {"trace", "sleep"}), 30, {{"XLR8_HEARTBEAT_TIMEOUT", "soon"}});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("XLR8_HEARTBEAT_TIMEOUT=\"soon\" must be a positive number of seconds"), std::string::npos)
      << bad.err;
}

TEST(Launcher, SigtermToTheLauncherStopsHangingWorkers) {
  auto dir = temp_dir("hang");
  Process launcher(launch({"--num_processes", "2"}, {"hang", dir}));
  wait_for_files(dir, 2);
  auto pids = read_pids(dir);
  ASSERT_EQ(pids.size(), 2u);
  launcher.signal(SIGTERM);
  auto r = launcher.wait(30);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_NE(r.err.find("received SIGTERM"), std::string::npos) << r.err;
  expect_all_dead(pids);
  fs::remove_all(dir);
}

TEST(Launcher, SigintIsForwardedToWorkers) {
  auto dir = temp_dir("int");
  Process launcher(launch({"--num_processes", "2"}, {"hang", dir}));
  wait_for_files(dir, 2);
  auto pids = read_pids(dir);
  launcher.signal(SIGINT);
  auto r = launcher.wait(30);
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.err;
  expect_all_dead(pids);
  fs::remove_all(dir);
}

// `kill -INT` to a launcher that a script started in the background: a shell without job control
// starts it with SIGINT ignored, which exec keeps; workers must still get the default disposition.
struct ScriptInterrupt {
  int rc = -1, ms = -1;  // the launcher's exit code, milliseconds from kill to its exit
  std::string launcher_err;
};
ScriptInterrupt interrupt_from_a_script(const std::string& mode, const std::string& dir) {
  const std::string script = fmt::format(
      "'{}' launch --num_processes 2 '{}' {} '{}' & pid=$!; "
      "while [ $(ls '{}' | wc -l) -lt 2 ]; do sleep 0.05; done; "
      "start=$(date +%s%N); kill -INT $pid; wait $pid; rc=$?; echo \"rc=$rc ms=$(( ($(date +%s%N) - start) / 1000000 ))\"",
      kXlr8, kWorker, mode, dir, dir);
  auto r = run({"bash", "-c", script}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  ScriptInterrupt result;
  result.launcher_err = r.err;
  std::sscanf(r.out.substr(r.out.rfind("rc=")).c_str(), "rc=%d ms=%d", &result.rc, &result.ms);
  return result;
}

TEST(Launcher, SigintFromAScriptStopsWorkersWithoutEscalating) {
  auto dir = temp_dir("int-script");
  auto r = interrupt_from_a_script("hang", dir);
  auto pids = read_pids(dir);
  EXPECT_EQ(r.rc, 128 + SIGINT);
  // The mechanism, not a stopwatch (CI runs other tests beside this one): SIGINT itself ended both workers.
  EXPECT_NE(r.launcher_err.find("workers stopped: rank 0 killed by SIGINT (signal 2), rank 1 killed by SIGINT"),
            std::string::npos)
      << r.launcher_err;
  EXPECT_LT(r.ms, 2500) << "the workers outlived SIGINT until the SIGTERM at half the 5 s grace";
  expect_all_dead(pids);
  fs::remove_all(dir);
}

TEST(Launcher, WorkersThatHandleSigintGetSigtermBeforeTheGraceEnds) {
  // Grace 5 s: SIGINT, then SIGTERM at 2.5 s, which the workers do not handle.
  auto dir = temp_dir("int-escalate");
  auto r = interrupt_from_a_script("hang-handling-int", dir);
  auto pids = read_pids(dir);
  EXPECT_EQ(r.rc, 128 + SIGINT);
  EXPECT_NE(r.launcher_err.find("workers stopped: rank 0 killed by SIGTERM (signal 15), rank 1 killed by SIGTERM"),
            std::string::npos)
      << r.launcher_err;
  EXPECT_GT(r.ms, 2000);
  EXPECT_LT(r.ms, 4500) << "no SIGTERM before the SIGKILL at the end of the grace";
  expect_all_dead(pids);
  fs::remove_all(dir);
}

TEST(Launcher, MaxRestartsRerunsTheGroupAfterAFailure) {
  auto once = run(launch({"--num_processes", "2", "--max_restarts", "1"}, {"fail-once", "5"}), 60);
  EXPECT_EQ(once.exit_code, 0) << once.err;
  EXPECT_NE(once.err.find("restarting all 2 local worker(s) (restart 1 of 1)"), std::string::npos) << once.err;
  EXPECT_EQ(occurrences(once.out, "attempt 1 ok"), 2u) << once.out;
  auto none = run(launch({"--num_processes", "2"}, {"fail-once", "5"}), 60);
  EXPECT_EQ(none.exit_code, 5) << none.err;
}

TEST(Launcher, ARankThatNeverJoinsGivesTheRendezvousErrorWithinTheTimeout) {
  int port = xlr8::pick_free_port();
  // Machine 0 of 2 alone: ranks 2 and 3 never come.
  auto r = run(launch({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip",
                       "127.0.0.1", "--main_process_port", std::to_string(port), "--rdzv_timeout", "3"},
                      {"allreduce"}),
               60);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_NE(r.err.find("missing ranks 2, 3"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << r.err;
}

TEST(Launcher, TwoMachinesOnLoopbackFormOneFourRankJob) {
  int port = xlr8::pick_free_port();
  Process m0(two_machines(port, 0, 4, {"allreduce"})), m1(two_machines(port, 1, 4, {"allreduce"}));
  auto r0 = m0.wait(90), r1 = m1.wait(90);
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  EXPECT_EQ(occurrences(r0.out, "sum=10 world=4 node=0"), 2u) << r0.out;
  EXPECT_EQ(occurrences(r1.out, "sum=10 world=4 node=1"), 2u) << r1.out;
  EXPECT_NE(r1.out.find("[rank3]: "), std::string::npos) << r1.out;
}

TEST(SharedMemory, APeerThatDiesIsNamedPromptlyNotAtTheTimeout) {
  // Two launchers ("machines" on one host), so rank 0's launcher does not stop it when rank 1 dies:
  // rank 0 must notice by itself, in the shared-memory barrier, long before the 120 s timeout.
  int port = xlr8::pick_free_port();
  std::map<std::string, std::string> env{{"XLR8_COLLECTIVE_TIMEOUT", "120"}};
  Process m0(two_machines(port, 0, 2, {"peer-dies"}), env), m1(two_machines(port, 1, 2, {"peer-dies"}), env);
  auto r1 = m1.wait(60), r0 = m0.wait(60);
  EXPECT_EQ(r1.exit_code, 3) << r1.err;
  EXPECT_EQ(r0.exit_code, 2) << r0.err;
  EXPECT_LT(r0.seconds, 30.0);
  EXPECT_NE(r0.err.find("all_reduce(float32[1048576], SUM) on group 'world' (rank 0 of 2)"), std::string::npos) << r0.err;
  EXPECT_NE(r0.err.find("rank 1 (pid"), std::string::npos) << r0.err;
  EXPECT_NE(r0.err.find("exited"), std::string::npos) << r0.err;
}

// Over Gloo the dead peer shows as a closed connection: the survivor's error says it lost its peer, so that it
// does not read as a second failure beside the first one's.
TEST(Launcher, OverGlooARankWhosePeerDiedSaysItLostItsPeer) {
  int port = xlr8::pick_free_port();
  std::map<std::string, std::string> env{{"XLR8_COLLECTIVE_TIMEOUT", "120"}, {"XLR8_SHM", "0"}};
  Process m0(two_machines(port, 0, 2, {"peer-dies"}), env), m1(two_machines(port, 1, 2, {"peer-dies"}), env);
  auto r1 = m1.wait(60), r0 = m0.wait(60);
  EXPECT_EQ(r1.exit_code, 3) << r1.err;
  EXPECT_EQ(r0.exit_code, 2) << r0.err;
  EXPECT_LT(r0.seconds, 30.0);
  EXPECT_NE(r0.err.find("all_reduce(float32[1048576], SUM) on group 'world' (rank 0 of 2) lost its peer: another rank "
                        "ended or failed first"),
            std::string::npos)
      << r0.err;
}

TEST(SharedMemory, TheLauncherRemovesSegmentsThatKilledWorkersLeft) {
  auto dir = temp_dir("leak");
  Process launcher(launch({"--num_processes", "2"}, {"leak-segment", dir}));
  auto r = launcher.wait(60);
  EXPECT_NE(r.exit_code, 0);
  int checked = 0;
  for (auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("segment", 0) != 0) continue;  // a rank stopped before its rename
    std::string name = read_file(entry.path());  // "/xlr8.<launcher pid>.<worker pid>.<n>"
    EXPECT_EQ(name.rfind(fmt::format("/xlr8.{}.", launcher.pid()), 0), 0u) << name;
    EXPECT_FALSE(fs::exists("/dev/shm" + name)) << name << " was left in /dev/shm";
    ++checked;
  }
  EXPECT_GE(checked, 1);
}

TEST(Launcher, OutputIsPrefixedAndLogDirKeepsPerRankFiles) {
  auto dir = temp_dir("logs");
  auto r = run(launch({"--num_processes", "2", "--log_dir", dir}, {"print", "3"}), 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]: out 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]: out 0"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("[rank1]: err 1"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(dir + "/attempt_0/1/stdout.log"), "out 0\nout 1\nout 2\n");
  EXPECT_EQ(read_file(dir + "/attempt_0/0/stderr.log"), "err 0\nerr 1\nerr 2\n");
  fs::remove_all(dir);
}

TEST(Launcher, InPlaceLinesAreShownAsTheyComeAndLoggedAsTheirLastFrame) {
  // A progress bar's frames ("\r<frame>" without a newline) reach the console at once, each after the
  // rank prefix; another rank's line starts below the open one (on its own stream); the log file and
  // CRLF lines keep plain text.
  auto dir = temp_dir("in-place");
  auto r = run(launch({"--num_processes", "2", "--log_dir", dir}, {"in-place"}), 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("[rank0]: windows line\n"), std::string::npos) << r.err;  // CRLF: the text kept
  EXPECT_NE(r.err.find("\r[rank0]: frame 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\r[rank0]: frame 3\x1b[K\n[rank0]: after\n"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "[rank1]: between frames\n");  // stdout gets no stray newline from stderr's bar
  EXPECT_EQ(read_file(dir + "/attempt_0/0/stderr.log"), "windows line\nframe 3\nafter\n");
  fs::remove_all(dir);
}

TEST(LauncherErrors, MissingProgramIsOneClearLine) {
  auto r = run({kXlr8, "launch", "--num_processes", "2", "/nonexistent/train"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(occurrences(r.err, "\n"), 1u) << r.err;
  EXPECT_NE(r.err.find("no such file"), std::string::npos) << r.err;
  auto p = run({kXlr8, "launch", "no_such_program_xlr8"});
  EXPECT_EQ(p.exit_code, 1);
  EXPECT_NE(p.err.find("not found in PATH"), std::string::npos) << p.err;
}

TEST(LauncherErrors, NonExecutableFileIsOneClearLine) {
  auto dir = temp_dir("noexec");
  std::ofstream(dir + "/train") << "#!/bin/sh\n";
  auto r = run({kXlr8, "launch", dir + "/train"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(occurrences(r.err, "\n"), 1u) << r.err;
  EXPECT_NE(r.err.find("not executable"), std::string::npos) << r.err;
  fs::remove_all(dir);
}

TEST(LauncherErrors, PortInUseIsOneClearLine) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  auto dir = temp_dir("port");
  auto r = run(launch({"--num_processes", "2", "--main_process_port", std::to_string(port)}, {"env", dir}));
  close(fd);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(occurrences(r.err, "\n"), 1u) << r.err;
  EXPECT_NE(r.err.find(fmt::format("port {} is already in use", port)), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_empty(dir));  // no worker started
  fs::remove_all(dir);
}

TEST(LauncherErrors, BadConfigIsRejectedBeforeAnyProcessStarts) {
  auto dir = temp_dir("badcfg");
  std::ofstream(dir + "/c.yaml") << "distributed_type: MULTI_CPU\nnum_proceses: 2\n";
  auto r = run(launch({"--config_file", dir + "/c.yaml"}, {"env", dir}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("unknown key \"num_proceses\" (did you mean \"num_processes\"?)"), std::string::npos) << r.err;
  auto m = run(launch({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h"},
                      {"env", dir}));
  EXPECT_EQ(m.exit_code, 1);
  EXPECT_NE(m.err.find("machine_rank 2 must be below num_machines 2"), std::string::npos) << m.err;
  auto t = run(launch({"--num_proceses", "2"}, {"env", dir}));
  EXPECT_EQ(t.exit_code, 1);
  EXPECT_NE(t.err.find("did you mean --num_processes"), std::string::npos) << t.err;
  auto v = run(launch({"--mixed_precision", "fp32"}, {"env", dir}));
  EXPECT_EQ(v.exit_code, 1);
  EXPECT_NE(v.err.find("\"fp32\""), std::string::npos) << v.err;
  EXPECT_EQ(fs::directory_iterator(dir)->path().filename(), "c.yaml");  // nothing else was written
  fs::remove_all(dir);
}

TEST(Cli, SelfTestPassesOn2And4Processes) {
  for (auto n : {"2", "4"}) {
    auto r = run({kXlr8, "test", "--num_processes", n}, 120);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find(fmt::format("on {} ranks (gloo backend", n)), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("0 failed"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("FAIL "), std::string::npos) << r.out;
  }
}

TEST(Cli, ConfigDefaultAndInteractiveWriteLoadableFiles) {
  auto dir = temp_dir("config");
  auto d = run({kXlr8, "config", "--default", "--config_file", dir + "/d.yaml", "--mixed_precision", "bf16"});
  ASSERT_EQ(d.exit_code, 0) << d.err;
  auto loaded = xlr8::load_config(dir + "/d.yaml");
  EXPECT_EQ(loaded.mixed_precision, xlr8::MixedPrecision::BF16);
  // Answers piped as a terminal user would type them: DeepSpeed, 1 machine, 4 processes, ZeRO 3 ...
  auto i = run({"/bin/sh", "-c",
                fmt::format("printf 'DEEPSPEED\\n1\\n4\\n3\\ncpu\\nnone\\n2\\nbf16\\n' | {} config --config_file {}/i.yaml",
                            kXlr8, dir)});
  ASSERT_EQ(i.exit_code, 0) << i.out << i.err;
  auto c = xlr8::load_config(dir + "/i.yaml");
  EXPECT_EQ(c.distributed_type, xlr8::DistributedType::DEEPSPEED);
  EXPECT_EQ(c.num_processes, 4);
  EXPECT_EQ(c.deepspeed.zero_stage, 3);
  EXPECT_EQ(c.deepspeed.offload_optimizer_device, "cpu");
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.mixed_precision, xlr8::MixedPrecision::BF16);
  EXPECT_FALSE(c.use_cpu);  // as Accelerate writes a GPU kind's file, even on a machine without GPUs (this one)
  // And the launcher uses it.
  auto r = run(launch({"--config_file", dir + "/i.yaml", "--num_processes", "2"}, {"env", dir}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_env_file(dir + "/rank1.env")["ACCELERATE_MIXED_PRECISION"], "bf16");
  // Piped answers with a typo whose input then ends: an error, and no file (before: the defaults, written, exit 0).
  auto typo = run({"/bin/sh", "-c", fmt::format("printf 'DEEPSPED\n' | {} config --config_file {}/t.yaml", kXlr8, dir)});
  EXPECT_NE(typo.exit_code, 0) << typo.out;
  EXPECT_NE(typo.err.find("the answer \"DEEPSPED\" to \"Which kind of training\" was refused"), std::string::npos)
      << typo.err;
  EXPECT_FALSE(fs::exists(dir + "/t.yaml"));
  fs::remove_all(dir);
}

TEST(Cli, EnvReportsVersionsBlasAndConfig) {
  auto r = run({kXlr8, "env", "--config_file", "/nonexistent.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string libtorch = fmt::format("LibTorch version: {}.", TORCH_VERSION_MAJOR);  // the one this test built with
  for (auto needle : {"xlr8 version", libtorch.c_str(), "BLAS in use", "Gloo: available", "CPU cores", "GPUs"})
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << "\n" << r.out;
}

TEST(Cli, MistypedCommandAndBadCountAreNamedInCommandLineWords) {
  auto r = run({kXlr8, "lauch", "--num_processes", "2"}, 30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("\"lauch\" is not a command (did you mean \"launch\"?)"), std::string::npos) << r.err;
  r = run({kXlr8, "launch", "--help"}, 30);
  EXPECT_EQ(r.exit_code, 0);
  const auto usage = r.out.substr(r.out.find("Usage:"), r.out.find('\n', r.out.find("Usage:")) - r.out.find("Usage:"));
  EXPECT_NE(usage.find("program"), std::string::npos) << usage;
  EXPECT_NE(r.out.find("[--] program [args...]"), std::string::npos) << r.out;
  r = run({kXlr8, "launch", "--num_processes", "0", kWorker}, 30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--num_processes: 0 is not a number of processes: give 1 or more"), std::string::npos) << r.err;
  r = run({kXlr8, "env"}, 60);
  EXPECT_NE(r.out.find("in this `xlr8 env` process; a worker started by `xlr8 launch` gets"), std::string::npos) << r.out;
}
