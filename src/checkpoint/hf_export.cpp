#include "checkpoint/hf_export.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "checkpoint/files.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8::checkpoint {

int64_t parse_size(const std::string& text) {
  std::smatch m;
  static const std::regex pattern("\\s*(\\d+(?:\\.\\d+)?)\\s*([KMGT]?i?B)?\\s*", std::regex::icase);
  if (!std::regex_match(text, m, pattern))
    throw ConfigError(fmt::format("max_shard_size {:?} is not a size such as \"10GB\", \"500MB\" or a byte count", text));
  double value = std::stod(m[1]);
  std::string unit = m[2].matched ? std::string(m[2]) : "B";
  for (auto& c : unit) c = static_cast<char>(std::toupper(c));
  bool binary = unit.size() == 3;
  double base = binary ? 1024.0 : 1000.0;
  int power = static_cast<int>(std::string("BKMGT").find(unit[0]));
  for (int i = 0; i < power; ++i) value *= base;
  return static_cast<int64_t>(value);
}

void export_hf_model(const std::vector<SafetensorsSpec>& specs, const std::function<at::Tensor(size_t)>& fetch,
                     const std::string& dir, int64_t limit) {
  fs::create_directories(dir);
  std::vector<std::vector<size_t>> shards(1);  // tensor indices per file
  int64_t used = 0, total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t bytes = static_cast<int64_t>(at::elementSize(specs[i].dtype));
    for (auto d : specs[i].shape) bytes *= d;
    if (!shards.back().empty() && used + bytes > limit) shards.emplace_back(), used = 0;
    shards.back().push_back(i);
    used += bytes;
    total += bytes;
  }
  static const std::regex stale("model-\\d{5}-of-\\d{5}\\.safetensors");
  for (auto& e : fs::directory_iterator(dir))
    if (std::regex_match(e.path().filename().string(), stale)) fs::remove(e.path());
  auto write_file = [&](const std::string& name, const std::vector<size_t>& members) {
    std::vector<SafetensorsSpec> announced;
    for (auto i : members) announced.push_back(specs[i]);
    SafetensorsWriter writer((fs::path(dir) / name).string(), announced, {{"format", "pt"}});
    for (auto i : members) writer.write(fetch(i));  // one tensor in memory at a time
    writer.commit();
  };
  if (shards.size() == 1) {
    fs::remove(fs::path(dir) / "model.safetensors.index.json");
    write_file("model.safetensors", shards[0]);
    return;
  }
  nlohmann::ordered_json index{{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::ordered_json::object()}};
  for (size_t k = 0; k < shards.size(); ++k) {
    std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    write_file(name, shards[k]);
    for (auto i : shards[k]) index["weight_map"][specs[i].name] = name;
  }
  fs::remove(fs::path(dir) / "model.safetensors");
  files::write_durably((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2));
}

void export_hf_model(const NamedTensors& tensors, const std::string& dir, int64_t limit) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  export_hf_model(specs, [&](size_t i) { return tensors[i].second; }, dir, limit);
}

}  // namespace xlr8::checkpoint
