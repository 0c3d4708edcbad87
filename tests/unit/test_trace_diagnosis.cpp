// The hang diagnosis from flight-recorder dumps written by hand: a rank behind, a rank that diverged, a
// rank with no dump, and a job whose collectives all matched.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "launch/trace_diagnosis.hpp"

namespace fs = std::filesystem;

namespace {

struct Op {
  uint64_t sequence;
  std::string op, state;
};

void write_dump(const fs::path& dir, int rank, const std::vector<Op>& ops) {
  nlohmann::json entries = nlohmann::json::array();
  uint64_t id = 1;
  for (const auto& o : ops)
    entries.push_back({{"id", id++}, {"group", "world"}, {"sequence", o.sequence}, {"op", o.op}, {"state", o.state},
                       {"enqueued_at", 1.0}, {"finished_at", 2.0}});
  std::ofstream(dir / fmt::format("rank{}.json", rank)) << nlohmann::json{{"rank", rank}, {"reason", "test"}, {"entries", entries}};
}

fs::path fresh(const std::string& tag) {
  auto dir = fs::temp_directory_path() / fmt::format("xlr8-{}-{}", tag, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace

TEST(TraceDiagnosis, NamesTheRankThatNeverArrivedAndTheRanksWaitingForIt) {
  const auto dir = fresh("trace-behind");
  const Op ar1{1, "all_reduce(float32[4], SUM)", "completed"}, ar2{2, "all_reduce(float32[4], SUM)", "failed"};
  write_dump(dir, 0, {ar1, ar2});
  write_dump(dir, 2, {ar1, ar2});
  write_dump(dir, 1, {ar1, {0, "send(float32[2])", "completed"}});  // point-to-point: not numbered, not compared
  const auto text = xlr8::launcher::diagnose_traces(dir.string(), {.world_size = 4});
  EXPECT_EQ(text, fmt::format("collective trace (3 of 4 ranks, {}): ranks 0, 2 reached world #2 all_reduce(float32[4], "
                              "SUM) (failed or timed out waiting for the others); rank 1 never arrived at world #2: its "
                              "last world collective was world #1 all_reduce(float32[4], SUM) (completed), so it was "
                              "outside any collective: computing, or stuck in the program's own code; rank 3 left no "
                              "trace (died first, or never issued a collective through xlr8).",
                              dir.string()));
  fs::remove_all(dir);
}

TEST(TraceDiagnosis, NamesTheFirstPositionWhereTheRanksIssuedDifferentCollectives) {
  const auto dir = fresh("trace-differ");
  write_dump(dir, 0, {{1, "barrier", "completed"}, {2, "all_reduce(float32[4], SUM)", "failed"}});
  write_dump(dir, 1, {{1, "barrier", "completed"}, {2, "broadcast(float32[4], root 0)", "failed"}});
  const auto text = xlr8::launcher::diagnose_traces(dir.string(), {.world_size = 2});
  EXPECT_NE(text.find("the ranks issued different collectives at world #2: rank 0 issued all_reduce(float32[4], SUM); "
                      "rank 1 issued broadcast(float32[4], root 0)"),
            std::string::npos)
      << text;
  fs::remove_all(dir);
  const auto clean = fresh("trace-clean");
  write_dump(clean, 0, {{1, "barrier", "completed"}});
  write_dump(clean, 1, {{1, "barrier", "completed"}});
  EXPECT_NE(xlr8::launcher::diagnose_traces(clean.string(), {.world_size = 2}).find("every rank's collectives match and completed"),
            std::string::npos);
  EXPECT_EQ(xlr8::launcher::diagnose_traces((clean / "none").string(), {.world_size = 2}), "");  // no dumps: nothing to say
  fs::remove_all(clean);
}

// A dump that does not read whole (`{}`, or cut short) is no rank's: its rank counts as having left no trace, and the
// file is named with why (before, `{}` counted as a rank whose collectives completed, and a cut one vanished silently).
TEST(TraceDiagnosis, ADumpThatDoesNotReadIsNamedAndCountsForNoRank) {
  const auto dir = fresh("trace-unreadable");
  write_dump(dir, 0, {{1, "barrier", "completed"}});
  std::ofstream(dir / "rank1.json") << "{}";
  std::ofstream(dir / "rank2.json") << "{\"entries\": [";
  const auto text = xlr8::launcher::diagnose_traces(dir.string(), {.world_size = 3});
  EXPECT_NE(text.find("collective trace (1 of 3 ranks"), std::string::npos) << text;
  EXPECT_NE(text.find("ranks 1, 2 left no trace"), std::string::npos) << text;
  EXPECT_NE(text.find("not read: rank1.json ("), std::string::npos) << text;
  EXPECT_NE(text.find("rank2.json ("), std::string::npos) << text;
  fs::remove(dir / "rank0.json");
  EXPECT_NE(xlr8::launcher::diagnose_traces(dir.string(), {.world_size = 3}).find("no dump could be read: rank1.json"),
            std::string::npos);
  fs::remove_all(dir);
}
