#include "checkpoint/hf_export.hpp"

#include <ATen/ops/empty.h>

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "checkpoint/files.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8::checkpoints {

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

HfModelWriter::HfModelWriter(std::string dir, std::vector<SafetensorsSpec> specs, int64_t limit)
    : dir_(std::move(dir)), specs_(std::move(specs)), files_(1) {
  made_dir_ = fs::create_directories(dir_);
  static const std::regex staged("\\.model.*\\.safetensors\\.staged");  // left by an export that was killed
  for (auto& e : fs::directory_iterator(dir_))
    if (std::regex_match(e.path().filename().string(), staged)) fs::remove(e.path());
  int64_t used = 0;
  for (size_t i = 0; i < specs_.size(); ++i) {
    int64_t bytes = static_cast<int64_t>(at::elementSize(specs_[i].dtype));
    for (auto d : specs_[i].shape) bytes *= d;
    if (!files_.back().empty() && used + bytes > limit) files_.emplace_back(), used = 0;
    files_.back().push_back(i);
    used += bytes;
    total_ += bytes;
  }
}

// Without finish(): the files written so far go, the earlier export stays as it was.
HfModelWriter::~HfModelWriter() {
  if (finished_) return;
  current_.reset();
  std::error_code ec;
  for (size_t k = 0; k < file_; ++k) fs::remove(staged_path(k), ec);
  if (made_dir_ && fs::is_empty(dir_, ec)) fs::remove(dir_, ec);
}

std::string HfModelWriter::file_name(size_t k) const {
  return files_.size() == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, files_.size());
}

std::string HfModelWriter::staged_path(size_t k) const {
  return (fs::path(dir_) / fmt::format(".{}.staged", file_name(k))).string();
}

void HfModelWriter::write(const at::Tensor& tensor) {
  if (next_ >= specs_.size()) throw Error(fmt::format("{}: more tensors written than announced", dir_));
  if (!current_) {
    std::vector<SafetensorsSpec> announced;
    for (auto i : files_[file_]) announced.push_back(specs_[i]);
    current_ = std::make_unique<SafetensorsWriter>(staged_path(file_), announced,
                                                   std::map<std::string, std::string>{{"format", "pt"}});
  }
  current_->write(tensor.to(specs_[next_].dtype));
  ++next_;
  if (next_ == files_[file_].back() + 1) {  // the file is complete
    current_->commit();
    current_.reset();
    ++file_;
  }
}

// Every file is written: the new files take their names (replacing same-named ones), the index follows, and only
// then do the earlier export's other files go, so that a stop at any point leaves one readable export.
void HfModelWriter::finish() {
  if (next_ != specs_.size()) throw Error(fmt::format("{}: {} of {} tensors written", dir_, next_, specs_.size()));
  if (specs_.empty()) {
    SafetensorsWriter(staged_path(0), {}, {{"format", "pt"}}).commit();
    file_ = 1;
  }
  std::set<std::string> names;
  for (size_t k = 0; k < files_.size(); ++k) {
    fs::rename(staged_path(k), fs::path(dir_) / file_name(k));
    names.insert(file_name(k));
  }
  finished_ = true;
  const auto index = fs::path(dir_) / "model.safetensors.index.json";
  if (files_.size() == 1) {
    fs::remove(index);
  } else {
    nlohmann::ordered_json json{{"metadata", {{"total_size", total_}}}, {"weight_map", nlohmann::ordered_json::object()}};
    for (size_t k = 0; k < files_.size(); ++k)
      for (auto i : files_[k]) json["weight_map"][specs_[i].name] = file_name(k);
    files::write_durably(index.string(), json.dump(2));
  }
  static const std::regex earlier("model(-\\d{5}-of-\\d{5})?\\.safetensors");
  for (auto& e : fs::directory_iterator(dir_)) {
    const auto name = e.path().filename().string();
    if (std::regex_match(name, earlier) && !names.count(name)) fs::remove(e.path());
  }
  files::fsync_directory(dir_);
}

HfModelReader::HfModelReader(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p))
    p = fs::exists(p / "model.safetensors.index.json") ? p / "model.safetensors.index.json" : p / "model.safetensors";
  if (!fs::exists(p))
    throw Error(fmt::format("{} holds no model (expected model.safetensors, or "
                            "model.safetensors.index.json and its shards)",
                            path));
  std::vector<fs::path> files{p};
  if (p.extension() == ".json") {
    files.clear();
    std::set<std::string> names;
    try {
      auto index = nlohmann::json::parse(files::read_all(p.string()));
      for (auto& [tensor, file] : index.at("weight_map").items()) names.insert(file.get<std::string>());
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("{} is not a safetensors index: {}", p.string(), e.what()));
    }
    for (const auto& n : names) files.push_back(p.parent_path() / n);
  }
  for (const auto& f : files) {
    if (!fs::exists(f)) throw Error(fmt::format("{} is missing (listed by {})", f.string(), p.string()));
    const auto read = [&](size_t offset, size_t size, void* out) { files::read_range(f.string(), offset, size, out); };
    for (auto& e : read_safetensors_header(fs::file_size(f), read, f.string()).entries) {
      files_[e.name] = f.string();
      entries_[e.name] = std::move(e);
    }
  }
}

at::Tensor HfModelReader::read(const std::string& name) const {
  const auto& e = entries_.at(name);
  auto t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  read_into(name, t);
  return t;
}

void HfModelReader::read_into(const std::string& name, at::Tensor& out) const {
  const auto& e = entries_.at(name);
  if (!out.is_contiguous() || out.scalar_type() != e.dtype || out.nbytes() != e.bytes)
    throw Error(fmt::format("HfModelReader: a buffer of {} bytes of {} cannot take {:?}", out.nbytes(),
                            c10::toString(out.scalar_type()), name));
  files::read_range(files_.at(name), e.begin, e.bytes, out.data_ptr());
}

void export_hf_model(const std::vector<SafetensorsSpec>& specs, const std::function<at::Tensor(size_t)>& fetch,
                     const std::string& dir, int64_t limit) {
  HfModelWriter writer(dir, specs, limit);
  for (size_t i = 0; i < specs.size(); ++i) writer.write(fetch(i));  // one tensor in memory at a time
  writer.finish();
}

void export_hf_model(const NamedTensors& tensors, const std::string& dir, int64_t limit) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  export_hf_model(specs, [&](size_t i) { return tensors[i].second; }, dir, limit);
}

}  // namespace xlr8::checkpoints
