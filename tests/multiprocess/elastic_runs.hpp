#pragma once
// What the elastic launch tests (c10d and etcd rendezvous) share: the training worker they launch, waits on
// a launcher's output, and the one-process oracle they end equal to.
#include <string>
#include <utility>
#include <vector>

#include "oracle.hpp"

using Args = std::vector<std::string>;

// The training worker on a global batch of 12 (--split_batches: the same whatever the number of ranks).
Args elastic_worker(const std::string& out, int steps, Args extra = {});
// Waits until `p`'s output matches `pattern`; the last match's first group as a number (0 without one), or -1
// at the deadline.
int wait_for(const Process& p, const std::string& pattern, double timeout_s, bool stderr_too = false);
// Every "start at step S on N processes" line of a job's rank 0, in order.
std::vector<std::pair<int, int>> starts(const std::string& out);
// The highest "step N" a job's rank 0 printed before `marker` (the whole output without one).
int last_step_before(const std::string& out, const std::string& marker);
// The oracle: elastic_worker(steps) trained by one process.
Run elastic_oracle(int steps);
