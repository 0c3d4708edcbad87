// The checkpoint format on its own, without an Accelerator: save, verified reading, model/state
// mismatches and corruption named by file, sharded pieces read back in any placement, and the Hugging
// Face export's sharding.
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "checkpoint/hf_export.hpp"
#include "checkpoint/sharded_pieces.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "thread_ranks.hpp"
#include "xlr8/error.hpp"

using namespace xlr8;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("xlr8_ckpt_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

checkpoints::Content sample_content() {
  checkpoints::Content c;
  c.state = {{"micro_step", 3}};
  c.models.push_back({{"w", at::arange(6, at::kFloat).reshape({2, 3})}, {"b", at::ones({2})}});
  torch::optim::SGD sgd(std::vector<at::Tensor>{at::ones({2}, at::requires_grad())}, 0.1);
  c.optimizers[0] = checkpoints::optimizer_bytes(sgd);
  c.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
  return c;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TrainingCheckpoint, SavedContentReadsBackVerified) {
  auto dir = fresh_dir("roundtrip");
  auto world = Communicator::in_process("ckpt-roundtrip", 0, 1);
  auto written = checkpoints::save(dir, sample_content(), world);
  EXPECT_EQ(written, dir.string());
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  checkpoints::Verified saved(dir);
  EXPECT_EQ(saved.models(), 1u);
  EXPECT_EQ(saved.saved_world_size(), 1);
  EXPECT_EQ(saved.state()["micro_step"], 3);
  auto model = saved.model(0);
  ASSERT_EQ(model.tensors.size(), 2u);
  EXPECT_EQ(model.tensors[0].first, "w");  // module order kept
  EXPECT_TRUE(at::equal(model.tensors[0].second, at::arange(6, at::kFloat).reshape({2, 3})));
  (void)checkpoints::read_optimizer_archive(saved.optimizer(0), "optimizer.bin");
  EXPECT_TRUE(saved.rng(0).has_value());
  EXPECT_FALSE(saved.rng(1).has_value());
  fs::remove_all(dir);
}

TEST(TrainingCheckpoint, MismatchesAndCorruptionAreNamed) {
  auto dir = fresh_dir("bad");
  auto world = Communicator::in_process("ckpt-bad", 0, 1);
  checkpoints::save(dir, sample_content(), world);
  checkpoints::Verified saved(dir);
  NamedTensors other{{"w", at::zeros({3, 2})}, {"extra", at::zeros({1})}};
  auto m = error_of([&] { checkpoints::check_matches(other, saved.model(0), "model.safetensors"); });
  EXPECT_NE(m.find("missing [extra]"), std::string::npos) << m;
  EXPECT_NE(m.find("mismatched [w (float32[2, 3] saved, float32[3, 2] in the model)]"), std::string::npos) << m;
  EXPECT_NE(m.find("unexpected [b]"), std::string::npos) << m;
  m = error_of([&] { (void)checkpoints::read_optimizer_archive("not an archive", "optimizer.bin"); });
  EXPECT_NE(m.find("optimizer.bin is not a readable optimizer state"), std::string::npos) << m;
  {  // one flipped byte in the model file
    std::fstream f(dir / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  checkpoints::Verified again(dir);  // sizes match: the CRC32 is checked when the file is read
  m = error_of([&] { (void)again.model(0); });
  EXPECT_NE(m.find("model.safetensors fails its CRC32 check"), std::string::npos) << m;
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") - 1);
  m = error_of([&] { checkpoints::Verified truncated(dir); });
  EXPECT_NE(m.find("model.safetensors has"), std::string::npos) << m;
  fs::remove(dir / "MANIFEST.json");
  m = error_of([&] { checkpoints::Verified again(dir); });
  EXPECT_NE(m.find("MANIFEST.json is missing"), std::string::npos) << m;
  fs::remove_all(dir);
}

// Three ranks save their placements of a [6, 4] tensor (tensor-parallel boxes of two fused parts, each
// rank's slice chunked again) and of a [5] one (uneven flat shards); one process reads any placement back:
// the whole, a box saved alike, a split on the other dimension, a chunk crossing boxes.
TEST(ShardedPieces, AnyPlacementReadsBackWhateverPlacementsSavedIt) {
  auto dir = fresh_dir("placements");
  const auto w = at::arange(24, at::kFloat).reshape({6, 4}), v = at::arange(5, at::kFloat);
  xlr8::testing::run_ranks(3, [&](Communicator& world) {
    checkpoints::Content content;
    const int r = world.rank();
    const auto slice = Placement::split({6, 4}, 0, {3, 3}, r, 3).chunk(r == 0 ? 1 : 0, r == 0 ? 7 : 8);
    content.pieces.add("w", slice, slice.take(w));
    if (r == 0) content.pieces.add("w", Placement::split({6, 4}, 0, {3, 3}, 0, 3).chunk(0, 1), w[0][0]);
    const auto shard = Placement::whole_tensor({5}).chunk(2 * r, r == 2 ? 1 : 2);
    content.pieces.add("v", shard, shard.take(v));
    content.pieces.add("e", Placement::whole_tensor({0, 4}), at::empty({0, 4}));  // no elements, still saved
    checkpoints::save(dir, content, world);
  });
  checkpoints::Verified saved(dir);
  const checkpoints::PieceReader reader(saved);
  EXPECT_TRUE(reader.find("w")->boxed());
  const std::vector<Placement> asked{Placement::whole_tensor({6, 4}), Placement::split({6, 4}, 0, {3, 3}, 1, 3),
                                     Placement::split({6, 4}, 1, {4}, 1, 2).chunk(3, 5),
                                     Placement::split({6, 4}, 0, {2, 4}, 1, 2).chunk(2, 5)};
  for (const auto& p : asked) EXPECT_TRUE(at::equal(reader.read("w", p), p.take(w))) << p.describe();
  EXPECT_TRUE(at::equal(reader.read("v", Placement::whole_tensor({5}).chunk(1, 3)), v.narrow(0, 1, 3)));
  ASSERT_NE(reader.find("e"), nullptr);
  EXPECT_EQ(reader.find("e")->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(reader.read("e", Placement::whole_tensor({0, 4})).numel(), 0);
  const auto m = error_of([&] { (void)reader.read("v", Placement::whole_tensor({6})); });
  EXPECT_NE(m.find("is [5], but this rank holds [6]"), std::string::npos) << m;
  fs::remove_all(dir);
}

TEST(HfExport, ShardsWithAnIndexAboveTheLimitAndOneFileBelow) {
  auto dir = fresh_dir("hf");
  NamedTensors tensors{{"a", at::zeros({256})}, {"b", at::zeros({256})}, {"c", at::zeros({256})}};  // 1 KB each
  checkpoints::export_hf_model(tensors, dir.string(), 2100);  // a and b fit one shard, c the next
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  checkpoints::export_hf_model(tensors, dir.string(), checkpoints::parse_size("10GB"));  // replaces the shards
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  EXPECT_EQ(checkpoints::parse_size("2GiB"), int64_t{2} << 30);
  EXPECT_THROW(checkpoints::parse_size("lots"), ConfigError);
  fs::remove_all(dir);
}

// An export that fails part way (merge-weights reading a corrupt checkpoint) leaves the earlier export whole:
// it removed the earlier shards first, leaving an index that named missing files.
TEST(HfExport, AFailedExportLeavesTheEarlierOneWholeAndNoFilesOfItsOwn) {
  auto dir = fresh_dir("hf_failed");
  NamedTensors tensors{{"a", at::full({256}, 1.0)}, {"b", at::full({256}, 2.0)}, {"c", at::full({256}, 3.0)}};
  checkpoints::export_hf_model(tensors, dir.string(), 1100);  // three shards
  auto listing = [&] {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    return names;
  };
  const auto before = listing();
  ASSERT_EQ(before.size(), 4u);
  for (size_t fail_at : {0, 1, 2}) {  // the reader fails at the first, second or last tensor
    std::vector<SafetensorsSpec> specs;
    for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
    EXPECT_THROW(checkpoints::export_hf_model(
                     specs,
                     [&](size_t i) -> at::Tensor {
                       if (i == fail_at) throw Error("the checkpoint is corrupt");
                       return at::zeros({256});
                     },
                     dir.string(), 2100),
                 Error);
    EXPECT_EQ(listing(), before) << "failing at tensor " << fail_at;
  }
  checkpoints::HfModelReader reader(dir.string());
  EXPECT_TRUE(reader.read("b").equal(at::full({256}, 2.0)));
  // A killed export's staged file goes with the next export, which replaces the three shards with one file.
  std::ofstream(dir / ".model-00001-of-00002.safetensors.staged") << "partial";
  checkpoints::export_hf_model(tensors, dir.string(), checkpoints::parse_size("10GB"));
  EXPECT_EQ(listing(), (std::set<std::string>{"model.safetensors"}));
  // Into a directory of its own: nothing is left, not even the directory.
  auto fresh = dir / "new";
  EXPECT_THROW(checkpoints::export_hf_model({{"a", at::kFloat, {2}}}, [](size_t) -> at::Tensor { throw Error("no"); },
                                            fresh.string(), 100),
               Error);
  EXPECT_FALSE(fs::exists(fresh));
  fs::remove_all(dir);
}
