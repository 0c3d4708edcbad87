#include "elastic_runs.hpp"

#include <chrono>
#include <regex>
#include <thread>

#include "programs.hpp"

Args elastic_worker(const std::string& out, int steps, Args extra) {
  Args a{kTrain, "--split_batches", "--batch", "12", "--steps", std::to_string(steps), "--out", out};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

int wait_for(const Process& p, const std::string& pattern, double timeout_s, bool stderr_too) {
  const std::regex re(pattern);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string text = p.out_so_far() + (stderr_too ? p.err_so_far() : "");
    int last = -1;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
      last = it->size() > 1 && (*it)[1].matched ? std::stoi((*it)[1]) : 0;
    if (last >= 0) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

std::vector<std::pair<int, int>> starts(const std::string& out) {
  static const std::regex re(R"(start at step (\d+) on (\d+) processes)");
  std::vector<std::pair<int, int>> found;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    found.emplace_back(std::stoi((*it)[1]), std::stoi((*it)[2]));
  return found;
}

int last_step_before(const std::string& out, const std::string& marker) {
  const std::string head = out.substr(0, out.find(marker));
  static const std::regex re(R"(\bstep (\d+)\n)");
  int last = 0;
  for (auto it = std::sregex_iterator(head.begin(), head.end(), re); it != std::sregex_iterator(); ++it)
    last = std::max(last, std::stoi((*it)[1]));
  return last;
}

Run elastic_oracle(int steps) {
  const auto dir = temp_dir("elastic-oracle");
  Args command{kXlr8, "launch", "--num_processes", "1"};
  const Args w = elastic_worker(dir, steps);
  command.insert(command.end(), w.begin(), w.end());
  return oracle_command(command, dir);
}

