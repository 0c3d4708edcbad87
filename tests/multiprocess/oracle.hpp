#pragma once
// The correctness oracle's checks, shared by the launcher, training and scheduler tests: the JSON line
// a training worker prints, the parameters it saved, and comparisons within a tolerance.
#include <ATen/core/Tensor.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "process_runner.hpp"

// The last JSON object in a worker's output (the line may carry a "[rankN]: " prefix).
nlohmann::json last_json(const std::string& out);
// The parameters a worker saved with save_model into `dir`/model.
std::map<std::string, at::Tensor> params(const std::string& dir);
void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tolerance);
void expect_same_params(const std::string& a, const std::string& b, double tolerance);

struct Run {
  std::string dir;
  std::vector<double> losses;
  nlohmann::json result;
};

// Runs `command` (a training worker however it is started, writing into `dir`) and reads its losses;
// a failure is a test failure that shows the output.
Run oracle_command(const std::vector<std::string>& command, const std::string& dir, double timeout_s = 120,
                   const std::map<std::string, std::string>& env = {});
