#include "launch/failure_report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>

#include <algorithm>

#include "core/error_file.hpp"
#include "core/log.hpp"

namespace xlr8::launcher {
namespace {

// The first failure's last stderr lines, less those that repeat the error already shown (nothing when that is
// all they say). Backtraces stay in the log and on the console.
void report_tail(const WorkerEnd& w, const std::string& said, const std::string& log_dir) {
  // A headline may be assembled from its lines ("terminate called ... 'T'" + "what(): M" as "T: M").
  const auto repeats = [&](const std::string& line) {
    return !said.empty() && (line.find(said) != std::string::npos ||
                             (line.size() >= 16 && said.find(line) != std::string::npos));
  };
  std::vector<std::string> kept;
  for (const auto& line : w.notes->tail())
    if (!repeats(line) && line.find_first_not_of(" \t") != std::string::npos) kept.push_back(line);
  std::string left_out;
  if (size_t n = w.notes->backtrace_lines())
    left_out = fmt::format(" ({} backtrace lines left out: they are above{})", n,
                           log_dir.empty() ? "" : fmt::format(" and in {}", w.err_log_path));
  if (kept.empty()) {
    if (!left_out.empty()) log::error("xlr8 launch: rank {}'s stderr{}", w.rank, left_out);
    return;
  }
  std::string lines;
  for (const auto& line : kept) lines += fmt::format("\n    {}", line);
  log::error("xlr8 launch: last {} lines of rank {}'s stderr{}:{}", kept.size(), w.rank, left_out, lines);
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status))
    return fmt::format("killed by {} (signal {})", signal_name(WTERMSIG(status)), WTERMSIG(status));
  return fmt::format("exit code {}", WEXITSTATUS(status));
}

void report_first_failure(const std::vector<WorkerEnd>& workers, size_t first, const std::string& log_dir) {
  const auto& w = workers[first];
  log::error("xlr8 launch: rank {} (local rank {}, pid {}) failed first: {}", w.rank, w.local_rank, w.pid,
             describe_status(w.status));
  const auto recorded = core::read_error_file(w.error_file);
  const std::string said = recorded ? recorded->message : w.notes->headline();
  // Ranks refusing the same input fail alike: their message is said once, with their ranks.
  std::vector<int> same;
  for (const auto& other : workers)
    if (&other != &w && other.status != 0 && !said.empty() && other.notes->headline().find(said) != std::string::npos)
      same.push_back(other.rank);
  const std::string also = same.empty() ? "" : fmt::format(" (rank{} {} said the same)", same.size() > 1 ? "s" : "",
                                                           fmt::join(same, ", "));
  if (recorded)
    log::error("xlr8 launch: rank {}'s error{}: {}\nxlr8 launch: (recorded in its error file{})", w.rank, also, said,
               log_dir.empty() ? "; pass --log_dir to keep it" : " " + w.error_file);
  else if (!said.empty())
    log::error("xlr8 launch: rank {}'s error{}: {}", w.rank, also, said);
  for (const auto& other : workers)
    if (&other != &w && other.status != 0 && !other.notes->headline().empty() &&
        std::find(same.begin(), same.end(), other.rank) == same.end())
      log::error("xlr8 launch: rank {} ({}) said: {}", other.rank, describe_status(other.status), other.notes->headline());
  report_tail(w, said, log_dir);
  if (workers.size() > 1) log::error("xlr8 launch: stopped the other {} local worker(s)", workers.size() - 1);
}

}  // namespace xlr8::launcher
