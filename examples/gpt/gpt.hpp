#pragma once
// A GPT-2-style decoder written with LibTorch modules, as a user would write it: token + position
// embedding, N pre-norm blocks (causal self-attention + MLP), a final norm and an LM head tied to the
// token embedding (or not). Byte-level: the vocabulary is the 256 byte values. What xlr8 adds is two
// lines in each of BlockImpl::forward and GptImpl::forward (xlr8::unshard) and the block class GptImpl
// declares (xlr8::NoSplitModules), for stage-3 sharding, and
// xlr8::nn's Linear and Embedding in place of LibTorch's (the same layers until a tensor-parallel plan,
// tp_plan.cpp, splits them), and xlr8::attention with xlr8::cp::local_positions (plain attention and
// arange until context parallelism splits the sequence): the model holds no parallel logic.
#include <torch/torch.h>

#include "xlr8/deepspeed_pipeline.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/unshard.hpp"

#include <string>
#include <vector>

namespace gpt {

struct Config {
  int64_t vocab_size = 256;
  int64_t seq_len = 128;
  int64_t n_layer = 4;
  int64_t d_model = 128;
  int64_t n_head = 4;
  int64_t n_kv_head = 0;  // grouped-query attention: key/value heads, each serving n_head / n_kv_head queries (0: n_head)
  double dropout = 0.0;  // off by default, so runs on any number of processes compare exactly
  bool tied_head = true;
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const Config& c);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, C] -> [B, T, C]
  xlr8::nn::Linear qkv{nullptr}, proj{nullptr};
  double dropout;  // on the attention weights, while training
  // The heads this process computes follow from qkv's (possibly tensor-parallel) width, which holds query,
  // key and value heads in the model's proportion n_head : n_kv_head : n_kv_head.
  int64_t head_dim, n_head, n_kv_head;
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const Config& c);
  torch::Tensor forward(const torch::Tensor& x);
  xlr8::nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Mlp);

// One transformer block: the unit that sharding strategies wrap (GptImpl declares it; or
// fsdp_transformer_layer_cls_to_wrap: Block).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

// Its blocks are declared as a Hugging Face model's _no_split_modules: TRANSFORMER_BASED_WRAP without
// fsdp_transformer_layer_cls_to_wrap (Accelerate's own configs) wraps each Block.
struct GptImpl : torch::nn::Module, xlr8::NoSplitModules {
  explicit GptImpl(const Config& c);
  std::vector<std::string> no_split_modules() const override { return {"Block"}; }
  torch::Tensor forward(const torch::Tensor& tokens);  // int64 [B, T] -> logits [B, T, vocab]
  Config config;
  xlr8::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  xlr8::nn::Linear head{nullptr};  // null when tied to wte
};
TORCH_MODULE(Gpt);

// The tensor-parallel plan for this model (kept apart from it, as torchtitan's parallelize.py): qkv
// column-wise in 3 fused parts (queries, keys, values; narrower keys and values under grouped-query
// attention) and the attention's proj row-wise, fc column-wise and the MLP's proj
// row-wise, both embeddings vocabulary-parallel, an untied head column-wise with its logits gathered (a
// tied head follows wte through Embedding::attend). Throws xlr8::ConfigError when tp_size does not
// divide the query or key/value heads, with both numbers.
xlr8::tp::Plan tp_plan(const Config& c, int tp_size, bool sequence_parallel = false);

// GPT-2's initialisation of `module`'s parameters: N(0, 0.02) weights, zero biases, LayerNorms ("ln" in the name) as
// built. GptImpl and pipeline_layers' layers take it.
void gpt2_init(torch::nn::Module& module);

// The same GPT as DeepSpeed's layer specs, for a PipelineModule (gpt_deepspeed --pipeline): the token and position
// embeddings, the blocks, the final norm, and the head (the token embedding's weight again when c.tied_head, a
// TiedLayerSpec; else a Linear of its own), each with GPT-2's initialisation.
std::vector<xlr8::deepspeed::PipeLayer> pipeline_layers(const Config& c);

// Fine-tuning: stops gradients (requires_grad false) for every parameter under one of the
// comma-separated module paths, matched on whole dotted segments ("attn" freezes blocks.*.attn.*,
// "blocks.0" the first block, "wte" also the head tied to it). Throws xlr8::ConfigError naming a path
// that matches nothing. Returns how many parameter elements it froze.
int64_t freeze(torch::nn::Module& model, const std::string& paths);

// Windows of seq_len + 1 bytes of one text, seq_len apart: input bytes and the next bytes as targets.
class TextWindows : public torch::data::datasets::Dataset<TextWindows> {
 public:
  // `bytes` empty: no windows (nothing held out); otherwise at least one window, or an error naming `what`.
  TextWindows(torch::Tensor bytes, int64_t seq_len, const std::string& what = "text");
  torch::data::Example<> get(size_t index) override;
  torch::optional<size_t> size() const override;

 private:
  torch::Tensor bytes_;
  int64_t seq_len_;
};

// 90 % of `text` for training and, after it, at most `held_out_windows` windows held out (none when 0); an error
// naming the part and what to change where a part is shorter than one window.
struct TextSplit {
  TextWindows train, held_out;
};
TextSplit split_text(const torch::Tensor& text, int64_t seq_len, int64_t held_out_windows);

// Every regular file of Debian's `fortunes` package (/usr/share/games/fortunes, no .dat indexes or
// links), in name order, as one uint8 tensor. Throws xlr8::Error naming the directory when it is empty.
torch::Tensor load_text(const std::string& dir);

}  // namespace gpt
