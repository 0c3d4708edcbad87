// DeviceMesh arithmetic: dims in Accelerate's order, row-major ranks, flattened groups.
#include <gtest/gtest.h>

#include "xlr8/device_mesh.hpp"
#include "xlr8/error.hpp"

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
