#pragma once
// Experiment trackers, as Accelerate's `log_with` / `init_trackers` / `log` / `get_tracker`: each run in
// its own directory <project_dir>/<project_name>/<run_name>/, written by the main process only, with the
// run's configuration stored beside the values. Built in: "jsonl" (metrics.jsonl), "csv" (metrics.csv) and
// "tensorboard" (event files: numbers as scalars, strings as text, the configuration as hyperparameters).
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace xlr8 {

class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual std::string name() const = 0;
  // Numbers become scalars; strings are kept as text where the format has it.
  virtual void log(const nlohmann::json& values, std::optional<int64_t> step) = 0;
  // The run's configuration, once, when the run starts (Accelerate's store_init_configuration): every
  // tracker's run also has it as config.json; TensorBoard shows it as the run's hyperparameters.
  virtual void store_init_configuration(const nlohmann::json& /*config*/) {}
  virtual void finish() {}
  const std::string& run_dir() const { return run_dir_; }

 protected:
  explicit Tracker(std::string run_dir) : run_dir_(std::move(run_dir)) {}

 private:
  std::string run_dir_;
};

// The tracker names xlr8 builds in.
const std::vector<std::string>& builtin_trackers();
// A built-in tracker writing into `run_dir` (which exists); ConfigError naming the choices for another name.
std::unique_ptr<Tracker> make_tracker(const std::string& name, const std::string& run_dir);
// "all" (every built-in tracker), or a comma- or space-separated list; ConfigError for an unknown name.
std::vector<std::string> parse_log_with(const std::string& text);

}  // namespace xlr8
