// DeepSpeed's `elasticity` section through the real launcher and engine: every world size picks DeepSpeed's
// micro batch and accumulation for one global batch, so 1-4 ranks (and a job that loses a machine mid-run)
// train as one process does, without split_batches.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <regex>

#include "elastic_runs.hpp"
#include "etcd_cluster.hpp"
#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace {

// Global batch 24 from micro batches 1-3 (version 0.1): valid on 1, 2, 3, 4, 6, 8, 12, 24 ranks.
std::string write_elastic_config(const std::string& dir, nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json config = {
      {"elasticity", {{"enabled", true}, {"max_train_batch_size", 24}, {"micro_batch_sizes", {1, 2, 3}}, {"version", 0.1}}},
      {"steps_per_print", 1000},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", 2}}}};
  config.update(extra);
  const auto path = dir + "/ds_elastic.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

// "start at step S on N processes: M per rank x G accumulation" of a run's rank 0.
std::string chosen(const std::string& out) {
  static const std::regex re(R"(on (\d+) processes: (\d+) per rank x (\d+) accumulation)");
  std::smatch m;
  return std::regex_search(out, m, re) ? fmt::format("{} ranks: {} x {}", m[1].str(), m[2].str(), m[3].str()) : "";
}

}  // namespace

TEST(DeepSpeedElasticity, OneToFourRanksTakeDeepSpeedsMicroBatchAndAccumulationAndTrainAsOneProcess) {
  const std::map<int, std::string> expected = {
      {1, "1 ranks: 3 x 8"}, {2, "2 ranks: 3 x 4"}, {3, "3 ranks: 2 x 4"}, {4, "4 ranks: 3 x 2"}};
  std::string one_dir;
  std::vector<double> one_losses;
  for (const auto& [ranks, choice] : expected) {
    const auto dir = temp_dir("ds-elastic");
    auto r = run({kXlr8, "launch", "--num_processes", std::to_string(ranks), kEngine, "--config",
                  write_elastic_config(dir), "--steps", "4", "--out", dir},
                 120);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(chosen(r.out), choice) << r.out;
    EXPECT_NE(r.err.find("train_batch_size 24 = "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("(elasticity's choice for this world size)"), std::string::npos) << r.err;
    const auto losses = last_json(r.out)["losses"].get<std::vector<double>>();
    if (ranks == 1) {
      one_dir = dir, one_losses = losses;
      continue;
    }
    expect_close(losses, one_losses, 1e-5);
    expect_same_params(dir, one_dir, 1e-5);
  }
}

TEST(DeepSpeedElasticity, AWorldSizeTheSectionDoesNotAllowOrBatchKeysBesideItAreOneLineBeforeAnyWorkerStarts) {
  const auto dir = temp_dir("ds-elastic-bad");
  auto five = run({kXlr8, "launch", "--num_processes", "5", kEngine, "--config", write_elastic_config(dir), "--out", dir});
  EXPECT_NE(five.exit_code, 0);
  EXPECT_NE(five.err.find("elasticity: world size 5 (data-parallel ranks) is not valid for max_train_batch_size 24 "
                          "and micro_batch_sizes [1, 2, 3]; the valid ones are [1, 2, 3, 4, 6, 8, 12, 24]"),
            std::string::npos)
      << five.err;
  EXPECT_EQ(five.out.find("start at step"), std::string::npos) << five.out;
  auto keys = run({kXlr8, "launch", "--num_processes", "2", kEngine, "--config",
                   write_elastic_config(dir, {{"train_batch_size", 24}}), "--out", dir});
  EXPECT_NE(keys.exit_code, 0);
  EXPECT_NE(keys.err.find("train_batch_size is set, but elasticity is enabled and chooses the batch sizes itself"),
            std::string::npos)
      << keys.err;
}

// Two machines of two ranks (the etcd rendezvous); one is killed mid-run. The other goes on alone from the last
// checkpoint with 2 ranks, where the section chooses 3 x 4 instead of 3 x 2: the global batch stays 24, and the
// job ends with one process's parameters.
TEST(DeepSpeedElasticity, AJobThatLosesAMachineKeepsItsGlobalBatchAndEndsAsOneProcess) {
  if (const std::string why = EtcdCluster::unavailable(); !why.empty()) GTEST_SKIP() << why;
  EtcdCluster etcd(1);
  const auto dir = temp_dir("ds-elastic-job");
  const Args program{kEngine, "--config", write_elastic_config(dir), "--steps", "12", "--out", dir,
                     "--save_every", "2", "--resume_latest", "--step_sleep_ms", "200"};
  auto agent = [&] {
    Args a{kXlr8, "launch", "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv_backend", "etcd", "--rdzv_endpoint",
           etcd.endpoint(0), "--rdzv_id", "ds-elastic", "--rdzv_conf",
           "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60,read_timeout=1", "--max_restarts", "2"};
    a.insert(a.end(), program.begin(), program.end());
    return a;
  };
  Process first(agent());
  ASSERT_GE(wait_for(first, "joined the etcd rendezvous", 30, true), 0) << first.err_so_far();
  Process second(agent());
  ASSERT_GE(wait_for(first, R"(step ([3-9]|1\d)\n)", 90), 0) << first.out_so_far() << first.err_so_far();
  second.signal(SIGKILL);  // its workers die with it (PR_SET_PDEATHSIG)
  second.wait(10);
  auto r = first.wait(150);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto begun = starts(r.out);
  ASSERT_EQ(begun.size(), 2u) << r.out;
  EXPECT_EQ(begun[0], std::make_pair(0, 4));
  EXPECT_EQ(begun[1].second, 2);
  EXPECT_GT(begun[1].first, 0);
  EXPECT_NE(r.out.find("on 4 processes: 3 per rank x 2 accumulation"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("on 2 processes: 3 per rank x 4 accumulation"), std::string::npos) << r.out;
  const auto one = temp_dir("ds-elastic-one");
  auto oracle = run({kXlr8, "launch", "--num_processes", "1", kEngine, "--config", write_elastic_config(one), "--steps",
                     "12", "--out", one});
  ASSERT_EQ(oracle.exit_code, 0) << oracle.out << oracle.err;
  expect_same_params(dir, one, 1e-5);
}
