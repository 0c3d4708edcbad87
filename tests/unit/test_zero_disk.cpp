// Offload's disk tier for the optimizer (ZeroOptions::optimizer_on_disk; src/parallel/shard/optimizer_swap.hpp):
// the optimizer's state in a real O_DIRECT swap file between steps, stepped group by group. The same arithmetic
// as in memory, so every run is compared bitwise with the same layout in memory, and with one process.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <new>
#include <set>

#include "checkpoint/optimizer_state.hpp"
#include "compat/torch_compat.hpp"
#include "os/swap_directory.hpp"
#include "parallel/group_in_memory.hpp"
#include "parallel/shard/zero_options.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/error.hpp"
#include "zero_disk_fixture.hpp"
#include "zero_fixture.hpp"

using namespace xlr8;
using namespace xlr8::testing::zero;
using xlr8::testing::run_ranks;
namespace fs = std::filesystem;

namespace {

std::string disk_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Every state tensor `optimizer` keeps for the leaves of `strategy`, by leaf and name.
std::vector<at::Tensor> state_tensors(const torch::optim::Optimizer& optimizer, ParallelStrategy& strategy) {
  std::vector<at::Tensor> out;
  for (const auto& leaf : strategy.optimizer_parameters())
    if (auto state = checkpoints::read_parameter_state(optimizer, leaf))
      for (const auto& [name, t] : state->tensors) out.push_back(t);
  return out;
}

// `steps` plain steps of `optimizer` over the strategy's model on the fixture's batches (one rank).
void step_through(ParallelStrategy& strategy, torch::optim::Optimizer& optimizer, int from, int steps) {
  auto& net = dynamic_cast<TinyNetImpl&>(*strategy.module());
  for (int s = from; s < from + steps; ++s) {
    const auto batch = global_batch(s);
    strategy.begin_step(false);
    torch::nll_loss(torch::log_softmax(net.forward(batch.x), 1), batch.y).backward();
    strategy.end_step();
    strategy.optimizer_step(optimizer);
    for (auto& group : optimizer.param_groups())  // the leaves' gradients are views of the reduced chunks
      for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
}

// Whole parameters of the two, bitwise equal.
void expect_same_parameters(ParallelStrategy& got, ParallelStrategy& want) {
  const auto a = got.state_dict(StateDictKind::FULL), b = want.state_dict(StateDictKind::FULL);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
}

// The layout the runs on disk are compared with: one process sharded over a group of one, the optimizer offloaded to
// host memory (its leaves laid out as on disk).
std::unique_ptr<ParallelStrategy> in_memory_reference() {
  auto options = stage_options(3);
  options.zero.offload_optimizer = true;
  return make_parallel_strategy(make_model(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), options);
}

// The reference in memory and the same model with its state (and shards) on disk as `disk` says, each with its AdamW.
struct BothRuns {
  explicit BothRuns(const ParallelOptions& disk)
      : reference(in_memory_reference()),
        ref_opt(reference->module()->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1)),
        strategy(make_parallel_strategy(make_model(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), disk)),
        opt(strategy->module()->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1)) {
    reference->bind_optimizer(ref_opt);
    strategy->bind_optimizer(opt);
  }
  std::unique_ptr<ParallelStrategy> reference;
  torch::optim::AdamW ref_opt;
  std::unique_ptr<ParallelStrategy> strategy;
  torch::optim::AdamW opt;
};

}  // namespace

// Stages 1-3 (stage 3's units as FULL_SHARD's transformer wrap makes them) on 1, 2 and 3 ranks, with accumulation
// and clipping: bitwise the same run as in memory, and the one-process run within float rounding. The state went
// to disk and came back every step; the swap file is gone with the model.
TEST(ZeroDisk, EveryStageOnOneTwoAndThreeRanksEqualsTheRunInMemoryBitwise) {
  const auto dir = swap_dir("stages");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05);
  for (int stage : {1, 2, 3})
    for (int ranks : {1, 2, 3}) {
      std::vector<TrainRun> in_memory(ranks);
      run_ranks(ranks, [&](Communicator& comm) {
        auto strategy = make_parallel_strategy(make_model(), comm, stage_options(stage));
        in_memory[comm.rank()] = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
      });
      run_ranks(ranks, [&](Communicator& comm) {
        const auto what = fmt::format("stage {} on {} ranks, rank {}", stage, ranks, comm.rank());
        // Read ahead and write behind on odd ranks only: both ways are the same arithmetic.
        auto strategy = make_parallel_strategy(make_model(), comm, on_disk(stage, dir, comm.rank() % 2 == 1));
        auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
        expect_same_run(got, in_memory[comm.rank()], 0.0, what);
        expect_same_run(got, expected, 2e-6, what);
        const auto disk = strategy->stats()["optimizer_on_disk"];
        ASSERT_TRUE(disk.is_object()) << what;
        EXPECT_TRUE(disk["optimizer_state_on_disk"].get<bool>()) << what;
        EXPECT_EQ(disk["swapped_steps"], 3) << what;
        // AdamW's two moments of this rank's chunk: written every step (behind the next group when pipelined, so
        // the last step's may still be on their way: bytes count once on disk), read back on the second and third.
        const int64_t steps_on_disk = comm.rank() % 2 == 1 ? 2 : 3;
        EXPECT_GE(disk["swap_bytes_written"].get<int64_t>(), steps_on_disk * disk["swap_file_bytes"].get<int64_t>())
            << what;
        EXPECT_GE(disk["swap_bytes_read"].get<int64_t>(), 2 * disk["swap_file_bytes"].get<int64_t>()) << what;
        const fs::path file = disk["swap_file"].get<std::string>();
        EXPECT_TRUE(fs::exists(file)) << what;
        strategy.reset();
        EXPECT_FALSE(fs::exists(file)) << what;
      });
    }
  fs::remove_all(dir);
}

// Stage 3 with the parameter shards on disk too, in fp32 and with bf16 parameters over fp32 masters, on 1, 2 and 3
// ranks with accumulation and clipping: bitwise the run in memory. Between steps no shard holds memory; the
// gathers and the steps read them, the steps write them.
TEST(ZeroDisk, ParametersOnDiskTooAtStageThreeOnOneTwoAndThreeRanksEqualTheRunInMemoryBitwise) {
  const auto dir = swap_dir("params");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  for (bool bf16 : {false, true})
    for (int ranks : {1, 2, 3}) {
      auto memory = stage_options(3);
      memory.zero.offload_optimizer = true;  // one process sharded over a group of one, as on disk
      auto disk = on_disk(3, dir, ranks == 2, /*params=*/true);
      if (bf16) memory.zero.param_dtype = disk.zero.param_dtype = at::kBFloat16;
      std::vector<TrainRun> in_memory(ranks);
      run_ranks(ranks, [&](Communicator& comm) {
        auto strategy = make_parallel_strategy(make_model(), comm, memory);
        in_memory[comm.rank()] = train(*strategy, comm.rank(), ranks, 3, 2, 0.05, bf16);
      });
      run_ranks(ranks, [&](Communicator& comm) {
        const auto what = fmt::format("{} on {} ranks, rank {}", bf16 ? "bf16" : "fp32", ranks, comm.rank());
        auto strategy = make_parallel_strategy(make_model(), comm, disk);
        // Reads found ahead during each optimizer step: the step reads the next group's shard while one steps.
        std::vector<int64_t> found_in_steps;
        int64_t found_before = 0;
        auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05, bf16, [&](bool after) {
          const auto found = strategy->stats()["parameters_on_disk"]["swap_reads_found_ahead"].get<int64_t>();
          if (after) found_in_steps.push_back(found - found_before);
          found_before = found;
        });
        expect_same_run(got, in_memory[comm.rank()], 0.0, what);
        // fp32: every group's shard is read in the step, all but the first while the one before steps; a bf16
        // group's shard follows its master (in memory) and is not read.
        const auto groups = strategy->stats()["offloaded_parameter_groups"].get<int64_t>();
        EXPECT_EQ(found_in_steps, std::vector<int64_t>(3, bf16 ? 0 : groups - 1)) << what;
        if (!bf16) {
          for (const auto& leaf : strategy->optimizer_parameters()) EXPECT_EQ(leaf.storage().nbytes(), 0u) << what;
        }
        const auto params = strategy->stats()["parameters_on_disk"];
        ASSERT_TRUE(params.is_object()) << what;
        // Written at prepare and after every step, read for every gather and step.
        EXPECT_GT(params["shard_writes"].get<int64_t>(), 3) << what;
        EXPECT_GT(params["shard_reads"].get<int64_t>(), params["shard_writes"].get<int64_t>()) << what;
        EXPECT_GT(params["swap_bytes_read"].get<int64_t>(), 0) << what;
        // From the second step on, the unit before each one read its shards ahead, and its gather found them coming.
        EXPECT_GT(params["swap_reads_ahead"].get<int64_t>(), 0) << what;
        EXPECT_GT(params["swap_reads_found_ahead"].get<int64_t>(), 0) << what;
      });
    }
  fs::remove_all(dir);
}

// Between steps each moment the optimizer holds is empty (on disk) and its step count is kept; a checkpoint's
// window brings every moment into memory with its values, and state written there (a load) goes to disk after.
TEST(ZeroDisk, BetweenStepsTheStateIsOnDiskAndACheckpointsWindowBringsItIn) {
  const auto dir = swap_dir("window");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  BothRuns runs(on_disk(3, dir));
  auto& [reference, ref_opt, strategy, opt] = runs;
  step_through(*reference, ref_opt, 0, 2);
  step_through(*strategy, opt, 0, 2);
  const auto held = state_tensors(opt, *strategy);
  ASSERT_FALSE(held.empty());
  for (const auto& t : held) EXPECT_EQ(t.numel(), 0);
  for (const auto& leaf : strategy->optimizer_parameters())
    if (leaf.numel() > 0) {
      EXPECT_EQ(checkpoints::read_parameter_state(opt, leaf)->counters.at("step"), 2);
    }

  strategy->optimizer_state_in_memory(opt, true);
  const auto want = state_tensors(ref_opt, *reference), got = state_tensors(opt, *strategy);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
  // A load replaces one leaf's state with the reference's: it reaches disk, and the next step reads it.
  const auto first = strategy->optimizer_parameters().front();
  checkpoints::write_parameter_state(opt, first, *checkpoints::read_parameter_state(ref_opt, reference->optimizer_parameters().front()));
  strategy->optimizer_state_in_memory(opt, false);
  for (const auto& t : state_tensors(opt, *strategy)) EXPECT_EQ(t.numel(), 0);

  step_through(*reference, ref_opt, 2, 1);
  step_through(*strategy, opt, 2, 1);
  expect_same_parameters(*strategy, *reference);
  fs::remove_all(dir);
}

// What checkpoints use (hold_in_memory): one group at a time in memory, its state and shard equal to the same run's
// in memory; held for reading, it goes back to disk unwritten (nothing written, its tensors empty again); held for
// writing, what was changed reaches disk and the next read finds it.
TEST(ZeroDisk, ACheckpointHoldsOneGroupAtATimeReadsItAsItIsAndWritesOnlyWhatItChanged) {
  const auto dir = swap_dir("held");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  // Writes waited for (no write-behind), so that the bytes written are all counted when read.
  BothRuns runs(on_disk(3, dir, /*pipelined=*/false, /*params=*/true));
  auto& [reference, ref_opt, strategy, opt] = runs;
  step_through(*reference, ref_opt, 0, 2);
  step_through(*strategy, opt, 0, 2);
  const auto leaves = strategy->optimizer_parameters(), ref_leaves = reference->optimizer_parameters();
  const auto written_before = strategy->stats()["optimizer_on_disk"]["swap_bytes_written"].get<int64_t>();
  std::set<HeldInMemory*> groups;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i].numel() == 0) continue;
    auto state = strategy->hold_in_memory(leaves[i], &opt, HoldFor::reading);
    auto values = strategy->hold_in_memory(leaves[i], nullptr, HoldFor::reading);
    ASSERT_TRUE(state && values) << i;
    groups.insert(state.get());
    const auto got = checkpoints::read_parameter_state(opt, leaves[i]);
    const auto want = checkpoints::read_parameter_state(ref_opt, ref_leaves[i]);
    for (const auto& [name, t] : want->tensors) EXPECT_TRUE(at::equal(got->tensors.at(name), t)) << i << name;
    EXPECT_TRUE(at::equal(leaves[i], ref_leaves[i])) << i;
    // Whatever is in memory now is this group's (the same handle): state, and values.
    for (size_t j = 0; j < leaves.size(); ++j) {
      if (leaves[j].numel() == 0) continue;
      if (checkpoints::read_parameter_state(opt, leaves[j])->tensors.at("exp_avg").numel() > 0) {
        EXPECT_EQ(strategy->hold_in_memory(leaves[j], &opt, HoldFor::reading), state) << i << " " << j;
      }
      if (leaves[j].storage().nbytes() > 0) {
        EXPECT_EQ(strategy->hold_in_memory(leaves[j], nullptr, HoldFor::reading), values) << i << " " << j;
      }
    }
    state->release();
    values->release();
    EXPECT_EQ(checkpoints::read_parameter_state(opt, leaves[i])->tensors.at("exp_avg").numel(), 0) << i;
    EXPECT_EQ(leaves[i].storage().nbytes(), 0u) << i;  // the shard is on disk again
  }
  EXPECT_GT(groups.size(), 1u);
  auto disk = strategy->stats()["optimizer_on_disk"];
  EXPECT_EQ(disk["swap_bytes_written"].get<int64_t>(), written_before);
  EXPECT_EQ(disk["checkpoint_groups_in_memory_most"], 1);

  // Written: the first leaf's moments doubled reach disk, and the leaf's shard keeps its (unchanged) values.
  const auto first = leaves.front();
  {
    auto held = strategy->hold_in_memory(first, &opt, HoldFor::writing);
    auto state = *checkpoints::read_parameter_state(opt, first);
    for (auto& [name, t] : state.tensors) t = t * 2;
    checkpoints::write_parameter_state(opt, first, state);
    held->release();
  }
  EXPECT_GT(strategy->stats()["optimizer_on_disk"]["swap_bytes_written"].get<int64_t>(), written_before);
  auto held = strategy->hold_in_memory(first, &opt, HoldFor::reading);
  const auto want = checkpoints::read_parameter_state(ref_opt, ref_leaves.front());
  for (const auto& [name, t] : want->tensors)
    EXPECT_TRUE(at::equal(checkpoints::read_parameter_state(opt, first)->tensors.at(name), t * 2)) << name;
  held->release();
  strategy.reset();
  fs::remove_all(dir);
}

// Parameters on disk: a sharded state dict reads every shard in, frozen ones included; the next optimizer step puts
// them all back (the trained ones it steps, the frozen ones after), so that between steps no shard stays in memory.
TEST(ZeroDisk, ShardsAShardedStateDictBroughtInGoBackToDiskWithTheNextStepFrozenOnesToo) {
  const auto dir = swap_dir("frozen");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  auto strategy = make_parallel_strategy(make_model(true, /*frozen=*/true),
                                         Communicator::in_process(xlr8::testing::unique_key(), 0, 1),
                                         on_disk(3, dir, /*pipelined=*/true, /*params=*/true));
  torch::optim::AdamW opt(strategy->module()->parameters(), torch::optim::AdamWOptions(1e-2));
  strategy->bind_optimizer(opt);
  auto shards_in_memory = [&](bool frozen) {
    int n = 0;
    const auto stats = strategy->stats();  // kept: a range over a temporary's member would dangle
    for (const auto& g : stats["groups"]) n += g["frozen"] == frozen && g["shard_on_disk"] == false;
    return n;
  };
  step_through(*strategy, opt, 0, 1);
  EXPECT_EQ(shards_in_memory(true) + shards_in_memory(false), 0);
  int frozen_groups = 0;
  const auto stats = strategy->stats();
  for (const auto& g : stats["groups"]) frozen_groups += g["frozen"] == true;
  ASSERT_GT(frozen_groups, 0);
  {
    const auto sharded = strategy->state_dict(StateDictKind::SHARDED);
    EXPECT_EQ(shards_in_memory(true), frozen_groups);
  }
  step_through(*strategy, opt, 1, 1);
  EXPECT_EQ(shards_in_memory(true), 0);
  EXPECT_EQ(shards_in_memory(false), 0);
  strategy.reset();
  fs::remove_all(dir);
}

// A rank whose shard read fails while a load's refresh gathers (its parameter swap file cut short here: a real end of
// file) still joins every group's gather, then throws; the other rank is not left waiting in one (it would wait for the
// 10 s timeout and fail with it), so load_state's agreement that follows reaches both. The root opens no guard, so its
// group stays whole after a step and the refresh reads its shard.
TEST(ZeroDisk, ARankWhoseShardReadFailsInALoadsRefreshStillJoinsEveryGather) {
  const auto dir = swap_dir("refresh");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  std::vector<std::string> errors(2);
  std::vector<int64_t> reads(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto strategy = make_parallel_strategy(make_model(/*guard_root=*/false), comm,
                                               on_disk(3, dir, /*pipelined=*/true, /*params=*/true));
        train(*strategy, comm.rank(), 2, 1);
        // Each shard read and let go: a write still behind would land after the cut and lengthen the file again.
        for (const auto& leaf : strategy->optimizer_parameters())
          if (auto held = strategy->hold_in_memory(leaf, nullptr, HoldFor::reading)) held->release();
        auto shards = [&] { return strategy->stats()["parameters_on_disk"]; };
        if (comm.rank() == 1) fs::resize_file(shards()["swap_file"].get<std::string>(), 0);
        comm.barrier();
        const auto before = shards()["shard_reads"].get<int64_t>();
        try {
          strategy->parameter_pieces_loaded();
        } catch (const Error& e) {
          errors[comm.rank()] = e.what();
        }
        reads[comm.rank()] = shards()["shard_reads"].get<int64_t>() - before;
      },
      std::chrono::seconds(10));
  EXPECT_EQ(errors[0], "");
  EXPECT_GT(reads[0], 0);  // the refresh read (and gathered) on both ranks
  EXPECT_NE(errors[1].find("end of file"), std::string::npos) << errors[1];
  fs::remove_all(dir);
}

// A load into a run whose state is already on disk (load_state mid-run) replaces it as a checkpoint does, one group
// at a time (GroupInMemory): a group held for writing goes back (taking a swap buffer more to write it) before the next
// comes in, so the four buffers of a pool without read-ahead suffice; the run then goes on as the one it was loaded from.
TEST(ZeroDisk, ALoadIntoARunWhoseStateIsOnDiskReplacesItOneGroupAtATime) {
  const auto dir = swap_dir("reload");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  BothRuns runs(on_disk(3, dir, /*pipelined=*/false, /*params=*/true));
  auto& [reference, ref_opt, strategy, opt] = runs;
  step_through(*reference, ref_opt, 0, 3);
  step_through(*strategy, opt, 0, 2);  // its own state on disk, one step behind the reference's
  const auto leaves = strategy->optimizer_parameters(), ref_leaves = reference->optimizer_parameters();
  ASSERT_EQ(leaves.size(), ref_leaves.size());
  GroupInMemory held;
  for (size_t i = 0; i < leaves.size(); ++i) {
    held.hold(*strategy, leaves[i], nullptr, HoldFor::writing);
    at::NoGradGuard no_grad;
    leaves[i].copy_(ref_leaves[i]);
  }
  held.release();
  strategy->parameter_pieces_loaded();
  for (size_t i = 0; i < leaves.size(); ++i) {
    held.hold(*strategy, leaves[i], &opt, HoldFor::writing);
    if (auto state = checkpoints::read_parameter_state(ref_opt, ref_leaves[i])) {
      checkpoints::write_parameter_state(opt, leaves[i], *state);
    }
  }
  held.release();
  EXPECT_EQ(strategy->stats()["optimizer_on_disk"]["checkpoint_groups_in_memory_most"], 1);
  for (const auto& t : state_tensors(opt, *strategy)) EXPECT_EQ(t.numel(), 0);

  step_through(*reference, ref_opt, 3, 1);
  step_through(*strategy, opt, 3, 1);
  expect_same_parameters(*strategy, *reference);
  strategy.reset();
  fs::remove_all(dir);
}

// An optimizer freed, and another bound in its place at another address (a second training phase): the first one's
// swap goes when the second is bound, its file with it; the second trains from its own state.
TEST(ZeroDisk, AFreedOptimizersSwapGoesWhenAnotherIsBound) {
  const auto dir = swap_dir("freed");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  auto optimizer_files = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().rfind("xlr8-optimizer-", 0) == 0;
    return n;
  };
  auto comm = Communicator::in_process(xlr8::testing::unique_key(), 0, 1);
  auto strategy = make_parallel_strategy(make_model(), comm, on_disk(3, dir));
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto first = std::make_unique<torch::optim::AdamW>(strategy->module()->parameters(), options);
  strategy->bind_optimizer(*first);
  step_through(*strategy, *first, 0, 2);
  EXPECT_EQ(optimizer_files(), 1u);
  auto second = std::make_unique<torch::optim::AdamW>(strategy->module()->parameters(), options);  // elsewhere
  strategy->bind_optimizer(*second);
  EXPECT_EQ(optimizer_files(), 2u);  // the first is alive: its swap stays
  const auto both = strategy->stats()["optimizer_on_disk"];  // both swaps, as one
  EXPECT_EQ(both["optimizers"], 2) << both;
  EXPECT_EQ(both["swap_files"].size(), 2u) << both;
  EXPECT_EQ(both["swapped_steps"], 2) << both;  // the first's two, none yet of the second
  EXPECT_EQ(both["swap_file_bytes"].get<int64_t>(), 2 * fs::file_size(both["swap_file"].get<std::string>())) << both;
  first.reset();
  strategy->bind_optimizer(*second);  // bound again: keeps its own swap, and the freed one's goes
  EXPECT_EQ(optimizer_files(), 1u);
  step_through(*strategy, *second, 2, 1);
  for (const auto& t : state_tensors(*second, *strategy)) EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(strategy->stats()["optimizer_on_disk"]["swapped_steps"], 1);
  // A live optimizer whose state is replaced outside its swap (cleared here) looks freed when a third is bound: its
  // swap goes, and its next step makes one again, its state back on disk after it.
  second->state().clear();
  torch::optim::AdamW third(strategy->module()->parameters(), options);
  strategy->bind_optimizer(third);
  step_through(*strategy, *second, 3, 1);
  const auto held = state_tensors(*second, *strategy);
  EXPECT_FALSE(held.empty());
  for (const auto& t : held) EXPECT_EQ(t.numel(), 0);
  strategy.reset();
  fs::remove_all(dir);
}

// An optimizer made where a freed one lived (the same address) and bound to the same model is another optimizer: its
// state gets a swap of its own (SGD's momentum, not the AdamW moments the first laid out), on disk between steps, and
// the run equals the same sequence in memory.
TEST(ZeroDisk, AnOptimizerMadeAtAFreedOnesAddressSwapsItsOwnState) {
  const auto dir = swap_dir("again");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  auto reference = in_memory_reference();
  auto comm2 = Communicator::in_process(xlr8::testing::unique_key(), 0, 1);
  auto strategy = make_parallel_strategy(make_model(), comm2, on_disk(3, dir));
  using torch::optim::AdamW, torch::optim::SGD;
  const auto adamw = [](ParallelStrategy& s) { return AdamW(s.module()->parameters(), torch::optim::AdamWOptions(1e-2)); };
  const auto sgd = [](ParallelStrategy& s) { return SGD(s.module()->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)); };
  {
    auto first = adamw(*reference);
    reference->bind_optimizer(first);
    step_through(*reference, first, 0, 1);
  }
  auto then = sgd(*reference);
  reference->bind_optimizer(then);
  step_through(*reference, then, 1, 2);

  alignas(AdamW) alignas(SGD) std::byte place[std::max(sizeof(AdamW), sizeof(SGD))];
  auto* first = new (place) AdamW(adamw(*strategy));
  strategy->bind_optimizer(*first);
  step_through(*strategy, *first, 0, 1);
  first->~AdamW();
  auto* second = new (place) SGD(sgd(*strategy));
  strategy->bind_optimizer(*second);
  step_through(*strategy, *second, 1, 2);
  const auto held = state_tensors(*second, *strategy);
  EXPECT_FALSE(held.empty());
  for (const auto& t : held) EXPECT_EQ(t.numel(), 0);  // the momentum is on disk
  expect_same_parameters(*strategy, *reference);
  second->~SGD();
  fs::remove_all(dir);
}

// SGD's momentum and Adam's amsgrad maximum are swapped like AdamW's moments; SGD without momentum keeps no state
// and needs no file.
TEST(ZeroDisk, EveryStateTheOptimizerKeepsIsSwappedAndNoStateNeedsNoFile) {
  const auto dir = swap_dir("kinds");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  const std::vector<std::tuple<std::string, Factory, size_t>> kinds{
      {"sgd with momentum",
       [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }, 1},
      {"adam with amsgrad",
       [](auto p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).amsgrad(true)); }, 3},
      {"sgd", [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)); }, 0}};
  for (const auto& [what, make, names] : kinds) {
    std::vector<StateDict> params;
    for (bool disk : {false, true}) {
      auto comm = Communicator::in_process(xlr8::testing::unique_key(), 0, 1);
      auto strategy = make_parallel_strategy(make_model(), comm, disk ? on_disk(2, dir) : stage_options(2));
      auto opt = make(strategy->module()->parameters());
      strategy->bind_optimizer(*opt);
      EXPECT_EQ(checkpoints::kept_state_names(*opt).size(), names) << what;
      step_through(*strategy, *opt, 0, 3);
      params.push_back(strategy->state_dict(StateDictKind::FULL));
      if (disk) {
        EXPECT_EQ(strategy->stats()["optimizer_on_disk"]["optimizer_state_on_disk"], names > 0) << what;
      }
    }
    for (size_t i = 0; i < params[0].size(); ++i)
      EXPECT_TRUE(at::equal(params[0][i].second, params[1][i].second)) << what << " " << params[0][i].first;
  }
  fs::remove_all(dir);
}

// A swap file nobody holds was left by a process that died: the next claim removes it. One a live process holds
// (locked) stays. An nvme_path that cannot be a directory fails when the optimizer is prepared, naming it.
TEST(ZeroDisk, StaleSwapFilesAreRemovedLiveOnesKeptAndABadPathFailsAtPrepare) {
  const auto dir = swap_dir("stale");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  const auto stale = dir / "xlr8-optimizer-999999-0.swap", live = dir / "xlr8-optimizer-999998-0.swap";
  std::ofstream(stale) << std::string(8192, 'x');
  std::ofstream(live) << "held";
  const int held = ::open(live.c_str(), O_RDONLY);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  {
    auto comm = Communicator::in_process(xlr8::testing::unique_key(), 0, 1);
    auto strategy = make_parallel_strategy(make_model(), comm, on_disk(3, dir));
    torch::optim::AdamW opt(strategy->module()->parameters());
    strategy->bind_optimizer(opt);
    EXPECT_FALSE(fs::exists(stale));
    EXPECT_TRUE(fs::exists(live));
    EXPECT_EQ(strategy->stats()["optimizer_on_disk"]["stale_swap_files_removed"], 1);
  }
  ::close(held);
  const auto file = dir / "a-file";
  std::ofstream(file) << "not a directory";
  auto comm = Communicator::in_process(xlr8::testing::unique_key(), 0, 1);
  auto strategy = make_parallel_strategy(make_model(), comm, on_disk(3, file / "swap"));
  torch::optim::AdamW opt(strategy->module()->parameters());
  const auto error = disk_error_of([&] { strategy->bind_optimizer(opt); });
  EXPECT_NE(error.find("cannot create the nvme_path directory " + (file / "swap").string()), std::string::npos) << error;
  fs::remove_all(dir);
}

// A swap directory other machines may share (a network file system, where flock may be each client's own): only this
// machine's stale files are removed, by the host name in their names; another machine's unlocked one is left to it.
// The same files on a local directory are all judged. This machine's /tmp-like directory is not a network one.
TEST(ZeroDisk, OnASharedSwapDirectoryOnlyThisMachinesStaleFilesAreRemoved) {
  const auto dir = swap_dir("shared");
  fs::create_directories(dir);
  if (const auto network = os::network_file_system(dir); !network.empty())
    GTEST_SKIP() << dir << " is on " << network << ": its stale files would be judged as shared ones";
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  const auto mine = dir / fmt::format("xlr8-optimizer-999999-0-0@{}.swap", host);
  const auto theirs = dir / "xlr8-optimizer-999999-0-0@another-machine.swap";
  const auto unnamed = dir / "xlr8-optimizer-999997-0.swap";  // an older run's name, without its host
  for (const auto& f : {mine, theirs, unnamed}) std::ofstream(f) << "left";
  {
    const os::SwapDirectoryClaim claim(dir, 5, /*shared=*/true);
    EXPECT_EQ(claim.removed(), std::vector<fs::path>{mine});
    EXPECT_TRUE(claim.new_file("optimizer").filename().string().ends_with(fmt::format("@{}.swap", host)));
  }
  EXPECT_FALSE(fs::exists(mine));
  EXPECT_TRUE(fs::exists(theirs) && fs::exists(unnamed));
  const os::SwapDirectoryClaim local(dir, 5);  // a local directory (the default here): every file judged
  EXPECT_EQ(local.removed().size(), 2u);
  fs::remove_all(dir);
}

// DeepSpeed's JSON: offload_optimizer nvme with its buffers and the aio section become the options; what cannot
// run is one ConfigError naming the key. Accelerate's keys reach the same options.
TEST(ZeroDiskConfig, DeepSpeedsNvmeSectionsAndAccelerateKeysMapOntoTheOptions) {
  auto parse = [](const std::string& json) { return deepspeed::parse_config(nlohmann::json::parse(json)); };
  auto config = parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/d",
                          "buffer_count": 6, "pipeline_read": true, "pipeline_write": true}},
                          "aio": {"block_size": 2097152, "queue_depth": 16, "thread_count": 3, "single_submit": true,
                          "overlap_events": false}})");
  ParallelOptions parallel;
  shard::apply_zero_config(config.zero_optimization, parallel);
  const auto& disk = parallel.zero.optimizer_on_disk;
  EXPECT_EQ(disk.path, "/d");
  EXPECT_EQ(disk.buffer_count, 6);
  EXPECT_TRUE(disk.read_ahead && disk.write_behind);
  EXPECT_EQ(disk.aio_block_size, 2097152);
  EXPECT_EQ(disk.aio_threads, 3);  // thread_count, intra_op_parallelism's old name
  EXPECT_TRUE(parallel.zero.offload_optimizer);
  const std::vector<std::pair<std::string, std::string>> refused{
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})", "nvme_path"},
      {R"({"aio": {"use_gds": true}})", "GPUDirect Storage is not supported"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size"},
      {R"({"aio": {"thread_count": 1000000}})", "1000000 must be 1 to 1024"},  // it hung the machine
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})",
       "offload_optimizer.ratio 1.5 must be above 0 and at most 1"},  // accepted, silently, with device cpu
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/d", "ratio": 0.5}}})",
       "offload_optimizer.ratio is 0.5 with device \"nvme\""},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})", "nvme_path"}};
  for (const auto& [json, needle] : refused) {
    const auto error = disk_error_of([&] {
      ParallelOptions p;
      shard::apply_zero_config(parse(json).zero_optimization, p);
    });
    EXPECT_NE(error.find(needle), std::string::npos) << json << "\n" << error;
  }
  auto both = parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/p",
                        "buffer_count": 7}, "offload_optimizer": {"device": "nvme", "nvme_path": "/o"}}})");
  ParallelOptions with_params;
  shard::apply_zero_config(both.zero_optimization, with_params);
  EXPECT_EQ(with_params.zero.params_on_disk.path, "/p");
  EXPECT_EQ(with_params.zero.params_on_disk.buffer_count, 7);
  EXPECT_EQ(with_params.zero.optimizer_on_disk.path, "/o");
  Settings settings;
  settings.deepspeed.emplace();
  settings.deepspeed->zero_stage = 2;
  settings.deepspeed->offload_optimizer_device = "nvme";
  EXPECT_NE(disk_error_of([&] { shard::resolve_zero_options({}, settings, 1); }).find("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"),
            std::string::npos);
  settings.deepspeed->offload_optimizer_nvme_path = "/nvme2";
  const auto resolved = shard::resolve_zero_options({}, settings, 1, /*parameters_in_host_memory=*/true);
  EXPECT_EQ(resolved.optimizer_on_disk.path, "/nvme2");  // on a CPU the disk tier stays; host offload has no meaning
  EXPECT_FALSE(resolved.offload_optimizer);
  settings.deepspeed->offload_param_device = "nvme";
  EXPECT_NE(disk_error_of([&] { shard::resolve_zero_options({}, settings, 1); }).find("offload_param_nvme_path"),
            std::string::npos);
  settings.deepspeed->offload_param_nvme_path = "/nvme";
  EXPECT_NE(disk_error_of([&] { shard::resolve_zero_options({}, settings, 1); }).find("offload_param device nvme at ZeRO stage 2"),
            std::string::npos);
  settings.deepspeed->zero_stage = 3;
  EXPECT_EQ(shard::resolve_zero_options({}, settings, 1).params_on_disk.path, "/nvme");
  settings.deepspeed->offload_optimizer_device = "cpu";
  EXPECT_NE(disk_error_of([&] { shard::resolve_zero_options({}, settings, 1); })
                .find("offload_param device nvme without offload_optimizer device nvme"),
            std::string::npos);
  settings.deepspeed->offload_param_device = "none";
  settings.deepspeed->offload_optimizer_device = "nvme";
  settings.deepspeed->zero_stage = 0;
  EXPECT_NE(disk_error_of([&] { shard::resolve_zero_options({}, settings, 1); }).find("at ZeRO stage 0"), std::string::npos);
  // A CPU run (parameters in host memory: nothing to offload) refuses what a GPU's would: parameters below stage 3.
  settings.deepspeed->zero_stage = 2;
  settings.deepspeed->offload_optimizer_device = "none";
  settings.deepspeed->offload_param_device = "cpu";
  EXPECT_NE(disk_error_of([&] { shard::resolve_zero_options({}, settings, 1, /*parameters_in_host_memory=*/true); })
                .find("offloading parameters needs ZeRO stage 3 (FULL_SHARD); stage 2"),
            std::string::npos);
  settings.deepspeed->offload_param_device = "none";
  settings.deepspeed->offload_optimizer_device = "nvme";
  // With a JSON, its own devices win over the launch's: a "none" there stayed none only in the log before.
  settings.deepspeed->zero_stage = 3;
  const auto json_none = parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}})");
  const auto with_json = shard::resolve_parallel_options({}, &json_none.zero_optimization, settings, 1, false);
  EXPECT_FALSE(with_json.zero.optimizer_on_disk.enabled());
  EXPECT_FALSE(with_json.zero.offload_optimizer);
  const auto without_json = shard::resolve_parallel_options({}, nullptr, settings, 1, false);
  EXPECT_TRUE(without_json.zero.optimizer_on_disk.enabled());  // the launch decides when there is no JSON
}
