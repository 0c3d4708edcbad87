// Tensor parallelism: drop-in layers equal LibTorch's at tp 1, and a planned model on 2, 3 and 4 tp
// ranks (threads) trains exactly as one process does.
#include <gtest/gtest.h>
#include <torch/torch.h>


#include <map>
#include <optional>

#include "parallel/tensor/tp_layer_kinds.hpp"
#include "thread_ranks.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace {

using xlr8::Communicator;
using xlr8::testing::generator_lock;
using xlr8::testing::run_ranks;
namespace tp = xlr8::tp;

// A little language model whose sizes 2, 3 and 4 all divide: every style and a column-wise head.
struct TinyLmImpl : torch::nn::Module {
  xlr8::nn::Embedding wte{nullptr};
  xlr8::nn::Linear fc_in{nullptr}, fc_out{nullptr}, head{nullptr};
  TinyLmImpl() {
    std::lock_guard<std::mutex> lock(generator_lock());
    torch::manual_seed(11);
    wte = register_module("wte", xlr8::nn::Embedding(24, 12));
    fc_in = register_module("fc_in", xlr8::nn::Linear(12, 36));
    fc_out = register_module("fc_out", xlr8::nn::Linear(36, 12));
    head = register_module("head", xlr8::nn::Linear(12, 24));
  }
  at::Tensor forward(const at::Tensor& ids) {
    auto h = wte(ids);
    h = h + fc_out(torch::gelu(fc_in(h)));
    return head(h);
  }
};
TORCH_MODULE(TinyLm);

const tp::Plan kPlan{{"wte", tp::Style::VocabParallel},
                     {"fc_in", tp::Style::Colwise},
                     {"fc_out", tp::Style::Rowwise},
                     {"head", tp::Style::Colwise, /*gather_output=*/true}};

at::Tensor batch_ids(int step) {
  std::lock_guard<std::mutex> lock(generator_lock());
  torch::manual_seed(100 + step);
  return torch::randint(0, 24, {4, 6}, torch::kLong);
}

// Losses of `steps` AdamW steps, every rank reading the same batch.
std::vector<double> train(TinyLm& model, int steps) {
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.02).weight_decay(0.01));
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto ids = batch_ids(step);
    auto logits = model->forward(ids.narrow(1, 0, 5));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, 24}), ids.narrow(1, 1, 5).reshape(-1));
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// The slice of a whole parameter that a rank's layer holds.
at::Tensor expected_slice(const at::Tensor& whole, const std::optional<xlr8::nn::TensorParallelSlot>& slot, int64_t local,
                          bool is_weight) {
  if (!slot) return whole;
  switch (slot->style) {
    case tp::Style::Colwise:
    case tp::Style::VocabParallel: return whole.narrow(0, slot->offset, local);
    case tp::Style::Rowwise: return is_weight ? whole.narrow(1, slot->offset, local) : whole;
    case tp::Style::Replicate:
    case tp::Style::SequenceParallel: return whole;
  }
  return whole;
}

void expect_same_parameters(TinyLm& got, TinyLm& whole, const std::string& where) {
  auto check = [&](const std::string& name, const at::Tensor& mine, const at::Tensor& reference,
                   const std::optional<xlr8::nn::TensorParallelSlot>& slot, int64_t local, bool is_weight) {
    auto want = expected_slice(reference, slot, local, is_weight);
    ASSERT_EQ(mine.sizes(), want.sizes()) << where << " " << name;
    EXPECT_TRUE(torch::allclose(mine, want, 1e-5, 1e-6))
        << where << " " << name << " differs by " << (mine - want).abs().max().item<double>();
  };
  check("wte.weight", got->wte->weight, whole->wte->weight, got->wte->tensor_parallel(), got->wte->weight.size(0), true);
  for (auto [name, mine, ref] : {std::tuple{"fc_in", got->fc_in, whole->fc_in}, std::tuple{"fc_out", got->fc_out, whole->fc_out},
                                 std::tuple{"head", got->head, whole->head}}) {
    const auto& slot = mine->tensor_parallel();
    const int64_t local = slot && slot->style == tp::Style::Rowwise ? mine->weight.size(1) : mine->weight.size(0);
    check(std::string(name) + ".weight", mine->weight, ref->weight, slot, local, true);
    check(std::string(name) + ".bias", mine->bias, ref->bias, slot, local, false);
  }
}

// TinyLm built as Accelerator::build_model builds under tp: rank 0 keeping the whole values, the others on
// the meta device, the plan applied inside the build, then `inside`. The model, and rank 0's whole values.
std::pair<TinyLm, std::map<std::string, at::Tensor>> build_split(Communicator& comm,
                                                                 const std::function<void(TinyLm&)>& inside = {}) {
  std::optional<xlr8::EmptyInitScope> empty;
  std::optional<tp::detail::KeepWholeValues> keep;
  if (comm.rank() == 0) keep.emplace();
  else empty.emplace();
  TinyLm model;
  tp::parallelize(*model, comm, kPlan);
  if (inside) inside(model);
  empty.reset();
  std::map<std::string, at::Tensor> wholes;
  if (comm.rank() == 0)
    for (const auto& item : model->named_parameters()) wholes[item.key()] = keep->whole_of(item.value());
  return {model, wholes};
}

}  // namespace

TEST(TensorParallel, DropInLayersAreLibTorchsAtTpOne) {
  torch::manual_seed(3);
  torch::nn::Linear plain_linear(torch::nn::LinearOptions(7, 5));
  torch::nn::Embedding plain_embedding(9, 4);
  torch::manual_seed(3);
  xlr8::nn::Linear linear(torch::nn::LinearOptions(7, 5));
  xlr8::nn::Embedding embedding(9, 4);
  auto names = [](const torch::nn::Module& m) {
    std::vector<std::string> out;
    for (const auto& p : m.named_parameters()) out.push_back(p.key() + ":" + c10::str(p.value().sizes()));
    return out;
  };
  EXPECT_EQ(names(*linear), names(*plain_linear));
  EXPECT_EQ(names(*embedding), names(*plain_embedding));
  EXPECT_TRUE(torch::equal(linear->weight, plain_linear->weight));
  EXPECT_TRUE(torch::equal(linear->bias, plain_linear->bias));
  EXPECT_TRUE(torch::equal(embedding->weight, plain_embedding->weight));
  auto x = torch::randn({3, 7});
  EXPECT_TRUE(torch::equal(linear(x), plain_linear(x)));
  auto ids = torch::randint(0, 9, {2, 3}, torch::kLong);
  EXPECT_TRUE(torch::equal(embedding(ids), plain_embedding(ids)));
  // A plan on a one-rank group keeps everything whole.
  run_ranks(1, [&](Communicator& comm) {
    TinyLm model, reference;
    tp::parallelize(*model, comm, kPlan, /*strict=*/true);
    EXPECT_EQ(model->fc_in->weight.sizes(), reference->fc_in->weight.sizes());
    auto ids2 = batch_ids(0);
    EXPECT_TRUE(torch::allclose(model->forward(ids2), reference->forward(ids2)));
  });
}

TEST(TensorParallel, EveryStyleOnTwoThreeAndFourRanksTrainsAsOneProcess) {
  TinyLm whole;
  const auto expected = train(whole, 4);
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      TinyLm model;
      tp::parallelize(*model, comm, kPlan, /*strict=*/true);
      EXPECT_EQ(model->fc_in->weight.size(0), 36 / ranks);
      EXPECT_EQ(model->fc_out->weight.size(1), 36 / ranks);
      EXPECT_EQ(model->fc_out->bias.size(0), 12);  // a row-wise bias stays whole
      EXPECT_EQ(model->wte->weight.size(0), 24 / ranks);
      const auto where = fmt::format("tp {} rank {}", ranks, comm.rank());
      const auto losses = train(model, 4);
      for (size_t s = 0; s < expected.size(); ++s) EXPECT_NEAR(losses[s], expected[s], 2e-6) << where << " step " << s;
      expect_same_parameters(model, whole, where);
    });
}

TEST(TensorParallel, WithoutTheBackwardAllReduceTheRanksDrift) {
  // The oracle can fail: a column-wise layer whose input gradient is not summed over the group trains
  // the embedding below it on a partial gradient.
  TinyLm whole;
  const auto expected = train(whole, 3);
  run_ranks(2, [&](Communicator& comm) {
    TinyLm model;
    tp::parallelize(*model, comm, {{"fc_in", tp::Style::Colwise}, {"fc_out", tp::Style::Rowwise}});
    // Detaching fc_in's input drops its all-reduced gradient from the residual stream's.
    auto ids = batch_ids(0);
    auto h = model->wte(ids.narrow(1, 0, 5));
    auto logits = model->head(h + model->fc_out(torch::gelu(torch::nn::functional::linear(
                                      h, model->fc_in->weight, model->fc_in->bias))));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, 24}), ids.narrow(1, 1, 5).reshape(-1));
    loss.backward();
    TinyLm reference;
    auto ref_logits = reference->forward(ids.narrow(1, 0, 5));
    torch::cross_entropy_loss(ref_logits.reshape({-1, 24}), ids.narrow(1, 1, 5).reshape(-1)).backward();
    EXPECT_NEAR(loss.item<double>(), expected[0], 2e-6);  // forward agrees...
    EXPECT_FALSE(torch::allclose(model->wte->weight.grad(), reference->wte->weight.grad(), 1e-4, 1e-5));  // ...backward not
  });
}

TEST(TensorParallel, PatternsMatchWithinOnePathComponent) {
  EXPECT_TRUE(tp::path_matches("blocks.*.attn.qkv", "blocks.0.attn.qkv"));
  EXPECT_TRUE(tp::path_matches("blocks.*.attn.qkv", "blocks.11.attn.qkv"));
  EXPECT_FALSE(tp::path_matches("blocks.*.qkv", "blocks.0.attn.qkv"));  // a star stays in its component
  EXPECT_TRUE(tp::path_matches("blocks.*.mlp.fc_*", "blocks.3.mlp.fc_in"));
  EXPECT_FALSE(tp::path_matches("blocks.*.mlp.fc", "blocks.3.mlp.fc_in"));  // whole path, not a prefix
  EXPECT_TRUE(tp::path_matches("*", "wte"));
  EXPECT_FALSE(tp::path_matches("*", "blocks.0"));
  EXPECT_TRUE(tp::path_matches("head", "head"));
}

TEST(TensorParallel, OnlyRankZeroBuildsTheWholeModelAndTheOthersReceiveJustTheirSlices) {
  // What Accelerator::build_model does under tensor parallelism: ranks but 0 build in an EmptyInitScope
  // (meta: no values, no memory), the plan slices that inside the build, and at prepare() they get memory
  // for their slices only and rank 0's values, one whole tensor at a time.
  for (int P : {2, 3, 4})
    run_ranks(P, [&](Communicator& comm) {
      auto [model, wholes] = build_split(comm);
      for (const auto& item : model->named_parameters()) {
        if (comm.rank() != 0) {
          EXPECT_TRUE(item.value().is_meta()) << item.key();
        }
      }
      if (comm.rank() == 0) {
        EXPECT_EQ(wholes.at("fc_in.weight").sizes(), (std::vector<int64_t>{36, 12}));
      }
      tp::detail::take_whole_values_from_main(*model, comm, wholes, at::kCPU);
      TinyLm whole;  // what this rank would have built itself: the same seed
      expect_same_parameters(model, whole, fmt::format("rank {} of {}", comm.rank(), P));
    });
  // What only rank 0 can see is said on every rank before anything is sent: a slice changed after the plan
  // cut it (its other slices' new values exist nowhere), and a tensor rank 0 kept no whole value of.
  for (const std::string change : {"changed", "added"})
    run_ranks(2, [&](Communicator& comm) {
      auto [model, wholes] = build_split(comm, [&](TinyLm& m) {
        torch::NoGradGuard no_grad;
        if (change == "changed") m->fc_in->weight.add_(1.0);  // initialising after parallelize, inside the build
      });
      if (change == "added") wholes.erase("head.bias");
      try {
        tp::detail::take_whole_values_from_main(*model, comm, wholes, at::kCPU);
        ADD_FAILURE() << change << ": no error on rank " << comm.rank();
      } catch (const xlr8::ConfigError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find(change == "changed" ? "fc_in.weight changed after the tensor-parallel plan sliced it"
                                             : "head.bias was added to the model after build_model()"),
                  std::string::npos)
            << m;
      }
    });
  // A rank whose model differs is named on every rank, before anything is sent.
  run_ranks(2, [&](Communicator& comm) {
    struct Net : torch::nn::Module {
      xlr8::nn::Linear proj;
      explicit Net(int64_t out) : proj(register_module("proj", xlr8::nn::Linear(4, out))) {}
    };
    auto net = std::make_shared<Net>(comm.rank() == 0 ? 8 : 6);
    std::map<std::string, at::Tensor> wholes;
    for (const auto& item : net->named_parameters()) wholes[item.key()] = item.value().detach();
    try {
      tp::detail::take_whole_values_from_main(*net, comm, wholes, at::kCPU);
      ADD_FAILURE() << "rank " << comm.rank() << ": no error";
    } catch (const xlr8::ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("the model built on rank 1 differs from the main process's"), std::string::npos) << m;
      EXPECT_NE(m.find("\"proj.weight 8x4 Float\" on rank 0, \"proj.weight 6x4 Float\" on rank 1"), std::string::npos) << m;
    }
  });
}

TEST(TensorParallel, BadPlansAreRefusedNamingWhatExists) {
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const xlr8::ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  };
  run_ranks(2, [&](Communicator& comm) {
    {
      TinyLm model;
      auto m = message([&] { tp::parallelize(*model, comm, {{"blocks.*.fc", tp::Style::Colwise}}); });
      EXPECT_NE(m.find("'blocks.*.fc' matches no module"), std::string::npos) << m;
      EXPECT_NE(m.find("wte, fc_in, fc_out, head"), std::string::npos) << m;
    }
    {
      TinyLm model;
      auto m = message([&] { tp::parallelize(*model, comm, {{"fc_in", tp::Style::Colwise}}, /*strict=*/true); });
      EXPECT_NE(m.find("no pattern covers wte, fc_out, head"), std::string::npos) << m;
    }
    {
      TinyLm model;
      auto m = message([&] { tp::parallelize(*model, comm, {{"wte", tp::Style::Rowwise}}); });
      EXPECT_NE(m.find("an Embedding takes VocabParallel or Replicate, not Rowwise"), std::string::npos) << m;
    }
    {
      // Checked before anything is sliced: the plan's good entries leave the model untouched too.
      TinyLm model;
      auto m = message([&] {
        tp::parallelize(*model, comm, {{"fc_in", tp::Style::Colwise}, {"fc_out", tp::Style::Rowwise, true}});
      });
      EXPECT_NE(m.find("'fc_out' (Rowwise): gather_output applies to Colwise only"), std::string::npos) << m;
      EXPECT_EQ(model->fc_in->weight.size(0), 36);
      EXPECT_FALSE(model->fc_in->tensor_parallel().has_value());
    }
    {
      // A head tied to the embedding would be sliced twice over one tensor.
      struct Tied : torch::nn::Module {
        xlr8::nn::Linear head{register_module("head", xlr8::nn::Linear(12, 24))};
        xlr8::nn::Embedding wte{
            register_module("wte", xlr8::nn::Embedding(torch::nn::EmbeddingOptions(24, 12)._weight(head->weight)))};
      } tied;
      auto m = message([&] { tp::parallelize(tied, comm, {{"wte", tp::Style::VocabParallel}}); });
      EXPECT_NE(m.find("'wte': its weight is tied (head.weight, wte.weight)"), std::string::npos) << m;
    }
    {
      struct Plain : torch::nn::Module {
        torch::nn::Linear proj{register_module("proj", torch::nn::Linear(4, 4))};
      } plain;
      auto m = message([&] { tp::parallelize(plain, comm, {{"proj", tp::Style::Colwise}}); });
      EXPECT_NE(m.find("'proj' (torch::nn::LinearImpl) is LibTorch's own layer"), std::string::npos) << m;
      EXPECT_NE(m.find("xlr8::nn::Linear"), std::string::npos) << m;
    }
  });
  run_ranks(3, [&](Communicator& comm) {
    struct Odd : torch::nn::Module {
      xlr8::nn::Linear proj{register_module("proj", xlr8::nn::Linear(4, 8))};
    } odd;
    auto m = message([&] { tp::parallelize(odd, comm, {{"proj", tp::Style::Colwise}}); });
    EXPECT_NE(m.find("'proj' (Colwise): its out_features is 8, which the tp size 3 does not divide"), std::string::npos)
        << m;
  });
}
