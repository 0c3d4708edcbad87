#pragma once
// Checks every collective x dtype on a communicator against values computed locally.
// Used by `xlr8 test` (real processes) and by the unit tests (ranks as threads).
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8 {

struct CheckResult {
  std::string name;  // e.g. "all_reduce SUM bfloat16"
  bool ok = false;
  std::string detail;  // what differed, or the error
};

// Collective over `comm`: every rank must call it. Returns this rank's results. `device` "cpu" checks
// the Gloo paths; a CUDA device ("cuda:0") checks the NCCL ones.
std::vector<CheckResult> run_collective_checks(Communicator& comm, const std::string& device = "cpu");

}  // namespace xlr8
