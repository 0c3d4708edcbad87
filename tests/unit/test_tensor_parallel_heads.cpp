// A tp size that cuts an attention head (issue 41 §2: 2 key/value heads of 16 at tp 4, k_proj's 32 features
// split 8 a rank) is refused before anything is split, in one line naming the layer, its features, the head
// size and tp, however the plan was made: by hand (PlanEntry::head_dim), by AutoTP, by a plan file (its
// head_dim keys or prepare()'s head size), or a model the program split itself checked against the head size
// (prepare()'s tp_head_dim; the launch's parallelism_config_tp_head_dim).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "thread_ranks.hpp"
#include "xlr8/config.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/settings.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace {

using xlr8::Communicator;
using xlr8::testing::generator_lock;
using xlr8::testing::run_ranks;
namespace tp = xlr8::tp;

// The new user's grouped-query attention: 4 query heads and 2 key/value heads of 16, separate projections.
constexpr int64_t kHead = 16, kWidth = 4 * kHead, kKv = 2 * kHead;

struct Attention : torch::nn::Module {
  Attention() {
    register_module("q_proj", xlr8::nn::Linear(kWidth, kWidth));
    register_module("k_proj", xlr8::nn::Linear(kWidth, kKv));
    register_module("v_proj", xlr8::nn::Linear(kWidth, kKv));
    register_module("o_proj", xlr8::nn::Linear(kWidth, kWidth));
  }
};

struct Model : torch::nn::Module {
  Model() {
    std::lock_guard<std::mutex> lock(generator_lock());
    register_module("embed", xlr8::nn::Embedding(32, kWidth));
    register_module("attn", std::make_shared<Attention>());
  }
  int64_t k_rows() { return named_parameters()["attn.k_proj.weight"].size(0); }
};

// The plan the user wrote, with the head size on its attention entries (0: none, as before).
tp::Plan user_plan(int64_t head_dim) {
  auto heads = [&](const char* pattern, tp::Style style) {
    tp::PlanEntry entry{pattern, style};
    entry.head_dim = head_dim;
    return entry;
  };
  return {{"embed", tp::Style::VocabParallel},
          heads("attn.q_proj", tp::Style::Colwise),
          heads("attn.k_proj", tp::Style::Colwise),
          heads("attn.v_proj", tp::Style::Colwise),
          heads("attn.o_proj", tp::Style::Rowwise)};
}

std::string config_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const xlr8::ConfigError& e) {
    return e.what();
  }
  return "";
}

const std::string kCut = "'attn.k_proj' (Colwise): its output has 32 features = 2 heads of 16, which 4 tp ranks cannot "
                         "share whole; choose a tp size that divides 2";

// `message` is one line that begins with `head` and names the cut head.
void expect_refusal(const std::string& message, const std::string& head) {
  EXPECT_EQ(message.rfind(head, 0), 0u) << message;
  EXPECT_NE(message.find(kCut), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

std::string write_file(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::temp_directory_path() / ("xlr8_tp_heads_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const auto path = (dir / name).string();
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST(TensorParallelHeads, AHandWrittenPlanWithTheHeadSizeRefusesATpSizeThatCutsAKeyValueHead) {
  run_ranks(4, [&](Communicator& comm) {
    Model unchecked, model;
    // Without the head size the split is taken (8 features a rank): the run would die in the model's reshape.
    EXPECT_NO_THROW(tp::parallelize(unchecked, comm, user_plan(0), /*strict=*/true));
    EXPECT_EQ(unchecked.k_rows(), 8);
    const auto m = config_error([&] { tp::parallelize(model, comm, user_plan(kHead), /*strict=*/true); });
    expect_refusal(m, "tp plan on 4 ranks: ");
    EXPECT_NE(m.find("'attn.v_proj' (Colwise): its output has 32 features"), std::string::npos) << m;
    EXPECT_EQ(m.find("q_proj"), std::string::npos) << m;  // 4 heads: one a rank
    EXPECT_EQ(model.k_rows(), kKv);                        // refused before anything was sliced
  });
  run_ranks(2, [&](Communicator& comm) {  // one key/value head a rank
    Model model;
    EXPECT_NO_THROW(tp::parallelize(model, comm, user_plan(kHead), /*strict=*/true));
    EXPECT_EQ(model.k_rows(), kHead);
  });
}

TEST(TensorParallelHeads, AutoTpWithTheHeadSizeRefusesItAndHandsTheSizeToItsEntries) {
  Model model;
  expect_refusal(config_error([&] { tp::auto_plan(model, 4, kHead); }), "AutoTP: ");
  const auto plan = tp::auto_plan(model, 2, kHead);
  for (const auto& entry : plan) EXPECT_EQ(entry.head_dim, entry.pattern == "embed" ? 0 : kHead) << entry.pattern;
  EXPECT_NE(config_error([&] { tp::auto_plan(model, 2, -1); }).find("head_dim -1 must be 0"), std::string::npos);
}

// What prepare() does with its head size to a model the program split with a plan that lacked it.
TEST(TensorParallelHeads, AModelSplitWithoutTheHeadSizeIsCheckedAgainstIt) {
  run_ranks(4, [&](Communicator& comm) {
    Model model;
    tp::parallelize(model, comm, user_plan(0), /*strict=*/true);
    expect_refusal(config_error([&] { tp::check_whole_heads(model, kHead); }), "the model's tp split cuts attention heads: ");
    EXPECT_NO_THROW(tp::check_whole_heads(model, 0));  // no head size: nothing to check
  });
  run_ranks(2, [&](Communicator& comm) {
    Model model;
    tp::parallelize(model, comm, user_plan(0), /*strict=*/true);
    EXPECT_NO_THROW(tp::check_whole_heads(model, kHead));
  });
}

TEST(TensorParallelHeads, APlanFileRefusesItByItsHeadDimKeysOrPreparesHeadSize) {
  const std::string specs = R"("partition_config": {"layer_specs": [
      {"patterns": ["attn\\.[qkv]_proj"], "partition_type": "column"},
      {"patterns": ["attn\\.o_proj"], "partition_type": "row"}]})";
  const auto bare = write_file("bare.json", R"({"tensor_parallel": {"autotp_size": 4, )" + specs + "}}");
  const auto keyed = write_file("keyed.json", R"({"tensor_parallel": {"head_dim": 16, )" + specs + "}}");
  const auto per_spec = write_file("spec.json", R"({"tensor_parallel": {"partition_config": {"layer_specs": [
      {"patterns": ["attn\\.k_proj"], "partition_type": "column", "head_dim": 16}]}}})");
  const auto bad = write_file("bad.json", R"({"head_dim": "16"})");
  Model model;
  EXPECT_NO_THROW(tp::plan_from_file(bare, model, 4));  // no head size anywhere: the split the user's run died of
  // prepare()'s head size (AcceleratorOptions::tp_head_dim, parallelism_config_tp_head_dim), the file's section
  // key, a spec's key.
  for (const auto& given : {std::pair{bare, kHead}, std::pair{keyed, int64_t{0}}, std::pair{per_spec, int64_t{0}}})
    expect_refusal(config_error([&] { tp::plan_from_file(given.first, model, 4, given.second); }),
                   "tensor-parallel plan file " + given.first + ": tensor_parallel: ");
  const auto plan = tp::plan_from_file(keyed, model, 2);
  for (const auto& entry : plan) EXPECT_EQ(entry.head_dim, entry.pattern == "embed" ? 0 : kHead) << entry.pattern;
  const auto m = config_error([&] { tp::plan_from_file(bad, model, 2); });
  EXPECT_NE(m.find("tensor_parallel.head_dim = \"16\": the features of one attention head"), std::string::npos) << m;
}

TEST(TensorParallelHeads, TheLaunchCarriesTheHeadSizeAsParallelismConfigTpHeadDim) {
  const auto settings = xlr8::parse_config("num_processes: 4\nparallelism_config:\n  parallelism_config_tp_size: 4\n"
                                           "  parallelism_config_tp_head_dim: 16\n")
                            .settings();
  ASSERT_TRUE(settings.parallelism);
  EXPECT_EQ(settings.parallelism->tp_head_dim, 16);
  const auto env = xlr8::settings_to_env(settings);
  EXPECT_EQ(env.at("PARALLELISM_CONFIG_TP_HEAD_DIM"), "16");
  EXPECT_EQ(xlr8::settings_from_env(xlr8::Env(env)), settings);
  const auto m = config_error([] { xlr8::parse_config("parallelism_config:\n  parallelism_config_tp_head_dim: 0\n"); });
  EXPECT_NE(m.find("parallelism_config_tp_head_dim"), std::string::npos) << m;
}
