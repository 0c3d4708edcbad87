// Tensor-parallel plans nobody writes by hand (AutoTP, DeepSpeed's partition_config), fused q/k/v, a head
// tied to a vocabulary-parallel embedding, the global gradient norm and whole tensors from slices.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
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
// token embedding. Under grouped-query attention (kv narrower than q) each k/v feature serves q / kv
// consecutive q features, as a key/value head serves its group of query heads.
struct FusedImpl : torch::nn::Module {
  xlr8::nn::Embedding wte{nullptr};
  xlr8::nn::Linear qkv{nullptr}, proj{nullptr};
  int64_t q, kv;
  explicit FusedImpl(int64_t q_width = kWidth, int64_t kv_width = kWidth) : q(q_width), kv(kv_width) {
    std::lock_guard<std::mutex> lock(generator_lock());
    torch::manual_seed(5);
    wte = register_module("wte", xlr8::nn::Embedding(kVocab, kWidth));
    qkv = register_module("qkv", xlr8::nn::Linear(kWidth, q + 2 * kv));
    proj = register_module("proj", xlr8::nn::Linear(q, kWidth));
  }
  at::Tensor forward(const at::Tensor& ids) {
    auto h = wte(ids);
    auto projected = qkv(h);
    // This rank's widths keep the whole's proportion q : kv : kv.
    const int64_t local_q = projected.size(-1) * q / (q + 2 * kv), local_kv = (projected.size(-1) - local_q) / 2;
    auto parts = projected.split_with_sizes({local_q, local_kv, local_kv}, -1);
    auto gate = (torch::sigmoid(parts[1]) + parts[2]).repeat_interleave(local_q / local_kv, -1);
    h = h + proj(parts[0] * gate);
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
    out += fmt::format("{}={}{}{}{}{};", e.pattern, tp::to_string(e.style), e.gather_output ? "+gather" : "",
                       e.fused > 1 ? fmt::format("x{}", e.fused) : "",
                       e.fused_sizes.empty() ? "" : fmt::format("[{}]", fmt::join(e.fused_sizes, ",")),
                       e.sequence_parallel ? "+sp" : "");
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
      EXPECT_EQ(layouts.at("qkv.weight").parts, (std::vector<int64_t>{kWidth, kWidth, kWidth}));
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
  EXPECT_NE(m.find("'blocks.0.qkv' (Colwise): its fused part 1 of 3 has 8 features = 2 heads of 4, which 4 tp ranks "
                   "cannot share whole"),
            std::string::npos)
      << m;
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
  EXPECT_NE(m.find("cannot tell how to split the layer(s) \"mixer\""), std::string::npos) << m;
  // Grouped-query attention: queries as wide as the model, keys and values the rest in two equal parts.
  struct Gqa : torch::nn::Module {
    explicit Gqa(int64_t out) { register_module("qkv", xlr8::nn::Linear(8, out)); }
  };
  EXPECT_EQ(describe(tp::auto_plan(Gqa(16), 2, /*head_dim=*/2)), "qkv=Colwise[8,4,4];");
  m = config_error([&] { tp::auto_plan(Gqa(16), 4, /*head_dim=*/2); });
  EXPECT_NE(m.find("'qkv' (Colwise): its fused part 2 of 3 has 4 features = 2 heads of 2, which 4 tp ranks cannot share "
                   "whole"),
            std::string::npos)
      << m;
  m = config_error([&] { tp::auto_plan(Gqa(7), 2); });
  EXPECT_NE(m.find("'qkv' looks like a fused q/k/v projection but has out_features 7 for in_features 8"), std::string::npos) << m;
  // LibTorch's own layers are planned, then refused by parallelize with the type to use.
  struct Plain : torch::nn::Module {
    Plain() { register_module("fc1", torch::nn::Linear(4, 4)); }
  };
  run_ranks(2, [&](Communicator& comm) {
    // Each rank its own model, as each process has: LibTorch's Module::name() caches the class name in the
    // module unguarded, so two threads naming one module race (a garbled error message, 4 runs in 40).
    Plain plain;
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
  m = bad(R"({"partition_config": {"layer_specs": [{"patterns": [".*qkv"], "shape": [[8, 0, 4], -1]}]}})");
  EXPECT_NE(m.find("layer_specs[0].shape = [[8,0,4],-1]: xlr8 splits [k, -1]"), std::string::npos) << m;
  m = bad(R"({"partition_config": {"layer_specs": [{"patterns": [".*qkv"], "shape": [4, -1, 2]}]}})");
  EXPECT_NE(m.find("layer_specs[0].shape = [4,-1,2]: xlr8 splits [k, -1]"), std::string::npos) << m;
  m = bad(R"({"preset_model": "gpt5"})");
  EXPECT_NE(m.find("tensor_parallel.preset_model = \"gpt5\": DeepSpeed's presets are bloom, chatglm, deepseek_v2, "
                   "llama, mixtral, phi3, qwen2"),
            std::string::npos)
      << m;
  // Unequal fused parts (grouped-query q/k/v): DeepSpeed's nested shape.
  const auto nested = nlohmann::json::parse(R"({"partition_config": {"use_default_specs": false,
      "layer_specs": [{"patterns": ["blocks\\.0\\.qkv"], "shape": [[12, 6, 6], -1]}]}})");
  const auto plan = describe(tp::plan_from_deepspeed(nested, *model, 2));
  EXPECT_NE(plan.find(";blocks.0.qkv=Colwise[12,6,6];"), std::string::npos) << plan;
  m = bad(R"({"partition_config": {"layer_spec": []}})");
  EXPECT_NE(m.find("tensor_parallel.partition_config: unknown key 'layer_spec'"), std::string::npos) << m;
  m = bad(R"({"partition_config": {"layer_specs": [{"patterns": ["(qkv"]}]}})");
  EXPECT_NE(m.find("is not a regular expression"), std::string::npos) << m;
}

// Grouped-query attention's fused projection: 24 query features and 12 each of keys and values, each part
// split on its own (a rank holds whole shares of q, of k and of v), trains as one process on 2, 3 and 4
// ranks; the layout and the whole tensors gathered from slices follow the unequal parts.
TEST(TensorParallelPlans, UnequalFusedPartsOnTwoThreeAndFourRanksTrainAsOneProcess) {
  constexpr int64_t kQ = 24, kKv = 12;
  const tp::Plan plan{{"wte", tp::Style::VocabParallel},
                      {"qkv", tp::Style::Colwise, false, 1, false, {kQ, kKv, kKv}},
                      {"proj", tp::Style::Rowwise}};
  Fused whole(kQ, kKv);
  const auto expected = train(whole, 4, [](std::vector<at::Tensor> p) { return torch::nn::utils::clip_grad_norm_(p, 0.05); });
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      Fused model(kQ, kKv), initial(kQ, kKv);
      tp::parallelize(*model, comm, plan, /*strict=*/true);
      const auto where = fmt::format("tp {} rank {}", ranks, comm.rank());
      const auto layouts = tp::slice_layouts(*model);
      EXPECT_EQ(layouts.at("qkv.weight").parts, (std::vector<int64_t>{kQ, kKv, kKv})) << where;
      const int64_t q = kQ / ranks, kv = kKv / ranks, r = comm.rank();
      const auto& w = initial->qkv->weight;
      auto want = torch::cat({w.narrow(0, r * q, q), w.narrow(0, kQ + r * kv, kv), w.narrow(0, kQ + kKv + r * kv, kv)});
      EXPECT_TRUE(torch::equal(model->qkv->weight, want)) << where;
      EXPECT_TRUE(torch::equal(tp::local_slice(w, layouts.at("qkv.weight")), want)) << where;
      const auto sliced = tp::sliced_parameters(*model);
      const auto got = train(model, 4, [&](std::vector<at::Tensor> p) { return tp::clip_grad_norm(p, sliced, 0.05, 2.0); });
      for (size_t s = 0; s < expected.losses.size(); ++s) {
        EXPECT_NEAR(got.losses[s], expected.losses[s], 2e-6) << where << " step " << s;
        EXPECT_NEAR(got.norms[s], expected.norms[s], 1e-5 * expected.norms[s]) << where << " norm at step " << s;
      }
      for (const auto& item : model->named_parameters()) {
        auto it = layouts.find(item.key());
        auto mine = it == layouts.end() ? item.value() : tp::gather_whole(item.value(), it->second);
        auto theirs = whole->named_parameters()[item.key()];
        EXPECT_TRUE(torch::allclose(mine, theirs, 1e-5, 1e-6))
            << where << " " << item.key() << " differs by " << (mine - theirs).abs().max().item<double>();
      }
    });
  // Parts that do not add up, or that the tp size cannot split, are named with their numbers.
  run_ranks(2, [&](Communicator& comm) {
    Fused model(kQ, kKv);
    auto m = config_error([&] {
      tp::parallelize(*model, comm, {{"qkv", tp::Style::Colwise, false, 1, false, {kQ, kKv, kKv - 1}}});
    });
    EXPECT_NE(m.find("its out_features 48 is not the sum of fused_sizes [24, 12, 11] (47)"), std::string::npos) << m;
    m = config_error([&] { tp::parallelize(*model, comm, {{"qkv", tp::Style::Colwise, false, 2, false, {kQ, kKv, kKv}}}); });
    EXPECT_NE(m.find("fused 2 but 3 fused_sizes"), std::string::npos) << m;
    m = config_error([&] { tp::parallelize(*model, comm, {{"qkv", tp::Style::Colwise, false, 1, false, {kQ, 9, 15}}}); });
    EXPECT_NE(m.find("its fused part 2 of 3 is 9, which the tp size 2 does not divide"), std::string::npos) << m;
  });
}

// AutoTP with sequence parallelism: every split layer takes the sequence split, and the norms and dropouts
// between them (LibTorch's own) run on this rank's share; a layer kept whole there is refused by name.
TEST(TensorParallelPlans, AutoTpPlacesSequenceParallelism) {
  struct Net : torch::nn::Module {
    Net() {
      register_module("wte", xlr8::nn::Embedding(32, 8));
      register_module("drop", torch::nn::Dropout(0.1));
      register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
      register_module("fc", xlr8::nn::Linear(8, 16));
      register_module("proj", xlr8::nn::Linear(16, 8));
      register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
      register_module("head", xlr8::nn::Linear(torch::nn::LinearOptions(8, 32).bias(false)));
    }
  } net;
  EXPECT_EQ(describe(tp::auto_plan(net, 2, 0, /*sequence_parallel=*/true)),
            "wte=VocabParallel+sp;fc=Colwise+sp;proj=Rowwise+sp;head=Colwise+gather+sp;drop=SequenceParallel;"
            "ln=SequenceParallel;ln_f=SequenceParallel;");
  EXPECT_EQ(describe(tp::auto_plan(net, 2)), "wte=VocabParallel;fc=Colwise;proj=Rowwise;head=Colwise+gather;");
  Lm tied(true);
  auto m = config_error([&] { tp::auto_plan(*tied, 2, 0, true); });
  EXPECT_NE(m.find("sequence parallelism: wte, lm_head would stay whole"), std::string::npos) << m;
}

// DeepSpeed's preset_model: the family's specs by Hugging Face names (matched case-insensitively); the
// partition_config's specs go first unless use_default_specs is false; what no spec matches stays whole.
TEST(TensorParallelPlans, DeepSpeedPresetsPlaceAModelNamedAsTheirFamily) {
  struct Layer : torch::nn::Module {
    Layer() {
      auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
      for (const auto* name : {"q_proj", "k_proj", "v_proj", "o_proj"}) attn->register_module(name, xlr8::nn::Linear(8, 8));
      auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
      mlp->register_module("gate_proj", xlr8::nn::Linear(8, 16));
      mlp->register_module("up_proj", xlr8::nn::Linear(8, 16));
      mlp->register_module("down_proj", xlr8::nn::Linear(16, 8));
    }
  };
  struct Llama : torch::nn::Module {
    Llama() {
      auto inner = register_module("model", std::make_shared<torch::nn::Module>());
      inner->register_module("embed_tokens", xlr8::nn::Embedding(32, 8));
      inner->register_module("layers", torch::nn::ModuleList(std::make_shared<Layer>()));
      register_module("lm_head", xlr8::nn::Linear(torch::nn::LinearOptions(8, 32).bias(false)));
    }
  } llama;
  const std::string preset_plan =
      "model.embed_tokens=Replicate;model.layers.0.self_attn.q_proj=Colwise;model.layers.0.self_attn.k_proj=Colwise;"
      "model.layers.0.self_attn.v_proj=Colwise;model.layers.0.self_attn.o_proj=Rowwise;"
      "model.layers.0.mlp.gate_proj=Colwise;model.layers.0.mlp.up_proj=Colwise;model.layers.0.mlp.down_proj=Rowwise;"
      "lm_head=Replicate;";
  auto plan = [&](const char* json) { return describe(tp::plan_from_deepspeed(nlohmann::json::parse(json), llama, 2)); };
  EXPECT_EQ(plan(R"({"autotp_size": 2, "preset_model": "Llama"})"), preset_plan);
  EXPECT_EQ(plan(R"({"preset_model": "qwen2"})"), preset_plan);
  // Custom specs first, then the preset's (use_default_specs defaults to true with a preset)...
  const std::string head = R"({"patterns": ["lm_head"], "partition_type": "column", "gather_output": true})";
  auto merged = plan((R"({"preset_model": "llama", "partition_config": {"layer_specs": [)" + head + "]}}").c_str());
  EXPECT_EQ(merged, preset_plan.substr(0, preset_plan.size() - std::string("lm_head=Replicate;").size()) +
                        "lm_head=Colwise+gather;");
  // ...or alone.
  auto alone = plan((R"({"preset_model": "llama", "partition_config": {"use_default_specs": false, "layer_specs": [)" + head +
                     "]}}").c_str());
  EXPECT_NE(alone.find("model.layers.0.self_attn.q_proj=Replicate;"), std::string::npos) << alone;
  EXPECT_NE(alone.find("lm_head=Colwise+gather;"), std::string::npos) << alone;
  // A preset whose names the model does not use places nothing: every layer stays whole.
  EXPECT_EQ(plan(R"({"preset_model": "bloom"})").find("Colwise"), std::string::npos);
  // phi3's fused projections are equal parts.
  struct Phi : torch::nn::Module {
    Phi() {
      auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
      attn->register_module("qkv_proj", xlr8::nn::Linear(8, 24));
      auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
      mlp->register_module("gate_up_proj", xlr8::nn::Linear(8, 32));
    }
  };
  struct PhiModel : torch::nn::Module {
    PhiModel() { register_module("layers", torch::nn::ModuleList(std::make_shared<Phi>())); }
  } phi;
  EXPECT_EQ(describe(tp::plan_from_deepspeed(nlohmann::json::parse(R"({"preset_model": "phi3"})"), phi, 2)),
            "layers.0.self_attn.qkv_proj=Colwisex3;layers.0.mlp.gate_up_proj=Colwisex2;");
}
