// DeviceMesh arithmetic (dims in Accelerate's order, row-major ranks, flattened groups) and the placements
// ranks hold of a tensor on it.
#include <gtest/gtest.h>

#include "xlr8/device_mesh.hpp"
#include "xlr8/error.hpp"
#include "xlr8/placement.hpp"

using namespace xlr8;

TEST(MeshLayout, ProductMustEqualWorldSize) {
  try {
    MeshLayout::from({.dp_replicate = 2, .dp_shard = 2}, 8);
    FAIL();
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("multiply to 4"), std::string::npos) << m;
    EXPECT_NE(m.find("world size is 8"), std::string::npos) << m;
  }
  EXPECT_THROW(MeshLayout({{MeshDim::tp, 0}}, 0), ConfigError);
}

TEST(MeshLayout, CoordinatesAreRowMajorWithTpFastest) {
  auto m = MeshLayout::from({.dp_replicate = 2, .dp_shard = 2, .tp = 2}, 8);
  EXPECT_EQ(m.coordinate(5, MeshDim::dp_replicate), 1);
  EXPECT_EQ(m.coordinate(5, MeshDim::dp_shard), 0);
  EXPECT_EQ(m.coordinate(5, MeshDim::tp), 1);
  EXPECT_EQ(m.group_ranks(5, MeshDim::tp), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp_shard), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp_replicate), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp_shard_cp), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.rank_in(5, MeshDim::dp), 2);
  EXPECT_EQ(m.size(MeshDim::dp), 4);
  EXPECT_EQ(m.size(MeshDim::dp_cp), 4);
  EXPECT_EQ(m.size(MeshDim::tp), 2);
}

TEST(MeshLayout, GroupsPartitionTheWorld) {
  auto m = MeshLayout::from({.dp_shard = 2, .cp = 2, .tp = 3}, 12);
  for (const auto name : {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp, MeshDim::tp, MeshDim::dp,
                          MeshDim::dp_shard_cp, MeshDim::dp_cp}) {
    std::vector<int> seen(12, 0);
    for (int r = 0; r < 12; ++r) {
      auto g = m.group_ranks(r, name);
      EXPECT_EQ(static_cast<int>(g.size()), m.size(name)) << to_string(name);
      EXPECT_EQ(g[m.rank_in(r, name)], r);
      if (g.front() == r)
        for (int member : g) ++seen[member];
    }
    for (int r = 0; r < 12; ++r) EXPECT_EQ(seen[r], 1) << to_string(name) << " rank " << r;
  }
}

TEST(MeshLayout, UnknownNameListsKnownOnes) {
  try {
    parse_mesh_dim("ep");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dp_shard"), std::string::npos) << e.what();
  }
  // A layout made of some dimensions only names those it has.
  const MeshLayout m({{MeshDim::dp_shard, 2}}, 2);
  try {
    m.size(MeshDim::tp);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dp_shard"), std::string::npos) << e.what();
  }
}

TEST(MeshLayout, PipelineStagesAreTheOutermostDimensionAndOneUntilPipelinesLand) {
  auto m = MeshLayout::from({.dp_shard = 2, .tp = 2}, 4);
  ASSERT_EQ(m.dims().front().dim, MeshDim::pp);
  EXPECT_EQ(m.size(MeshDim::pp), 1);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(m.group_ranks(r, MeshDim::pp), std::vector<int>{r});
  for (const auto dim : {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp, MeshDim::sp, MeshDim::tp,
                         MeshDim::dp, MeshDim::dp_shard_cp, MeshDim::dp_cp})
    EXPECT_EQ(parse_mesh_dim(to_string(dim)), dim);
  EXPECT_THROW(MeshLayout({{MeshDim::dp, 2}}, 2), Error);  // a flattened group is no dimension of its own
}

TEST(MeshLayout, UlyssesSitsBetweenCpAndTpAndJoinsTheFlattenedSequenceGroups) {
  auto m = MeshLayout::from({.dp_shard = 2, .sp = 2, .tp = 2}, 8);
  EXPECT_EQ(m.group_ranks(5, MeshDim::sp), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::tp), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp_shard_cp), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.group_ranks(5, MeshDim::dp_cp), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.size(MeshDim::cp), 1);
}

TEST(MeshLayout, CpAndSpTogetherAreOneErrorNamingBoth) {
  try {
    MeshLayout::from({.cp = 2, .sp = 2}, 4);
    FAIL();
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parallelism_config_cp_size 2"), std::string::npos) << m;
    EXPECT_NE(m.find("parallelism_config_sp_size 2"), std::string::npos) << m;
    EXPECT_NE(m.find("set one of them to 1"), std::string::npos) << m;
  }
}

// ------------------------------------------------------------------------------------------------ Placement

namespace {

at::Tensor numbered(const std::vector<int64_t>& shape) {
  return at::arange(c10::multiply_integers(shape), at::kLong).reshape(shape);
}

}  // namespace

TEST(Placement, TheWholeTensorIsOneBoxOfEveryElement) {
  const auto p = Placement::whole_tensor({2, 3});
  EXPECT_TRUE(p.unsplit());
  EXPECT_EQ(p.count(), 6);
  EXPECT_EQ(p.boxes().size(), 1u);
  EXPECT_TRUE(at::equal(p.take(numbered({2, 3})), at::arange(6, at::kLong)));
  EXPECT_TRUE(at::equal(p.chunk(2, 3).take(numbered({2, 3})), at::arange(2, 5, at::kLong)));
  EXPECT_THROW(p.chunk(4, 3), Error);  // past the end
}

// A fused layer (parts of 6 and 3 rows) over 3 tp ranks: each rank's slice stacks its share of each part,
// which is what tp::local_slice cuts; a flat chunk of that crosses from one box into the next.
TEST(Placement, ASplitOfFusedPartsIsOneBoxPerPartAndChunksCrossThem) {
  const auto whole = numbered({9, 2});
  for (int rank = 0; rank < 3; ++rank) {
    const auto p = Placement::split({9, 2}, 0, {6, 3}, rank, 3);
    ASSERT_EQ(p.boxes().size(), 2u);
    EXPECT_FALSE(p.unsplit());
    EXPECT_EQ(p.boxes()[0].offsets, (std::vector<int64_t>{2 * rank, 0}));
    EXPECT_EQ(p.boxes()[1].offsets, (std::vector<int64_t>{6 + rank, 0}));
    const auto slice = at::cat({whole.narrow(0, 2 * rank, 2), whole.narrow(0, 6 + rank, 1)}).reshape(-1);
    EXPECT_TRUE(at::equal(p.take(whole), slice));
    const auto crossing = p.chunk(3, 2);  // the last element of box 0 and the first of box 1
    ASSERT_EQ(crossing.spans().size(), 2u);
    EXPECT_EQ(crossing.spans()[1].at, 1);
    EXPECT_TRUE(at::equal(crossing.take(whole), slice.narrow(0, 3, 2)));
    EXPECT_EQ(crossing.unchunked().count(), 6);
  }
}

// The chunks of every tp rank's slice, together, hold each element of the whole once (a [6, 5] tensor over
// 3 tp ranks, each slice of 10 elements in shards of 3, 3, 3 and 1); splits that cannot be are refused.
TEST(Placement, TpSlicesChunkedUnevenlyTileTheWholeOnce) {
  const auto whole = numbered({6, 5});
  auto seen = at::zeros({30}, at::kLong);
  for (int tp = 0; tp < 3; ++tp) {
    const auto slice = Placement::split({6, 5}, 0, {6}, tp, 3);
    const int64_t n = slice.count(), share = (n + 3) / 4;
    for (int64_t begin = 0; begin < n; begin += share) {
      const int64_t count = std::min(share, n - begin);
      seen.index_add_(0, slice.chunk(begin, count).take(whole), at::ones({count}, at::kLong));
    }
  }
  EXPECT_TRUE(at::equal(seen, at::ones({30}, at::kLong)));
  EXPECT_THROW(Placement::split({6, 5}, 1, {5}, 0, 3), ConfigError);     // 5 columns over 3 ranks
  EXPECT_THROW(Placement::split({6, 4}, 1, {2, 2}, 0, 2), ConfigError);  // fused parts only on dimension 0
  EXPECT_THROW(Placement::of_box({6, 4}, {{4, 0}, {3, 4}}), Error);     // rows 4..7 of 6
  EXPECT_THROW(Placement::whole_tensor({6, 4}).take(numbered({4, 6})), Error);
}
