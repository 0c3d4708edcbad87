// Elastic `xlr8 launch --rdzv_backend etcd`: the rendezvous kept by a real three-member etcd cluster the test
// starts (Debian's etcd-server), so that no machine of the job is a single point of failure. On loopback
// (two agents on this machine) and on simulated hosts (netns_hosts.hpp: each host one etcd member and, on
// two of them, one `xlr8 launch` of two ranks). The oracle: one process trained on the same global batch.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "elastic_runs.hpp"
#include "etcd_cluster.hpp"
#include "netns_hosts.hpp"
#include "process_runner.hpp"
#include "programs.hpp"
#include "xlr8/launcher.hpp"

namespace {

#define SKIP_WITHOUT_ETCD() \
  if (const std::string why = EtcdCluster::unavailable(); !why.empty()) GTEST_SKIP() << why

// One machine's agent of two ranks meeting the others through etcd at `endpoints`.
Args etcd_agent(const std::string& endpoints, const std::string& nnodes, const std::string& job, const Args& program) {
  Args a{kXlr8, "launch", "--nnodes", nnodes, "--nproc_per_node", "2", "--rdzv_backend", "etcd", "--rdzv_endpoint",
         endpoints, "--rdzv_id", job, "--rdzv_conf",
         "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60,read_timeout=1",
         "--max_restarts", "3"};
  a.insert(a.end(), program.begin(), program.end());
  return a;
}

// Waits until either agent (whichever holds rank 0) printed a line matching `pattern`.
bool either_printed(const Process& a, const Process& b, const std::string& pattern, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  while (std::chrono::steady_clock::now() < deadline)
    if (wait_for(a, pattern, 0.05) >= 0 || wait_for(b, pattern, 0.05) >= 0) return true;
  return false;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

// Two machines of two ranks meet through etcd and train to the oracle, and training goes on while the etcd
// leader is killed: the agents move to another member, nobody restarts.
TEST(EtcdRendezvous, TwoMachinesOfTwoRanksTrainToTheOracleWhileTheEtcdLeaderIsKilled) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster etcd(3);
  const auto out = temp_dir("etcd-leader");
  const Args program = elastic_worker(out, 30, {"--print_steps", "--step_sleep_ms", "150"});
  // The leader first in the list: the agents talk to it, so its loss is both an election and a failover.
  const int leader = etcd.leader();
  ASSERT_GE(leader, 0);
  std::string endpoints = etcd.endpoint(leader);
  for (int m = 0; m < 3; ++m)
    if (m != leader) endpoints += "," + etcd.endpoint(m);
  Process first(etcd_agent(endpoints, "2", "etcd-leader", program));
  Process second(etcd_agent(endpoints, "2", "etcd-leader", program));
  ASSERT_TRUE(either_printed(first, second, R"(step ([4-9]|\d\d)\n)", 60)) << first.err_so_far() << second.err_so_far();
  etcd.kill(leader);
  auto r0 = first.wait(120), r1 = second.wait(120);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  EXPECT_EQ(starts(r0.out + r1.out), (std::vector<std::pair<int, int>>{{0, 4}})) << r0.out << r1.out;
  EXPECT_EQ((r0.err + r1.err).find("new round"), std::string::npos) << r0.err << r1.err;
  // One agent ran ranks 0-1, the other 2-3, and neither served anything.
  EXPECT_NE((r0.err + r1.err).find("node 1 of 2 (ranks 2-3 of 4)"), std::string::npos) << r0.err << r1.err;
  EXPECT_EQ((r0.err + r1.err).find("serving the rendezvous"), std::string::npos);
  const ::Run oracle = elastic_oracle(30);
  expect_close(last_json(r0.out + r1.out)["losses"].get<std::vector<double>>(), oracle.losses, 1e-5);
  expect_same_params(out, oracle.dir, 1e-5);
}

TEST(EtcdRendezvous, EtcdUnreachableAtStartIsOneClearLine) {
  const int a = xlr8::pick_free_port(), b = xlr8::pick_free_port();
  auto r = run({kXlr8, "launch", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "etcd",
                "--rdzv_endpoint", fmt::format("127.0.0.1:{},http://127.0.0.1:{}", a, b), "--rdzv_conf", "join_timeout=2",
                "true"},
               30);
  EXPECT_NE(r.exit_code, 0);
  const std::string line =
      fmt::format("cannot reach the etcd rendezvous at 127.0.0.1:{}, 127.0.0.1:{} within join_timeout 2 s", a, b);
  EXPECT_EQ(occurrences(r.err, line), 1u) << r.err;
  EXPECT_NE(r.err.find("Connection refused"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 15);
}

TEST(EtcdRendezvous, BadFlagsAndAMachineThatDisagreesAreOneLineNamingTheFix) {
  auto no_endpoint = run({kXlr8, "launch", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "etcd", "true"});
  EXPECT_NE(no_endpoint.err.find("--rdzv_backend etcd needs --rdzv_endpoint host:port[,host:port...]"), std::string::npos)
      << no_endpoint.err;
  auto tls = run({kXlr8, "launch", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "etcd-v2",
                  "--rdzv_endpoint", "127.0.0.1:2379", "--rdzv_conf", "protocol=https", "true"});
  EXPECT_NE(tls.err.find("--rdzv_conf protocol=\"https\": only http is supported"), std::string::npos) << tls.err;
  auto unknown = run({kXlr8, "launch", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "etcd",
                      "--rdzv_endpoint", "127.0.0.1:2379", "--rdzv_conf", "timeout=3", "true"});
  EXPECT_NE(unknown.err.find("and with etcd: protocol, read_timeout, etcd_prefix"), std::string::npos) << unknown.err;
  SKIP_WITHOUT_ETCD();
  EtcdCluster etcd(1);
  Process first(etcd_agent(etcd.endpoint(0), "1:2", "disagree", {"sleep", "3"}));
  ASSERT_GE(wait_for(first, "round 1: this machine is node 0", 30, true), 0) << first.err_so_far();
  auto other = run(etcd_agent(etcd.endpoint(0), "2:2", "disagree", {"true"}), 30);
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("--nnodes 2:2 on this machine, but the job --rdzv_id \"disagree\" on etcd has --nnodes 1:2"),
            std::string::npos)
      << other.err;
  EXPECT_EQ(first.wait(30).exit_code, 0);
  // The job finished: the same --rdzv_id runs nothing, and says why.
  auto again = run(etcd_agent(etcd.endpoint(0), "1:2", "disagree", {"true"}), 30);
  EXPECT_EQ(again.exit_code, 0);
  EXPECT_NE(again.err.find("--rdzv_id \"disagree\" already finished"), std::string::npos) << again.err;
}

// The machine that started first dies, with the etcd member it ran (its link down first, or killed with the
// link up): the other re-forms through the two etcd members left and finishes from the last checkpoint,
// losing less than one checkpoint interval, with the oracle's parameters. With `comes_back` the machine then
// returns and is admitted.
void first_machine_dies(bool link_down, bool comes_back) {
  NetnsHosts hosts(3);
  EtcdCluster etcd(3, &hosts);
  const int steps = 40, every = 5;
  const auto out = temp_dir("etcd-dies");
  const Args program = elastic_worker(out, steps, {"--save_every", std::to_string(every), "--resume_latest",
                                                   "--print_steps", "--step_sleep_ms", "100"});
  auto agent_on = [&](int host) { return hosts.on(host, etcd_agent(etcd.endpoints(), "1:2", "etcd-dies", program)); };
  auto first = std::make_unique<Process>(agent_on(0));
  ASSERT_GE(wait_for(*first, "joined the etcd rendezvous", 30, true), 0) << first->err_so_far();
  Process second(agent_on(1));
  ASSERT_GE(wait_for(*first, R"(step (1[2-9]|[2-9]\d)\n)", 60), 0) << first->out_so_far() << first->err_so_far();
  if (link_down) hosts.link(0, false);
  hosts.kill_all(0);
  const auto killed = std::chrono::steady_clock::now();
  const std::string first_out = first->wait(10).out;
  ASSERT_GE(wait_for(second, R"(start at step \d+ on 2 processes)", 60), 0) << second.out_so_far() << second.err_so_far();
  std::printf("etcd: the first machine %s; the other training again after %.1f s\n",
              link_down ? "lost its link, then was killed" : "was killed", seconds_since(killed));
  if (comes_back) {
    hosts.link(0, true);
    first = std::make_unique<Process>(agent_on(0));
    ASSERT_GE(wait_for(second, R"(start at step \d+ on 2 processes[\s\S]*start at step \d+ on 4 processes)", 60), 0)
        << second.out_so_far() << second.err_so_far();
  }
  auto r1 = second.wait(120);
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  if (comes_back) {
    EXPECT_EQ(first->wait(60).exit_code, 0);
  }
  const auto begun = starts(r1.out);
  ASSERT_FALSE(begun.empty()) << r1.out;
  EXPECT_EQ(begun[0].second, 2);
  EXPECT_GT(begun[0].first, 0);
  EXPECT_LT(last_step_before(first_out, "\xff") - begun[0].first, every) << first_out << r1.out;
  if (comes_back) {
    EXPECT_EQ(begun.back().second, 4);
  }
  EXPECT_NE(r1.err.find("is gone: its etcd lease expired"), std::string::npos) << r1.err;
  expect_same_params(out, elastic_oracle(steps).dir, 1e-5);
}

TEST(EtcdRendezvous, TheFirstMachineWhoseLinkGoesDownAndDiesLeavesTheJobToTheOtherWhichAdmitsItWhenItReturns) {
  SKIP_WITHOUT_ETCD();
  if (const std::string why = NetnsHosts::unavailable(); !why.empty()) GTEST_SKIP() << why;
  first_machine_dies(/*link_down=*/true, /*comes_back=*/true);
}

TEST(EtcdRendezvous, TheFirstMachineKilledWithItsEtcdMemberLeavesTheJobToTheOther) {
  SKIP_WITHOUT_ETCD();
  if (const std::string why = NetnsHosts::unavailable(); !why.empty()) GTEST_SKIP() << why;
  first_machine_dies(/*link_down=*/false, /*comes_back=*/false);
}

// xlr8::train::Trainer with ScalingConfig.rendezvous_endpoint "etcd://...": each machine's driver meets the
// other's through the etcd cluster, and the run trains on both machines' workers.
TEST(EtcdRendezvous, TheTrainerOnTwoMachinesMeetsThroughEtcd) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster etcd(3);
  const auto storage = temp_dir("etcd-trainer");
  const Args driver{kTrainer, "--storage_path", storage, "--name", "etcd_trainer", "--num_workers", "4",
                    "--workers_per_machine", "2", "--rdzv_endpoint", "etcd://" + etcd.endpoints(), "--rdzv_conf",
                    "last_call_timeout=5,keep_alive_interval=1", "--steps", "10", "--checkpoint_every", "5",
                    "--train_limit", "640"};
  Process first(driver), second(driver);
  auto r0 = first.wait(150), r1 = second.wait(150);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  const auto result = last_json(r0.out);
  EXPECT_FALSE(result.contains("error")) << r0.out;
  EXPECT_EQ(result["metrics"]["step"], 10) << r0.out;
  EXPECT_EQ(result["metrics"]["world_size"], 4) << r0.out;
  EXPECT_NE((r0.err + r1.err).find("rendezvous round 1: 2 machine(s), 4 ranks"), std::string::npos) << r0.err << r1.err;
}
