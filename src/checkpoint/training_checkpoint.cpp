#include "checkpoint/training_checkpoint.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fcntl.h>
#include <stdio.h>

#include <regex>
#include <sstream>

#include "checkpoint/files.hpp"
#include "checkpoint/integrity.hpp"
#include "core/text.hpp"
#include "core/tensor_text.hpp"

namespace fs = std::filesystem;

namespace xlr8::checkpoints {
namespace {

constexpr const char* kFormat = "xlr8-checkpoint-1";
constexpr const char* kManifest = "MANIFEST.json";
constexpr const char* kStateFile = "accelerator_state.json";

std::string suffix(size_t i) { return i == 0 ? "" : fmt::format("_{}", i); }
std::string rng_file(int rank) { return fmt::format("random_states_{}.safetensors", rank); }

int64_t checkpoint_number(const fs::path& p) {
  static const std::regex pattern("checkpoint_(\\d+)");
  std::smatch m;
  std::string name = p.filename().string();
  return std::regex_match(name, m, pattern) ? std::stoll(m[1]) : -1;
}

// Puts `tmp` at `final_dir` in one atomic step: a rename, or where a checkpoint is already there an
// exchange of the two (renameat2), so that at every instant `final_dir` is a complete checkpoint.
void commit_directory(const fs::path& tmp, const fs::path& final_dir) {
  if (!fs::exists(final_dir)) {
    fs::rename(tmp, final_dir);
    return;
  }
  if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp);  // the previous checkpoint, now under the temporary name
    return;
  }
  // A filesystem without exchange: the old one is moved aside for the instant between two renames.
  fs::path old = final_dir.string() + ".old";
  fs::remove_all(old);
  fs::rename(final_dir, old);
  fs::rename(tmp, final_dir);
  fs::remove_all(old);
}

}  // namespace

std::string model_file(size_t index) { return fmt::format("model{}.safetensors", suffix(index)); }
std::string optimizer_file(size_t index) { return fmt::format("optimizer{}.bin", suffix(index)); }
std::string rank_optimizer_file(size_t index, int rank) {
  return fmt::format("optimizer{}_rank{}.bin", suffix(index), rank);
}

fs::path directory_path(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty() && p.has_parent_path()) p = p.parent_path();
  return p;
}

std::vector<fs::path> automatic_checkpoints(const std::string& project_dir) {
  std::vector<fs::path> dirs;
  fs::path root = fs::path(project_dir) / "checkpoints";
  if (!fs::exists(root)) return dirs;
  for (auto& e : fs::directory_iterator(root))
    if (e.is_directory() && checkpoint_number(e.path()) >= 0) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end(), [](auto& a, auto& b) { return checkpoint_number(a) < checkpoint_number(b); });
  return dirs;
}

void prune_automatic_checkpoints(const std::string& project_dir, int64_t keep) {
  auto all = automatic_checkpoints(project_dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    const auto doomed = all[i].string() + ".removing";
    fs::rename(all[i], doomed);
    fs::remove_all(doomed);
  }
  for (auto& e : fs::directory_iterator(fs::path(project_dir) / "checkpoints"))
    if (e.path().extension() == ".removing") fs::remove_all(e.path());
}

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

torch::serialize::InputArchive read_optimizer_archive(const std::string& bytes, const std::string& path) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  try {
    archive.load_from(in);
  } catch (const std::exception& e) {
    throw Error(fmt::format("load_state: {} is not a readable optimizer state: {}; nothing was loaded", path,
                            text::first_line(e.what())));
  }
  return archive;
}

void load_optimizer(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive, const std::string& path) {
  try {
    optimizer.load(archive);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}: cannot load the optimizer state: {}", path, text::first_line(e.what())));
  }
}

std::string save(const fs::path& final_dir, const Content& content, Communicator& world) {
  const fs::path tmp = final_dir.string() + ".partial";
  const bool main = world.rank() == 0;
  if (main) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world.barrier();
  // This rank's files are flushed together once written (a flush each, one after the other, made a small
  // checkpoint cost a dozen device flushes in a row); the folder is renamed into place only after every
  // rank's and the manifest's flush.
  files::SyncBatch batch;
  std::vector<std::string> written{rng_file(world.rank()), pieces_file(world.rank())};
  save_safetensors((tmp / rng_file(world.rank())).string(), content.rng, {{"rank", std::to_string(world.rank())}});
  for (const auto& [index, bytes] : content.rank_optimizers) {
    written.push_back(rank_optimizer_file(index, world.rank()));
    files::write_durably((tmp / written.back()).string(), bytes);
  }
  write_pieces(tmp, content.pieces, world);
  if (content.write_models) {
    auto names = content.write_models(tmp);  // collective
    if (main) written.insert(written.end(), names.begin(), names.end());
  }
  if (main) {
    written.push_back(kPiecesIndex);
    for (size_t i = 0; i < content.models.size(); ++i) {
      written.push_back(model_file(i));
      save_safetensors((tmp / written.back()).string(), content.models[i], {{"format", "pt"}});
    }
    for (const auto& [name, bytes] : content.main_files) {
      written.push_back(name);
      files::write_durably((tmp / name).string(), bytes);
    }
    for (const auto& [index, bytes] : content.optimizers) {
      written.push_back(optimizer_file(index));
      files::write_durably((tmp / written.back()).string(), bytes);
    }
    auto state = content.state;
    state["format"] = kFormat;
    state["world_size"] = world.size();
    written.push_back(kStateFile);
    files::write_durably((tmp / kStateFile).string(), state.dump(2));
  }
  // Every rank checksums what it wrote, read back from disk on purpose: the CRCs describe what was
  // actually written. In parallel, so no rank reads the whole checkpoint.
  nlohmann::json mine = nlohmann::json::object();
  for (const auto& name : written) {
    const auto sum = files::crc32_of_file((tmp / name).string());  // streamed: memory independent of the size
    mine[name] = {{"size", sum.size}, {"crc32", sum.crc32}};
  }
  batch.sync();  // before the gather: once it completes, every rank's files are on disk
  auto all = world.all_gather_object(mine.dump());
  if (main) {
    nlohmann::json manifest{{"format", kFormat}, {"world_size", world.size()}, {"files", nlohmann::json::object()}};
    for (const auto& text : all) manifest["files"].update(nlohmann::json::parse(text));
    files::write_durably((tmp / kManifest).string(), manifest.dump(2));
    batch.sync();  // the manifest and the folder's entries
    commit_directory(tmp, final_dir);
    files::fsync_directory(final_dir.parent_path().empty() ? "." : final_dir.parent_path().string());
  }
  return final_dir.string();
}

Verified::Verified(const fs::path& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) throw Error(fmt::format("load_state: checkpoint {} does not exist", dir.string()));
  fs::path manifest_path = dir / kManifest;
  if (!fs::exists(manifest_path))
    throw Error(fmt::format("load_state: {} is not a complete checkpoint: {} is missing (the save was interrupted, or "
                            "this is not an xlr8 checkpoint); nothing was loaded",
                            dir.string(), kManifest));
  try {
    manifest_ = nlohmann::json::parse(files::read_all(manifest_path.string()));
    if (manifest_.at("format") != kFormat) throw std::runtime_error("unknown format " + manifest_.at("format").dump());
  } catch (const std::exception& e) {
    throw Error(fmt::format("load_state: {} is corrupt ({}); nothing was loaded", manifest_path.string(), e.what()));
  }
  for (auto& [name, entry] : manifest_.at("files").items()) {
    fs::path file = dir / name;
    if (!fs::exists(file))
      throw Error(fmt::format("load_state: {} is missing; the checkpoint is corrupt or partial, nothing was loaded",
                              file.string()));
    if (fs::file_size(file) != entry.at("size").get<size_t>())
      throw Error(fmt::format("load_state: {} has {} bytes, expected {}; the checkpoint is corrupt or partial, "
                              "nothing was loaded",
                              file.string(), fs::file_size(file), entry.at("size").get<size_t>()));
  }
}

const std::string& Verified::file(const std::string& name) const {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second;
  const fs::path path = dir_ / name;
  if (!has(name))
    throw Error(fmt::format("load_state: {} is missing: the checkpoint does not list it; nothing was loaded",
                            path.string()));
  auto bytes = files::read_all(path.string());
  const auto& entry = manifest_.at("files").at(name);
  auto fail = [&](const std::string& why) {
    return Error(fmt::format("load_state: {} {}; the checkpoint is corrupt or partial, nothing was loaded", path.string(), why));
  };
  if (bytes.size() != entry.at("size").get<size_t>())
    throw fail(fmt::format("has {} bytes, expected {}", bytes.size(), entry.at("size").get<size_t>()));
  if (files::crc32_of(bytes) != entry.at("crc32").get<uint32_t>()) throw fail("fails its CRC32 check");
  return files_.emplace(name, std::move(bytes)).first->second;
}

void Verified::verify(const std::string& name) const {
  if (verified_.count(name)) return;
  if (!has(name))
    throw Error(fmt::format("load_state: {} is missing: the checkpoint does not list it; nothing was loaded",
                            (dir_ / name).string()));
  const auto path = (dir_ / name).string();
  const auto& entry = manifest_.at("files").at(name);
  const auto crc = files::crc32_of_file(path);
  if (crc.size != entry.at("size").get<size_t>())
    throw Error(fmt::format("load_state: {} has {} bytes, expected {}; the checkpoint is corrupt or partial, nothing "
                            "was loaded",
                            path, crc.size, entry.at("size").get<size_t>()));
  if (crc.crc32 != entry.at("crc32").get<uint32_t>())
    throw Error(fmt::format("load_state: {} fails its CRC32 check; the checkpoint is corrupt or partial, nothing was "
                            "loaded",
                            path));
  verified_[name] = true;
}

void Verified::read_into(const std::string& name, size_t offset, size_t size, void* out) const {
  verify(name);
  files::read_range((dir_ / name).string(), offset, size, out);
}

nlohmann::json Verified::state() const { return nlohmann::json::parse(file(kStateFile)); }

SafetensorsContent Verified::model(size_t index) const {
  return parse_safetensors(file(model_file(index)), (dir_ / model_file(index)).string());
}

size_t Verified::models() const {
  size_t n = 0;
  while (has(model_file(n))) ++n;
  return n;
}

const std::string& Verified::optimizer(size_t index) const { return file(optimizer_file(index)); }
const std::string& Verified::rank_optimizer(size_t index, int rank) const {
  return file(rank_optimizer_file(index, rank));
}

std::optional<SafetensorsContent> Verified::rng(int rank) const {
  if (!has(rng_file(rank))) return std::nullopt;
  return parse_safetensors(file(rng_file(rank)), (dir_ / rng_file(rank)).string());
}

std::string integrity_problem(const fs::path& dir) {
  try {
    if (!fs::is_directory(dir)) return fmt::format("{} does not exist", dir.string());
    const fs::path manifest_path = dir / kManifest;
    if (!fs::exists(manifest_path))
      return fs::exists(dir / kStateFile) ? fmt::format("{} is missing", manifest_path.string()) : "";
    const auto manifest = nlohmann::json::parse(files::read_all(manifest_path.string()));
    // Another version's checkpoint is not a damaged one: setting it aside would lose it.
    if (manifest.at("format") != kFormat)
      throw Error(fmt::format("{} has a format this xlr8 does not read ({}); resume it with the xlr8 that wrote it",
                              manifest_path.string(), manifest.at("format").dump()));
    for (const auto& [name, entry] : manifest.at("files").items()) {
      const fs::path file = dir / name;
      if (!fs::exists(file)) return fmt::format("{} is missing", file.string());
      const auto sum = files::crc32_of_file(file.string());
      if (sum.size != entry.at("size").get<size_t>())
        return fmt::format("{} has {} bytes, expected {}", file.string(), sum.size, entry.at("size").get<size_t>());
      if (sum.crc32 != entry.at("crc32").get<uint32_t>()) return fmt::format("{} fails its CRC32 check", file.string());
    }
    return "";
  } catch (const nlohmann::json::exception& e) {  // a manifest whose bytes are damaged
    return fmt::format("{} cannot be read: {}", (dir / kManifest).string(), text::first_line(e.what()));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // a read that failed (I/O, permissions) says nothing of the bytes: no verdict
    throw Error(fmt::format("checkpoint {} cannot be checked: {}", dir.string(), text::first_line(e.what())));
  }
}

std::vector<std::string> manifest_files(const fs::path& dir) {
  std::vector<std::string> names;
  try {
    const auto manifest = nlohmann::json::parse(files::read_all((dir / kManifest).string()));
    if (manifest.at("format") != kFormat) return names;
    for (const auto& [name, entry] : manifest.at("files").items()) names.push_back(name);
    names.push_back(kManifest);
  } catch (const std::exception&) {
    names.clear();  // not a save_state checkpoint
  }
  return names;
}

void check_matches(const NamedTensors& expected, const SafetensorsContent& content, const std::string& path) {
  std::map<std::string, at::Tensor> saved(content.tensors.begin(), content.tensors.end());
  std::vector<std::string> missing, mismatched;
  for (auto& [name, t] : expected) {
    auto it = saved.find(name);
    if (it == saved.end()) missing.push_back(name);
    else if (!it->second.sizes().equals(t.sizes()) || it->second.scalar_type() != t.scalar_type())
      mismatched.push_back(fmt::format("{} ({} saved, {} in the model)", name, core::describe(it->second), core::describe(t)));
    saved.erase(name);
  }
  if (!missing.empty() || !mismatched.empty() || !saved.empty()) {
    std::vector<std::string> unexpected;
    for (auto& [k, v] : saved) unexpected.push_back(k);
    throw Error(fmt::format("load_state: {} does not match the model: missing {}, mismatched {}, unexpected {}{}; "
                            "nothing was loaded",
                            path, text::listing(missing), text::listing(mismatched), text::listing(unexpected),
                            text::prefix_hint(missing, unexpected)));
  }
}

}  // namespace xlr8::checkpoints
