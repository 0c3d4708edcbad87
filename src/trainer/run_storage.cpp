// The run directory's snapshot: registration, retention by score and the Result a directory describes.
#include "trainer/run_storage.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <fstream>

#include "checkpoint/files.hpp"
#include "core/log.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8::train::detail {

void validate(const CheckpointConfig& config) {
  if (config.checkpoint_score_order != "max" && config.checkpoint_score_order != "min")
    throw ConfigError(fmt::format("CheckpointConfig.checkpoint_score_order {:?} must be \"max\" or \"min\"",
                                  config.checkpoint_score_order));
  if (config.num_to_keep && *config.num_to_keep < 1)
    throw ConfigError(fmt::format("CheckpointConfig.num_to_keep {} must be at least 1 (leave it unset to keep every "
                                  "checkpoint)",
                                  *config.num_to_keep));
}

nlohmann::json to_json(const CheckpointConfig& config) {
  nlohmann::json j{{"checkpoint_score_attribute", config.checkpoint_score_attribute},
                   {"checkpoint_score_order", config.checkpoint_score_order}};
  j["num_to_keep"] = config.num_to_keep ? nlohmann::json(*config.num_to_keep) : nlohmann::json();
  return j;
}

CheckpointConfig checkpoint_config_from_json(const nlohmann::json& saved) {
  CheckpointConfig config;
  if (saved.is_null()) return config;
  config.checkpoint_score_attribute = saved.value("checkpoint_score_attribute", "");
  config.checkpoint_score_order = saved.value("checkpoint_score_order", "max");
  if (saved.contains("num_to_keep") && !saved["num_to_keep"].is_null()) config.num_to_keep = saved["num_to_keep"].get<int>();
  return config;
}

std::string checkpoint_dir_name(int index) { return fmt::format("checkpoint_{:06d}", index); }

RunSnapshot RunSnapshot::load(const fs::path& run_dir) {
  RunSnapshot snapshot;
  const fs::path path = run_dir / kSnapshotFile;
  std::ifstream in(path);
  if (!in) return snapshot;
  try {
    auto j = nlohmann::json::parse(in);
    snapshot.next_index = j.at("next_index").get<int>();
    snapshot.latest_metrics = j.value("latest_metrics", nlohmann::json());
    snapshot.config = checkpoint_config_from_json(j.value("checkpoint_config", nlohmann::json()));
    for (const auto& c : j.at("checkpoints"))
      snapshot.kept.push_back({c.at("index").get<int>(), c.at("path").get<std::string>(), c.at("metrics")});
  } catch (const std::exception& e) {
    throw Error(fmt::format("{} cannot be read ({}); it records the run's checkpoints: restore it, or remove the run "
                            "directory {} to start the run afresh",
                            path.string(), e.what(), run_dir.string()));
  }
  return snapshot;
}

void RunSnapshot::save(const fs::path& run_dir) const {
  nlohmann::json j{{"next_index", next_index},
                   {"latest_metrics", latest_metrics},
                   {"checkpoint_config", to_json(config)},
                   {"checkpoints", nlohmann::json::array()}};
  for (const auto& c : kept) j["checkpoints"].push_back({{"index", c.index}, {"path", c.dir_name}, {"metrics", c.metrics}});
  // Through a synced temporary and a rename, then the folder synced: a reader (or a machine that lost power)
  // sees the old snapshot or the new one, never half of one, and the checkpoint renamed before it is on disk.
  files::write_durably((run_dir / kSnapshotFile).string(), j.dump(2) + "\n");
}

void set_aside(const fs::path& run_dir, int index, const std::string& problem) {
  auto snapshot = RunSnapshot::load(run_dir);
  auto it = std::find_if(snapshot.kept.begin(), snapshot.kept.end(), [&](const auto& c) { return c.index == index; });
  if (it == snapshot.kept.end()) return;
  const std::string name = it->dir_name, kept_as = name + ".corrupt";
  // Renamed first: a crash before the snapshot's update leaves the entry, whose folder is then missing, and
  // the next look sets it aside again.
  std::error_code not_renamed;
  fs::rename(run_dir / name, run_dir / kept_as, not_renamed);
  const bool missing = not_renamed == std::errc::no_such_file_or_directory;
  snapshot.kept.erase(it);
  snapshot.save(run_dir);
  const std::string kept = missing       ? "its folder is gone"
                           : not_renamed ? fmt::format("it could not be renamed ({}) and stays as {}, unregistered",
                                                       not_renamed.message(), (run_dir / name).string())
                                         : fmt::format("it is kept as {} for inspection", (run_dir / kept_as).string());
  log::warning("xlr8 train: checkpoint {} fails its check ({}); {}, and the run resumes from the newest intact "
               "checkpoint before it{}",
               name, problem, kept, snapshot.kept.empty() ? " (none: from the start)" : "");
}

namespace {
// The added checkpoint must report the score attribute (a number: NaN from a diverged run counts, as the
// worst); a ConfigError names the metrics there are.
void require_score(const RegisteredCheckpoint& c, const std::string& attribute) {
  auto found = c.metrics.find(attribute);
  if (found != c.metrics.end() && found->is_number()) return;
  std::vector<std::string> names;
  if (c.metrics.is_object())
    for (auto it = c.metrics.begin(); it != c.metrics.end(); ++it) names.push_back(it.key());
  throw ConfigError(fmt::format("CheckpointConfig.checkpoint_score_attribute {:?} is not a number in the metrics "
                                "reported with {} (they have: {}); report it with every checkpoint",
                                attribute, c.dir_name, names.empty() ? "nothing" : fmt::format("{}", fmt::join(names, ", "))));
}

// A score to rank by, larger is better; none (missing, null: NaN once written as JSON, or a checkpoint of a run
// that scored by another attribute) ranks below every number, so the order stays total.
std::optional<double> rank_score(const RegisteredCheckpoint& c, const std::string& attribute, bool larger_is_better) {
  auto found = c.metrics.find(attribute);
  if (found == c.metrics.end() || !found->is_number()) return std::nullopt;
  const double value = found->get<double>();
  if (!std::isfinite(value)) return std::nullopt;
  return larger_is_better ? value : -value;
}
}  // namespace

std::vector<RegisteredCheckpoint> RunSnapshot::best_first() const {
  std::vector<RegisteredCheckpoint> order(kept.rbegin(), kept.rend());  // newest first
  const auto& attribute = config.checkpoint_score_attribute;
  if (attribute.empty()) return order;
  const bool larger_is_better = config.checkpoint_score_order == "max";
  std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    return rank_score(a, attribute, larger_is_better) > rank_score(b, attribute, larger_is_better);  // nullopt lowest
  });
  return order;
}

std::vector<RegisteredCheckpoint> RunSnapshot::add(RegisteredCheckpoint added) {
  if (!config.checkpoint_score_attribute.empty()) require_score(added, config.checkpoint_score_attribute);
  kept.push_back(std::move(added));
  next_index = std::max(next_index, kept.back().index + 1);
  std::vector<RegisteredCheckpoint> dropped;
  if (!config.num_to_keep) return dropped;
  auto best = best_first();
  best.resize(std::min(best.size(), static_cast<size_t>(*config.num_to_keep)));
  auto keep = [&](const RegisteredCheckpoint& c) {
    if (c.index == kept.back().index) return true;  // the latest, until a newer one is registered
    return std::any_of(best.begin(), best.end(), [&](const auto& b) { return b.index == c.index; });
  };
  std::vector<RegisteredCheckpoint> still;
  for (auto& c : kept) (keep(c) ? still : dropped).push_back(c);
  kept = std::move(still);
  return dropped;
}

}  // namespace xlr8::train::detail
