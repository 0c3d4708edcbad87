#include "xlr8/trackers.hpp"

#include <fmt/format.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "accelerate/accelerator_impl.hpp"
#include "accelerate/tensorboard.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8 {
namespace {

// One JSON object per log() call: {"step": s, ...values}.
// A logged NaN or infinity kept as what it was: JSON has no such number, and nlohmann's dump writes null (a value
// not logged). Python's json reads the same names from its own files; here they are strings, valid JSON.
nlohmann::json named_if_not_finite(const nlohmann::json& v) {
  if (!v.is_number_float() || std::isfinite(v.get<double>())) return v;
  const double x = v.get<double>();
  return std::isnan(x) ? "NaN" : x > 0 ? "Infinity" : "-Infinity";
}

class JsonLinesTracker final : public Tracker {
 public:
  explicit JsonLinesTracker(const std::string& dir) : Tracker(dir), out_(fs::path(dir) / "metrics.jsonl", std::ios::app) {
    if (!out_) throw Error(fmt::format("cannot write {}/metrics.jsonl", dir));
  }
  std::string name() const override { return "jsonl"; }
  void log(const nlohmann::json& values, std::optional<int64_t> step) override {
    nlohmann::json line = nlohmann::json::object();
    if (step) line["step"] = *step;
    for (auto& [k, v] : values.items()) line[k] = named_if_not_finite(v);
    out_ << line.dump() << '\n' << std::flush;
  }
  void finish() override { out_.close(); }

 private:
  std::ofstream out_;
};

std::string csv_field(const nlohmann::json& v) {
  if (v.is_null()) return "";
  if (v.is_number_float() && !std::isfinite(v.get<double>()))  // as pandas and strtod read them
    return std::isnan(v.get<double>()) ? "nan" : v.get<double>() > 0 ? "inf" : "-inf";
  std::string text = v.is_string() ? v.get<std::string>() : v.dump();
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

// A wide table: a "step" column, then one column per key in the order keys first appeared. A key that
// appears later rewrites the file once with the wider header (the rows so far get empty cells).
class CsvTracker final : public Tracker {
 public:
  explicit CsvTracker(const std::string& dir) : Tracker(dir), path_((fs::path(dir) / "metrics.csv").string()) {
    rewrite();
  }
  std::string name() const override { return "csv"; }
  void log(const nlohmann::json& values, std::optional<int64_t> step) override {
    bool wider = false;
    for (auto& [k, v] : values.items())
      if (std::find(columns_.begin(), columns_.end(), k) == columns_.end()) columns_.push_back(k), wider = true;
    nlohmann::json row = values;
    row["step"] = step ? nlohmann::json(*step) : nlohmann::json();
    rows_.push_back(row);
    if (wider) return rewrite();
    std::ofstream out(path_, std::ios::app);
    out << line(row) << std::flush;
    if (!out) throw Error(fmt::format("cannot write {}", path_));
  }

 private:
  std::string line(const nlohmann::json& row) const {
    std::string out = csv_field(row.value("step", nlohmann::json()));
    for (const auto& c : columns_) out += "," + csv_field(row.contains(c) ? row[c] : nlohmann::json());
    return out + "\n";
  }
  void rewrite() {
    std::ofstream out(path_, std::ios::trunc);
    out << "step";
    for (const auto& c : columns_) out << "," << csv_field(c);
    out << "\n";
    for (const auto& r : rows_) out << line(r);
    if (!out) throw Error(fmt::format("cannot write {}", path_));
  }
  std::string path_;
  std::vector<std::string> columns_;
  std::vector<nlohmann::json> rows_;  // kept for a rewrite when a key first appears
};

}  // namespace

const std::vector<std::string>& builtin_trackers() {
  static const std::vector<std::string> names{"jsonl", "csv", "tensorboard"};
  return names;
}

std::unique_ptr<Tracker> make_tracker(const std::string& name, const std::string& run_dir) {
  if (name == "jsonl") return std::make_unique<JsonLinesTracker>(run_dir);
  if (name == "csv") return std::make_unique<CsvTracker>(run_dir);
  if (name == "tensorboard") return accelerate::make_tensorboard_tracker(run_dir);
  std::string choices;
  for (const auto& n : builtin_trackers()) choices += (choices.empty() ? "" : ", ") + n;
  throw ConfigError(fmt::format("log_with {:?} is not a tracker xlr8 has; use {} or all", name, choices));
}

std::vector<std::string> parse_log_with(const std::string& text) {
  std::vector<std::string> out;
  bool all = false;
  std::string word;
  std::istringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    std::istringstream words(part);
    while (words >> word) {
      all = all || word == "all";
      if (word != "all" && std::find(builtin_trackers().begin(), builtin_trackers().end(), word) == builtin_trackers().end())
        (void)make_tracker(word, "");  // throws naming the choices
      // Each tracker once: a name given twice would write every value twice into one file.
      if (word != "all" && std::find(out.begin(), out.end(), word) == out.end()) out.push_back(word);
    }
  }
  if (all) return builtin_trackers();
  if (out.empty())
    throw ConfigError(fmt::format("log_with {:?} names no tracker: give jsonl, csv, tensorboard or all", text));
  return out;
}

// ------------------------------------------------------------------------------------------ the Accelerator's side

void Accelerator::init_trackers(const std::string& project_name, const nlohmann::json& config,
                                const std::string& run_name) {
  if (!is_main_process()) return;
  auto& s = *impl_;
  if (project_name.empty() || project_name.find('/') != std::string::npos)
    throw ConfigError(fmt::format("init_trackers: project_name {:?} must be a non-empty name without '/'", project_name));
  for (auto& t : s.trackers) t->finish();
  s.trackers.clear();
  auto names = s.options.log_with;
  if (names.empty()) {
    const auto env = env_var("XLR8_LOG_WITH");
    names = env ? parse_log_with(*env) : std::vector<std::string>{"jsonl"};
  }
  const auto project = std::filesystem::path(s.options.project_dir) / project_name;
  std::string run = run_name;
  if (run.empty()) {  // the local time, made unique
    const auto now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &local);
    run = stamp;
    for (int k = 2; std::filesystem::exists(project / run); ++k) run = fmt::format("{}-{}", stamp, k);
  } else if (std::filesystem::exists(project / run)) {
    throw ConfigError(fmt::format("init_trackers: run {:?} of project {:?} exists already ({}); give another run_name",
                                  run, project_name, (project / run).string()));
  }
  const auto dir = project / run;
  std::filesystem::create_directories(dir);
  nlohmann::json stored{{"project_name", project_name},
                        {"run_name", run},
                        {"log_with", names},
                        {"num_processes", num_processes()},
                        {"mixed_precision", to_string(s.plan.mixed_precision)},
                        {"config", config}};
  std::ofstream((dir / "config.json").string()) << stored.dump(2) << "\n";
  for (const auto& name : names) {
    s.trackers.push_back(make_tracker(name, dir.string()));
    s.trackers.back()->store_init_configuration(config);
  }
  s.run_dir = dir.string();
}

void Accelerator::log(const nlohmann::json& values, std::optional<int64_t> step) {
  if (!is_main_process()) return;
  auto& s = *impl_;
  if (s.run_dir.empty()) init_trackers("xlr8");
  for (auto& t : s.trackers) t->log(values, step);
}

Tracker* Accelerator::get_tracker(const std::string& name) {
  if (!is_main_process()) return nullptr;
  for (auto& t : impl_->trackers)
    if (t->name() == name) return t.get();
  throw Error(fmt::format("get_tracker({:?}): no such tracker is logging{}", name,
                          impl_->run_dir.empty() ? " (call init_trackers first)" : ""));
}

std::string Accelerator::run_dir() const { return impl_->run_dir; }

void Accelerator::end_training() {
  for (auto& t : impl_->trackers) t->finish();
  impl_->trackers.clear();
  impl_->run_dir.clear();
  wait_for_everyone();
}

}  // namespace xlr8
