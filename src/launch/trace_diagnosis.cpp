// The merged picture of every rank's flight recorder: per group, compare the ranks' sequence numbers and
// operations; the group where a rank lags or differs is the hang's cause.
#include "launch/trace_diagnosis.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <vector>

#include "core/text.hpp"

namespace fs = std::filesystem;

namespace xlr8::launcher {

namespace {

struct Entry {
  uint64_t sequence = 0;
  std::string op, state;
};

struct RankTrace {
  std::string reason;
  std::map<std::string, std::vector<Entry>> by_group;  // numbered collectives only, in issue order
};

std::string describe(const std::string& group, const Entry& e) {
  return fmt::format("{} #{} {}", group, e.sequence, e.op);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

using Traces = std::map<int, RankTrace>;

// rank<N>.json files of `dir`; a file that cannot be read is skipped (half a picture beats none) and named in
// `unreadable`, with why; only a dump that reads whole counts as its rank's.
Traces read_traces(const std::string& dir, std::vector<std::string>& unreadable) {
  Traces traces;
  std::error_code error;
  const std::regex name("rank([0-9]+)\\.json");
  for (const auto& file : fs::directory_iterator(dir, error)) {
    std::smatch match;
    const std::string filename = file.path().filename().string();
    if (!std::regex_match(filename, match, name)) continue;
    try {
      std::ifstream in(file.path());
      const auto dump = nlohmann::json::parse(in);
      RankTrace t;
      t.reason = dump.value("reason", "");
      for (const auto& e : dump.at("entries"))
        if (e.at("sequence").get<uint64_t>() > 0)
          t.by_group[e.at("group").get<std::string>()].push_back(
              {e.at("sequence").get<uint64_t>(), e.at("op").get<std::string>(), e.at("state").get<std::string>()});
      traces[std::stoi(match[1])] = std::move(t);
    } catch (const std::exception& e) {
      unreadable.push_back(fmt::format("{} ({})", filename, text::first_line(e.what())));
    }
  }
  return traces;
}

// Different operations at the same position of `group`: the ranks' programs diverged at the first one.
std::optional<std::string> divergence(const Traces& traces, const std::string& group) {
  std::map<uint64_t, std::map<std::string, std::vector<int>>> ops_at;
  for (const auto& [rank, t] : traces) {
    auto it = t.by_group.find(group);
    if (it == t.by_group.end()) continue;
    for (const auto& e : it->second) ops_at[e.sequence][e.op].push_back(rank);
  }
  for (const auto& [sequence, ops] : ops_at) {
    if (ops.size() < 2) continue;
    std::vector<std::pair<std::vector<int>, std::string>> by_rank;  // told in rank order, lowest rank first
    for (const auto& [op, ranks] : ops) by_rank.emplace_back(ranks, op);
    std::sort(by_rank.begin(), by_rank.end());
    std::string parts;
    for (const auto& [ranks, op] : by_rank) parts += fmt::format("{}{} issued {}", parts.empty() ? "" : "; ", ranks_text(ranks), op);
    return fmt::format("the ranks issued different collectives at {} #{}: {}", group, sequence, parts);
  }
  return std::nullopt;
}

// Where each rank stands in `group`: who waits at the furthest position, who never arrived there.
void compare_positions(const Traces& traces, const std::string& group, std::vector<std::string>& findings) {
  uint64_t furthest = 0;
  std::map<int, const Entry*> last;
  for (const auto& [rank, t] : traces) {
    auto it = t.by_group.find(group);
    if (it == t.by_group.end() || it->second.empty()) continue;
    last[rank] = &it->second.back();
    furthest = std::max(furthest, it->second.back().sequence);
  }
  std::vector<int> waiting, behind;
  for (const auto& [rank, e] : last) (e->sequence == furthest ? waiting : behind).push_back(rank);
  if (behind.empty()) {
    std::vector<int> stuck;
    for (const auto& [rank, e] : last)
      if (e->state != "completed") stuck.push_back(rank);
    if (!stuck.empty())
      findings.push_back(fmt::format("{} waited in {} ({})", ranks_text(stuck), describe(group, *last[stuck.front()]),
                                     last[stuck.front()]->state == "failed" ? "it failed or timed out" : "still in it"));
    return;
  }
  const Entry& ahead = *last[waiting.front()];
  findings.push_back(fmt::format("{} reached {} ({})", ranks_text(waiting), describe(group, ahead),
                                 ahead.state == "completed" ? "completed"
                                 : ahead.state == "failed"  ? "failed or timed out waiting for the others"
                                                            : "waiting for the others"));
  for (int rank : behind) {
    const Entry& e = *last[rank];
    findings.push_back(fmt::format(
        "rank {} never arrived at {} #{}: its last {} collective was {} ({}){}", rank, group, furthest, group,
        describe(group, e), e.state,
        e.state == "completed" ? ", so it was outside any collective: computing, or stuck in the program's own code"
                               : ""));
  }
}

}  // namespace

std::string diagnose_traces(const std::string& dir, const TraceDiagnosisOptions& options) {
  const int world_size = options.world_size;
  std::vector<std::string> unreadable;
  const auto traces = read_traces(dir, unreadable);
  if (traces.empty()) return unreadable.empty() ? "" : fmt::format("collective trace ({}): no dump could be read: {}",
                                                                    options.shown_as.empty() ? dir : options.shown_as,
                                                                    fmt::join(unreadable, "; "));
  if (options.only_after_timeout &&
      std::none_of(traces.begin(), traces.end(), [](const auto& t) { return t.second.reason.rfind("timed out", 0) == 0; }))
    return "";
  std::vector<std::string> findings;
  std::set<std::string> groups;
  for (const auto& [rank, t] : traces)
    for (const auto& [group, entries] : t.by_group) groups.insert(group);
  for (const auto& group : groups) {
    if (auto diverged = divergence(traces, group)) findings.push_back(*diverged);
    else compare_positions(traces, group, findings);
  }
  std::vector<int> silent;
  for (int rank = 0; rank < world_size; ++rank)
    if (!traces.count(rank)) silent.push_back(rank);
  if (!silent.empty())
    findings.push_back(fmt::format("{} left no trace (died first, or never issued a collective through xlr8)",
                                   ranks_text(silent)));
  if (!unreadable.empty()) findings.push_back(fmt::format("not read: {}", fmt::join(unreadable, "; ")));
  if (world_size > 0 && traces.rbegin()->first >= world_size)
    findings.push_back(fmt::format("rank {} dumped, beyond the {} ranks given", traces.rbegin()->first, world_size));
  if (findings.empty()) findings.push_back("every rank's collectives match and completed");
  std::string text = fmt::format("collective trace ({} of {} ranks, {}): ", traces.size(),
                                 world_size > 0 ? world_size : static_cast<int>(traces.size()),
                                 options.shown_as.empty() ? dir : options.shown_as);
  for (size_t i = 0; i < findings.size(); ++i) text += (i ? "; " : "") + findings[i];
  return text + ".";
}

}  // namespace xlr8::launcher
