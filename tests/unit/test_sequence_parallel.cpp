// Sequence parallelism (issue 24 §1): between layers the activations are split on the sequence over
// the tp group; a model planned that way on 2, 3 and 4 ranks (threads) trains exactly as one process,
// its norms included (their gradients, partial per rank, are summed over tp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace {

using xlr8::Communicator;
using xlr8::testing::generator_lock;
using xlr8::testing::run_ranks;
namespace tp = xlr8::tp;

constexpr int64_t kVocab = 24, kWidth = 12, kSeq = 12;

// Embedding + position embedding -> norm -> MLP (column-wise in, row-wise out) -> norm -> head, with
// residuals: the layout of a transformer block, every size divisible by 2, 3 and 4.
struct SeqLmImpl : torch::nn::Module {
  xlr8::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::LayerNorm ln{nullptr}, ln_f{nullptr};
  xlr8::nn::Linear fc_in{nullptr}, fc_out{nullptr}, head{nullptr};
  SeqLmImpl() {
    std::lock_guard<std::mutex> lock(generator_lock());
    torch::manual_seed(21);
    wte = register_module("wte", xlr8::nn::Embedding(kVocab, kWidth));
    wpe = register_module("wpe", xlr8::nn::Embedding(kSeq, kWidth));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    fc_in = register_module("fc_in", xlr8::nn::Linear(kWidth, 3 * kWidth));
    fc_out = register_module("fc_out", xlr8::nn::Linear(3 * kWidth, kWidth));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", xlr8::nn::Linear(kWidth, kVocab));
    // Norms that are not the identity at the start, so that their gradients matter.
    torch::NoGradGuard no_grad;
    for (auto* norm : {ln.get(), ln_f.get()}) {
      norm->weight.uniform_(0.5, 1.5);
      norm->bias.uniform_(-0.2, 0.2);
    }
  }
  at::Tensor forward(const at::Tensor& ids) {
    auto positions = torch::arange(ids.size(1), torch::kLong);
    auto h = wte(ids) + wpe(positions);
    h = h + fc_out(torch::gelu(fc_in(ln(h))));
    return head(ln_f(h));
  }
};
TORCH_MODULE(SeqLm);

tp::Plan sequence_plan() {
  using tp::Style;
  tp::PlanEntry wte{"wte", Style::VocabParallel}, wpe{"wpe", Style::VocabParallel}, fc_in{"fc_in", Style::Colwise},
      fc_out{"fc_out", Style::Rowwise}, head{"head", Style::Colwise, /*gather_output=*/true};
  for (auto* e : {&wte, &wpe, &fc_in, &fc_out, &head}) e->sequence_parallel = true;
  return {wte, wpe, fc_in, fc_out, head, {"ln", Style::SequenceParallel}, {"ln_f", Style::SequenceParallel}};
}

at::Tensor batch(int step) {
  std::lock_guard<std::mutex> lock(generator_lock());
  torch::manual_seed(300 + step);
  return torch::randint(0, kVocab, {3, kSeq + 1}, torch::kLong);
}

std::vector<double> train(SeqLm& model, int steps) {
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.02).weight_decay(0.01));
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto ids = batch(step);
    auto logits = model->forward(ids.narrow(1, 0, kSeq));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, kVocab}), ids.narrow(1, 1, kSeq).reshape(-1));
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

}  // namespace

TEST(SequenceParallel, TwoThreeAndFourRanksTrainAsOneProcessNormsIncluded) {
  SeqLm whole;
  const auto expected = train(whole, 4);
  std::map<std::string, at::Tensor> reference;
  for (const auto& p : whole->named_parameters()) reference[p.key()] = p.value().detach();
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      SeqLm model;
      tp::parallelize(*model, comm, sequence_plan(), /*strict=*/true);
      const auto where = fmt::format("tp {} rank {}", ranks, comm.rank());
      const auto losses = train(model, 4);
      for (size_t s = 0; s < expected.size(); ++s) EXPECT_NEAR(losses[s], expected[s], 2e-6) << where << " step " << s;
      const auto layouts = tp::slice_layouts(*model);
      for (const auto& p : model->named_parameters()) {
        auto it = layouts.find(p.key());
        auto want = it == layouts.end() ? reference.at(p.key()) : tp::local_slice(reference.at(p.key()), it->second);
        ASSERT_EQ(p.value().sizes(), want.sizes()) << where << " " << p.key();
        EXPECT_LE((p.value() - want).abs().max().item<double>(), 1e-5) << where << " " << p.key();
      }
    });
}

TEST(SequenceParallel, ASequenceTheGroupCannotSplitAndMisplacedFlagsAreRefused) {
  run_ranks(2, [&](Communicator& comm) {
    SeqLm model;
    tp::parallelize(*model, comm, sequence_plan(), /*strict=*/true);
    try {
      model->forward(batch(0).narrow(1, 0, 7));
      ADD_FAILURE() << "a sequence of 7 was split over 2 ranks";
    } catch (const xlr8::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("the sequence length 7 is not divisible by the tp size 2"), std::string::npos)
          << e.what();
    }
    SeqLm other;
    tp::PlanEntry replicated{"head", tp::Style::Replicate};
    replicated.sequence_parallel = true;
    try {
      tp::parallelize(*other, comm, {replicated});
      ADD_FAILURE() << "sequence_parallel on a Replicate entry was accepted";
    } catch (const xlr8::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("sequence_parallel applies to Colwise and Rowwise Linears"), std::string::npos)
          << e.what();
    }
    // SequenceParallel on a module that holds layers would sum their slices' gradients too.
    auto holder = std::make_shared<torch::nn::Module>();
    holder->register_module("inner", torch::nn::Sequential(torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})),
                                                           xlr8::nn::Linear(4, 4)));
    try {
      tp::parallelize(*holder, comm, {{"inner", tp::Style::SequenceParallel}});
      ADD_FAILURE() << "SequenceParallel on a module holding a Linear was accepted";
    } catch (const xlr8::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'inner' (SequenceParallel) holds layers (inner.1)"), std::string::npos)
          << e.what();
    }
    try {
      tp::parallelize(*other, comm, {{"head", tp::Style::SequenceParallel}});
      ADD_FAILURE() << "a Linear planned SequenceParallel was accepted";
    } catch (const xlr8::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("a Linear takes Colwise, Rowwise or Replicate, not SequenceParallel"),
                std::string::npos)
          << e.what();
    }
  });
}
