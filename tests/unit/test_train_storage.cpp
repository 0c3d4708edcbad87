// The Trainer's run storage (snapshot, retention by score) and torchelastic's error file, without processes.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error_file.hpp"
#include "trainer/run_storage.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;
using xlr8::train::detail::RegisteredCheckpoint;
using xlr8::train::detail::RunSnapshot;

namespace {

fs::path fresh_dir(const std::string& tag) {
  auto dir = fs::temp_directory_path() / fmt::format("xlr8-{}-{}", tag, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Registers checkpoints 0..n-1 with these losses; returns the indices kept, in registration order.
std::vector<int> keep_after(RunSnapshot& s, const std::vector<double>& losses) {
  for (size_t i = 0; i < losses.size(); ++i) {
    const int index = s.next_index;
    s.add({index, xlr8::train::detail::checkpoint_dir_name(index), {{"loss", losses[i]}, {"step", i}}});
  }
  std::vector<int> kept;
  for (auto& c : s.kept) kept.push_back(c.index);
  return kept;
}

}  // namespace

TEST(TrainStorage, RetentionKeepsTheBestByScoreAndAlwaysTheLatest) {
  RunSnapshot all;
  EXPECT_EQ(keep_after(all, {3, 1, 2, 5}), (std::vector<int>{0, 1, 2, 3}));

  RunSnapshot recent;
  recent.config.num_to_keep = 2;
  EXPECT_EQ(keep_after(recent, {3, 1, 2, 5}), (std::vector<int>{2, 3}));

  RunSnapshot lowest;
  lowest.config = {.num_to_keep = 2, .checkpoint_score_attribute = "loss", .checkpoint_score_order = "min"};
  EXPECT_EQ(keep_after(lowest, {3, 1, 2, 5}), (std::vector<int>{1, 2, 3}));  // 3 is the latest
  lowest.add({4, "checkpoint_000004", {{"loss", 0.5}}});
  EXPECT_EQ(lowest.kept.size(), 2u);  // 3 goes once a newer one is registered
  EXPECT_EQ(lowest.best_first().front().index, 4);

  RunSnapshot highest;
  highest.config = {.num_to_keep = 1, .checkpoint_score_attribute = "loss", .checkpoint_score_order = "max"};
  EXPECT_EQ(keep_after(highest, {3, 1, 2, 5}), (std::vector<int>{3}));
  EXPECT_EQ(keep_after(highest, {4}), (std::vector<int>{3, 4}));
  EXPECT_EQ(highest.best_first().front().index, 3);
}

TEST(TrainStorage, ANanScoreRanksLastAndSurvivesTheSnapshotsRoundTrip) {
  // A diverged run reports NaN; JSON keeps it as null. Neither may wedge later reports or the ordering.
  const auto dir = fresh_dir("snapshot-nan");
  RunSnapshot s;
  s.config = {.num_to_keep = 1, .checkpoint_score_attribute = "loss", .checkpoint_score_order = "min"};
  keep_after(s, {2, std::nan("")});
  EXPECT_EQ(s.best_first().front().index, 0);  // NaN (the latest, so kept) ranks below 2
  s.save(dir);
  auto back = RunSnapshot::load(dir);
  EXPECT_TRUE(back.kept.back().metrics["loss"].is_null());
  std::vector<RegisteredCheckpoint> dropped;
  EXPECT_NO_THROW(dropped = back.add({2, "checkpoint_000002", {{"loss", 3.0}}}));
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].index, 1);  // the NaN one goes once it is not the latest
  EXPECT_EQ(back.best_first().front().index, 0);
  fs::remove_all(dir);
}

TEST(TrainStorage, AScoreAttributeMissingFromTheMetricsIsNamedWithWhatThereIs) {
  RunSnapshot s;
  s.config = {.num_to_keep = 1, .checkpoint_score_attribute = "accuracy", .checkpoint_score_order = "max"};
  try {
    s.add({0, "checkpoint_000000", {{"loss", 1.0}, {"step", 10}}});
    FAIL() << "no error";
  } catch (const xlr8::ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "CheckpointConfig.checkpoint_score_attribute \"accuracy\" is not a number in the metrics reported with "
                 "checkpoint_000000 (they have: loss, step); report it with every checkpoint");
  }
  EXPECT_TRUE(s.kept.empty());
  EXPECT_THROW(xlr8::train::detail::validate({.checkpoint_score_order = "largest"}), xlr8::ConfigError);
  EXPECT_THROW(xlr8::train::detail::validate({.num_to_keep = 0}), xlr8::ConfigError);
}

TEST(TrainStorage, TheSnapshotRoundTripsAndAnUnreadableOneIsNamed) {
  const auto dir = fresh_dir("snapshot");
  EXPECT_TRUE(RunSnapshot::load(dir).kept.empty());  // a new run
  RunSnapshot s;
  s.config = {.num_to_keep = 3, .checkpoint_score_attribute = "loss", .checkpoint_score_order = "min"};
  keep_after(s, {2, 1});
  s.latest_metrics = {{"loss", 1}, {"note", "last"}};
  s.save(dir);
  auto back = RunSnapshot::load(dir);
  EXPECT_EQ(back.next_index, 2);
  ASSERT_EQ(back.kept.size(), 2u);
  EXPECT_EQ(back.kept[1].dir_name, "checkpoint_000001");
  EXPECT_EQ(back.kept[1].metrics["loss"], 1);
  EXPECT_EQ(back.latest_metrics["note"], "last");
  EXPECT_EQ(back.config.num_to_keep, 3);
  EXPECT_EQ(back.config.checkpoint_score_order, "min");
  std::ofstream(dir / xlr8::train::detail::kSnapshotFile) << "{\"next_index\": ";
  try {
    RunSnapshot::load(dir);
    FAIL() << "no error";
  } catch (const xlr8::Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "checkpoint_manager_snapshot.json").string() + " cannot be read"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

TEST(ErrorFile, TheFirstErrorIsWrittenInTorchsFormatWithoutTheBacktrace) {
  const auto dir = fresh_dir("error-file");
  const auto path = (dir / "attempt_0" / "0" / "error.json").string();
  ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
  xlr8::core::write_error_file(
      xlr8::core::describe_exception(xlr8::ConfigError("shapes differ\nException raised from f at a.cpp:1 (most recent call first):\nframe #0: g")));
  xlr8::core::write_error_file("a later consequence");
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  auto record = xlr8::core::read_error_file(path);
  ASSERT_TRUE(record);
  EXPECT_EQ(record->message, "xlr8::ConfigError: shapes differ");
  EXPECT_GT(record->timestamp, 1700000000);
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("frame #0: g"), std::string::npos);  // kept where torch keeps the traceback
  std::ofstream(dir / "plain.json") << R"({"message": "plain string"})";
  EXPECT_EQ(xlr8::core::read_error_file((dir / "plain.json").string())->message, "plain string");
  std::ofstream(dir / "bad.json") << "not json";
  EXPECT_FALSE(xlr8::core::read_error_file((dir / "bad.json").string()));
  EXPECT_FALSE(xlr8::core::read_error_file((dir / "missing.json").string()));
  fs::remove_all(dir);
}
