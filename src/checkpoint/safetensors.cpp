#include "xlr8/safetensors.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

#include "checkpoint/files.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

// The codes of safetensors' own torch mapping (safetensors.torch) that LibTorch 2.6 on has.
const std::vector<std::pair<at::ScalarType, std::string>> kDtypes = {
    {at::kDouble, "F64"},           {at::kFloat, "F32"},          {at::kHalf, "F16"},    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},             {at::kInt, "I32"},            {at::kShort, "I16"},   {at::kChar, "I8"},
    {at::kByte, "U8"},              {at::kBool, "BOOL"},          {at::kUInt16, "U16"},  {at::kUInt32, "U32"},
    {at::kUInt64, "U64"},           {at::kFloat8_e4m3fn, "F8_E4M3"}, {at::kFloat8_e5m2, "F8_E5M2"},
    {at::kComplexFloat, "C64"}};

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

// As safetensors' own reader: the tensors' bytes follow each other from the data's start to the file's end,
// with no gap, overlap or trailing bytes (a file that is neither truncated nor padded by another writer).
template <class Bad>
void check_data_covered(const std::vector<SafetensorsEntry>& entries, size_t data_start, size_t data_size,
                        const Bad& bad) {
  std::vector<std::pair<size_t, size_t>> ranges;  // [begin, end) within the data
  for (const auto& e : entries) ranges.emplace_back(e.begin - data_start, e.begin - data_start + e.bytes);
  std::sort(ranges.begin(), ranges.end());
  size_t end = 0;
  for (const auto& [begin, stop] : ranges) {
    if (begin != end)
      throw bad(fmt::format("the tensors' data {} at byte {} of the data (a gap or an overlap)",
                            begin > end ? "leaves a gap" : "overlaps", end));
    end = stop;
  }
  if (end != data_size)
    throw bad(fmt::format("the tensors' data ends at byte {} but the file holds {} bytes of data", end, data_size));
}

}  // namespace

std::string safetensors_dtype_code(at::ScalarType type) { return dtype_code(type); }
std::optional<at::ScalarType> safetensors_dtype_from_code(const std::string& code) { return dtype_of(code); }

std::string safetensors_header_bytes(const std::vector<SafetensorsSpec>& specs,
                                    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& spec : specs) {
    if (header.contains(spec.name)) throw Error(fmt::format("safetensors: duplicate tensor name {:?}", spec.name));
    size_t bytes = at::elementSize(spec.dtype);
    for (auto d : spec.shape) bytes *= static_cast<size_t>(d);
    header[spec.name] = {{"dtype", dtype_code(spec.dtype)}, {"shape", spec.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = head.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + head;
}

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsSpec> specs;
  std::vector<at::Tensor> contiguous;
  size_t total = 0;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(at::kCPU).contiguous();
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
    total += static_cast<size_t>(t.numel()) * t.element_size();
    contiguous.push_back(t);
  }
  std::string out = safetensors_header_bytes(specs, metadata);
  out.reserve(out.size() + total);
  for (const auto& t : contiguous)
    out.append(reinterpret_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * t.element_size());
  return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter writer(path, specs, metadata);
  for (const auto& [name, t] : tensors) writer.write(t);
  writer.commit();
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), specs_(std::move(specs)), out_(std::make_unique<files::DurableFile>(path_)) {
  out_->append(safetensors_header_bytes(specs_, metadata));
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const at::Tensor& tensor) {
  if (next_ >= specs_.size()) throw Error(fmt::format("{}: more tensors written than announced", path_));
  const auto& spec = specs_[next_];
  auto t = tensor.detach().to(at::kCPU).contiguous();
  if (t.scalar_type() != spec.dtype || t.sizes().vec() != spec.shape)
    throw Error(fmt::format("{}: tensor {:?} is {}{}, announced as {}{}", path_, spec.name, c10::toString(t.scalar_type()),
                            c10::str(t.sizes()), c10::toString(spec.dtype), c10::str(at::IntArrayRef(spec.shape))));
  out_->append(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  ++next_;
}

void SafetensorsWriter::commit() {
  if (next_ != specs_.size())
    throw Error(fmt::format("{}: {} of {} tensors written", path_, next_, specs_.size()));
  out_->commit();
}

SafetensorsHeader parse_safetensors_header(const std::string& bytes, size_t file_size, const std::string& origin) {
  auto bad = [&](const std::string& why) { return Error(fmt::format("{} is not a valid safetensors file: {}", origin, why)); };
  if (bytes.size() < 8) throw bad(fmt::format("only {} bytes", bytes.size()));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > file_size - 8 || n > bytes.size() - 8)
    throw bad(fmt::format("header length {} exceeds the file size {}", n, file_size));
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  } catch (const std::exception& e) {
    throw bad(std::string("header is not JSON: ") + e.what());
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = 8 + n;
  const size_t data_size = file_size - out.data_start;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw bad("__metadata__ is not a JSON object");
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw bad(fmt::format("__metadata__ value {:?} is {}, not a string", k, v.dump()));
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    try {
      auto type = dtype_of(entry.at("dtype").get<std::string>());
      if (!type) throw bad(fmt::format("tensor {:?} has unknown dtype {}", name, entry.at("dtype").dump()));
      auto shape = entry.at("shape").get<std::vector<int64_t>>();
      auto offsets = entry.at("data_offsets").get<std::vector<size_t>>();
      int64_t numel = 1;
      for (auto d : shape) {
        if (d < 0) throw bad(fmt::format("tensor {:?} has a negative dimension", name));
        numel *= d;
      }
      size_t expected = static_cast<size_t>(numel) * at::elementSize(*type);
      if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] > data_size || offsets[1] - offsets[0] != expected)
        throw bad(fmt::format("tensor {:?} has data offsets {} that do not fit its shape or the file", name,
                              entry.at("data_offsets").dump()));
      out.entries.push_back({name, *type, std::move(shape), out.data_start + offsets[0], expected});
    } catch (const nlohmann::json::exception& e) {
      throw bad(fmt::format("tensor {:?}: {}", name, e.what()));
    }
  }
  check_data_covered(out.entries, out.data_start, data_size, bad);
  return out;
}

SafetensorsHeader read_safetensors_header(size_t file_size, const std::function<void(size_t, size_t, void*)>& read,
                                          const std::string& origin) {
  if (file_size < 8) throw Error(fmt::format("{} is not a valid safetensors file: only {} bytes", origin, file_size));
  std::string head(8, '\0');
  read(0, 8, head.data());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(head[i])) << (8 * i);
  if (n > file_size - 8)
    throw Error(fmt::format("{} is not a valid safetensors file: header length {} exceeds the file size {}", origin, n,
                            file_size));
  head.resize(8 + n);
  read(8, n, head.data() + 8);
  return parse_safetensors_header(head, file_size, origin);
}

SafetensorsContent parse_safetensors(const std::string& bytes, const std::string& origin) {
  auto header = parse_safetensors_header(bytes, bytes.size(), origin);
  SafetensorsContent content;
  content.metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    auto t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    std::memcpy(t.data_ptr(), bytes.data() + e.begin, e.bytes);
    content.tensors.emplace_back(e.name, t);
  }
  return content;
}

SafetensorsContent load_safetensors(const std::string& path) { return parse_safetensors(files::read_all(path), path); }

}  // namespace xlr8
