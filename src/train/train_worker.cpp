// The worker's side of a Trainer run: report() (a barrier that registers rank 0's metrics and the workers'
// checkpoint directories merged into one), get_checkpoint() and get_context().
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "train/run_storage.hpp"
#include "xlr8/error.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/train.hpp"

namespace fs = std::filesystem;

namespace xlr8::train {

namespace {

std::string required_variable(const char* name, const char* function) {
  const char* value = std::getenv(name);
  if (!value || !*value)
    throw Error(fmt::format("xlr8::train::{}() runs inside a Trainer's worker (train_loop_per_worker); {} is not set "
                            "here",
                            function, name));
  return value;
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
  nlohmann::json my_offer{{"dir", mine}, {"files", nlohmann::json::array()}, {"error", ""}};
  if (copies) {
    try {
      my_offer["files"] = files_under(mine);
    } catch (const std::exception& e) {
      my_offer["error"] = e.what();
    }
  }
  std::vector<Offer> offers;
  std::string problem;
  for (const auto& text : world.all_gather_object(my_offer.dump())) {
    auto j = nlohmann::json::parse(text);
    offers.push_back({j["dir"].get<std::string>(), j["files"].get<std::vector<std::string>>()});
    if (problem.empty() && !j["error"].get<std::string>().empty()) problem = j["error"].get<std::string>();
  }
  if (problem.empty()) problem = first_conflict(offers);
  if (!problem.empty()) throw Error(problem);  // the same on every rank: nobody waits for the others
  const bool with_checkpoint = std::any_of(dirs.begin(), dirs.end(), [](const std::string& d) { return !d.empty(); });

  // Rank 0 names the new checkpoint (an empty staging folder: a report killed mid-copy may have left files in
  // one of that name); each copying rank fills it; rank 0 registers it. Whatever fails on rank 0 reaches every
  // rank through the broadcasts, so no rank throws while the others wait.
  detail::RunSnapshot snapshot;
  std::string staging_name, rank0_problem;
  if (rank == 0) {
    try {
      snapshot = detail::RunSnapshot::load(dir);
      if (with_checkpoint) {
        staging_name = ".staging_" + detail::checkpoint_dir_name(snapshot.next_index);
        fs::remove_all(dir / staging_name);
        fs::create_directories(dir / staging_name);
      }
    } catch (const std::exception& e) {
      rank0_problem = e.what();
    }
  }
  if (const auto said = world.broadcast_object(rank0_problem, 0); !said.empty()) throw Error(said);
  if (with_checkpoint) {
    staging_name = world.broadcast_object(staging_name, 0);
    std::string copy_error;
    if (copies) {
      try {
        fs::copy(mine, dir / staging_name, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
        for (const auto& file : offers[static_cast<size_t>(rank)].files)  // on disk before it is registered
          if (const int fd = ::open((dir / staging_name / file).c_str(), O_RDONLY | O_CLOEXEC); fd >= 0) {
            ::fsync(fd);
            ::close(fd);
          }
      } catch (const std::exception& e) {
        copy_error = fmt::format("rank {} could not copy {} into {}: {}", rank, mine, (dir / staging_name).string(), e.what());
      }
    }
    for (const auto& e : world.all_gather_object(copy_error))
      if (!e.empty()) problem = e;
  }
  std::string outcome;
  if (rank == 0) {
    try {
      if (!problem.empty()) throw Error(problem);
      const char* config = std::getenv("XLR8_TRAIN_CHECKPOINT_CONFIG");
      snapshot.config = detail::checkpoint_config_from_json(config ? nlohmann::json::parse(config) : nlohmann::json());
      snapshot.latest_metrics = metrics;
      std::vector<detail::RegisteredCheckpoint> dropped;
      if (with_checkpoint) {
        detail::RegisteredCheckpoint added{snapshot.next_index, detail::checkpoint_dir_name(snapshot.next_index), metrics};
        dropped = snapshot.add(added);  // first: a score it lacks is refused before anything moves
        fs::remove_all(dir / added.dir_name);  // a crash between the rename and the snapshot's update left it
        fs::rename(dir / staging_name, dir / added.dir_name);
      }
      snapshot.save(dir);
      // After the snapshot no longer names them: a crash in between leaves a folder, never a dangling entry.
      for (const auto& old : dropped) fs::remove_all(dir / old.dir_name);
    } catch (const std::exception& e) {
      std::error_code ignored;  // the cleanup must not throw past the broadcast the others wait in
      if (!staging_name.empty()) fs::remove_all(dir / staging_name, ignored);
      outcome = e.what();
    }
  }
  outcome = world.broadcast_object(outcome, 0);  // also the barrier: registered when report() returns
  if (!outcome.empty()) throw Error(outcome);
}

std::optional<Checkpoint> get_checkpoint() {
  const fs::path dir = run_dir("get_checkpoint");
  auto snapshot = detail::RunSnapshot::load(dir);
  if (snapshot.kept.empty()) return std::nullopt;
  return Checkpoint{(dir / snapshot.kept.back().dir_name).string()};
}

TrainContext get_context() {
  run_dir("get_context");
  const Topology t = topology_from_env(Env::current());
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return {.world_rank = t.rank,
          .world_size = t.world_size,
          .local_rank = t.local_rank,
          .local_world_size = t.local_world_size,
          .node_rank = t.node_rank,
          .restart_count = restarts ? std::atoi(restarts) : 0,
          .experiment_name = required_variable("XLR8_TRAIN_NAME", "get_context"),
          .storage_path = required_variable("XLR8_TRAIN_STORAGE_PATH", "get_context")};
}

}  // namespace xlr8::train
