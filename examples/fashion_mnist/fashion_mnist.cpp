#include "fashion_mnist.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <filesystem>

#include "xlr8/error.hpp"

namespace fashion {
namespace {

std::string read_gzip(const std::string& path) {
  if (!std::filesystem::exists(path))
    throw xlr8::Error(fmt::format("dataset file {} does not exist: install dataset-fashion-mnist (scripts/setup does) "
                                  "or pass --data_dir with the IDX .gz files",
                                  path));
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw xlr8::Error(fmt::format("cannot open {}", path));
  std::string out;
  char buffer[1 << 16];
  int n;
  while ((n = gzread(f, buffer, sizeof(buffer))) > 0) out.append(buffer, static_cast<size_t>(n));
  bool failed = n < 0;
  gzclose(f);
  if (failed) throw xlr8::Error(fmt::format("{} is not a valid gzip file", path));
  return out;
}

uint32_t big_endian(const std::string& bytes, size_t at) {
  return (uint32_t(uint8_t(bytes[at])) << 24) | (uint32_t(uint8_t(bytes[at + 1])) << 16) |
         (uint32_t(uint8_t(bytes[at + 2])) << 8) | uint32_t(uint8_t(bytes[at + 3]));
}

// An IDX file of unsigned bytes: magic 0x000008NN (NN = number of dimensions), then the sizes.
torch::Tensor read_idx(const std::string& path, uint32_t dims) {
  auto bytes = read_gzip(path);
  if (bytes.size() < 4 + 4 * dims || big_endian(bytes, 0) != (0x800u | dims))
    throw xlr8::Error(fmt::format("{} is not an IDX file with {} dimension(s)", path, dims));
  std::vector<int64_t> shape;
  int64_t count = 1;
  for (uint32_t d = 0; d < dims; ++d) shape.push_back(big_endian(bytes, 4 + 4 * d)), count *= shape.back();
  size_t offset = 4 + 4 * dims;
  if (bytes.size() != offset + static_cast<size_t>(count))
    throw xlr8::Error(fmt::format("{} is truncated: {} data bytes for shape {}", path, bytes.size() - offset, count));
  auto t = torch::empty(shape, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data() + offset, static_cast<size_t>(count));
  return t;
}

}  // namespace

Dataset::Dataset(const std::string& data_dir, const std::string& split, int64_t limit) {
  auto images = read_idx(fmt::format("{}/{}-images-idx3-ubyte.gz", data_dir, split), 3);
  auto labels = read_idx(fmt::format("{}/{}-labels-idx1-ubyte.gz", data_dir, split), 1);
  if (images.size(0) != labels.size(0))
    throw xlr8::Error(fmt::format("{}: {} images but {} labels", data_dir, images.size(0), labels.size(0)));
  if (limit > 0 && limit < images.size(0)) images = images.narrow(0, 0, limit), labels = labels.narrow(0, 0, limit);
  images_ = ((images.to(torch::kFloat32) / 255.0 - 0.2860) / 0.3530).unsqueeze(1).contiguous();
  labels_ = labels.to(torch::kInt64);
}

torch::data::Example<> Dataset::get(size_t index) { return {images_[index], labels_[index]}; }
torch::optional<size_t> Dataset::size() const { return static_cast<size_t>(images_.size(0)); }

NetImpl::NetImpl() {
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 5)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 5)));
  fc1 = register_module("fc1", torch::nn::Linear(64 * 4 * 4, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, 10));
}

torch::Tensor NetImpl::forward(torch::Tensor x) {
  x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // 32 x 12 x 12
  x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // 64 x 4 x 4
  x = torch::relu(fc1(x.flatten(1)));
  return torch::log_softmax(fc2(x), 1);
}

}  // namespace fashion
