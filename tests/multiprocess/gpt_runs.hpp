#pragma once
// examples/gpt launched through the real launcher, shared by the GPT tests.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "process_runner.hpp"

namespace gpt_runs {

using Args = std::vector<std::string>;

inline const std::string kXlr8 = XLR8_BIN;
inline const std::string kGpt = GPT_BIN;

inline Args concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// xlr8 launch --num_processes N <launcher flags> gpt <program flags>; a failure is reported.
inline ProcessResult launch_gpt(int processes, const Args& launcher, const Args& program, bool expect_success = true) {
  auto command = concat(concat({kXlr8, "launch", "--num_processes", std::to_string(processes)}, launcher), {kGpt});
  auto r = run(concat(command, program), 300);
  if (expect_success) {
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  return r;
}

inline nlohmann::json json_of(const ProcessResult& r) {
  return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
}

}  // namespace gpt_runs
