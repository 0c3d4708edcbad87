#include "xlr8/safetensors.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include "checkpoint/files.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

const std::vector<std::pair<at::ScalarType, std::string>> kDtypes = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
    {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},  {at::kByte, "U8"},       {at::kBool, "BOOL"}};

std::string dtype_code(at::ScalarType t) {
  for (auto& [type, code] : kDtypes)
    if (type == t) return code;
  throw Error(fmt::format("safetensors cannot store dtype {}", c10::toString(t)));
}

std::optional<at::ScalarType> dtype_of(const std::string& code) {
  for (auto& [type, c] : kDtypes)
    if (c == code) return type;
  return std::nullopt;
}

}  // namespace

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  size_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (header.contains(name)) throw Error(fmt::format("safetensors: duplicate tensor name {:?}", name));
    auto t = tensor.detach().to(at::kCPU).contiguous();
    size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", dtype_code(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(t);
  }
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = head.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += head;
  out.reserve(out.size() + offset);
  for (const auto& t : contiguous)
    out.append(reinterpret_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * t.element_size());
  return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  files::write_durably(path, safetensors_bytes(tensors, metadata));
}

SafetensorsContent parse_safetensors(const std::string& bytes, const std::string& origin) {
  auto bad = [&](const std::string& why) { return Error(fmt::format("{} is not a valid safetensors file: {}", origin, why)); };
  if (bytes.size() < 8) throw bad(fmt::format("only {} bytes", bytes.size()));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > bytes.size() - 8) throw bad(fmt::format("header length {} exceeds the file size {}", n, bytes.size()));
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  } catch (const std::exception& e) {
    throw bad(std::string("header is not JSON: ") + e.what());
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const size_t data_start = 8 + n, data_size = bytes.size() - data_start;
  SafetensorsContent content;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      for (auto& [k, v] : entry.items()) content.metadata[k] = v.get<std::string>();
      continue;
    }
    try {
      auto type = dtype_of(entry.at("dtype").get<std::string>());
      if (!type) throw bad(fmt::format("tensor {:?} has unknown dtype {}", name, entry.at("dtype").dump()));
      auto shape = entry.at("shape").get<std::vector<int64_t>>();
      auto offsets = entry.at("data_offsets").get<std::vector<size_t>>();
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      size_t expected = static_cast<size_t>(numel) * at::elementSize(*type);
      if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] > data_size || offsets[1] - offsets[0] != expected)
        throw bad(fmt::format("tensor {:?} has data offsets {} that do not fit its shape or the file", name,
                              entry.at("data_offsets").dump()));
      auto t = at::empty(shape, at::TensorOptions().dtype(*type));
      std::memcpy(t.data_ptr(), bytes.data() + data_start + offsets[0], expected);
      content.tensors.emplace_back(name, t);
    } catch (const nlohmann::json::exception& e) {
      throw bad(fmt::format("tensor {:?}: {}", name, e.what()));
    }
  }
  return content;
}

SafetensorsContent load_safetensors(const std::string& path) { return parse_safetensors(files::read_all(path), path); }

}  // namespace xlr8
