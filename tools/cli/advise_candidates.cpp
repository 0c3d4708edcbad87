// The strategies `xlr8 advise` tries and what each makes of the user's launch (advise_candidates.hpp).
#include "cli/advise_candidates.hpp"

#include <fmt/format.h>

#include <exception>
#include <string>

namespace xlr8::cli {

namespace {

// Tensor, context, sequence and pipeline parallelism of 2 on n ranks (n even): the rest of the ranks data-parallel.
// Pipelines under 1F1B and the zero-bubble schedule.
std::vector<Candidate> mesh_candidates(int n, const std::map<std::string, std::string>& full_shard) {
  if (n % 2 != 0) return {};
  const std::string rest = std::to_string(n / 2);
  auto mesh = [&](std::map<std::string, std::string> m, const std::string& dp_key) {
    if (n > 2) m[dp_key] = rest;
    return m;
  };
  std::vector<Candidate> out{
      {.name = "tp 2, bf16", .formula = "ddp", .mixed_precision = "bf16",
       .parallelism = mesh({{"parallelism_config_tp_size", "2"}}, "parallelism_config_dp_replicate_size"), .tp = 2},
      {.name = "cp 2 (ring), FULL_SHARD, bf16", .formula = "zero3", .use_fsdp = true, .fsdp = full_shard,
       .mixed_precision = "bf16",
       .parallelism = mesh({{"parallelism_config_cp_size", "2"}, {"parallelism_config_cp_comm_strategy", "alltoall"}},
                           "parallelism_config_dp_shard_size"),
       .needs_attention = true},
      {.name = "sp 2 (Ulysses), FULL_SHARD, bf16", .formula = "zero3", .use_fsdp = true, .fsdp = full_shard,
       .mixed_precision = "bf16",
       .parallelism = mesh({{"parallelism_config_sp_size", "2"}}, "parallelism_config_dp_shard_size"),
       .needs_attention = true},
      {.name = "pp 2, bf16", .formula = "ddp", .mixed_precision = "bf16",
       .parallelism = mesh({{"parallelism_config_pp_size", "2"}}, "parallelism_config_dp_replicate_size"), .pp = 2},
      // The zero-bubble schedule: less idle than 1F1B, each stage holding up to 2 micro-batches' activations.
      {.name = "pp 2, zero-bubble, bf16", .formula = "ddp", .mixed_precision = "bf16",
       .parallelism = mesh({{"parallelism_config_pp_size", "2"},
                            {"parallelism_config_pp_schedule", "InterleavedZeroBubble"}},
                           "parallelism_config_dp_replicate_size"),
       .pp = 2}};
  if (n >= 4)
    out.push_back({.name = "pp 2 x FULL_SHARD, bf16", .formula = "zero3", .use_fsdp = true, .fsdp = full_shard,
                   .mixed_precision = "bf16",
                   .parallelism = mesh({{"parallelism_config_pp_size", "2"}}, "parallelism_config_dp_shard_size"),
                   .pp = 2, .formula_ranks = n / 2});
  if (n >= 4)
    out.insert(out.begin() + 1, Candidate{.name = "FULL_SHARD x tp 2, bf16", .formula = "zero3", .use_fsdp = true,
                                          .fsdp = full_shard, .mixed_precision = "bf16",
                                          .parallelism = mesh({{"parallelism_config_tp_size", "2"}},
                                                              "parallelism_config_dp_shard_size"),
                                          .tp = 2, .formula_ranks = n / 2});
  return out;
}

// The candidate's mesh, with the user's settings of each axis the candidate splits over (pp's micro-batches and
// schedule, tp's head size, sp's sequence length, ...) where the candidate sets none: the sizes are the candidate's,
// and an axis it does not use takes none of the user's settings.
std::map<std::string, std::string> with_axes_settings(const std::map<std::string, std::string>& user,
                                                      std::map<std::string, std::string> mesh) {
  const auto splits = [&](const std::string& axis) {
    const auto at = mesh.find("parallelism_config_" + axis + "_size");
    return at != mesh.end() && at->second != "1";
  };
  for (const auto& [key, value] : user) {
    if (key.ends_with("_size") || mesh.count(key)) continue;
    for (const std::string axis : {"pp", "cp", "sp", "tp"})
      if (key.starts_with("parallelism_config_" + axis + "_") && splits(axis)) mesh[key] = value;
  }
  // Interleaved schedules take micro-batches in groups of the stage count: the user's, made for their stages, stay
  // only when they are a multiple of the candidate's (else its default, one per stage).
  if (const auto m = mesh.find("parallelism_config_pp_microbatches"); m != mesh.end()) {
    const int stages = std::stoi(mesh.at("parallelism_config_pp_size"));
    int micro_batches = 0;
    try {
      micro_batches = std::stoi(m->second);
    } catch (const std::exception&) {  // the launch refuses it by name
    }
    if (micro_batches <= 0 || micro_batches % stages != 0) mesh.erase(m);
  }
  return mesh;
}

}  // namespace

// n processes over `machines` machines: HYBRID_SHARD (sharded inside a machine, replicated across) once there
// are several.
std::vector<Candidate> candidates(int n, int machines) {
  const std::map<std::string, std::string> full{{"fsdp_sharding_strategy", "FULL_SHARD"},
                                                {"fsdp_backward_prefetch", "NO_PREFETCH"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    auto m = full;
    for (auto& [k, v] : extra) m[k] = v;
    return m;
  };
  // The least memory-hungry first: its prepare() tells the model's size, which prunes the rest; the ones
  // likely fastest next, so that a slower candidate is stopped early (--cut_below).
  std::vector<Candidate> all{
      {.name = "FULL_SHARD, bf16", .formula = "zero3", .use_fsdp = true, .fsdp = full, .mixed_precision = "bf16"},
      {.name = "DDP, bf16", .formula = "ddp", .mixed_precision = "bf16"},
      {.name = "HYBRID_SHARD, bf16", .formula = "zero3", .use_fsdp = true,
       .fsdp = with({{"fsdp_sharding_strategy", "HYBRID_SHARD"}}), .mixed_precision = "bf16",
       .formula_ranks = n / machines},
      {.name = "DDP", .formula = "ddp"},
      {.name = "ZeRO-1", .formula = "zero1", .use_deepspeed = true, .deepspeed = {{"zero_stage", "1"}}},
      {.name = "SHARD_GRAD_OP (ZeRO-2)", .formula = "zero2", .use_fsdp = true,
       .fsdp = {{"fsdp_sharding_strategy", "SHARD_GRAD_OP"}}},
      {.name = "FULL_SHARD (ZeRO-3)", .formula = "zero3", .use_fsdp = true, .fsdp = full},
      {.name = "HYBRID_SHARD", .formula = "zero3", .use_fsdp = true, .fsdp = with({{"fsdp_sharding_strategy", "HYBRID_SHARD"}}),
       .formula_ranks = n / machines},
      {.name = "FULL_SHARD, prefetch", .formula = "zero3", .use_fsdp = true,
       .fsdp = with({{"fsdp_backward_prefetch", "BACKWARD_PRE"}, {"fsdp_forward_prefetch", "true"}})},
      {.name = "FULL_SHARD, activation checkpointing", .formula = "zero3", .use_fsdp = true,
       .fsdp = with({{"fsdp_activation_checkpointing", "true"}})},
  };
  if (machines == 1) std::erase_if(all, [](const Candidate& c) { return c.name.starts_with("HYBRID_SHARD"); });
  for (auto& c : mesh_candidates(n, full)) all.push_back(std::move(c));
  return all;
}

// The user's launch under the candidate: their FSDP keys (wrap policy, block class) stay unless it sets them.
LaunchRequest with_candidate(LaunchRequest r, const Candidate& c) {
  r.use_fsdp = c.use_fsdp;
  r.use_deepspeed = c.use_deepspeed;
  for (const auto& [k, v] : c.fsdp) r.fsdp[k] = v;
  if (!c.use_fsdp) r.fsdp.clear();
  r.deepspeed = c.deepspeed;
  r.parallelism = with_axes_settings(r.parallelism, c.parallelism);
  if (!c.mixed_precision.empty()) r.mixed_precision = c.mixed_precision;
  r.max_restarts = 0;
  return r;
}

LaunchRequest without_strategy_hints(LaunchRequest r) {
  if (!r.use_fsdp) r.fsdp.clear();
  if (!r.use_deepspeed) r.deepspeed.clear();
  return r;
}

// Two candidates that change the user's launch the same way (bf16 when the launch is bf16 already) run once.
std::string launch_key(const LaunchRequest& r) {
  std::string key = fmt::format("{}|{}|{}|", r.use_fsdp, r.use_deepspeed, r.mixed_precision.value_or(""));
  for (const auto& [k, v] : r.fsdp)
    if (!(k == "fsdp_activation_checkpointing" && v == "false")) key += k + "=" + v + ";";  // false: the default
  for (const auto& [k, v] : r.deepspeed) key += k + "=" + v + ";";
  for (const auto& [k, v] : r.parallelism) key += k + "=" + v + ";";
  return key;
}

// The launch without activation checkpointing, when it has it: the same run but for the recomputation, which can
// only make it slower (it frees activations, which the memory limit on training state does not count).
std::optional<LaunchRequest> without_recompute(LaunchRequest r) {
  const auto at = r.fsdp.find("fsdp_activation_checkpointing");
  if (at == r.fsdp.end() || at->second != "true") return std::nullopt;
  r.fsdp.erase(at);
  return r;
}

// What decides the bytes a step holds above the training state (activations, autocast copies, gathered units):
// the precision, recomputation, how tp, cp or sp split the activations, and the stages a pipeline holds (and how many of
// its micro-batches, by schedule). Strategies of the same kind differ
// by their gathered units and buckets alone.
std::string activation_kind(const LaunchRequest& r) {
  auto value = [](const std::map<std::string, std::string>& m, const std::string& key) {
    const auto at = m.find(key);
    return at == m.end() ? std::string("-") : at->second;
  };
  const std::string cp = value(r.parallelism, "parallelism_config_cp_size");  // cp and sp split the sequence alike
  return fmt::format("{}|ac {}|tp {}|sequence / {}|pp {} {}", r.mixed_precision.value_or(""),
                     value(r.fsdp, "fsdp_activation_checkpointing") == "true",
                     value(r.parallelism, "parallelism_config_tp_size"),
                     cp != "-" ? cp : value(r.parallelism, "parallelism_config_sp_size"),
                     value(r.parallelism, "parallelism_config_pp_size"),
                     r.parallelism.count("parallelism_config_pp_schedule")  // micro-batches held differ
                         ? r.parallelism.at("parallelism_config_pp_schedule")
                         : "1F1B");
}

std::string compute_kind(const LaunchRequest& r, MixedPrecision precision) {
  const auto ac = r.fsdp.find("fsdp_activation_checkpointing");
  const bool reduced = precision != MixedPrecision::NO;
  std::string kind = fmt::format("{}|ac {}|{}|", to_string(precision), ac != r.fsdp.end() && ac->second == "true",
                                 !reduced ? "" : r.use_fsdp || r.use_deepspeed ? "sharding engine" : "ddp");
  for (const auto& [k, v] : r.parallelism)
    if (k.find("_dp_") == std::string::npos) kind += k + "=" + v + ";";  // dp sizes change communication only
  return kind;
}

}  // namespace xlr8::cli
