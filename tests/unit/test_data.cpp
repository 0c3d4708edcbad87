// BatchSamplerShard against Accelerate's published golden vectors (Accelerate's tests/test_data_loader.py),
// split_between_processes, the loader's epochs/resume, to_device, and gather_for_metrics' remainder.
#include <gtest/gtest.h>

#include <torch/cuda.h>

#include <numeric>

#include "xlr8/batch_sharding.hpp"
#include "xlr8/data_loader.hpp"

using namespace xlr8;
using Batches = std::vector<std::vector<int64_t>>;

namespace {

std::vector<int64_t> range(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

Batches shard_of(int64_t n, int64_t b, int rank, bool split = false, bool even = true, bool drop_last = false) {
  ShardingOptions o;
  o.batch_size = b;
  o.num_processes = 2;
  o.process_index = rank;
  o.split_batches = split;
  o.even_batches = even;
  o.drop_last = drop_last;
  return shard_batches(range(n), o);
}

}  // namespace

TEST(BatchSharding, NoSplitGoldenVectors) {
  EXPECT_EQ(shard_of(24, 3, 0), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}));
  EXPECT_EQ(shard_of(24, 3, 1), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}));
  EXPECT_EQ(shard_of(21, 3, 0), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}));
  EXPECT_EQ(shard_of(21, 3, 1), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {0, 1, 2}}));
  EXPECT_EQ(shard_of(22, 3, 0), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}));
  EXPECT_EQ(shard_of(22, 3, 1), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 0, 1}}));
  EXPECT_EQ(shard_of(20, 3, 0), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 0}}));
  EXPECT_EQ(shard_of(20, 3, 1), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {1, 2, 3}}));
  EXPECT_EQ(shard_of(2, 3, 0), (Batches{{0, 1, 0}}));
  EXPECT_EQ(shard_of(2, 3, 1), (Batches{{1, 0, 1}}));
}

TEST(BatchSharding, DropLastGoldenVectors) {
  for (int64_t n : {20, 21, 22}) {
    EXPECT_EQ(shard_of(n, 3, 0, false, true, true), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}})) << n;
    EXPECT_EQ(shard_of(n, 3, 1, false, true, true), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}})) << n;
  }
  EXPECT_EQ(shard_of(24, 3, 1, false, true, true).size(), 4u);
}

TEST(BatchSharding, UnevenBatchesGoldenVectors) {
  EXPECT_EQ(shard_of(22, 3, 0, false, false), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}));
  EXPECT_EQ(shard_of(22, 3, 1, false, false), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21}}));
  EXPECT_EQ(shard_of(20, 3, 0, false, false), (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19}}));
  EXPECT_EQ(shard_of(20, 3, 1, false, false), (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}));
  EXPECT_EQ(shard_of(2, 3, 0, false, false), (Batches{{0, 1}}));
  EXPECT_EQ(shard_of(2, 3, 1, false, false), (Batches{}));
}

TEST(BatchSharding, SplitBatchesGoldenVectors) {
  EXPECT_EQ(shard_of(24, 4, 0, true), (Batches{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}));
  EXPECT_EQ(shard_of(24, 4, 1, true), (Batches{{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}));
  EXPECT_EQ(shard_of(22, 4, 0, true).back(), (std::vector<int64_t>{20, 21}));
  EXPECT_EQ(shard_of(22, 4, 1, true).back(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(shard_of(21, 4, 0, true).back(), (std::vector<int64_t>{20, 0}));
  EXPECT_EQ(shard_of(21, 4, 1, true).back(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(shard_of(21, 4, 0, true, false).back(), (std::vector<int64_t>{20}));
  EXPECT_EQ(shard_of(21, 4, 1, true, false).size(), 5u);
  EXPECT_EQ(shard_of(2, 4, 0, true), (Batches{{0, 1}}));
  EXPECT_EQ(shard_of(2, 4, 1, true), (Batches{{0, 1}}));
  EXPECT_EQ(shard_of(2, 4, 1, true, false), (Batches{}));
}

// `xlr8 verify`'s third run: one process yields, round by round, what 2 ranks would, rank 0's share first.
TEST(BatchSharding, MicroBatchesAreEachRoundsRankSharesInRankOrder) {
  ShardingOptions one;
  one.batch_size = 4;
  one.split_batches = true;
  one.micro_batches = 2;
  EXPECT_EQ(shard_batches(range(8), one), (Batches{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  for (bool split : {true, false})
    for (bool even : {true, false})
      for (int64_t n : {2, 21, 22, 24}) {
        one.split_batches = split, one.even_batches = even;
        const auto r0 = shard_of(n, 4, 0, split, even), r1 = shard_of(n, 4, 1, split, even);
        Batches interleaved;
        for (size_t i = 0; i < r0.size(); ++i) {
          interleaved.push_back(r0[i]);
          if (i < r1.size()) interleaved.push_back(r1[i]);
        }
        EXPECT_EQ(shard_batches(range(n), one), interleaved) << n << (split ? " split" : "") << (even ? " even" : "");
      }
}

TEST(BatchSharding, RemainderAndSplitRange) {
  ShardingOptions o;
  o.batch_size = 3;
  o.num_processes = 2;
  EXPECT_EQ(padding_remainder(22, o), 4);
  EXPECT_EQ(padding_remainder(24, o), 0);
  o.drop_last = true;
  EXPECT_EQ(padding_remainder(22, o), 0);
  EXPECT_EQ(split_range(10, 3, 0), (std::pair<int64_t, int64_t>{0, 4}));
  EXPECT_EQ(split_range(10, 3, 1), (std::pair<int64_t, int64_t>{4, 7}));
  EXPECT_EQ(split_range(10, 3, 2), (std::pair<int64_t, int64_t>{7, 10}));
}

namespace {
struct Numbers {  // the minimal size()+get(i) dataset interface
  int64_t n;
  size_t size() const { return static_cast<size_t>(n); }
  at::Tensor get(size_t i) const { return at::full({1}, static_cast<int64_t>(i), at::kLong); }
};

std::vector<int64_t> flatten(DataLoader<Numbers>& loader, int64_t limit = -1) {
  std::vector<int64_t> seen;
  for (auto& batch : loader) {
    for (int64_t i = 0; i < batch.size(0); ++i) seen.push_back(batch[i][0].item<int64_t>());
    if (--limit == 0) break;
  }
  return seen;
}
}  // namespace

// Expected: Accelerate 1.16's SeedableRandomSampler(range(10), data_seed=42) after set_epoch(0) and set_epoch(1).
TEST(DataLoader, ShuffleIsAcceleratesSeedableSamplerOrderForTheSameSeed) {
  ShardingOptions single;
  single.num_processes = 1;
  DataLoader<Numbers> loader(Numbers{10}, {.batch_size = 10, .shuffle = true, .seed = 42}, single, 0, nullptr, at::kCPU);
  EXPECT_EQ(flatten(loader), (std::vector<int64_t>{2, 6, 1, 8, 4, 5, 0, 9, 3, 7}));
  EXPECT_EQ(flatten(loader), (std::vector<int64_t>{8, 4, 9, 0, 5, 1, 6, 7, 2, 3}));
}

TEST(DataLoader, ShuffleIsOneOrderForAnyNumberOfProcessesAndEpochsDiffer) {
  ShardingOptions single;
  single.num_processes = 1;
  DataLoader<Numbers> one(Numbers{24}, {.batch_size = 4, .shuffle = true, .seed = 7}, single, 0, nullptr, at::kCPU);
  auto order = flatten(one);
  std::vector<int64_t> merged;
  std::vector<std::vector<int64_t>> per_rank;
  for (int r = 0; r < 2; ++r) {
    ShardingOptions s;
    s.num_processes = 2;
    s.process_index = r;
    DataLoader<Numbers> part(Numbers{24}, {.batch_size = 2, .shuffle = true, .num_workers = 2, .seed = 7}, s, 0, nullptr,
                             at::kCPU);
    per_rank.push_back(flatten(part));
  }
  // Round i of 2 ranks x batch 2 holds exactly global batch i of 1 rank x batch 4.
  for (size_t i = 0; i < per_rank[0].size(); i += 2)
    for (int r = 0; r < 2; ++r) merged.insert(merged.end(), per_rank[r].begin() + i, per_rank[r].begin() + i + 2);
  EXPECT_EQ(merged, order);
  EXPECT_EQ(one.epoch(), 1);
  auto second = flatten(one);
  EXPECT_NE(second, order);  // a new epoch reshuffles
  std::sort(second.begin(), second.end());
  EXPECT_EQ(second, range(24));
}

TEST(DataLoader, ResumeContinuesTheExactBatchSequence) {
  ShardingOptions s;
  DataLoader<Numbers> full(Numbers{30}, {.batch_size = 4, .shuffle = true, .seed = 3}, s, 0, nullptr, at::kCPU);
  auto expected = flatten(full);
  DataLoader<Numbers> first(Numbers{30}, {.batch_size = 4, .shuffle = true, .seed = 3}, s, 0, nullptr, at::kCPU);
  auto head = flatten(first, 3);  // stop after 3 batches
  auto saved = first.state();
  EXPECT_EQ(saved["position"], 3);
  DataLoader<Numbers> resumed(Numbers{30}, {.batch_size = 4, .shuffle = true, .seed = 3}, s, 0, nullptr, at::kCPU);
  resumed.load_state(saved);
  auto tail = flatten(resumed);
  head.insert(head.end(), tail.begin(), tail.end());
  EXPECT_EQ(head, expected);
}

TEST(DataLoader, ResumeWithAnotherGlobalBatchContinuesAtTheSameSample) {
  // Two processes x 4 stopped after 3 batches each: 24 samples. One process x 4 resumes at batch 6 and
  // takes exactly the samples the two would have taken next, in order.
  ShardingOptions two;
  two.num_processes = 2;
  DataLoader<Numbers> first(Numbers{40}, {.batch_size = 4, .shuffle = true, .seed = 3}, two, 0, nullptr, at::kCPU);
  (void)flatten(first, 3);
  auto saved = first.state();
  EXPECT_EQ(saved["samples"], 24);
  ShardingOptions one;
  DataLoader<Numbers> whole(Numbers{40}, {.batch_size = 4, .shuffle = true, .seed = 3}, one, 0, nullptr, at::kCPU);
  auto expected = flatten(whole);
  DataLoader<Numbers> resumed(Numbers{40}, {.batch_size = 4, .shuffle = true, .seed = 3}, one, 0, nullptr, at::kCPU);
  resumed.load_state(saved);
  EXPECT_EQ(resumed.state()["position"], 6);
  auto tail = flatten(resumed);
  EXPECT_EQ(tail, std::vector<int64_t>(expected.begin() + 24, expected.end()));
  // 24 samples are not a whole number of batches of 16: refused, naming the numbers.
  DataLoader<Numbers> odd(Numbers{40}, {.batch_size = 16}, one, 0, nullptr, at::kCPU);
  try {
    odd.load_state(saved);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("after 24 samples"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, EndOfDataloaderAndRemainderTrackTheLastBatch) {
  auto gs = std::make_shared<GradientState>();
  ShardingOptions s;
  s.num_processes = 2;
  s.process_index = 1;
  DataLoader<Numbers> loader(Numbers{22}, {.batch_size = 3}, s, 0, gs, at::kCPU);
  std::vector<bool> ends;
  for (auto& batch : loader) {
    (void)batch;
    ends.push_back(gs->end_of_dataloader());
    EXPECT_EQ(gs->remainder(), 4);
  }
  EXPECT_EQ(ends, (std::vector<bool>{false, false, false, true}));
  EXPECT_FALSE(gs->in_dataloader());
}

namespace {
struct Pixels {
  at::Tensor data;
  Pixels to(const at::Device& d) const { return {data.to(d)}; }
};
}  // namespace

TEST(DataLoader, PinMemoryOffAGpuWarnsAsTorchDoesAndLoadsTheSameBatches) {
  ShardingOptions single;
  ::testing::internal::CaptureStderr();
  DataLoader<Numbers> pinned(Numbers{24}, {.batch_size = 4, .shuffle = true, .num_workers = 2, .pin_memory = true,
                                           .seed = 7}, single, 0, nullptr, at::kCPU);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("pin_memory: the data loader's device is cpu, not a CUDA GPU"), std::string::npos) << err;
  DataLoader<Numbers> plain(Numbers{24}, {.batch_size = 4, .shuffle = true, .num_workers = 2, .seed = 7}, single, 0,
                            nullptr, at::kCPU);
  EXPECT_EQ(flatten(pinned), flatten(plain));
}

namespace {
struct Blocks {  // sample i: a 1 MiB block of i, and i as its target
  size_t size() const { return 48; }
  torch::data::Example<> get(size_t i) const {
    return {at::full({256, 1024}, static_cast<float>(i)), at::full({}, static_cast<float>(i))};
  }
};
}  // namespace

// The copies run on the loader's stream while the step's stream is busy: a batch read before its copy
// ended, or memory reused while the step still read it, shows as a block that differs from its target.
TEST(DataLoaderOnAGpu, PinnedBatchesReachTheGpuWholeWhileTheStepKeepsItsStreamBusy) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const at::Device gpu("cuda:0");
  DataLoader<Blocks> loader(Blocks{}, {.batch_size = 4, .shuffle = true, .num_workers = 2, .pin_memory = true, .seed = 1},
                            ShardingOptions{}, 0, nullptr, gpu);
  auto busy = at::randn({2048, 2048}, at::TensorOptions().device(gpu));
  auto worst = at::zeros({}, at::TensorOptions().device(gpu));
  auto targets = at::zeros({}, at::TensorOptions().device(gpu));
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (auto& batch : loader) {
      ASSERT_TRUE(batch.data.is_cuda());
      for (int k = 0; k < 4; ++k) busy = at::tanh(at::mm(busy, busy));  // the step's work, queued ahead
      worst = at::maximum(worst, (batch.data - batch.target.view({-1, 1, 1})).abs().max());
      targets += batch.target.sum();
    }
  }
  EXPECT_EQ(worst.item<float>(), 0.0f);
  EXPECT_EQ(targets.item<float>(), 2.0f * (47 * 48 / 2));  // every sample, once per epoch
}

TEST(ToDevice, NestedContainersAndUserStructs) {
  std::map<std::string, std::vector<std::pair<at::Tensor, int>>> nested{{"a", {{at::ones({2}), 3}}}};
  auto moved = to_device(nested, at::Device(at::kCPU));
  EXPECT_EQ(moved.at("a")[0].second, 3);
  EXPECT_TRUE(moved.at("a")[0].first.equal(at::ones({2})));
  auto tuple = to_device(std::make_tuple(at::zeros({1}), Pixels{at::ones({1})}, std::string("x")), at::Device(at::kCPU));
  EXPECT_EQ(std::get<2>(tuple), "x");
  EXPECT_TRUE(std::get<1>(tuple).data.equal(at::ones({1})));
}
