// The worker's side of a Trainer run: report() (a barrier that registers rank 0's metrics and the workers'
// checkpoint directories merged into one), get_checkpoint() and get_context().
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <system_error>

#include "checkpoint/files.hpp"
#include "checkpoint/integrity.hpp"
#include "trainer/run_storage.hpp"
#include "xlr8/error.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/train.hpp"

namespace fs = std::filesystem;

namespace xlr8::train {

namespace {

std::string required_variable(const char* name, const char* function) {
  const auto value = env_var(name);
  if (!value)
    throw Error(fmt::format("xlr8::train::{}() runs inside a Trainer's worker (train_loop_per_worker); {} is not set "
                            "here",
                            function, name));
  return *value;
}

fs::path run_dir(const char* function) { return required_variable("XLR8_TRAIN_RUN_DIR", function); }

// What one worker brings to a report: its checkpoint directory and, when it is the lowest rank with that
// directory (the one that copies it), the files in it relative to it.
struct Offer {
  std::string dir;
  std::vector<std::string> files;
};

std::vector<std::string> files_under(const fs::path& dir) {
  if (!fs::is_directory(dir))
    throw Error(fmt::format("xlr8::train::report(): checkpoint directory {:?} does not exist", dir.string()));
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir))
    if (!entry.is_directory()) files.push_back(fs::relative(entry.path(), dir).string());
  return files;
}

// The same relative path offered from two directories would make the merged checkpoint depend on which copy
// lands last: refused, naming both.
std::string first_conflict(const std::vector<Offer>& offers) {
  std::map<std::string, size_t> owner;
  for (size_t rank = 0; rank < offers.size(); ++rank)
    for (const auto& file : offers[rank].files) {
      auto [it, added] = owner.emplace(file, rank);
      if (!added)
        return fmt::format("xlr8::train::report(): {:?} is in rank {}'s checkpoint directory {} and in rank {}'s {}; "
                           "the directories are merged into one checkpoint, so their files must not overlap",
                           file, it->second, offers[it->second].dir, rank, offers[rank].dir);
    }
  return "";
}

// Every rank's offer, and the staging folder rank 0 prepared for the new checkpoint (an empty one: a report
// killed mid-copy may have left files in one of that name) in the same exchange. Whatever failed, on any
// rank, is thrown on every rank alike: nobody waits for the others.
std::vector<Offer> exchange_offers(Communicator& world, const std::string& mine, bool copies, bool with_checkpoint,
                                   const fs::path& dir, detail::RunSnapshot& snapshot, std::string& staging_name) {
  nlohmann::json my_offer{{"dir", mine}, {"files", nlohmann::json::array()}, {"error", ""}, {"staging", ""}};
  try {
    if (copies) my_offer["files"] = files_under(mine);
    if (world.rank() == 0) {
      snapshot = detail::RunSnapshot::load(dir);
      if (with_checkpoint) {
        my_offer["staging"] = ".staging_" + detail::checkpoint_dir_name(snapshot.next_index);
        fs::remove_all(dir / my_offer["staging"].get<std::string>());
        fs::create_directories(dir / my_offer["staging"].get<std::string>());
      }
    }
  } catch (const std::exception& e) {
    my_offer["error"] = e.what();
  }
  std::vector<Offer> offers;
  std::string problem;
  for (const auto& text : world.all_gather_object(my_offer.dump())) {
    auto j = nlohmann::json::parse(text);
    offers.push_back({j["dir"].get<std::string>(), j["files"].get<std::vector<std::string>>()});
    if (problem.empty() && !j["error"].get<std::string>().empty()) problem = j["error"].get<std::string>();
    if (offers.size() == 1) staging_name = j["staging"].get<std::string>();
  }
  if (problem.empty()) problem = first_conflict(offers);
  if (!problem.empty()) {
    std::error_code ignored;  // nothing was staged yet
    if (world.rank() == 0 && !staging_name.empty()) fs::remove_all(dir / staging_name, ignored);
    throw Error(problem);
  }
  return offers;
}

// Puts `files` of `from` into `to`: hard links for the files of a save_state checkpoint (save_state flushed
// them and never rewrites one in place, so a link is as durable and as fixed as a copy, without copying or
// flushing the data again), copies for other files or across filesystems; then the copies and every folder
// made are flushed together (one after the other, a dozen small files' flushes cost more than a step).
void stage_files(const fs::path& from, const fs::path& to, const std::vector<std::string>& files) {
  const auto listed = checkpoints::manifest_files(from);
  const std::set<std::string> linkable(listed.begin(), listed.end());
  std::vector<std::string> flush;
  std::set<std::string> folders{to.string()};
  for (const auto& file : files) {
    const fs::path target = to / file;
    for (auto folder = target.parent_path(); folder.string().size() > to.string().size(); folder = folder.parent_path())
      folders.insert(folder.string());
    fs::create_directories(target.parent_path());
    std::error_code not_linked = std::make_error_code(std::errc::operation_not_supported);
    if (linkable.count(file)) fs::create_hard_link(from / file, target, not_linked);  // cleared when linked
    if (not_linked) {
      fs::copy_file(from / file, target, fs::copy_options::overwrite_existing);
      flush.push_back(target.string());
    }
  }
  flush.insert(flush.end(), folders.begin(), folders.end());
  files::sync_all(flush);
}

// Rank 0, once every rank has staged its files: registers the new checkpoint, saves the snapshot and drops
// what retention no longer keeps. Returns what failed ("" when nothing did), after cleaning up after it.
std::string register_report(const fs::path& dir, detail::RunSnapshot& snapshot, const nlohmann::json& metrics,
                            bool with_checkpoint, const std::string& staging_name, const std::string& problem) {
  try {
    if (!problem.empty()) throw Error(problem);
    const auto config = env_var("XLR8_TRAIN_CHECKPOINT_CONFIG");
    snapshot.config = detail::checkpoint_config_from_json(config ? nlohmann::json::parse(*config) : nlohmann::json());
    snapshot.latest_metrics = metrics;
    std::vector<detail::RegisteredCheckpoint> dropped;
    if (with_checkpoint) {
      detail::RegisteredCheckpoint added{snapshot.next_index, detail::checkpoint_dir_name(snapshot.next_index), metrics};
      dropped = snapshot.add(added);  // first: a score it lacks is refused before anything moves
      fs::remove_all(dir / added.dir_name);  // a crash between the rename and the snapshot's update left it
      fs::rename(dir / staging_name, dir / added.dir_name);
    }
    snapshot.save(dir);  // its folder's flush also records the rename
    // After the snapshot no longer names them: a crash in between leaves a folder, never a dangling entry.
    for (const auto& old : dropped) fs::remove_all(dir / old.dir_name);
    return "";
  } catch (const std::exception& e) {
    std::error_code ignored;  // the cleanup must not throw past the broadcast the others wait in
    if (!staging_name.empty()) fs::remove_all(dir / staging_name, ignored);
    return e.what();
  }
}

}  // namespace

void report(const nlohmann::json& metrics, const std::string& checkpoint_dir) {
  const fs::path dir = run_dir("report");
  Communicator& world = ProcessState::instance().world();
  const int rank = world.rank();

  // Who copies what: the lowest rank offering each distinct directory.
  const std::string mine = checkpoint_dir.empty() ? "" : fs::absolute(checkpoint_dir).lexically_normal().string();
  const auto dirs = world.all_gather_object(mine);
  bool copies = !mine.empty();
  for (int r = 0; r < rank && copies; ++r) copies = dirs[static_cast<size_t>(r)] != mine;
  const bool with_checkpoint = std::any_of(dirs.begin(), dirs.end(), [](const std::string& d) { return !d.empty(); });

  // Each copying rank fills rank 0's staging folder; rank 0 registers it. Whatever fails on rank 0 reaches
  // every rank through the broadcast, so no rank throws while the others wait.
  detail::RunSnapshot snapshot;
  std::string staging_name, problem;
  const auto offers = exchange_offers(world, mine, copies, with_checkpoint, dir, snapshot, staging_name);
  if (with_checkpoint) {
    std::string copy_error;
    if (copies) {
      try {
        stage_files(mine, dir / staging_name, offers[static_cast<size_t>(rank)].files);  // on disk before registered
      } catch (const std::exception& e) {
        copy_error = fmt::format("rank {} could not copy {} into {}: {}", rank, mine, (dir / staging_name).string(), e.what());
      }
    }
    for (const auto& e : world.all_gather_object(copy_error))
      if (!e.empty()) problem = e;
  }
  std::string outcome;
  if (rank == 0) outcome = register_report(dir, snapshot, metrics, with_checkpoint, staging_name, problem);
  outcome = world.broadcast_object(outcome, 0);  // also the barrier: registered when report() returns
  if (!outcome.empty()) throw Error(outcome);
}

// The newest registered checkpoint that passes its check. Every rank checks alike and so finds the same one;
// rank 0 also sets aside each that fails (a rank that looks later no longer finds it registered, or finds
// its folder gone: the same verdict).
std::optional<Checkpoint> get_checkpoint() {
  const fs::path dir = run_dir("get_checkpoint");
  const auto snapshot = detail::RunSnapshot::load(dir);
  const bool rank0 = topology_from_env(Env::current()).rank == 0;
  for (auto it = snapshot.kept.rbegin(); it != snapshot.kept.rend(); ++it) {
    const fs::path path = dir / it->dir_name;
    const auto problem = checkpoints::integrity_problem(path);
    if (problem.empty()) return Checkpoint{path.string()};
    if (rank0) detail::set_aside(dir, it->index, problem);
  }
  return std::nullopt;
}

TrainContext get_context() {
  run_dir("get_context");
  const Topology t = topology_from_env(Env::current());
  const auto restarts = env_var("TORCHELASTIC_RESTART_COUNT");
  return {.world_rank = t.rank,
          .world_size = t.world_size,
          .local_rank = t.local_rank,
          .local_world_size = t.local_world_size,
          .node_rank = t.node_rank,
          .restart_count = restarts ? std::atoi(restarts->c_str()) : 0,
          .experiment_name = required_variable("XLR8_TRAIN_NAME", "get_context"),
          .storage_path = required_variable("XLR8_TRAIN_STORAGE_PATH", "get_context")};
}

}  // namespace xlr8::train
