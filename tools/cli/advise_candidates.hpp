#pragma once
// The strategies `xlr8 advise` tries (cmd_advise.cpp), and what each makes of the user's launch.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/launcher.hpp"

namespace xlr8::cli {

// One strategy to try: the flags it adds to the user's launch, and its static-memory formula.
struct Candidate {
  std::string name, formula;  // formula: ddp, zero1, zero2, zero3 (memory_formulas.hpp)
  bool use_fsdp = false, use_deepspeed = false;
  std::map<std::string, std::string> fsdp, deepspeed;
  std::string mixed_precision;  // empty: the launch's
  std::map<std::string, std::string> parallelism;  // the mesh (parallelism_config keys); empty: none
  int tp = 1;                    // > 1: AutoTP must split the model (the first run tells)
  bool needs_attention = false;  // cp / sp: the model's attention must go through xlr8::attention
  int pp = 1;                    // > 1: a Sequential the program steps through pipeline_step (the runs tell)
  int formula_ranks = 0;         // the ranks the formula shares state over (0: all)
};

// n processes over `machines` machines, likely fastest first (the least memory-hungry leads).
std::vector<Candidate> candidates(int n, int machines);
// The user's launch under the candidate: their FSDP keys (wrap policy, block class) stay unless it sets them.
LaunchRequest with_candidate(LaunchRequest r, const Candidate& c);
// The user's launch without the strategy flags it gives only as the candidates' hints (--fsdp_* without
// --use_fsdp): what advise plans as its base, which a strategy's flag on another strategy's launch would stop.
LaunchRequest without_strategy_hints(LaunchRequest r);
// Two candidates that change the user's launch the same way (bf16 when the launch is bf16 already) run once.
std::string launch_key(const LaunchRequest& r);
// The launch without activation checkpointing, when it has it.
std::optional<LaunchRequest> without_recompute(LaunchRequest r);
// What decides the bytes a step holds above the training state: precision, recomputation, tp/cp/sp split.
std::string activation_kind(const LaunchRequest& r);
// What decides a step's forward and backward arithmetic per rank: the precision, recomputation, the tp/cp/sp
// split (with cp's strategy), and under reduced precision whether the sharding engine runs it (its parameters
// may compute in that precision, DDP's in fp32 under autocast). The strategies of one compute kind differ by
// their communication and how much optimizer state each rank steps. `precision`: the launch's, in effect (a
// config file may set it without the flag).
std::string compute_kind(const LaunchRequest& r, MixedPrecision precision);

}  // namespace xlr8::cli
