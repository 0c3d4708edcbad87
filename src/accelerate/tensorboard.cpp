#include "accelerate/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "os/net.hpp"
#include "tensorboard.pb.h"
#include "xlr8/error.hpp"

namespace xlr8::accelerate {
namespace {

namespace pb = xlr8::tensorboard;

constexpr int kDtString = 7;  // TensorFlow's DT_STRING

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
    table[i] = c;
  }
  return table;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class TensorBoardTracker final : public Tracker {
 public:
  explicit TensorBoardTracker(const std::string& dir) : Tracker(dir) {
    const std::string name =
        "events.out.tfevents." + std::to_string(static_cast<int64_t>(now_seconds())) + "." + os::host_name();
    path_ = (std::filesystem::path(dir) / name).string();
    out_.open(path_, std::ios::binary | std::ios::app);
    if (!out_) throw Error("cannot write " + path_);
    pb::Event first;
    first.set_wall_time(now_seconds());
    first.set_file_version("brain.Event:2");
    write(first);
  }
  std::string name() const override { return "tensorboard"; }

  // Numbers become scalars; strings become text (the text plugin's string tensors); anything else is
  // logged as its JSON text.
  void log(const nlohmann::json& values, std::optional<int64_t> step) override {
    pb::Event event;
    event.set_wall_time(now_seconds());
    event.set_step(step.value_or(next_step_));
    next_step_ = event.step() + 1;
    auto* summary = event.mutable_summary();
    for (const auto& [key, value] : values.items()) {
      auto* v = summary->add_value();
      v->set_tag(key);
      if (value.is_number() || value.is_boolean()) {
        v->set_simple_value(value.is_boolean() ? static_cast<float>(value.get<bool>()) : value.get<float>());
        continue;
      }
      v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
      auto* tensor = v->mutable_tensor();
      tensor->set_dtype(kDtString);
      tensor->mutable_tensor_shape();  // a scalar string
      tensor->add_string_val(value.is_string() ? value.get<std::string>() : value.dump());
    }
    write(event);
  }
  // The HParams dashboard's records: this run's session start with the hyperparameters' values, and at
  // finish() its end. No experiment record: TensorBoard then infers the hyperparameters from the sessions
  // and the metrics from the scalars logged (an experiment record fixes both, and we know no metrics
  // yet). Nested objects are flattened to "outer.inner"; arrays and nulls are kept as their JSON text.
  void store_init_configuration(const nlohmann::json& config) override {
    std::map<std::string, nlohmann::json> flat;
    flatten(config, "", flat);
    if (flat.empty()) return;
    pb::HParamsPluginData start;
    auto* session = start.mutable_session_start_info();
    session->set_start_time_secs(now_seconds());
    for (const auto& [name, value] : flat) {
      google::protobuf::Value v;
      if (value.is_boolean()) v.set_bool_value(value.get<bool>());
      else if (value.is_number()) v.set_number_value(value.get<double>());
      else v.set_string_value(value.is_string() ? value.get<std::string>() : value.dump());
      (*session->mutable_hparams())[name] = v;
    }
    write_hparams("_hparams_/session_start_info", start);
    session_started_ = true;
  }
  void finish() override {
    if (session_started_ && out_.is_open()) {
      pb::HParamsPluginData end;
      end.mutable_session_end_info()->set_status(pb::STATUS_SUCCESS);
      end.mutable_session_end_info()->set_end_time_secs(now_seconds());
      write_hparams("_hparams_/session_end_info", end);
    }
    out_.close();
  }

 private:
  static void flatten(const nlohmann::json& value, const std::string& prefix, std::map<std::string, nlohmann::json>& out) {
    if (value.is_object()) {
      for (const auto& [key, inner] : value.items()) flatten(inner, prefix.empty() ? key : prefix + "." + key, out);
    } else if (!prefix.empty()) {
      out[prefix] = value;
    }
  }
  void write_hparams(const std::string& tag, const pb::HParamsPluginData& data) {
    pb::Event event;
    event.set_wall_time(now_seconds());
    auto* value = event.mutable_summary()->add_value();
    value->set_tag(tag);
    auto* plugin = value->mutable_metadata()->mutable_plugin_data();
    plugin->set_plugin_name("hparams");
    plugin->set_content(data.SerializeAsString());
    write(event);
  }
  void write(const pb::Event& event) {
    const std::string data = event.SerializeAsString();
    char header[12];
    const uint64_t length = data.size();
    for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    const uint32_t length_crc = masked_crc32c(header, 8);
    for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<char>((length_crc >> (8 * i)) & 0xff);
    const uint32_t data_crc = masked_crc32c(data.data(), data.size());
    char footer[4];
    for (int i = 0; i < 4; ++i) footer[i] = static_cast<char>((data_crc >> (8 * i)) & 0xff);
    out_.write(header, sizeof(header));
    out_.write(data.data(), static_cast<std::streamsize>(data.size()));
    out_.write(footer, sizeof(footer));
    out_.flush();  // TensorBoard reads while the run goes on
    if (!out_) throw Error("cannot write " + path_);
  }

  std::string path_;
  std::ofstream out_;
  int64_t next_step_ = 0;
  bool session_started_ = false;
};

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  static const auto table = crc32c_table();
  uint32_t c = 0xFFFFFFFFu;
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) c = table[(c ^ bytes[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::unique_ptr<Tracker> make_tensorboard_tracker(const std::string& run_dir) {
  return std::make_unique<TensorBoardTracker>(run_dir);
}

namespace {
std::string record_error(const std::string& path, uint64_t offset, const std::string& what) {
  return path + ": the record at byte " + std::to_string(offset) + " " + what;
}
}  // namespace

std::map<std::string, std::vector<std::pair<int64_t, double>>> read_tensorboard_scalars(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read " + path);
  const uint64_t size = std::filesystem::file_size(path);
  auto little_endian = [](const char* bytes, int count) {
    uint64_t v = 0;
    for (int i = count - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
    return v;
  };
  std::map<std::string, std::vector<std::pair<int64_t, double>>> scalars;
  for (uint64_t offset = 0;;) {
    char header[12], footer[4];
    if (!in.read(header, sizeof(header))) break;
    if (masked_crc32c(header, 8) != little_endian(header + 8, 4))
      throw Error(record_error(path, offset, "has a corrupt length (checksum mismatch)"));
    const uint64_t length = little_endian(header, 8);
    if (length > size - offset - sizeof(header)) break;  // cut short: still being written
    std::string data(length, '\0');
    if (!in.read(data.data(), static_cast<std::streamsize>(length)) || !in.read(footer, sizeof(footer))) break;
    if (masked_crc32c(data.data(), data.size()) != little_endian(footer, 4))
      throw Error(record_error(path, offset, "fails its checksum"));
    pb::Event event;
    if (!event.ParseFromString(data))
      throw Error(record_error(path, offset, "is not a TensorBoard Event"));
    for (const auto& value : event.summary().value())
      if (value.value_case() == pb::Summary::Value::kSimpleValue)
        scalars[value.tag()].emplace_back(event.step(), value.simple_value());
    offset += sizeof(header) + length + sizeof(footer);
  }
  return scalars;
}

}  // namespace xlr8::accelerate
