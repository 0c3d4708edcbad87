#pragma once
// examples/gpt launched through the real launcher, shared by the GPT tests.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace gpt_runs {

using Args = std::vector<std::string>;


inline Args concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// xlr8 launch --num_processes N <launcher flags> gpt <program flags> (with `env` set); a failure is reported.
inline ProcessResult launch_gpt(int processes, const Args& launcher, const Args& program, bool expect_success = true,
                                const std::map<std::string, std::string>& env = {}) {
  auto command = concat(concat({kXlr8, "launch", "--num_processes", std::to_string(processes)}, launcher), {kGpt});
  auto r = run(concat(command, program), 300, env);
  if (expect_success) {
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  return r;
}

inline nlohmann::json json_of(const ProcessResult& r) {
  return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
}

// Two runs of the same training that differ only in how the model was built and loaded (`on`: the new
// way): equal losses and saved parameters; what each rank's building and preparing cost (setup peak RSS,
// MB, by rank) and the model's fp32 size in MB, for the caller's memory claims.
struct SetupPeaks {
  std::vector<double> on, off;
  double model_mb = 0;
};
inline SetupPeaks same_training_and_setup_peaks(const nlohmann::json& on, const nlohmann::json& off,
                                                const std::string& on_dir, const std::string& off_dir, size_t ranks) {
  EXPECT_NEAR(on.value("final_train_loss", -1.0), off.value("final_train_loss", -2.0), 1e-6);
  EXPECT_NEAR(on.value("val_loss", -1.0), off.value("val_loss", -2.0), 1e-6);
  expect_same_params(on_dir, off_dir, 1e-6);
  SetupPeaks p{on.value("setup_peak_rss_mb_by_rank", std::vector<double>{}),
               off.value("setup_peak_rss_mb_by_rank", std::vector<double>{}), 4 * on.value("parameters", 0.0) / (1 << 20)};
  if (p.on.size() != ranks || p.off.size() != ranks) {
    ADD_FAILURE() << "setup peaks for " << ranks << " ranks expected: " << on << off;
    p.on.assign(ranks, 0);
    p.off.assign(ranks, 0);
  }
  return p;
}

}  // namespace gpt_runs
