#include "gpt.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <iterator>

#include "xlr8/context_parallel.hpp"
#include "xlr8/error.hpp"
#include "xlr8/unshard.hpp"

namespace fs = std::filesystem;
namespace F = torch::nn::functional;

namespace gpt {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const Config& c) {
  if (c.d_model % c.n_head != 0)
    throw xlr8::ConfigError(fmt::format("--d_model {} must be a multiple of --n_head {}", c.d_model, c.n_head));
  n_head = c.n_head;
  n_kv_head = c.n_kv_head > 0 ? c.n_kv_head : c.n_head;
  if (n_head % n_kv_head != 0)
    throw xlr8::ConfigError(fmt::format("--n_kv_head {} must divide --n_head {}", n_kv_head, n_head));
  head_dim = c.d_model / c.n_head;
  qkv = register_module("qkv", xlr8::nn::Linear(c.d_model, c.d_model + 2 * n_kv_head * head_dim));
  proj = register_module("proj", xlr8::nn::Linear(c.d_model, c.d_model));
  dropout = c.dropout;
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  auto projected = qkv(x);
  // This process's share of the heads (times head_dim) and the whole sequence, as qkv hands them over.
  const auto B = projected.size(0), T = projected.size(1), hd = head_dim;
  const auto local_heads = projected.size(2) / hd, q_heads = local_heads * n_head / (n_head + 2 * n_kv_head);
  const auto kv_heads = (local_heads - q_heads) / 2, C = q_heads * hd;
  auto parts = projected.split_with_sizes({C, kv_heads * hd, kv_heads * hd}, 2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, -1, hd}).transpose(1, 2); };  // [B, h, T, hd]
  auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  // Causal scaled-dot-product attention; under context parallelism T is this rank's share of the
  // sequence and the keys and values of the others' come to it.
  auto y = xlr8::attention(q, k, v, {.causal = true, .dropout = is_training() ? dropout : 0.0});
  return proj(y.transpose(1, 2).contiguous().view({B, T, C}));
}

MlpImpl::MlpImpl(const Config& c) {
  fc = register_module("fc", xlr8::nn::Linear(c.d_model, 4 * c.d_model));
  proj = register_module("proj", xlr8::nn::Linear(4 * c.d_model, c.d_model));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) { return proj(F::gelu(fc(x))); }

BlockImpl::BlockImpl(const Config& c) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  attn = register_module("attn", CausalSelfAttention(c));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  mlp = register_module("mlp", Mlp(c));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  // Sharding gathers this block's parameters around the body (a no-op otherwise); the body takes the
  // block's input, so that fsdp_activation_checkpointing can run it again in backward.
  return xlr8::sharded(*this, [this](torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + mlp(ln2(x));
  }, x);
}

GptImpl::GptImpl(const Config& c) : config(c) {
  wte = register_module("wte", xlr8::nn::Embedding(c.vocab_size, c.d_model));
  wpe = register_module("wpe", xlr8::nn::Embedding(c.seq_len, c.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) blocks->push_back(Block(c));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  if (!c.tied_head) head = register_module("head", xlr8::nn::Linear(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false)));
  gpt2_init(*this);
}

void gpt2_init(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    const auto& name = item.key();
    if (name.find("ln") != std::string::npos) continue;
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) item.value().zero_();
    else item.value().normal_(0.0, 0.02);
  }
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  auto unit = xlr8::unshard(*this);  // the embeddings and final norm, which no block owns
  const auto T = tokens.size(1);
  if (T > config.seq_len)
    throw xlr8::Error(fmt::format("sequence of {} tokens is longer than the model's {}", T, config.seq_len));
  auto positions = xlr8::cp::local_positions(T, tokens.device());  // arange(T) without context parallelism
  auto x = wte(tokens) + wpe(positions);
  for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
  x = ln_f(x);
  return unit.done(head ? head(x) : wte->attend(x));
}

int64_t freeze(torch::nn::Module& model, const std::string& paths) {
  int64_t frozen = 0;
  std::string rest = paths;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string path = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    if (path.empty()) continue;
    bool matched = false;
    for (auto& item : model.named_parameters()) {
      if (("." + item.key() + ".").find("." + path + ".") == std::string::npos) continue;
      matched = true;
      if (item.value().requires_grad()) frozen += item.value().numel();
      item.value().set_requires_grad(false);
    }
    if (!matched)
      throw xlr8::ConfigError(fmt::format("--freeze {:?}: no parameter lies under that module path (e.g. wpe, attn, "
                                          "blocks.0, blocks.1.mlp.fc)",
                                          path));
  }
  return frozen;
}

TextWindows::TextWindows(torch::Tensor bytes, int64_t seq_len, const std::string& what)
    : bytes_(std::move(bytes)), seq_len_(seq_len) {
  if (bytes_.numel() > 0 && bytes_.numel() < seq_len_ + 1)
    throw xlr8::Error(fmt::format("the {} has {} bytes, fewer than one window of {} (--seq_len {} + 1): give more text "
                                  "(--data_dir) or a shorter --seq_len",
                                  what, bytes_.numel(), seq_len_ + 1, seq_len_));
}

torch::data::Example<> TextWindows::get(size_t index) {
  auto window = bytes_.narrow(0, static_cast<int64_t>(index) * seq_len_, seq_len_ + 1).to(torch::kLong);
  return {window.narrow(0, 0, seq_len_), window.narrow(0, 1, seq_len_)};
}

torch::optional<size_t> TextWindows::size() const {
  return bytes_.numel() == 0 ? 0 : static_cast<size_t>((bytes_.numel() - 1) / seq_len_);  // none held out: empty
}

TextSplit split_text(const torch::Tensor& text, int64_t seq_len, int64_t held_out_windows) {
  const int64_t split = text.numel() * 9 / 10;
  const int64_t held = held_out_windows > 0 ? std::min(text.numel() - split, held_out_windows * seq_len + 1) : 0;
  return {TextWindows(text.narrow(0, 0, split), seq_len, "training text (90 % of --data_dir's)"),
          TextWindows(text.narrow(0, split, held), seq_len, "held-out text (what follows the training text, up to "
                                                            "--val_windows windows)")};
}

torch::Tensor load_text(const std::string& dir) {
  std::error_code failed;
  if (!fs::is_directory(dir, failed))
    throw xlr8::Error(fmt::format("--data_dir {}: {}; give a directory of text files", dir,
                                  fs::exists(dir, failed) ? "not a directory" : "does not exist"));
  std::vector<fs::path> files;
  for (auto& e : fs::directory_iterator(dir))  // regular files and links to them; no subdirectories
    if (e.is_regular_file() && e.path().extension() != ".dat") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string text;
  std::set<fs::path> read;  // each file once: fortunes' "<name>.u8" links to "<name>"
  for (auto& f : files) {
    if (!read.insert(fs::canonical(f)).second) continue;
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (text.empty())
    throw xlr8::Error(fmt::format("no text found in {} (its regular files, not subdirectories, and not .dat files): put "
                                  "text files there, or install Debian's `fortunes` package (scripts/setup does) and "
                                  "leave --data_dir at its default",
                                  dir));
  auto bytes = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes;
}

}  // namespace gpt
