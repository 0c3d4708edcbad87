// Elastic `xlr8 launch --rdzv_backend c10d` on real (simulated) hosts: every host a network namespace with
// its own address and its own `xlr8 launch` (tests/multiprocess/netns_hosts.hpp). The oracle: a job whose
// hosts come and go ends with the parameters of one process trained on the same global batch
// (--split_batches: the batch is global, whatever the number of ranks).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "elastic_runs.hpp"
#include "netns_hosts.hpp"
#include "process_runner.hpp"
#include "programs.hpp"
#include "xlr8/launcher.hpp"

namespace {

#define SKIP_WITHOUT_HOSTS()                                                      \
  if (const std::string why = NetnsHosts::unavailable(); !why.empty()) GTEST_SKIP() << why

// One host's agent: 2 ranks, the rendezvous served by host 0.
Args agent(const NetnsHosts& hosts, int host, const std::string& nnodes, const Args& program, Args extra = {}) {
  Args a{kXlr8, "launch", "--nnodes", nnodes, "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
         hosts.address(0) + ":29400", "--rdzv_id", "elastic-test", "--rdzv_conf",
         "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60", "--max_restarts", "3"};
  a.insert(a.end(), extra.begin(), extra.end());
  a.insert(a.end(), program.begin(), program.end());
  return hosts.on(host, a);
}

}  // namespace

TEST(Elastic, TwoHostsOfTwoRanksTrainToTheOracle) {
  SKIP_WITHOUT_HOSTS();
  NetnsHosts hosts(2);
  const auto out = temp_dir("elastic-2x2");
  Process first(agent(hosts, 0, "2", elastic_worker(out, 12)));
  ASSERT_GE(wait_for(first, "serving the rendezvous", 30, true), 0) << first.err_so_far();
  Process second(agent(hosts, 1, "2", elastic_worker(out, 12)));
  auto r0 = first.wait(120), r1 = second.wait(120);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  // The ranks really spanned both hosts: host 1's agent ran ranks 2 and 3 of 4, reaching the master on host 0.
  EXPECT_NE(r1.err.find(fmt::format("node 1 of 2 (ranks 2-3 of 4), master {}:", hosts.address(0))), std::string::npos) << r1.err;
  const auto result = last_json(r0.out);
  EXPECT_EQ(result["num_processes"], 4);
  const ::Run oracle = elastic_oracle(12);
  expect_close(result["losses"].get<std::vector<double>>(), oracle.losses, 1e-5);
  expect_same_params(out, oracle.dir, 1e-5);
}

// The second host dies mid-run (its link down first, so the first host sees silence, not a closed
// connection; or its processes killed with the link up); the first host restarts alone from the last
// checkpoint, losing less than one checkpoint interval. With `comes_back`, the host then returns and is
// admitted at a new round, and the job ends on both hosts. Every way, the parameters are the oracle's.
void host_dies(bool link_down, bool comes_back) {
  NetnsHosts hosts(2);
  const int steps = 60, every = 5;
  const auto out = temp_dir("elastic-dies");
  const Args program = elastic_worker(out, steps, {"--save_every", std::to_string(every), "--resume_latest", "--print_steps",
                                           "--step_sleep_ms", "100"});
  Process first(agent(hosts, 0, "1:2", program));
  ASSERT_GE(wait_for(first, "serving the rendezvous", 30, true), 0) << first.err_so_far();
  auto second = std::make_unique<Process>(agent(hosts, 1, "1:2", program));
  ASSERT_GE(wait_for(first, R"(step (1[2-9]|[2-9]\d)\n)", 60), 0) << first.out_so_far() << first.err_so_far();
  if (link_down) hosts.link(1, false);
  hosts.kill_all(1);
  const auto killed = std::chrono::steady_clock::now();
  second->wait(10);
  // Host 0 goes on alone from the checkpoint.
  ASSERT_GE(wait_for(first, R"(start at step \d+ on 2 processes)", 60), 0) << first.out_so_far() << first.err_so_far();
  const double restart_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("host 1 %s: host 0 training again after %.1f s\n", link_down ? "link down, then killed" : "killed", restart_s);
  if (comes_back) {
    hosts.link(1, true);
    second = std::make_unique<Process>(agent(hosts, 1, "1:2", program));
    ASSERT_GE(wait_for(first, R"(start at step \d+ on 4 processes[\s\S]*start at step \d+ on 4 processes)", 60), 0)
        << first.out_so_far() << first.err_so_far();
  }
  auto r0 = first.wait(120);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  if (comes_back) {
    auto r1 = second->wait(60);
    EXPECT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  }
  const auto begun = starts(r0.out);
  ASSERT_GE(begun.size(), comes_back ? 3u : 2u) << r0.out;
  EXPECT_EQ(begun[0], std::make_pair(0, 4));
  EXPECT_EQ(begun[1].second, 2);
  // At most one checkpoint interval lost: the restart resumed from the last checkpoint before the kill.
  const int reached = last_step_before(r0.out, fmt::format("start at step {} on 2", begun[1].first));
  EXPECT_GT(begun[1].first, 0);
  EXPECT_LT(reached - begun[1].first, every) << r0.out;
  if (comes_back) {
    EXPECT_EQ(begun.back().second, 4);
  }
  // The reason the survivors restarted is named.
  EXPECT_NE(r0.err.find(link_down ? "sent nothing for" : "xlr8 launch: rendezvous: machine"), std::string::npos) << r0.err;
  const ::Run oracle = elastic_oracle(steps);
  expect_same_params(out, oracle.dir, 1e-5);
}

TEST(Elastic, AHostWhoseLinkGoesDownAndDiesLeavesTheJobToTheOtherWhichFinishesAndAdmitsItWhenItReturns) {
  SKIP_WITHOUT_HOSTS();
  host_dies(/*link_down=*/true, /*comes_back=*/true);
}

TEST(Elastic, AHostKilledWithItsLinkUpLeavesTheJobToTheOtherWhichFinishes) {
  SKIP_WITHOUT_HOSTS();
  host_dies(/*link_down=*/false, /*comes_back=*/false);
}

// Two agents on this machine's loopback (no namespaces needed): the rendezvous, failures and refusals.
namespace {

Args local_agent(int port, const std::string& nnodes, const Args& program, Args extra = {}) {
  Args a{kXlr8, "launch", "--nnodes", nnodes, "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
         fmt::format("127.0.0.1:{}", port), "--rdzv_id", "local-test", "--rdzv_conf",
         "last_call_timeout=1,keep_alive_interval=1,join_timeout=30"};
  a.insert(a.end(), extra.begin(), extra.end());
  a.insert(a.end(), program.begin(), program.end());
  return a;
}

}  // namespace

TEST(Elastic, AWorkerThatDiesOnOneMachineRestartsEveryMachinesWorkersFromTheCheckpoint) {
  const int port = xlr8::pick_free_port();
  const auto out = temp_dir("elastic-worker-dies");
  const Args program = elastic_worker(out, 30, {"--save_every", "5", "--resume_latest", "--print_steps", "--die_at", "12",
                                        "--die_rank", "3"});
  Process first(local_agent(port, "2", program, {"--max_restarts", "1"}));
  ASSERT_GE(wait_for(first, "serving the rendezvous", 30, true), 0) << first.err_so_far();
  Process second(local_agent(port, "2", program, {"--max_restarts", "1"}));
  auto r0 = first.wait(120), r1 = second.wait(120);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  // Rank 3 (the second machine's) died at step 12: both machines' workers restarted from step 10.
  EXPECT_NE(r1.err.find("rank 3 (local rank 1"), std::string::npos) << r1.err;
  EXPECT_EQ(starts(r0.out), (std::vector<std::pair<int, int>>{{0, 4}, {10, 4}})) << r0.out;
  expect_same_params(out, elastic_oracle(30).dir, 1e-5);
}

TEST(Elastic, AMachineThatDisagreesOnTheJobIsRefusedNamingTheFlag) {
  const int port = xlr8::pick_free_port();
  Process first(local_agent(port, "1:2", {"sleep", "4"}));
  ASSERT_GE(wait_for(first, "serving the rendezvous", 30, true), 0) << first.err_so_far();
  auto other_size = run(local_agent(port, "2:2", {"true"}), 30);
  EXPECT_NE(other_size.exit_code, 0);
  EXPECT_NE(other_size.err.find("--nnodes 2:2 on this machine, but the rendezvous at 127.0.0.1:" + std::to_string(port) +
                                " was started with --nnodes 1:2"),
            std::string::npos)
      << other_size.err;
  Args other_job = local_agent(port, "1:2", {"true"});
  other_job[std::find(other_job.begin(), other_job.end(), "local-test") - other_job.begin()] = "another-job";
  auto refused = run(other_job, 30);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("belongs to --rdzv_id \"local-test\", not \"another-job\""), std::string::npos) << refused.err;
  EXPECT_EQ(first.wait(30).exit_code, 0);
}

TEST(Elastic, TooFewMachinesWithinTheJoinTimeoutIsAnErrorNamingTheMinimum) {
  const int port = xlr8::pick_free_port();
  auto r = run({kXlr8, "launch", "--nnodes", "2:3", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                fmt::format("127.0.0.1:{}", port), "--rdzv_conf", "join_timeout=2", "true"},
               30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("no group of at least 2 machine(s) (--nnodes 2:3)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 10);
}

// xlr8::train::Trainer across machines: each host runs the trainer example (its own driver), the workers of
// both meet at the rendezvous, the run's storage is shared. Host 1 dies (link down, then its processes);
// host 0's fit() goes on alone from the last registered checkpoint and returns the finished run's result.
TEST(Elastic, TheTrainerOnTwoHostsLosesOneAndItsFitFinishesOnTheOther) {
  SKIP_WITHOUT_HOSTS();
  NetnsHosts hosts(2);
  const auto storage = temp_dir("elastic-trainer");
  auto driver = [&](int host) {
    return hosts.on(host, {kTrainer, "--storage_path", storage, "--name", "two_hosts", "--num_workers", "2:4",
                           "--workers_per_machine", "2", "--rdzv_endpoint", hosts.address(0) + ":29400", "--rdzv_conf",
                           "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3", "--max_failures", "2",
                           "--steps", "80", "--checkpoint_every", "10", "--train_limit", "2560"});
  };
  Process first(driver(0));
  ASSERT_GE(wait_for(first, "serving the rendezvous", 30, true), 0) << first.err_so_far();
  // Host 1's driver starts now and has last_call_timeout (5 s: its start-up under a loaded CI machine took more
  // than 1 s) to join the first round.
  Process second(driver(1));
  const auto checkpoint = storage + "/two_hosts/checkpoint_000001";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (!std::filesystem::exists(checkpoint) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(std::filesystem::exists(checkpoint)) << first.out_so_far() << first.err_so_far();
  hosts.link(1, false);
  hosts.kill_all(1);
  second.wait(10);
  auto r = first.wait(150);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto result = last_json(r.out);
  EXPECT_FALSE(result.contains("error")) << r.out;
  EXPECT_EQ(result["metrics"]["step"], 80) << r.out;
  EXPECT_EQ(result["metrics"]["world_size"], 2) << r.out;  // the last group: host 0's two workers
  // The first group had both hosts' four workers, and the second resumed from a registered checkpoint.
  EXPECT_NE(r.err.find("rendezvous round 1: 2 machine(s), 4 ranks"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rendezvous round 2: 1 machine(s), 2 ranks"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from " + storage + "/two_hosts/checkpoint_"), std::string::npos) << r.out;
}

// A machine started long before the one that serves the rendezvous waits for it (its silence is counted from
// the connection, not from its first try).
TEST(Elastic, AMachineStartedBeforeTheServingOneWaitsForItAndBothTrain) {
  SKIP_WITHOUT_HOSTS();
  NetnsHosts hosts(2);
  const auto out = temp_dir("elastic-late");
  Process early(agent(hosts, 1, "2", elastic_worker(out, 4)));
  ASSERT_GE(wait_for(early, "waiting for the rendezvous", 30, true), 0) << early.err_so_far();
  std::this_thread::sleep_for(std::chrono::seconds(5));  // more than keep_alive_interval 1 s x 3
  Process serving(agent(hosts, 0, "2", elastic_worker(out, 4)));
  auto r0 = serving.wait(120), r1 = early.wait(120);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  EXPECT_EQ(last_json(r0.out + r1.out)["num_processes"], 4);
}
