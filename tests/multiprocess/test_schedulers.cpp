// Programs built with xlr8 started by real schedulers instead of `xlr8 launch`: Debian's OpenMPI
// `mpirun`, and a real single-node Slurm (slurmctld + slurmd started by tests/sched/slurm_cluster.sh)
// with `srun` and `sbatch`. Each checks the oracle: N ranks on batch b train exactly like one process on
// batch N*b, so the ranks found each other and stepped in lockstep.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "oracle.hpp"
#include "programs.hpp"
#include "xlr8/launcher.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {


bool on_path(const std::string& program) { return run({"sh", "-c", "command -v " + program}, 10).exit_code == 0; }

// mpirun refuses root unless told; neither variable changes anything else.
const std::map<std::string, std::string> kMpiEnv{{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                                 {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};

// No MASTER_ADDR/MASTER_PORT from the test's own environment: the ranks must work them out.
Args without_master(Args command) {
  Args a{"env", "-u", "MASTER_ADDR", "-u", "MASTER_PORT"};
  a.insert(a.end(), command.begin(), command.end());
  return a;
}

Args mpirun(int n, Args program) {
  Args a{"mpirun", "-np", std::to_string(n)};
  if (n > 2) a.push_back("--oversubscribe");  // more ranks than this machine's cores
  a.insert(a.end(), program.begin(), program.end());
  return a;
}

Run one_process(int batch, int steps) {
  auto dir = temp_dir("sched1");
  return oracle_command({kXlr8, "launch", "--num_processes", "1", kTrain, "--batch", std::to_string(batch), "--steps",
                         std::to_string(steps), "--out", dir},
                        dir);
}

Args train_args(int batch, int steps, const std::string& dir) {
  return {kTrain, "--batch", std::to_string(batch), "--steps", std::to_string(steps), "--out", dir};
}

// The allreduce worker's lines: "sum=S world=W node=N rank=R local=L/LW nodes=K source=X at=A:P".
std::vector<std::string> lines_with(const std::string& out, const std::string& needle) {
  std::vector<std::string> found;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.find(needle) != std::string::npos) found.push_back(line);
  return found;
}

std::string field(const std::string& line, const std::string& name) {
  auto at = line.find(" " + name + "=");
  if (at == std::string::npos) return "";
  at += name.size() + 2;
  return line.substr(at, line.find(' ', at) - at);
}

}  // namespace

// ---------------------------------------------------------------------------------------------- OpenMPI

class OpenMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!on_path("mpirun")) GTEST_SKIP() << "mpirun not installed (scripts/setup installs openmpi-bin)";
  }
};

TEST_F(OpenMpi, TrainsInLockstepWithoutMasterAddrOrPort) {
  for (int n : {2, 3}) {
    auto one = one_process(4 * n, 8);
    auto dir = temp_dir("mpi");
    auto many = oracle_command(without_master(mpirun(n, train_args(4, 8, dir))), dir, 180, kMpiEnv);
    ASSERT_EQ(one.losses.size(), 8u);
    expect_close(many.losses, one.losses, 1e-5);
    expect_same_params(many.dir, one.dir, 1e-5);
    EXPECT_EQ(many.result["num_processes"], n);
  }
}

TEST_F(OpenMpi, RanksReadTheirPlaceFromOpenMpiAndAgreeOnOnePort) {
  auto r = run(without_master(mpirun(3, {kWorker, "allreduce"})), 120, kMpiEnv);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto lines = lines_with(r.out, "sum=6 world=3 node=0 ");
  ASSERT_EQ(lines.size(), 3u) << r.out;
  std::set<std::string> ranks, places;
  for (const auto& line : lines) {
    ranks.insert(field(line, "rank"));
    EXPECT_EQ(field(line, "local"), field(line, "rank") + "/3") << line;  // one node: local rank = rank
    EXPECT_EQ(field(line, "nodes"), "1") << line;
    EXPECT_EQ(field(line, "source"), "openmpi") << line;
    places.insert(field(line, "at"));
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1", "2"}));
  ASSERT_EQ(places.size(), 1u) << r.out;
  const std::string at = *places.begin();
  EXPECT_EQ(at.rfind("127.0.0.1:", 0), 0u) << at;
  int port = std::stoi(at.substr(at.find(':') + 1));
  EXPECT_GE(port, 20000);
  EXPECT_LT(port, 30000);
}

TEST_F(OpenMpi, ExportedMasterAddrAndPortAreUsed) {
  int port = xlr8::pick_free_port();
  auto env = kMpiEnv;
  env["MASTER_ADDR"] = "127.0.0.1";
  env["MASTER_PORT"] = std::to_string(port);
  auto r = run({"mpirun", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-np", "2", kWorker, "allreduce"}, 120, env);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto lines = lines_with(r.out, "sum=3 world=2 node=0 ");
  ASSERT_EQ(lines.size(), 2u) << r.out;
  for (const auto& line : lines) EXPECT_EQ(field(line, "at"), fmt::format("127.0.0.1:{}", port)) << line;
  // And training through that rendezvous follows the oracle.
  auto one = one_process(8, 8);
  auto dir = temp_dir("mpi-x");
  Args command{"mpirun", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-np", "2"};
  auto program = train_args(4, 8, dir);
  command.insert(command.end(), program.begin(), program.end());
  env["MASTER_PORT"] = std::to_string(xlr8::pick_free_port());
  auto two = oracle_command(command, dir, 180, env);
  expect_close(two.losses, one.losses, 1e-5);
  expect_same_params(two.dir, one.dir, 1e-5);
}

TEST_F(OpenMpi, AJobAcrossNodesWithoutMasterAddrIsOneClearError) {
  // Two "nodes" as OpenMPI sees them (its rsh launcher with a local ssh stand-in), no MASTER_ADDR:
  // every rank stops at once with the error, instead of guessing an address or waiting.
  auto r = run(without_master({"mpirun", "--mca", "plm_rsh_agent", kSource + "/tests/sched/local_ssh.sh", "--host",
                               "localhost,127.0.0.2", "-np", "2", kWorker, "allreduce"}),
               60, kMpiEnv);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, 30.0);
  const std::string output = r.out + r.err;  // mpirun forwards the ranks' stderr
  EXPECT_NE(output.find("MASTER_ADDR is not set but the job spans 2 nodes (openmpi environment)"), std::string::npos)
      << output;
  EXPECT_NE(output.find("-x MASTER_ADDR"), std::string::npos) << output;
}

TEST_F(OpenMpi, AnAccelerateMpirunConfigStartsTheJobThroughMpirun) {
  // `accelerate config`'s own mpirun file (MULTI_CPU, 8 processes on 2 machines, /root/hostfile), kept on
  // this machine by flags over it: a host file naming localhost only, loopback, 2 processes.
  auto dir = temp_dir("mpirun-config");
  std::ofstream(dir + "/hostfile") << "localhost slots=2\n";
  auto launch = [&](Args program) {
    Args a{kXlr8, "launch", "--config_file", kSource + "/tests/data/accelerate_configs/multi_cpu_mpirun.yaml",
           "--mpirun_hostfile", dir + "/hostfile", "--num_machines", "1", "--num_processes", "2",
           "--main_process_ip", "127.0.0.1", "--main_process_port", "0"};
    a.insert(a.end(), program.begin(), program.end());
    return run(without_master(a), 180, kMpiEnv);
  };
  auto r = launch({kWorker, "allreduce"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("mpirun --hostfile " + dir + "/hostfile --npernode 2 -n 2 "), std::string::npos) << r.err;
  auto lines = lines_with(r.out, "sum=3 world=2 node=0 ");
  ASSERT_EQ(lines.size(), 2u) << r.out;
  for (const auto& line : lines) {
    EXPECT_EQ(field(line, "source"), "openmpi") << line;  // the ranks are mpirun's, not the launcher's
    EXPECT_EQ(field(line, "at").rfind("127.0.0.1:", 0), 0u) << line;
  }
  // Training through it follows the oracle: the launch settings (here the accumulation) reach the ranks.
  auto one = oracle_command({kXlr8, "launch", "--num_processes", "1", kTrain, "--batch", "8", "--steps", "6", "--accum",
                             "2", "--out", temp_dir("mpirun-one")},
                            "");
  auto trained = launch({"--gradient_accumulation_steps", "2", kTrain, "--batch", "4", "--steps", "6", "--out", dir});
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  expect_close(last_json(trained.out)["losses"].get<std::vector<double>>(), one.losses, 1e-5);
  // What mpirun cannot do is one line before anything starts.
  auto restarts = launch({"--max_restarts", "1", kWorker, "allreduce"});
  EXPECT_EQ(restarts.exit_code, 1);
  EXPECT_NE(restarts.err.find("--max_restarts 1 cannot be used with mpirun_config.mpirun_hostfile"), std::string::npos)
      << restarts.err;
  auto missing = run({kXlr8, "launch", "--mpirun_hostfile", dir + "/no-such-hostfile", "--num_processes", "2", kWorker,
                      "allreduce"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("mpirun_config.mpirun_hostfile \"" + dir + "/no-such-hostfile\" does not exist"),
            std::string::npos)
      << missing.err;
}

// --------------------------------------------------------------------------------- torchrun environment

TEST(TorchrunEnvironment, HandSetVariablesTrainInLockstep) {
  // What torchrun (or any other starter) sets, written by hand: no launcher involved.
  auto one = one_process(8, 8);
  auto dir = temp_dir("torchrun");
  int port = xlr8::pick_free_port();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.push_back(std::make_unique<Process>(
        train_args(4, 8, dir), std::map<std::string, std::string>{{"RANK", std::to_string(r)},
                                                                  {"WORLD_SIZE", "2"},
                                                                  {"LOCAL_RANK", std::to_string(r)},
                                                                  {"LOCAL_WORLD_SIZE", "2"},
                                                                  {"GROUP_RANK", "0"},
                                                                  {"MASTER_ADDR", "127.0.0.1"},
                                                                  {"MASTER_PORT", std::to_string(port)}}));
  auto r1 = ranks[1]->wait(120), r0 = ranks[0]->wait(120);
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  auto result = last_json(r0.out);
  EXPECT_EQ(result["num_processes"], 2);
  expect_close(result["losses"].get<std::vector<double>>(), one.losses, 1e-5);
  expect_same_params(dir, one.dir, 1e-5);
}

// The real torchrun (the venv's torch). Its agent keeps one store for every restart of the group; a rank
// that fails after the process group was made used to leave its join count and gloo addresses there, and the
// restarted group read them ("Connection refused", at random). Each attempt now has keys of its own.
TEST(TorchrunEnvironment, TheRealTorchrunRestartsAGroupWhoseRankFailedAfterTheProcessGroupWasMade) {
  const std::string torchrun = kSource + "/.venv/bin/torchrun";
  if (!fs::exists(torchrun)) GTEST_SKIP() << "no " << torchrun << " (scripts/setup installs torch into .venv)";
  auto one = one_process(8, 8);
  auto dir = temp_dir("torchrun-restart");
  const std::string script = dir + "/fail_once.sh";
  std::ofstream(script) << "#!/bin/sh\n\"$@\"; rc=$?\n"
                           "[ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ] && exit 7\n"
                           "exit $rc\n";
  fs::permissions(script, fs::perms::owner_all);
  Args command{torchrun,        "--nproc_per_node", "2", "--max_restarts", "1", "--master_port",
               std::to_string(xlr8::pick_free_port()), "--no-python", script};
  for (const auto& arg : train_args(4, 8, dir)) command.push_back(arg);
  auto many = run(without_master(command), 240);
  ASSERT_EQ(many.exit_code, 0) << many.out << many.err;
  EXPECT_NE(many.err.find("failed (exitcode: 7)"), std::string::npos) << many.err;  // torchrun saw the first attempt fail
  auto result = last_json(many.out);
  EXPECT_EQ(result["num_processes"], 2);
  expect_close(result["losses"].get<std::vector<double>>(), one.losses, 1e-5);
}

// ------------------------------------------------------------------------------------------------ Slurm

// One real Slurm cluster (controller + one node daemon) for the whole suite.
class Slurm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!on_path("slurmctld") || !on_path("slurmd") || !on_path("srun")) {
      skip_ = "Slurm not installed (scripts/setup installs slurmctld slurmd slurm-client)";
      return;
    }
    if (geteuid() != 0) {
      skip_ = "the private Slurm cluster runs its daemons as root; run the tests as root (CI does)";
      return;
    }
    dir_ = temp_dir("slurm");
    // With our pid, the cluster stops itself if this test is killed before TearDownTestSuite.
    auto r = run({kSource + "/tests/sched/slurm_cluster.sh", "start", dir_, std::to_string(getpid())}, 60);
    if (r.exit_code != 0) failure_ = "could not start Slurm: " + r.out + r.err;
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) run({kSource + "/tests/sched/slurm_cluster.sh", "stop", dir_}, 60);
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
    ASSERT_TRUE(failure_.empty()) << failure_;
  }
  static std::map<std::string, std::string> env() { return {{"SLURM_CONF", dir_ + "/slurm.conf"}}; }

  // Submits `script` with sbatch, polls squeue until the job is gone, and returns its output file.
  static std::string sbatch(const std::string& script, Args args = {}) {
    auto out_file = temp_dir("sbatch") + "/job.out";
    Args command{"sbatch", "--parsable", "--output", out_file, script};
    command.insert(command.end(), args.begin(), args.end());
    auto submitted = run(without_master(command), 30, env());
    std::string job = submitted.out.substr(0, submitted.out.find_first_of(";\n"));
    if (submitted.exit_code != 0 || job.empty()) {
      ADD_FAILURE() << "sbatch failed: " << submitted.out << submitted.err;
      return "";
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(100);
    while (std::chrono::steady_clock::now() < deadline) {
      auto q = run({"squeue", "-h", "-j", job}, 30, env());
      if (q.out.find(job) == std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return read_file(out_file);
  }

  static inline std::string dir_, skip_, failure_;
};

TEST_F(Slurm, SrunTrainsInLockstep) {
  for (int n : {2, 3}) {
    auto one = one_process(4 * n, 8);
    auto dir = temp_dir("srun");
    Args command{"srun", "-n", std::to_string(n)};
    auto program = train_args(4, 8, dir);
    command.insert(command.end(), program.begin(), program.end());
    auto many = oracle_command(without_master(command), dir, 180, env());
    ASSERT_EQ(one.losses.size(), 8u);
    expect_close(many.losses, one.losses, 1e-5);
    expect_same_params(many.dir, one.dir, 1e-5);
    EXPECT_EQ(many.result["num_processes"], n);
  }
}

TEST_F(Slurm, BackToBackStepsOfOneAllocationEachRendezvous) {
  // Two steps of one allocation, one after the other: each derives its own port from job and step id.
  const std::string step = fmt::format("srun --overlap -n 2 {} allreduce", kWorker);
  auto r = run(without_master({"salloc", "-n", "2", "sh", "-c", step + " && " + step}), 180, env());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto lines = lines_with(r.out, "sum=3 world=2 node=0 ");
  ASSERT_EQ(lines.size(), 4u) << r.out;
  for (const auto& line : lines) {
    EXPECT_EQ(field(line, "source"), "slurm") << line;
    EXPECT_EQ(field(line, "local"), field(line, "rank") + "/2") << line;
    EXPECT_EQ(field(line, "at").rfind("127.0.0.1:", 0), 0u) << line;
  }
}

TEST_F(Slurm, SbatchJobTrainsInLockstep) {
  auto one = one_process(8, 8);
  auto dir = temp_dir("sbatch-train");
  auto script = dir + "/job.sbatch";
  std::ofstream(script) << fmt::format("#!/bin/bash\n#SBATCH --ntasks=2\nsrun {} --batch 4 --steps 8 --out {}\n",
                                       kTrain, dir);
  auto out = sbatch(script);
  ASSERT_NE(out.find("\"losses\""), std::string::npos) << out;
  auto result = last_json(out);
  EXPECT_EQ(result["num_processes"], 2);
  expect_close(result["losses"].get<std::vector<double>>(), one.losses, 1e-5);
  expect_same_params(dir, one.dir, 1e-5);
}

TEST_F(Slurm, AProgramTheBatchScriptRunsWithoutSrunIsOneProcess) {
  // The batch script has SLURM_PROCID=0 and SLURM_NTASKS=2 but no step: it must not wait for a rank 1.
  auto one = one_process(4, 8);
  auto dir = temp_dir("sbatch-direct");
  auto script = dir + "/job.sbatch";
  std::ofstream(script) << fmt::format("#!/bin/bash\n#SBATCH --ntasks=2\n{} --batch 4 --steps 8 --out {}\n", kTrain, dir);
  auto out = sbatch(script);
  ASSERT_NE(out.find("\"losses\""), std::string::npos) << out;
  auto result = last_json(out);
  EXPECT_EQ(result["num_processes"], 1);
  expect_close(result["losses"].get<std::vector<double>>(), one.losses, 1e-9);
}

TEST_F(Slurm, TheShippedSbatchExampleTrainsFashionMnist) {
  auto dir = temp_dir("sbatch-example");
  setenv("XLR8_PROGRAM", kFashion.c_str(), 1);  // sbatch passes the submitting environment on
  auto out = sbatch(kSource + "/examples/slurm/train.sbatch",
                    {"--max_steps", "20", "--train_limit", "2560", "--output_dir", dir});
  unsetenv("XLR8_PROGRAM");
  ASSERT_NE(out.find("num_processes"), std::string::npos) << out;
  auto result = last_json(out);
  EXPECT_EQ(result["num_processes"], 2) << out;
  EXPECT_EQ(result["global_step"], 20) << out;  // both ranks stepped together to --max_steps
}

TEST_F(Slurm, XlrLaunchInsideSrunTakesItsMachinesFromSlurm) {
  // Two tasks of one step, each a "machine" whose launcher starts 2 workers: 4 ranks in lockstep.
  auto one = one_process(16, 8);
  auto dir = temp_dir("srun-launch");
  Args command{"srun", "-n", "2", kXlr8, "launch", "--nproc_per_node", "2"};
  auto program = train_args(4, 8, dir);
  command.insert(command.end(), program.begin(), program.end());
  auto many = oracle_command(without_master(command), dir, 180, env());
  EXPECT_EQ(many.result["num_processes"], 4);
  expect_close(many.losses, one.losses, 1e-5);
  expect_same_params(many.dir, one.dir, 1e-5);
}

TEST_F(Slurm, TheTrainerRunsInsideAnAllocation) {
  auto storage = temp_dir("srun-trainer");
  auto r = run(without_master({"srun", "-n", "1", kTrainer, "--storage_path", storage, "--name", "in-slurm",
                               "--num_workers", "2", "--steps", "20", "--checkpoint_every", "10", "--train_limit", "640"}),
               180, env());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto result = last_json(r.out);
  EXPECT_EQ(result["metrics"]["step"], 20) << r.out;
  EXPECT_EQ(result["metrics"]["world_size"], 2) << r.out;
}

TEST(TorchrunEnvironment, ARankOfAnotherJobIsRefusedAtTheRendezvous) {
  // Two jobs on one port (what a port collision between two scheduler jobs looks like): job B's rank 1
  // reaches job A's server and must stop with an error, not join a job of a different size.
  int port = xlr8::pick_free_port();
  auto rank_env = [&](int rank, int world) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(rank)},      {"WORLD_SIZE", std::to_string(world)},
                                              {"MASTER_ADDR", "127.0.0.1"},        {"MASTER_PORT", std::to_string(port)},
                                              {"XLR8_RDZV_TIMEOUT", "5"}};
  };
  Process a0({kWorker, "allreduce"}, rank_env(0, 2));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // job A's server is up first
  Process b1({kWorker, "allreduce"}, rank_env(1, 3));
  auto b = b1.wait(60), a = a0.wait(60);
  EXPECT_NE(b.exit_code, 0);
  EXPECT_LT(b.seconds, 4.0) << "refused at once, not at the rendezvous timeout";
  // Neither has a job id: one job whose machines counted differently, or another job's rank; the message says both.
  EXPECT_NE(b.err.find("rank 1 expected 3 ranks in all, but rank 0 started the rendezvous at 127.0.0.1:" +
                       std::to_string(port) + " for 2"),
            std::string::npos)
      << b.err;
  EXPECT_NE(b.err.find("every machine must count the same processes"), std::string::npos) << b.err;
  EXPECT_NE(b.err.find("MASTER_PORT"), std::string::npos) << b.err;
  EXPECT_NE(a.exit_code, 0);  // job A's rank 1 never came; its timeout names the rank it refused
  EXPECT_NE(a.err.find("missing rank 1"), std::string::npos) << a.err;
  EXPECT_NE(a.err.find("Refused here: rank 1 on "), std::string::npos) << a.err;
  EXPECT_NE(a.err.find("expected 3 ranks in all (this job: every machine must count the same processes)"),
            std::string::npos)
      << a.err;
}
