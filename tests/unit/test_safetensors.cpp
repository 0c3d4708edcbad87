// The safetensors format: every dtype round-trips with metadata; corrupt files are named errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "xlr8/error.hpp"
#include "xlr8/safetensors.hpp"

using namespace xlr8;

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  NamedTensors tensors;
  for (auto t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kByte, at::kBool})
    tensors.emplace_back(std::string("t_") + c10::toString(t), (at::arange(6) % 2).to(t).view({2, 3}));
  tensors.emplace_back("scalar", at::full({}, 3.5));
  auto path = (std::filesystem::temp_directory_path() / ("xlr8_st_" + std::to_string(getpid()))).string();
  save_safetensors(path, tensors, {{"format", "pt"}});
  auto back = load_safetensors(path);
  EXPECT_EQ(back.metadata.at("format"), "pt");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(back.tensors[i].second.equal(tensors[i].second)) << tensors[i].first;
  }
  // The header starts after an 8-byte length and keeps the data 8-byte aligned, as the format specifies.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  std::filesystem::remove(path);
}

TEST(Safetensors, CorruptFilesAreNamedErrors) {
  auto bytes = safetensors_bytes({{"w", at::ones({4})}});
  EXPECT_THROW(parse_safetensors(bytes.substr(0, 5), "x"), Error);
  EXPECT_THROW(parse_safetensors(bytes.substr(0, bytes.size() - 4), "x"), Error);  // data truncated
  std::string bad_header = bytes;
  bad_header[9] = '#';
  try {
    parse_safetensors(bad_header, "model.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors is not a valid safetensors file"), std::string::npos);
  }
}
