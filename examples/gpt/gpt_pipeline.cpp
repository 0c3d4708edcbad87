// The GPT as a list of layer specs for DeepSpeed's PipelineModule (gpt.hpp's pipeline_layers).
#include "gpt.hpp"
#include "xlr8/context_parallel.hpp"

namespace gpt {
namespace {

// The first layer: token plus position embeddings (GptImpl's wte and wpe).
struct EmbeddingsImpl : torch::nn::Module {
  explicit EmbeddingsImpl(const Config& c)
      : wte(register_module("wte", xlr8::nn::Embedding(c.vocab_size, c.d_model))),
        wpe(register_module("wpe", xlr8::nn::Embedding(c.seq_len, c.d_model))) {
    gpt2_init(*this);
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    return wte(tokens) + wpe(xlr8::cp::local_positions(tokens.size(1), tokens.device()));
  }
  xlr8::nn::Embedding wte, wpe;
};
TORCH_MODULE(Embeddings);

// The untied output layer: its Linear named "head", so that AutoTP splits it as an output head under pp x tp (a bare
// Linear would be named by its index in the PipelineModule alone).
struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(const Config& c)
      : head(register_module("head", xlr8::nn::Linear(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false)))) {
    gpt2_init(*this);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(x); }
  xlr8::nn::Linear head;
};
TORCH_MODULE(Head);

template <class Holder, class... Args>
xlr8::deepspeed::LayerSpec initialised(Args... args) {
  return xlr8::deepspeed::LayerSpec([=] {
    Holder layer(args...);
    gpt2_init(*layer);
    return torch::nn::AnyModule(layer);
  });
}

}  // namespace

std::vector<xlr8::deepspeed::PipeLayer> pipeline_layers(const Config& c) {
  using namespace xlr8::deepspeed;
  const auto embeddings = LayerSpec::of<Embeddings>(c);
  std::vector<PipeLayer> layers{TiedLayerSpec("embeddings", embeddings)};
  for (int64_t i = 0; i < c.n_layer; ++i) layers.push_back(initialised<Block>(c));
  layers.push_back(LayerSpec::of<torch::nn::LayerNorm>(torch::nn::LayerNormOptions({c.d_model})));
  if (c.tied_head)
    layers.push_back(TiedLayerSpec("embeddings", embeddings, [](torch::nn::Module& m, const torch::Tensor& x) {
      return m.as<Embeddings>()->wte->attend(x);  // the logits against the token embedding's weight
    }));
  else
    layers.push_back(LayerSpec::of<Head>(c));
  return layers;
}

}  // namespace gpt
