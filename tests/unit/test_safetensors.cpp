// The safetensors format: every dtype round-trips with metadata; corrupt files are named errors.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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

namespace {
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// A file in the format's layout with `header` as its JSON and `data` after it.
std::string file_of(const nlohmann::json& header, const std::string& data) {
  std::string head = header.dump(), out(8, '\0');
  uint64_t n = head.size();
  std::memcpy(out.data(), &n, 8);
  return out + head + data;
}
}  // namespace

// The dtypes Python's safetensors.torch writes beyond the classic ones (U16/U32/U64, F8_E4M3, F8_E5M2, C64):
// the codes are the format's, so files from Python load and ours load in Python.
TEST(Safetensors, RoundTripsUnsignedFloat8AndComplexDtypesWithTheFormatsCodes) {
  NamedTensors tensors;
  for (auto t : {at::kUInt16, at::kUInt32, at::kUInt64, at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kComplexFloat})
    tensors.emplace_back(std::string("t_") + c10::toString(t), at::arange(6, at::kFloat).view({2, 3}).to(t));
  auto bytes = safetensors_bytes(tensors);
  auto back = parse_safetensors(bytes, "x");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    EXPECT_TRUE(same_bytes(back.tensors[i].second, tensors[i].second)) << tensors[i].first;
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["t_UInt16"]["dtype"], "U16");
  EXPECT_EQ(header["t_UInt64"]["dtype"], "U64");
  EXPECT_EQ(header["t_Float8_e4m3fn"]["dtype"], "F8_E4M3");
  EXPECT_EQ(header["t_Float8_e5m2"]["dtype"], "F8_E5M2");
  EXPECT_EQ(header["t_ComplexFloat"]["dtype"], "C64");
}

// What Python's safetensors refuses is refused here too, as an Error naming the file (a number in __metadata__
// aborted the process; trailing, overlapping or missing bytes loaded).
TEST(Safetensors, MetadataThatIsNoStringAndDataNotCoveredExactlyAreNamedErrors) {
  auto message = [](const std::string& bytes) {
    try {
      parse_safetensors(bytes, "model.safetensors");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  const std::string eight(8, '\1');
  const nlohmann::json w = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  EXPECT_EQ(message(file_of({{"w", w}}, eight)), "loaded");
  // An empty tensor between two others takes no bytes: what xlr8 writes loads.
  EXPECT_EQ(message(safetensors_bytes({{"a", at::ones({2})}, {"empty", at::zeros({0, 3})}, {"b", at::ones({1})}})),
            "loaded");
  EXPECT_NE(message(file_of({{"__metadata__", {{"format", "pt"}, {"n", 1}}}, {"w", w}}, eight))
                .find("model.safetensors is not a valid safetensors file: __metadata__ value \"n\" is 1, not a string"),
            std::string::npos);
  EXPECT_NE(message(file_of({{"__metadata__", 3}, {"w", w}}, eight)).find("__metadata__ is not a JSON object"),
            std::string::npos);
  EXPECT_NE(message(file_of({{"w", w}}, eight + "pad")).find("ends at byte 8 but the file holds 11 bytes of data"),
            std::string::npos);
  const nlohmann::json v = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}};
  EXPECT_NE(message(file_of({{"w", w}, {"v", v}}, eight)).find("overlaps at byte 8"), std::string::npos);
  const nlohmann::json late = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}};
  EXPECT_NE(message(file_of({{"late", late}}, eight)).find("leaves a gap at byte 0"), std::string::npos);
}
