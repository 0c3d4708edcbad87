// xlr8 advise's candidates and the keys it derives from a launch under each (tools/cli/advise_candidates.hpp):
// which launches are the same, and which share their forward and backward arithmetic (the bound that keeps a
// candidate from being launched) or their activations (the peak prediction).
#include <gtest/gtest.h>

#include <algorithm>

#include "cli/advise_candidates.hpp"

using namespace xlr8;
using namespace xlr8::cli;

namespace {

const Candidate& named(const std::vector<Candidate>& all, const std::string& name) {
  const auto at = std::find_if(all.begin(), all.end(), [&](const Candidate& c) { return c.name == name; });
  if (at == all.end()) throw std::runtime_error("no candidate " + name);
  return *at;
}

// The user's launch (fp32 unless `mixed` says otherwise) under a candidate.
LaunchRequest under(const std::vector<Candidate>& all, const std::string& name, const std::string& mixed = "") {
  LaunchRequest user;
  if (!mixed.empty()) user.mixed_precision = mixed;
  user.fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP";
  return with_candidate(user, named(all, name));
}

MixedPrecision precision_of(const LaunchRequest& r) {
  return r.mixed_precision ? parse_mixed_precision(*r.mixed_precision, "test") : MixedPrecision::NO;
}

std::string compute_of(const std::vector<Candidate>& all, const std::string& name, const std::string& mixed = "") {
  const auto r = under(all, name, mixed);
  return compute_kind(r, precision_of(r));
}

}  // namespace

TEST(AdviseCandidates, HybridShardOnlyWithSeveralMachinesAndTheMeshOnesOnAnEvenCount) {
  auto names = [](const std::vector<Candidate>& all) {
    std::vector<std::string> out;
    for (const auto& c : all) out.push_back(c.name);
    return out;
  };
  const auto one = names(candidates(2, 1));
  EXPECT_EQ(std::count_if(one.begin(), one.end(), [](const std::string& n) { return n.starts_with("HYBRID"); }), 0);
  EXPECT_NE(std::find(one.begin(), one.end(), "tp 2, bf16"), one.end());
  EXPECT_EQ(std::find(one.begin(), one.end(), "FULL_SHARD x tp 2, bf16"), one.end());  // from 4 processes
  const auto two = names(candidates(4, 2));
  EXPECT_NE(std::find(two.begin(), two.end(), "HYBRID_SHARD, bf16"), two.end());
  EXPECT_NE(std::find(two.begin(), two.end(), "FULL_SHARD x tp 2, bf16"), two.end());
  EXPECT_NE(std::find(one.begin(), one.end(), "pp 2, zero-bubble, bf16"), one.end());
  const auto odd = names(candidates(3, 1));
  EXPECT_EQ(std::find(odd.begin(), odd.end(), "tp 2, bf16"), odd.end());
}

TEST(AdviseCandidates, LaunchKeysAreEqualExactlyWhenTheLaunchesAre) {
  const auto all = candidates(2, 1);
  // A launch in bf16 already: FULL_SHARD is FULL_SHARD in bf16.
  EXPECT_EQ(launch_key(under(all, "FULL_SHARD (ZeRO-3)", "bf16")), launch_key(under(all, "FULL_SHARD, bf16", "bf16")));
  EXPECT_NE(launch_key(under(all, "FULL_SHARD (ZeRO-3)")), launch_key(under(all, "FULL_SHARD, bf16")));
  EXPECT_NE(launch_key(under(all, "FULL_SHARD (ZeRO-3)")), launch_key(under(all, "FULL_SHARD, prefetch")));
  // Recomputation off is the default: the same launch as without the key.
  auto off = under(all, "FULL_SHARD (ZeRO-3)");
  off.fsdp["fsdp_activation_checkpointing"] = "false";
  EXPECT_EQ(launch_key(off), launch_key(under(all, "FULL_SHARD (ZeRO-3)")));
  const auto base = without_recompute(under(all, "FULL_SHARD, activation checkpointing"));
  ASSERT_TRUE(base.has_value());
  EXPECT_EQ(launch_key(*base), launch_key(under(all, "FULL_SHARD (ZeRO-3)")));
  EXPECT_FALSE(without_recompute(under(all, "FULL_SHARD (ZeRO-3)")).has_value());
}

TEST(AdviseCandidates, OneComputeKindForStrategiesThatDoTheSameArithmeticAndOnlyThem) {
  const auto all = candidates(4, 2);
  // fp32: every data-parallel strategy computes the same forward and backward.
  const auto fp32 = compute_of(all, "DDP");
  for (const char* name : {"ZeRO-1", "SHARD_GRAD_OP (ZeRO-2)", "FULL_SHARD (ZeRO-3)", "FULL_SHARD, prefetch", "HYBRID_SHARD"})
    EXPECT_EQ(compute_of(all, name), fp32) << name;
  EXPECT_NE(compute_of(all, "FULL_SHARD, activation checkpointing"), fp32);  // recomputes
  EXPECT_NE(compute_of(all, "DDP, bf16"), fp32);
  // bf16: the sharding engine may compute in bf16 parameters where DDP keeps fp32 ones under autocast.
  EXPECT_NE(compute_of(all, "DDP, bf16"), compute_of(all, "FULL_SHARD, bf16"));
  EXPECT_EQ(compute_of(all, "FULL_SHARD, bf16"), compute_of(all, "HYBRID_SHARD, bf16"));
  // A launch in bf16 already: the precision in effect decides, not the flag's spelling.
  EXPECT_EQ(compute_of(all, "FULL_SHARD (ZeRO-3)", "bf16"), compute_of(all, "FULL_SHARD, bf16"));
  // tp, cp and sp change the arithmetic, and the ring and the all-gather do different work.
  EXPECT_NE(compute_of(all, "cp 2 (ring), FULL_SHARD, bf16"), compute_of(all, "sp 2 (Ulysses), FULL_SHARD, bf16"));
  EXPECT_NE(compute_of(all, "cp 2 (ring), FULL_SHARD, bf16"), compute_of(all, "FULL_SHARD, bf16"));
  auto allgather = under(all, "cp 2 (ring), FULL_SHARD, bf16");
  allgather.parallelism["parallelism_config_cp_comm_strategy"] = "allgather";
  EXPECT_NE(compute_kind(allgather, MixedPrecision::BF16), compute_of(all, "cp 2 (ring), FULL_SHARD, bf16"));
  // How the data-parallel ranks are laid out beside tp changes only communication.
  auto replicated = under(all, "tp 2, bf16");
  auto sharded = replicated;
  sharded.parallelism.erase("parallelism_config_dp_replicate_size");
  sharded.parallelism["parallelism_config_dp_shard_size"] = "2";
  EXPECT_EQ(compute_kind(replicated, MixedPrecision::NO), compute_kind(sharded, MixedPrecision::NO));
  EXPECT_NE(compute_kind(replicated, MixedPrecision::NO), fp32);
}

TEST(AdviseCandidates, ContextAndSequenceParallelismOfOneSizeHoldTheSameActivations) {
  const auto all = candidates(2, 1);
  EXPECT_EQ(activation_kind(under(all, "cp 2 (ring), FULL_SHARD, bf16")),
            activation_kind(under(all, "sp 2 (Ulysses), FULL_SHARD, bf16")));
  EXPECT_EQ(activation_kind(under(all, "DDP, bf16")), activation_kind(under(all, "FULL_SHARD, bf16")));
  EXPECT_NE(activation_kind(under(all, "DDP")), activation_kind(under(all, "DDP, bf16")));
  EXPECT_NE(activation_kind(under(all, "tp 2, bf16")), activation_kind(under(all, "FULL_SHARD, bf16")));
  // A pipeline's schedule decides how many micro-batches a stage holds; its launches differ too.
  EXPECT_NE(activation_kind(under(all, "pp 2, bf16")), activation_kind(under(all, "pp 2, zero-bubble, bf16")));
  EXPECT_NE(launch_key(under(all, "pp 2, bf16")), launch_key(under(all, "pp 2, zero-bubble, bf16")));
}

// The user's settings of an axis stay under the candidates that split over it (a pipeline's micro-batches and schedule,
// tp's head size), unless the candidate sets them itself; the sizes are the candidate's, and the other candidates take
// none of them.
TEST(AdviseCandidates, TheUsersSettingsOfAnAxisStayUnderTheCandidatesThatUseIt) {
  const auto all = candidates(4, 1);
  LaunchRequest user;
  user.parallelism = {{"parallelism_config_pp_size", "4"},
                      {"parallelism_config_pp_microbatches", "8"},
                      {"parallelism_config_pp_schedule", "GPipe"},
                      {"parallelism_config_tp_head_dim", "64"}};
  const auto pp = with_candidate(user, named(all, "pp 2, bf16")).parallelism;
  EXPECT_EQ(pp.at("parallelism_config_pp_size"), "2");
  EXPECT_EQ(pp.at("parallelism_config_pp_microbatches"), "8");
  EXPECT_EQ(pp.at("parallelism_config_pp_schedule"), "GPipe");
  EXPECT_FALSE(pp.count("parallelism_config_tp_head_dim"));
  const auto zero_bubble = with_candidate(user, named(all, "pp 2, zero-bubble, bf16")).parallelism;
  EXPECT_EQ(zero_bubble.at("parallelism_config_pp_schedule"), "InterleavedZeroBubble");
  EXPECT_EQ(zero_bubble.at("parallelism_config_pp_microbatches"), "8");
  const auto tp = with_candidate(user, named(all, "tp 2, bf16")).parallelism;
  EXPECT_EQ(tp.at("parallelism_config_tp_head_dim"), "64");
  EXPECT_FALSE(tp.count("parallelism_config_pp_microbatches"));
  EXPECT_FALSE(tp.count("parallelism_config_pp_size"));
  EXPECT_TRUE(with_candidate(user, named(all, "DDP")).parallelism.empty());
  // Micro-batches that are no multiple of the candidate's 2 stages (an interleaved schedule takes them in groups of
  // the stage count) give way to the candidate's default.
  user.parallelism["parallelism_config_pp_microbatches"] = "9";
  const auto odd = with_candidate(user, named(all, "pp 2, zero-bubble, bf16")).parallelism;
  EXPECT_FALSE(odd.count("parallelism_config_pp_microbatches"));
  EXPECT_EQ(odd.at("parallelism_config_pp_schedule"), "InterleavedZeroBubble");
}
