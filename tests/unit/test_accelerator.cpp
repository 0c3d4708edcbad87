// The Accelerator on one process: preparation rules, fp16 loss scaling on CPU tensors, accumulation
// semantics, scheduler stepping, metrics logging, save_model's Hugging Face layout, checkpoint retention,
// a step that reads nothing back to the host, TF32.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/Context.h>

#include <filesystem>
#include <sstream>
#include <fstream>

#include "op_counter.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"
#include "xlr8/safetensors.hpp"

using namespace xlr8;
namespace fs = std::filesystem;

namespace {
std::string fresh_dir(const std::string& tag) {
  auto d = fs::temp_directory_path() / ("xlr8_acc_" + tag + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}
}  // namespace

TEST(Accelerator, PreparingTwiceIsAnError) {
  Accelerator acc(AcceleratorOptions{});
  auto model = acc.prepare(torch::nn::Linear(2, 2));
  EXPECT_THROW(acc.prepare(model), Error);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  acc.prepare_optimizer(opt);
  try {
    acc.prepare_optimizer(opt);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already prepared"), std::string::npos);
  }
  torch::nn::Linear stranger(2, 2);
  EXPECT_THROW(acc.accumulate(stranger), Error);  // not prepared
}

TEST(Accelerator, Fp16ScalerSkipsOverflowStepsAndUnscalesOnCpu) {
  AcceleratorOptions o;
  o.mixed_precision = MixedPrecision::FP16;
  Accelerator acc(o);
  auto model = acc.prepare(torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false)));
  auto opt = acc.prepare(torch::optim::SGD(model->parameters(), 0.5));
  auto x = torch::ones({1, 2});
  EXPECT_EQ(acc.loss_scale(), 65536.0);
  for (int overflow = 0; overflow < 2; ++overflow) {  // two overflows: hysteresis 2, then the scale halves
    auto before = model->weight.clone();
    acc.backward(model->forward(x).sum() * std::numeric_limits<float>::infinity());
    opt.step();
    opt.zero_grad();
    EXPECT_TRUE(opt.step_was_skipped());
    EXPECT_TRUE(model->weight.equal(before));
  }
  EXPECT_EQ(acc.loss_scale(), 32768.0);
  // A clean step: gradients arrive scaled by 32768 and are unscaled before SGD uses them.
  auto before = model->weight.clone();
  acc.backward(model->forward(x).sum());  // d/dw = x = 1
  opt.step();
  EXPECT_FALSE(opt.step_was_skipped());
  EXPECT_TRUE(torch::allclose(model->weight, before - 0.5));
  EXPECT_EQ(opt.steps_taken(), 1);
}

TEST(Accelerator, ZeroGradSetsGradientsToNoneOrZerosThemInPlace) {
  Accelerator acc(AcceleratorOptions{});
  auto model = acc.prepare(torch::nn::Linear(2, 1));
  auto opt = acc.prepare(torch::optim::SGD(model->parameters(), 0.1));
  acc.backward(model->forward(torch::ones({1, 2})).sum());
  auto grad = model->weight.grad();
  ASSERT_TRUE(grad.defined());
  opt.zero_grad(false);  // same storage, zeros
  EXPECT_TRUE(model->weight.grad().is_same(grad));
  EXPECT_EQ(grad.abs().sum().item<float>(), 0.0f);
  acc.backward(model->forward(torch::ones({1, 2})).sum());
  opt.zero_grad();  // PyTorch 2.x's default: undefined until the next backward
  EXPECT_FALSE(model->weight.grad().defined());
  EXPECT_FALSE(model->bias.grad().defined());
  acc.backward(model->forward(torch::ones({1, 2})).sum());
  EXPECT_TRUE(model->weight.grad().equal(torch::ones({1, 2})));
}

TEST(Accelerator, AccumulationDividesTheLossAndStepsOnlyOnTheBoundary) {
  AcceleratorOptions o;
  o.gradient_accumulation_steps = 2;
  Accelerator acc(o);
  auto model = acc.prepare(torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)));
  {
    torch::NoGradGuard no_grad;
    model->weight.fill_(0);
  }
  auto opt = acc.prepare(torch::optim::SGD(model->parameters(), 1.0));
  auto sched = acc.prepare(torch::optim::StepLR(opt.optimizer(), 1, 0.5));
  std::vector<bool> syncs;
  for (double value : {2.0, 4.0, 6.0, 8.0}) {
    auto scope = acc.accumulate(model);
    syncs.push_back(acc.sync_gradients());
    acc.backward(model->forward(torch::full({1, 1}, value)).sum());  // d/dw = value
    opt.step();
    sched.step();
    opt.zero_grad();
  }
  EXPECT_EQ(syncs, (std::vector<bool>{false, true, false, true}));
  // Step 1: w -= 1.0 * (2+4)/2 -> -3. Step 2: w -= 1.0 * (6+8)/2 -> -10 (LibTorch's StepLR leaves the first
  // step alone), after which the scheduler's second real step halves the rate.
  EXPECT_NEAR(model->weight.item<double>(), -10.0, 1e-6);
  EXPECT_DOUBLE_EQ(opt.optimizer().param_groups()[0].options().get_lr(), 0.5);
  EXPECT_EQ(opt.steps_taken(), 2);
  EXPECT_EQ(sched.steps_taken(), 2);
}

TEST(Accelerator, LastBatchOfAnEpochAlwaysSyncs) {
  AcceleratorOptions o;
  o.gradient_accumulation_steps = 4;
  Accelerator acc(o);
  struct Ten {
    size_t size() const { return 10; }
    at::Tensor get(size_t i) const { return at::full({1}, static_cast<double>(i)); }
  };
  auto loader = acc.prepare_data_loader(Ten{}, {.batch_size = 2});
  std::vector<bool> syncs;
  for (auto& b : *loader) {
    (void)b;
    auto scope = acc.accumulate();
    syncs.push_back(acc.sync_gradients());
  }
  EXPECT_EQ(syncs, (std::vector<bool>{false, false, false, true, true}));
}

// A file whose every name has a prefix: the message says so, and does not offer strict = false (it would load
// nothing); a file sharing some names does offer it.
TEST(Accelerator, LoadModelOffersStrictFalseOnlyWhenTheFileSharesNamesWithTheModel) {
  Accelerator acc;
  torch::nn::Linear model(2, 3);
  auto dir = fresh_dir("load_model_hint");
  auto message = [&](const NamedTensors& file) {
    save_safetensors((std::filesystem::path(dir) / "model.safetensors").string(), file);
    try {
      acc.load_model(model, dir);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  auto prefixed = message({{"model.weight", at::zeros({3, 2})}, {"model.bias", at::zeros({3})}});
  EXPECT_NE(prefixed.find("\"model.\" in front"), std::string::npos) << prefixed;
  EXPECT_EQ(prefixed.find("strict = false"), std::string::npos) << prefixed;
  auto partial = message({{"weight", at::zeros({3, 2})}});
  EXPECT_NE(partial.find("(strict = false loads the names both have)"), std::string::npos) << partial;
}

TEST(Accelerator, HelpersOnOneProcess) {
  AcceleratorOptions o;
  o.project_dir = fresh_dir("helpers");
  o.log_with = {"jsonl", "csv"};
  Accelerator acc(o);
  EXPECT_EQ(acc.split_between_processes(std::vector<int>{1, 2, 3}), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(acc.gather(at::ones({3})).equal(at::ones({3})));
  EXPECT_TRUE(acc.gather(at::scalar_tensor(2.0)).equal(at::full({1}, 2.0)));  // one value per process, as on N
  EXPECT_TRUE(acc.reduce(at::ones({2}), ReduceOp::AVG).equal(at::ones({2})));
  bool ran = false;
  acc.main_process_first([&] { ran = true; });
  EXPECT_TRUE(ran);
  acc.log({{"loss", 0.5}}, 3);
  acc.log({{"accuracy", 0.9}});
  acc.log({{"loss", std::nan("")}, {"accuracy", -INFINITY}}, 5);  // kept as such, not as null (not logged)
  const auto run = acc.run_dir();  // without init_trackers: project "xlr8", a run named by the time
  EXPECT_EQ(fs::path(run).parent_path(), fs::path(o.project_dir) / "xlr8");
  acc.end_training();
  std::ifstream in(run + "/metrics.jsonl");
  std::string first, second, third;
  std::getline(in, first);
  std::getline(in, second);
  std::getline(in, third);
  EXPECT_EQ(nlohmann::json::parse(first), (nlohmann::json{{"step", 3}, {"loss", 0.5}}));
  EXPECT_EQ(nlohmann::json::parse(second), (nlohmann::json{{"accuracy", 0.9}}));
  EXPECT_EQ(nlohmann::json::parse(third), (nlohmann::json{{"step", 5}, {"loss", "NaN"}, {"accuracy", "-Infinity"}}));
  std::ifstream csv(run + "/metrics.csv");
  const std::string table((std::istreambuf_iterator<char>(csv)), std::istreambuf_iterator<char>());
  EXPECT_NE(table.find("\n5,nan,-inf\n"), std::string::npos) << table;
  fs::remove_all(o.project_dir);
}

TEST(Accelerator, SaveModelWritesOneFileOrHuggingFaceShards) {
  Accelerator acc(AcceleratorOptions{});
  auto model = acc.prepare(torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4)));
  auto dir = fresh_dir("save_model");
  acc.save_model(model, dir);
  auto whole = load_safetensors(dir + "/model.safetensors");
  EXPECT_EQ(whole.tensors.size(), 4u);
  EXPECT_EQ(whole.metadata.at("format"), "pt");
  acc.save_model(model, dir, "1KB");  // 16x16 floats = 1 KiB: one tensor per shard or so
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  auto index = nlohmann::json::parse(std::ifstream(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), 4u);
  std::set<std::string> shards;
  for (auto& [name, file] : index["weight_map"].items()) {
    shards.insert(file.get<std::string>());
    auto content = load_safetensors(dir + "/" + file.get<std::string>());
    bool found = false;
    for (auto& [n, t] : content.tensors) found = found || n == name;
    EXPECT_TRUE(found) << name;
  }
  EXPECT_GT(shards.size(), 1u);
  EXPECT_TRUE(shards.count(fmt::format("model-00001-of-{:05d}.safetensors", shards.size())));
  EXPECT_EQ(index["metadata"]["total_size"], (16 * 16 + 16 + 16 * 4 + 4) * 4);
  fs::remove_all(dir);
}

TEST(Accelerator, AutomaticCheckpointNamingKeepsTheNewestAndLoadsTheLatest) {
  AcceleratorOptions o;
  o.project_dir = fresh_dir("auto");
  o.automatic_checkpoint_naming = true;
  o.total_limit = 2;
  Accelerator acc(o);
  auto model = acc.prepare(torch::nn::Linear(2, 2));
  auto opt = acc.prepare(torch::optim::SGD(model->parameters(), 0.1));
  std::vector<at::Tensor> weights;
  for (int i = 0; i < 3; ++i) {
    {
      torch::NoGradGuard no_grad;
      model->weight.fill_(i);
    }
    weights.push_back(model->weight.clone());
    acc.save_state();
  }
  auto root = o.project_dir + "/checkpoints/";
  EXPECT_FALSE(fs::exists(root + "checkpoint_0"));
  EXPECT_TRUE(fs::exists(root + "checkpoint_1/MANIFEST.json"));
  EXPECT_TRUE(fs::exists(root + "checkpoint_2/MANIFEST.json"));
  for (auto& e : fs::directory_iterator(root)) EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos);
  {
    torch::NoGradGuard no_grad;
    model->weight.fill_(-1);
  }
  acc.load_state();  // the newest
  EXPECT_TRUE(model->weight.equal(weights[2]));
  acc.save_state(root + "checkpoint_2/");  // saving over a checkpoint replaces it whole; a trailing slash is fine
  EXPECT_TRUE(fs::exists(root + "checkpoint_2/MANIFEST.json"));
  EXPECT_FALSE(fs::exists(root + "checkpoint_2.old"));
  EXPECT_FALSE(fs::exists(root + "checkpoint_2/.partial"));
  acc.load_state(root + "checkpoint_2/");
  fs::remove_all(o.project_dir);
}

TEST(Accelerator, ACheckpointOfAnotherModelOrOptimizerIsRefusedNamingTheTensorAndBothShapes) {
  auto dir = fresh_dir("other-model");
  {
    Accelerator acc;
    auto model = acc.prepare(torch::nn::Linear(4, 3));
    auto opt = acc.prepare(torch::optim::AdamW(model->parameters(), 0.1));
    acc.backward(model->forward(at::ones({2, 4})).sum());
    opt.step();
    acc.save_state(dir);
  }
  auto refused = [&](auto&& prepare_model, auto&& prepare_optimizer) {
    Accelerator acc;
    auto model = prepare_model(acc);
    auto before = model->parameters()[0].clone();
    auto opt = prepare_optimizer(acc, model);
    std::string message;
    try {
      acc.load_state(dir);
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_TRUE(model->parameters()[0].equal(before));  // nothing changed
    return message;
  };
  auto adamw = [](Accelerator& acc, auto& model) { return acc.prepare(torch::optim::AdamW(model->parameters(), 0.1)); };
  auto m = refused([](Accelerator& acc) { return acc.prepare(torch::nn::Linear(4, 2)); }, adamw);
  EXPECT_NE(m.find("mismatched [weight ([3, 4] saved, [2, 4] in the model), bias ([3] saved, [2] in the model)]"),
            std::string::npos)
      << m;
  m = refused([](Accelerator& acc) { return acc.prepare(torch::nn::Linear(torch::nn::LinearOptions(4, 3).bias(false))); },
              adamw);
  EXPECT_NE(m.find("unexpected [bias]"), std::string::npos) << m;
  m = refused([](Accelerator& acc) { return acc.prepare(torch::nn::Linear(4, 3)); },
              [](Accelerator& acc, auto& model) { return acc.prepare(torch::optim::SGD(model->parameters(), 0.1)); });
  EXPECT_NE(m.find("holds adamw state, but the prepared optimizer is sgd"), std::string::npos) << m;
  fs::remove_all(dir);
}

TEST(Accelerator, TrackersWriteEachRunToItsOwnDirectoryWithItsConfig) {
  AcceleratorOptions o;
  o.project_dir = fresh_dir("trackers");
  o.log_with = {"jsonl", "csv"};
  Accelerator acc(o);
  acc.init_trackers("proj", {{"lr", 0.1}}, "first");
  acc.log({{"loss", 2.0}}, 0);
  acc.log({{"loss", 1.5}, {"note", "a, \"quoted\" text"}}, 1);  // a new column widens the CSV once
  EXPECT_EQ(acc.get_tracker("csv")->run_dir(), o.project_dir + "/proj/first");
  EXPECT_THROW(acc.get_tracker("tensorboard"), Error);
  acc.end_training();
  const auto dir = o.project_dir + "/proj/first/";
  std::ifstream csv(dir + "metrics.csv");
  std::stringstream text;
  text << csv.rdbuf();
  EXPECT_EQ(text.str(), "step,loss,note\n0,2.0,\n1,1.5,\"a, \"\"quoted\"\" text\"\n");
  std::ifstream config(dir + "config.json");
  auto stored = nlohmann::json::parse(config);
  EXPECT_EQ(stored["config"]["lr"], 0.1);
  EXPECT_EQ(stored["log_with"], (nlohmann::json{"jsonl", "csv"}));
  // A second run of the project never reuses a directory; a run name that exists is refused by name.
  Accelerator again(o);
  EXPECT_THROW(again.init_trackers("proj", {}, "first"), ConfigError);
  again.init_trackers("proj");
  EXPECT_NE(again.run_dir(), o.project_dir + "/proj/first");
  again.end_training();
  o.log_with = {"wandb"};
  Accelerator unknown(o);
  try {
    unknown.init_trackers("proj");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("log_with \"wandb\" is not a tracker xlr8 has; use jsonl, csv, tensorboard or all"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(o.project_dir);
}


namespace {
struct Counter {
  int n = 0;
  nlohmann::json state() const { return {{"n", n}}; }
  void load_state(const nlohmann::json& j) { n = j.at("n").get<int>(); }
};
}  // namespace

TEST(Accelerator, RegisteredObjectsAreSavedAndRestoredInOrderAndCheckedOnLoad) {
  auto dir = fresh_dir("registered");
  Counter counter;
  torch::nn::Linear extra(2, 3);
  auto sgd = torch::optim::SGD(extra->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  extra->forward(at::ones({1, 2})).sum().backward();
  sgd.step();
  {
    Accelerator acc;
    acc.register_for_checkpointing(counter);
    acc.register_for_checkpointing(extra);
    acc.register_for_checkpointing(sgd);
    counter.n = 7;
    acc.save_state(dir);
    const auto weight = extra->weight.clone();
    counter.n = 0;
    {
      torch::NoGradGuard no_grad;
      extra->weight.zero_();
    }
    sgd.state().clear();
    acc.load_state(dir);
    EXPECT_EQ(counter.n, 7);
    EXPECT_TRUE(extra->weight.equal(weight));
    EXPECT_EQ(sgd.state().size(), 2u);  // the momentum buffers came back
  }
  Accelerator other;  // a different registration is refused before anything changes
  other.register_for_checkpointing(counter);
  counter.n = 1;
  try {
    other.load_state(dir);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 3 registered object(s) [json, module, optimizer] but [json] are registered"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(counter.n, 1);
  fs::remove_all(dir);
}

TEST(Accelerator, ATrainingStepReadsNothingBackUnlessTheProgramDoes) {
  // bf16 autocast, accumulation over 2 micro-batches, clipping, FusedAdamW: the step a GPU program runs.
  AcceleratorOptions o;
  o.mixed_precision = MixedPrecision::BF16;
  o.gradient_accumulation_steps = 2;
  Accelerator acc(o);
  torch::manual_seed(0);
  auto model = acc.prepare(torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::GELU(), torch::nn::Linear(16, 4)));
  auto opt = acc.prepare(optim::FusedAdamW(model->parameters(), torch::optim::AdamWOptions(1e-3)));
  const auto data = torch::randn({6, 2, 8});
  std::vector<GradNorm> norms;
  auto run = [&](int micro_steps, bool read_loss) {
    for (int i = 0; i < micro_steps; ++i) {
      auto scope = acc.accumulate(model);
      auto loss = model->forward(data[i % 6]).pow(2).mean();
      acc.backward(loss);
      if (acc.sync_gradients()) norms.push_back(acc.clip_grad_norm(model->parameters(), 0.01));
      opt.step();
      opt.zero_grad();
      if (read_loss) (void)loss.item<double>();
    }
  };
  run(4, false);  // first steps create the optimizer's state
  xlr8::testing::OpCounter reads(xlr8::testing::OpCounter::host_reads());
  const int64_t before = reads.count();
  run(8, false);
  EXPECT_EQ(reads.count() - before, 0) << "host reads in 4 optimizer steps";
  // The counter sees a read when there is one: the program's own loss.item(), once per micro-batch.
  run(8, true);
  EXPECT_EQ(reads.count() - before, 8);
  // The norm was kept on the device; reading it is the program's choice (and a read).
  ASSERT_EQ(norms.size(), 10u);
  EXPECT_GT(norms.back().value(), 0.0);
  EXPECT_EQ(reads.count() - before, 9);
}

TEST(Accelerator, AllowTf32SetsLibTorchsMatmulSettingAndUnsetLeavesIt) {
  const bool before = at::globalContext().allowTF32CuBLAS();
  {
    AcceleratorOptions o;
    o.allow_tf32 = true;
    Accelerator acc(o);
    EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
    EXPECT_EQ(acc.plan().to_json()["allow_tf32"], true);
    EXPECT_NE(acc.plan().describe().find("TF32 float32 matmuls on"), std::string::npos) << acc.plan().describe();
  }
  {
    AcceleratorOptions o;
    o.allow_tf32 = false;
    Accelerator acc(o);
    EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
  }
  at::globalContext().setAllowTF32CuBLAS(true);
  {
    Accelerator acc(AcceleratorOptions{});  // unset (and no XLR8_ALLOW_TF32 here): the process's setting stays
    EXPECT_TRUE(at::globalContext().allowTF32CuBLAS());
    EXPECT_TRUE(acc.plan().to_json()["allow_tf32"].is_null());
  }
  at::globalContext().setAllowTF32CuBLAS(before);
}
