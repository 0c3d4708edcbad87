#pragma once
// A Trainer run's storage, <storage_path>/<name>/: the checkpoint directories report() registered and
// checkpoint_manager_snapshot.json (Ray's name), the record of which exist, their metrics and the last
// metrics, rewritten whole (write, then rename) by rank 0 at each report. fit_error.json records why the
// driver's fit() gave up, for Result::from_path.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/train.hpp"

namespace xlr8::train::detail {

inline constexpr const char* kSnapshotFile = "checkpoint_manager_snapshot.json";
inline constexpr const char* kFitErrorFile = "fit_error.json";

struct RegisteredCheckpoint {
  int index = 0;
  std::string dir_name;  // checkpoint_<NNNNNN>, relative to the run directory
  nlohmann::json metrics;
};

// Throws ConfigError naming the field when `config` cannot work (order not max/min, num_to_keep < 1).
void validate(const CheckpointConfig& config);
nlohmann::json to_json(const CheckpointConfig& config);
CheckpointConfig checkpoint_config_from_json(const nlohmann::json& saved);

struct RunSnapshot {
  int next_index = 0;
  nlohmann::json latest_metrics;          // the last report()'s, with or without a checkpoint
  std::vector<RegisteredCheckpoint> kept;  // registration order; the last is the latest
  CheckpointConfig config;

  // An empty snapshot when the run has none yet; Error when the file is there but unreadable.
  static RunSnapshot load(const std::filesystem::path& run_dir);
  void save(const std::filesystem::path& run_dir) const;
  // Registers `added` as the latest and returns the checkpoints `config` no longer keeps (the num_to_keep
  // best by the score attribute, or the most recent, and always the latest). A score attribute missing from
  // a checkpoint's metrics is a ConfigError naming the metrics there are.
  std::vector<RegisteredCheckpoint> add(RegisteredCheckpoint added);
  // The kept checkpoints, best first (newer first among equal scores, and with no score attribute).
  std::vector<RegisteredCheckpoint> best_first() const;
};

std::string checkpoint_dir_name(int index);

// A registered checkpoint that fails its check (`problem`): renamed <dir_name>.corrupt, kept for inspection
// out of retention's reach, and dropped from the snapshot, so the run resumes from the checkpoint before it.
// Rank 0's to call (the snapshot's one writer during a run); nothing when it is no longer registered.
void set_aside(const std::filesystem::path& run_dir, int index, const std::string& problem);

}  // namespace xlr8::train::detail
