// DeepSpeed's elasticity against the real DeepSpeed: tests/data/deepspeed_elasticity/oracle.json holds what
// DeepSpeed 0.19.7's compute_elastic_config and its runtime DeepSpeedConfig answered for 119 cases
// (make_oracle.py beside it ran them): global batch, valid world sizes, micro batch and accumulation, or an
// error. Each must be ours too: the same numbers, or a ConfigError where DeepSpeed raised.
#include <gtest/gtest.h>

#include <array>
#include <fstream>
#include <regex>

#include "xlr8/deepspeed_config.hpp"
#include "xlr8/error.hpp"

using nlohmann::json;
using namespace xlr8::deepspeed;

namespace {

json oracle_cases() {
  std::ifstream in(std::string(XLR8_SOURCE_DIR) + "/tests/data/deepspeed_elasticity/oracle.json");
  return json::parse(in);
}

// The case through compute_elastic_batch: its result as DeepSpeed reports it, or the error's text.
json ours_compute(const json& c) {
  try {
    const ElasticBatch b = compute_elastic_batch(read_elasticity(c["config"], "oracle"), c["world_size"].get<int64_t>());
    return json{{"final_batch_size", b.train_batch_size},
                {"valid_gpus", b.valid_world_sizes},
                {"micro_batch_size", b.micro_batch_size},
                {"gradient_accumulation_steps", b.gradient_accumulation_steps}};
  } catch (const xlr8::ConfigError& e) {
    return json{{"error", e.what()}};
  }
}

// The case as a whole DeepSpeed JSON resolved for its data-parallel world size.
json ours_runtime(const json& c) {
  json document = c.value("top_level", json::object());
  document["elasticity"] = c["config"];
  try {
    const BatchSizes b = resolve_batch_sizes(parse_config(document), c["world_size"].get<int>());
    return json{{"train_batch_size", b.train_batch_size},
                {"train_micro_batch_size_per_gpu", b.micro_batch_per_gpu},
                {"gradient_accumulation_steps", b.gradient_accumulation_steps}};
  } catch (const xlr8::ConfigError& e) {
    return json{{"error", e.what()}};
  }
}

}  // namespace

TEST(DeepSpeedElasticity, EveryCaseAnswersAsTheRealDeepSpeedDid) {
  const json cases = oracle_cases();
  ASSERT_GE(cases.size(), 100u);
  int compared = 0;
  for (const json& c : cases) {
    if (c["world_size"] == 0) continue;  // DeepSpeed's WORLD_SIZE fallback: xlr8 always knows the world size
    const bool runtime = c["via"] == "DeepSpeedConfig";
    const json ours = runtime ? ours_runtime(c) : ours_compute(c);
    SCOPED_TRACE(c.dump());
    ++compared;
    if (c.contains("error")) {
      EXPECT_TRUE(ours.contains("error")) << ours.dump();
      // A world size DeepSpeed rejects names the same valid ones.
      // numpy's integers print as np.int64(576) inside DeepSpeed's list.
      const std::string theirs = std::regex_replace(c["error"].get<std::string>(), std::regex(R"(np\.int64\((\d+)\))"), "$1");
      if (theirs.rfind("ElasticityIncompatibleWorldSize", 0) == 0 && ours.contains("error")) {
        EXPECT_NE(ours["error"].get<std::string>().find(theirs.substr(theirs.rfind('['))), std::string::npos) << ours;
      }
      continue;
    }
    json expected = c["result"];
    expected.erase("world_size_seen");
    EXPECT_EQ(ours, expected);
  }
  EXPECT_GE(compared, 110);
}

TEST(DeepSpeedElasticity, TheSectionIsReadWithDeepSpeedsKeysAndBatchKeysBesideItAreRefusedUnlessIgnored) {
  const json section = {{"enabled", true}, {"max_train_batch_size", 24}, {"micro_batch_sizes", {1, 2, 3}}, {"version", 0.1}};
  // 24 global samples on 1-4 ranks: micro x accumulation x ranks, the largest micro batch that divides.
  const std::vector<std::array<int64_t, 3>> expected = {{1, 3, 8}, {2, 3, 4}, {3, 2, 4}, {4, 3, 2}};
  for (const auto& [world, micro, gas] : expected) {
    const BatchSizes b = resolve_batch_sizes(parse_config(json{{"elasticity", section}}), static_cast<int>(world));
    EXPECT_EQ(b.train_batch_size, 24);
    EXPECT_EQ(b.micro_batch_per_gpu, micro);
    EXPECT_EQ(b.gradient_accumulation_steps, gas);
  }
  try {
    resolve_batch_sizes(parse_config(json{{"elasticity", section}}), 5);
    FAIL();
  } catch (const xlr8::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("world size 5 (data-parallel ranks) is not valid"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[1, 2, 3, 4, 6, 8, 12, 24]"), std::string::npos) << e.what();
  }
  const json with_batch = {{"elasticity", section}, {"train_micro_batch_size_per_gpu", 4}};
  EXPECT_THROW(resolve_batch_sizes(parse_config(with_batch), 2), xlr8::ConfigError);
  json ignored = with_batch;
  ignored["elasticity"]["ignore_non_elastic_batch_info"] = true;
  EXPECT_EQ(resolve_batch_sizes(parse_config(ignored), 2).micro_batch_per_gpu, 3);
  json typo = section;
  typo["max_gpu"] = 8;
  try {
    parse_config(json{{"elasticity", typo}});
    FAIL();
  } catch (const xlr8::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean \"elasticity.max_gpus\"?"), std::string::npos) << e.what();
  }
  // Disabled, the section changes nothing (and needs none of its keys).
  EXPECT_EQ(resolve_batch_sizes(parse_config(json{{"elasticity", {{"enabled", false}}}, {"train_batch_size", 8}}), 2)
                .micro_batch_per_gpu,
            4);
}
