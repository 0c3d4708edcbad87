// How the GPT splits over a tensor-parallel group (torchtitan keeps this apart from the model, and so
// does this example): Megatron's layout, one all-reduce after each attention and each MLP, or with
// sequence parallelism a reduce-scatter there and an all-gather before each attention and MLP.
#include <fmt/format.h>

#include "gpt.hpp"
#include "xlr8/error.hpp"

namespace gpt {

xlr8::tp::Plan tp_plan(const Config& c, int tp_size, bool sequence_parallel) {
  const int64_t kv_heads = c.n_kv_head > 0 ? c.n_kv_head : c.n_head;
  for (auto [flag, heads] : {std::pair{"--n_head", c.n_head}, std::pair{"--n_kv_head", kv_heads}})
    if (tp_size < 1 || heads % tp_size != 0)
      throw xlr8::ConfigError(fmt::format("tensor parallelism: {} {} is not divisible by the tp size {}; every rank "
                                          "computes whole heads",
                                          flag, heads, tp_size));
  using xlr8::tp::Style;
  const int64_t head_dim = c.d_model / c.n_head, kv_width = kv_heads * head_dim;
  xlr8::tp::Plan plan{{"wte", Style::VocabParallel},
                      {"wpe", Style::VocabParallel},
                      // Queries, keys and values: each part split on its own, so a rank holds whole heads of each
                      // (head_dim: parallelize() checks it too).
                      {"blocks.*.attn.qkv", Style::Colwise, /*gather_output=*/false, /*fused=*/1,
                       /*sequence_parallel=*/false, /*fused_sizes=*/{c.d_model, kv_width, kv_width}, head_dim},
                      {"blocks.*.attn.proj", Style::Rowwise, false, 1, false, {}, head_dim},
                      {"blocks.*.mlp.fc", Style::Colwise},
                      {"blocks.*.mlp.proj", Style::Rowwise}};
  if (!c.tied_head) plan.push_back({"head", Style::Colwise, /*gather_output=*/true});
  if (!sequence_parallel) return plan;
  // Sequence parallelism: the residual stream between layers holds this rank's share of the sequence; the
  // norms run on it (their gradients summed over tp) and the split layers gather or reduce-scatter it.
  if (c.seq_len % tp_size != 0)
    throw xlr8::ConfigError(fmt::format("sequence parallelism: --seq_len {} is not divisible by the tp size {}",
                                        c.seq_len, tp_size));
  for (auto& entry : plan) entry.sequence_parallel = true;
  for (auto norm : {"blocks.*.ln1", "blocks.*.ln2", "ln_f"}) plan.push_back({norm, Style::SequenceParallel});
  return plan;
}

}  // namespace gpt
