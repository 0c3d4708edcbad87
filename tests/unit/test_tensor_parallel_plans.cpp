// Tensor-parallel plans nobody writes by hand (AutoTP, DeepSpeed's partition_config), fused q/k/v, a head
// tied to a vocabulary-parallel embedding, the global gradient norm and whole tensors from slices.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace {

using xlr8::Communicator;
using xlr8::testing::generator_lock;
using xlr8::testing::run_ranks;
namespace tp = xlr8::tp;

constexpr int64_t kVocab = 24, kWidth = 12;

// Attention's shapes without its arithmetic: a fused q/k/v projection whose three parts meet
// elementwise (so each rank needs its share of each), an output projection, and a head tied to the
// token embedding.
struct FusedImpl : torch::nn::Module {
  xlr8::nn::Embedding wte{nullptr};
  xlr8::nn::Linear qkv{nullptr}, proj{nullptr};
  FusedImpl() {
    std::lock_guard<std::mutex> lock(generator_lock());
    torch::manual_seed(5);
    wte = register_module("wte", xlr8::nn::Embedding(kVocab, kWidth));
    qkv = register_module("qkv", xlr8::nn::Linear(kWidth, 3 * kWidth));
    proj = register_module("proj", xlr8::nn::Linear(kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& ids) {
    auto h = wte(ids);
    auto projected = qkv(h);
    auto parts = projected.split(projected.size(-1) / 3, -1);
    h = h + proj(parts[0] * torch::sigmoid(parts[1]) + parts[2]);
    return wte->attend(h);
  }
};
TORCH_MODULE(Fused);

const tp::Plan kFusedPlan{{"wte", tp::Style::VocabParallel},
                          {"qkv", tp::Style::Colwise, /*gather_output=*/false, /*fused=*/3},
                          {"proj", tp::Style::Rowwise}};

at::Tensor ids_for(int step) {
  std::lock_guard<std::mutex> lock(generator_lock());
  torch::manual_seed(200 + step);
  return torch::randint(0, kVocab, {3, 7}, torch::kLong);
}

struct Trace {
  std::vector<double> losses, norms;
};

// AdamW steps clipped at 0.05 (below every norm here, so clipping acts on each step). `clip` is the
// one-process clip_grad_norm_ or the tensor-parallel one.
Trace train(Fused& model, int steps, const std::function<double(std::vector<at::Tensor>)>& clip) {
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.02));
  Trace t;
  for (int step = 0; step < steps; ++step) {
    auto ids = ids_for(step);
    auto logits = model->forward(ids.narrow(1, 0, 6));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, kVocab}), ids.narrow(1, 1, 6).reshape(-1));
    opt.zero_grad();
    loss.backward();
    t.norms.push_back(clip(model->parameters()));
    opt.step();
    t.losses.push_back(loss.item<double>());
  }
  return t;
}

// A GPT-like model named as GPT-2 and Llama name their layers.
struct BlockImpl : torch::nn::Module {
  xlr8::nn::Linear qkv{nullptr}, o_proj{nullptr}, gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  BlockImpl() {
    qkv = register_module("qkv", xlr8::nn::Linear(8, 24));
    o_proj = register_module("o_proj", xlr8::nn::Linear(8, 8));
    gate_proj = register_module("gate_proj", xlr8::nn::Linear(8, 16));
    up_proj = register_module("up_proj", xlr8::nn::Linear(8, 16));
    down_proj = register_module("down_proj", xlr8::nn::Linear(16, 8));
  }
};
TORCH_MODULE(Block);

struct LmImpl : torch::nn::Module {
  explicit LmImpl(bool tied) {
    xlr8::nn::Linear head(torch::nn::LinearOptions(8, 32).bias(false));
    // Tied: the embedding is built over the head's weight, one tensor under two names.
    wte = register_module("wte", tied ? xlr8::nn::Embedding(torch::nn::EmbeddingOptions(32, 8)._weight(head->weight))
                                      : xlr8::nn::Embedding(32, 8));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block()));
    lm_head = register_module("lm_head", head);
  }
  xlr8::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  xlr8::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(Lm);

std::string describe(const tp::Plan& plan) {
  std::string out;
  for (const auto& e : plan)
    out += fmt::format("{}={}{}{};", e.pattern, tp::to_string(e.style), e.gather_output ? "+gather" : "",
                       e.fused > 1 ? fmt::format("x{}", e.fused) : "");
  return out;
}

std::string config_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const xlr8::ConfigError& e) {
    return e.what();
  }
  return "";
}

const std::string kLlamaPlan =
    "wte=VocabParallel;blocks.0.qkv=Colwisex3;blocks.0.o_proj=Rowwise;blocks.0.gate_proj=Colwise;blocks.0.up_proj=Colwise;"
    "blocks.0.down_proj=Rowwise;blocks.1.qkv=Colwisex3;blocks.1.o_proj=Rowwise;blocks.1.gate_proj=Colwise;"
    "blocks.1.up_proj=Colwise;blocks.1.down_proj=Rowwise;lm_head=Colwise+gather;";

}  // namespace

TEST(TensorParallelPlans, FusedQkvAndATiedHeadWithClippingOnTwoThreeAndFourRanksTrainAsOneProcess) {
  Fused whole;
  const auto expected = train(whole, 4, [](std::vector<at::Tensor> p) { return torch::nn::utils::clip_grad_norm_(p, 0.05); });
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      Fused model;
      Fused initial;
      tp::parallelize(*model, comm, kFusedPlan, /*strict=*/true);
      const auto where = fmt::format("tp {} rank {}", ranks, comm.rank());
      // Each rank holds its share of q, of k and of v: the fused slice is three slices, and local_slice says so.
      const auto layouts = tp::slice_layouts(*model);
      ASSERT_EQ(layouts.size(), 4u) << where;  // wte, qkv.weight, qkv.bias, proj.weight (proj.bias is whole)
      EXPECT_EQ(layouts.at("qkv.weight").fused, 3);
      const int64_t local = kWidth / ranks;
      auto q_rows = initial->qkv->weight.narrow(0, comm.rank() * local, local);
      EXPECT_TRUE(torch::equal(model->qkv->weight.narrow(0, 0, local), q_rows)) << where;
      EXPECT_TRUE(torch::equal(tp::local_slice(initial->qkv->weight, layouts.at("qkv.weight")), model->qkv->weight));
      const auto sliced = tp::sliced_parameters(*model);
      const auto got = train(model, 4, [&](std::vector<at::Tensor> p) { return tp::clip_grad_norm(p, sliced, 0.05, 2.0); });
      for (size_t s = 0; s < expected.losses.size(); ++s) {
        EXPECT_NEAR(got.losses[s], expected.losses[s], 2e-6) << where << " step " << s;
        EXPECT_GT(expected.norms[s], 0.05) << "clipping must act for the test to mean anything";
        EXPECT_NEAR(got.norms[s], expected.norms[s], 1e-5 * expected.norms[s]) << where << " norm at step " << s;
      }
      // Every whole parameter, gathered from the slices, equals the one-process one.
      for (const auto& item : model->named_parameters()) {
        auto it = layouts.find(item.key());
        auto mine = it == layouts.end() ? item.value() : tp::gather_whole(item.value(), it->second);
        auto want = whole->named_parameters()[item.key()];
        EXPECT_TRUE(torch::allclose(mine, want, 1e-5, 1e-6))
            << where << " " << item.key() << " differs by " << (mine - want).abs().max().item<double>();
      }
    });
}

TEST(TensorParallelPlans, AReplicatedLayerCountsOnceInTheNormAndTheNormIsTheWholeModelsWithoutClipping) {
  Fused whole;
  auto ids = ids_for(0);
  auto loss = torch::cross_entropy_loss(whole->forward(ids.narrow(1, 0, 6)).reshape({-1, kVocab}), ids.narrow(1, 1, 6).reshape(-1));
  loss.backward();
  const double expected = torch::nn::utils::clip_grad_norm_(whole->parameters(), 1e9);
  run_ranks(3, [&](Communicator& comm) {
    Fused model;
    tp::parallelize(*model, comm, {{"wte", tp::Style::Replicate}, {"qkv", tp::Style::Colwise, false, 3}, {"proj", tp::Style::Rowwise}},
                    /*strict=*/true);
    EXPECT_EQ(model->wte->weight.size(0), kVocab);  // kept whole
    auto l = torch::cross_entropy_loss(model->forward(ids.narrow(1, 0, 6)).reshape({-1, kVocab}), ids.narrow(1, 1, 6).reshape(-1));
    l.backward();
    const double got = tp::clip_grad_norm(model->parameters(), tp::sliced_parameters(*model), 1e9, 2.0);
    EXPECT_NEAR(got, expected, 1e-5 * expected);
    // Summing the replicated embedding's gradient over the group as well would count it three times.
    const double local_only = torch::nn::utils::clip_grad_norm_(model->parameters(), 1e9);
    EXPECT_GT(std::abs(local_only - expected), 1e-3 * expected);
  });
}

TEST(TensorParallelPlans, AutoTpFindsTheMegatronPlanFromLayerNames) {
  Lm untied(false);
  EXPECT_EQ(describe(tp::auto_plan(*untied, 2)), kLlamaPlan);
  EXPECT_NO_THROW(tp::auto_plan(*untied, 2, /*head_dim=*/4));  // 2 heads of 4: one per rank
  auto m = config_error([&] { tp::auto_plan(*untied, 4, /*head_dim=*/4); });
  EXPECT_NE(m.find("'blocks.0.qkv' has 8 features = 2 heads of 4, which 4 tp ranks cannot share whole"), std::string::npos) << m;
  // A head tied to the embedding stays whole with it (DeepSpeed's rule).
  Lm tied(true);
  auto plan = describe(tp::auto_plan(*tied, 2));
  EXPECT_NE(plan.find("wte=Replicate;"), std::string::npos) << plan;
  EXPECT_NE(plan.find("lm_head=Replicate;"), std::string::npos) << plan;
  // A layer whose name says nothing is an error naming it, never left whole in silence.
  struct Odd : torch::nn::Module {
    Odd() { register_module("mixer", xlr8::nn::Linear(4, 4)); }
  } odd;
  m = config_error([&] { tp::auto_plan(odd, 2); });
  EXPECT_NE(m.find("cannot tell how to split mixer"), std::string::npos) << m;
  struct Gqa : torch::nn::Module {
    Gqa() { register_module("qkv", xlr8::nn::Linear(8, 16)); }
  } gqa;
  m = config_error([&] { tp::auto_plan(gqa, 2); });
  EXPECT_NE(m.find("'qkv' looks like a fused q/k/v projection but has out_features 16 for in_features 8"), std::string::npos) << m;
  // LibTorch's own layers are planned, then refused by parallelize with the type to use.
  struct Plain : torch::nn::Module {
    Plain() { register_module("fc1", torch::nn::Linear(4, 4)); }
  } plain;
  run_ranks(2, [&](Communicator& comm) {
    auto e = config_error([&] { tp::parallelize(plain, comm, tp::auto_plan(plain, 2), true); });
    EXPECT_NE(e.find("build it as xlr8::nn::Linear"), std::string::npos) << e;
  });
}

TEST(TensorParallelPlans, DeepSpeedPartitionConfigRulesBecomeAPlan) {
  Lm model(false);
  auto json = nlohmann::json::parse(R"({
    "autotp_size": 2,
    "partition_config": {
      "use_default_specs": false,
      "layer_specs": [
        {"patterns": [".*\\.qkv\\.weight$"], "partition_type": "column", "shape": [3, -1]},
        {"patterns": [".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$"], "partition_type": "row"},
        {"patterns": [".*_proj\\.weight$"], "partition_type": "column"},
        {"patterns": ["lm_head"], "partition_type": "column", "gather_output": true},
        {"patterns": ["wte"], "partition_type": "skip"}
      ]
    }})");
  const std::string expected =
      "wte=Replicate;blocks.0.qkv=Colwisex3;blocks.0.o_proj=Rowwise;blocks.0.gate_proj=Colwise;blocks.0.up_proj=Colwise;"
      "blocks.0.down_proj=Rowwise;blocks.1.qkv=Colwisex3;blocks.1.o_proj=Rowwise;blocks.1.gate_proj=Colwise;"
      "blocks.1.up_proj=Colwise;blocks.1.down_proj=Rowwise;lm_head=Colwise+gather;";
  EXPECT_EQ(describe(tp::plan_from_deepspeed(json, *model, 2)), expected);
  // Custom specs alone leave what they do not match whole (DeepSpeed's strict_mode off)...
  json["partition_config"]["layer_specs"].erase(4);
  EXPECT_NE(describe(tp::plan_from_deepspeed(json, *model, 2)).find("wte=Replicate;"), std::string::npos);
  // ...with the default specs AutoTP places it; no partition_config at all is AutoTP.
  json["partition_config"]["use_default_specs"] = true;
  EXPECT_NE(describe(tp::plan_from_deepspeed(json, *model, 2)).find("wte=VocabParallel;"), std::string::npos);
  EXPECT_EQ(describe(tp::plan_from_deepspeed(nlohmann::json::object(), *model, 2)), kLlamaPlan);
  // Bad rules name the key and value.
  auto bad = [&](const std::string& text) { return config_error([&] { tp::plan_from_deepspeed(nlohmann::json::parse(text), *model, 2); }); };
  auto m = bad(R"({"autotp_size": 4})");
  EXPECT_NE(m.find("tensor_parallel.autotp_size = 4 but the tp group has 2 ranks"), std::string::npos) << m;
  m = bad(R"({"partition_config": {"layer_specs": [{"patterns": ["nothing"], "partition_type": "diagonal"}]}})");
  EXPECT_NE(m.find("layer_specs[0].partition_type = \"diagonal\": one of column, row, skip"), std::string::npos) << m;
  m = bad(R"({"partition_config": {"layer_specs": [{"patterns": [".*qkv"], "shape": [[8, 4, 4], -1]}]}})");
  EXPECT_NE(m.find("layer_specs[0].shape = [[8,4,4],-1]: xlr8 splits [k, -1]"), std::string::npos) << m;
  m = bad(R"({"partition_config": {"layer_spec": []}})");
  EXPECT_NE(m.find("tensor_parallel.partition_config: unknown key 'layer_spec'"), std::string::npos) << m;
  m = bad(R"({"partition_config": {"layer_specs": [{"patterns": ["(qkv"]}]}})");
  EXPECT_NE(m.find("is not a regular expression"), std::string::npos) << m;
}
