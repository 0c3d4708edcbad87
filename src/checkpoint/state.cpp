// Accelerator::save_state / load_state / save_model. A checkpoint is written into <dir>.partial, every
// file fsynced, then MANIFEST.json (size + CRC32 of each file) is written last and the directory is
// renamed into place; a previous checkpoint at <dir> survives any failure before that rename.
// load_state verifies every file against the manifest before it changes anything.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <regex>
#include <sstream>

#include "checkpoint/files.hpp"
#include "compat/torch_compat.hpp"
#include "core/log.hpp"
#include "dist/comm_state.hpp"
#include "train/accelerator_impl.hpp"
#include "xlr8/error.hpp"
#include "xlr8/safetensors.hpp"

namespace fs = std::filesystem;

namespace xlr8 {
namespace {

constexpr const char* kFormat = "xlr8-checkpoint-1";
constexpr const char* kManifest = "MANIFEST.json";

std::string suffix(size_t i) { return i == 0 ? "" : fmt::format("_{}", i); }

// "ckpt/" and "ckpt" name the same directory; the temporary and backup siblings need the bare name.
fs::path directory_path(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty() && p.has_parent_path()) p = p.parent_path();
  return p;
}

NamedTensors state_dict(const torch::nn::Module& module) {
  NamedTensors tensors;
  for (const auto& p : module.named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers()) tensors.emplace_back(b.key(), b.value());
  return tensors;
}

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes, const std::string& path) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  try {
    archive.load_from(in);
    optimizer.load(archive);
  } catch (const std::exception& e) {
    std::string m = e.what();
    throw Error(fmt::format("{}: cannot load the optimizer state: {}", path, m.substr(0, m.find('\n'))));
  }
}

int64_t checkpoint_number(const fs::path& p) {
  static const std::regex pattern("checkpoint_(\\d+)");
  std::smatch m;
  std::string name = p.filename().string();
  return std::regex_match(name, m, pattern) ? std::stoll(m[1]) : -1;
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

// Checks every file named in the manifest; throws naming the first bad file and why. Returns the checked
// bytes of each file by name, so loading parses exactly what was verified and reads nothing twice.
struct VerifiedCheckpoint {
  nlohmann::json manifest;
  std::map<std::string, std::string> files;
  const std::string& bytes(const std::string& name, const fs::path& dir) const {
    auto it = files.find(name);
    if (it == files.end())
      throw Error(fmt::format("load_state: {} is missing: the checkpoint does not list it; nothing was loaded",
                              (dir / name).string()));
    return it->second;
  }
};

VerifiedCheckpoint verify_checkpoint(const fs::path& dir) {
  if (!fs::is_directory(dir)) throw Error(fmt::format("load_state: checkpoint {} does not exist", dir.string()));
  fs::path manifest_path = dir / kManifest;
  if (!fs::exists(manifest_path))
    throw Error(fmt::format("load_state: {} is not a complete checkpoint: {} is missing (the save was interrupted, or "
                            "this is not an xlr8 checkpoint); nothing was loaded",
                            dir.string(), kManifest));
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(files::read_all(manifest_path.string()));
    if (manifest.at("format") != kFormat) throw std::runtime_error("unknown format " + manifest.at("format").dump());
  } catch (const std::exception& e) {
    throw Error(fmt::format("load_state: {} is corrupt ({}); nothing was loaded", manifest_path.string(), e.what()));
  }
  VerifiedCheckpoint verified;
  for (auto& [name, entry] : manifest.at("files").items()) {
    fs::path file = dir / name;
    auto fail = [&](const std::string& why) {
      return Error(fmt::format("load_state: {} {}; the checkpoint is corrupt or partial, nothing was loaded", file.string(), why));
    };
    if (!fs::exists(file)) throw fail("is missing");
    auto bytes = files::read_all(file.string());
    if (bytes.size() != entry.at("size").get<size_t>())
      throw fail(fmt::format("has {} bytes, expected {}", bytes.size(), entry.at("size").get<size_t>()));
    if (files::crc32_of(bytes) != entry.at("crc32").get<uint32_t>()) throw fail("fails its CRC32 check");
    verified.files.emplace(name, std::move(bytes));
  }
  verified.manifest = std::move(manifest);
  return verified;
}

// Throws unless `content` has exactly the module's names, dtypes and shapes.
void check_module(const torch::nn::Module& module, const SafetensorsContent& content, const std::string& path) {
  std::map<std::string, at::Tensor> saved(content.tensors.begin(), content.tensors.end());
  auto targets = state_dict(module);
  std::vector<std::string> missing, mismatched;
  for (auto& [name, t] : targets) {
    auto it = saved.find(name);
    if (it == saved.end()) missing.push_back(name);
    else if (!it->second.sizes().equals(t.sizes()) || it->second.scalar_type() != t.scalar_type())
      mismatched.push_back(fmt::format("{} ({} saved, {} in the model)", name, detail::describe(it->second), detail::describe(t)));
    saved.erase(name);
  }
  if (!missing.empty() || !mismatched.empty() || !saved.empty()) {
    std::vector<std::string> unexpected;
    for (auto& [k, v] : saved) unexpected.push_back(k);
    throw Error(fmt::format("load_state: {} does not match the model: missing [{}], mismatched [{}], unexpected [{}]; "
                            "nothing was loaded",
                            path, fmt::join(missing, ", "), fmt::join(mismatched, ", "), fmt::join(unexpected, ", ")));
  }
}

void copy_into_module(torch::nn::Module& module, const SafetensorsContent& content) {
  auto targets = state_dict(module);
  std::map<std::string, at::Tensor> by_name(content.tensors.begin(), content.tensors.end());
  at::NoGradGuard no_grad;
  for (auto& [name, t] : targets) t.copy_(by_name.at(name));
}

// Filesystem failures (permissions, a full disk) become xlr8 errors that name the checkpoint.
template <class Fn>
auto filesystem_guard(const std::string& what, Fn&& fn) {
  try {
    return fn();
  } catch (const fs::filesystem_error& e) {
    throw Error(fmt::format("{}: {}", what, e.what()));
  }
}

}  // namespace

std::string Accelerator::save_state(const std::string& dir) {
  return filesystem_guard(fmt::format("save_state({:?})", dir), [&] { return save_state_unguarded(dir); });
}

void Accelerator::load_state(const std::string& dir) {
  filesystem_guard(fmt::format("load_state({:?})", dir), [&] {
    load_state_unguarded(dir);
    return 0;
  });
}

std::string Accelerator::save_state_unguarded(const std::string& dir) {
  auto& s = *impl_;
  std::string target = dir;
  if (target.empty()) {
    if (!s.options.automatic_checkpoint_naming)
      throw Error("save_state(): give a directory, or set AcceleratorOptions::automatic_checkpoint_naming");
    target = (fs::path(s.options.project_dir) / "checkpoints" / fmt::format("checkpoint_{}", s.save_iteration)).string();
  }
  const fs::path final_dir = directory_path(target), tmp = final_dir.string() + ".partial";
  const bool main = is_main_process();
  if (main) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  wait_for_everyone();

  // Per rank: RNG state.
  NamedTensors rng{{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
  save_safetensors((tmp / fmt::format("random_states_{}.safetensors", process_index())).string(), rng,
                   {{"rank", std::to_string(process_index())}});
  if (main) {
    for (size_t i = 0; i < s.models.size(); ++i)
      save_safetensors((tmp / fmt::format("model{}.safetensors", suffix(i))).string(), state_dict(*s.models[i]->module()),
                       {{"format", "pt"}});
    for (size_t i = 0; i < s.optimizers.size(); ++i)
      files::write_durably((tmp / fmt::format("optimizer{}.bin", suffix(i))).string(),
                           optimizer_bytes(*s.optimizers[i]->optimizer));
    nlohmann::json st;
    st["format"] = kFormat;
    st["world_size"] = num_processes();
    st["micro_step"] = s.micro_step;
    st["save_iteration"] = s.save_iteration + 1;
    st["seed"] = s.seed;
    st["mixed_precision"] = to_string(s.precision);
    st["gradient_accumulation_steps"] = s.gradient_state->num_steps;
    st["last_step_applied"] = s.last_step_applied;
    if (s.scaler) st["scaler"] = s.scaler->state();
    for (auto& o : s.optimizers) st["optimizer_steps"].push_back(o->steps);
    for (auto& sc : s.schedulers) st["scheduler_steps"].push_back(sc->steps);
    st["loaders"] = nlohmann::json::array();
    for (auto& weak : s.loaders)
      if (auto loader = weak.lock()) st["loaders"].push_back(loader->state());
    files::write_durably((tmp / "accelerator_state.json").string(), st.dump(2));
  }
  wait_for_everyone();

  if (main) {
    // Read back from disk on purpose: the CRCs describe what was actually written, including other ranks' files.
    nlohmann::json manifest{{"format", kFormat}, {"world_size", num_processes()}, {"files", nlohmann::json::object()}};
    for (auto& e : fs::directory_iterator(tmp)) {
      auto bytes = files::read_all(e.path().string());
      manifest["files"][e.path().filename().string()] = {{"size", bytes.size()}, {"crc32", files::crc32_of(bytes)}};
    }
    files::write_durably((tmp / kManifest).string(), manifest.dump(2));
    fs::path old = final_dir.string() + ".old";
    fs::remove_all(old);
    if (fs::exists(final_dir)) fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
    files::fsync_directory(final_dir.parent_path().empty() ? "." : final_dir.parent_path().string());
    if (dir.empty() && s.options.total_limit) {
      auto all = automatic_checkpoints(s.options.project_dir);
      for (size_t i = 0; i + static_cast<size_t>(*s.options.total_limit) < all.size(); ++i) fs::remove_all(all[i]);
    }
  }
  s.save_iteration += 1;
  wait_for_everyone();
  return final_dir.string();
}

void Accelerator::load_state_unguarded(const std::string& dir) {
  auto& s = *impl_;
  fs::path source = directory_path(dir);
  if (dir.empty()) {
    auto all = automatic_checkpoints(s.options.project_dir);
    if (all.empty())
      throw Error(fmt::format("load_state(): no checkpoints under {}/checkpoints", s.options.project_dir));
    source = all.back();
  }
  auto checkpoint = verify_checkpoint(source);
  auto st = nlohmann::json::parse(checkpoint.bytes("accelerator_state.json", source));

  // Parse and check everything before the first change.
  std::vector<SafetensorsContent> model_files;
  for (size_t i = 0; i < s.models.size(); ++i) {
    auto name = fmt::format("model{}.safetensors", suffix(i));
    model_files.push_back(parse_safetensors(checkpoint.bytes(name, source), (source / name).string()));
  }
  auto optimizer_steps = st.value("optimizer_steps", nlohmann::json::array());
  if (optimizer_steps.size() != s.optimizers.size())
    throw Error(fmt::format("load_state: {} holds {} optimizer(s) but {} were prepared; nothing was loaded",
                            source.string(), optimizer_steps.size(), s.optimizers.size()));
  for (size_t i = 0; i < s.models.size(); ++i)
    check_module(*s.models[i]->module(), model_files[i], (source / fmt::format("model{}.safetensors", suffix(i))).string());

  for (size_t i = 0; i < s.models.size(); ++i) copy_into_module(*s.models[i]->module(), model_files[i]);
  // Schedulers replay their steps before the optimizer state restores the exact learning rates.
  auto scheduler_steps = st.value("scheduler_steps", nlohmann::json::array());
  for (size_t i = 0; i < s.schedulers.size() && i < scheduler_steps.size(); ++i) {
    int64_t n = scheduler_steps[i].get<int64_t>();
    for (int64_t k = s.schedulers[i]->steps; k < n; ++k) s.schedulers[i]->scheduler->step();
    s.schedulers[i]->steps = n;
  }
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    auto name = fmt::format("optimizer{}.bin", suffix(i));
    load_optimizer_bytes(*s.optimizers[i]->optimizer, checkpoint.bytes(name, source), (source / name).string());
    s.optimizers[i]->steps = optimizer_steps[i].get<int64_t>();
  }
  s.micro_step = st.value("micro_step", int64_t{0});
  s.save_iteration = st.value("save_iteration", int64_t{0});
  s.seed = st.value("seed", uint64_t{0});
  s.last_step_applied = st.value("last_step_applied", false);
  if (s.scaler && st.contains("scaler")) s.scaler->load_state(st["scaler"]);
  auto loaders = st.value("loaders", nlohmann::json::array());
  size_t li = 0;
  for (auto& weak : s.loaders)
    if (auto loader = weak.lock(); loader && li < loaders.size()) loader->load_state(loaders[li++]);
  auto rng_name = fmt::format("random_states_{}.safetensors", process_index());
  if (checkpoint.files.count(rng_name)) {
    auto rng = parse_safetensors(checkpoint.files.at(rng_name), (source / rng_name).string());
    for (auto& [name, t] : rng.tensors)
      if (name == "cpu") {
        auto generator = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(t);
      }
  } else if (is_main_process()) {
    log::warning("xlr8: {} has no RNG state for rank {} (saved with {} processes); RNG not restored", source.string(),
                 process_index(), checkpoint.manifest.value("world_size", 0));
  }
}

namespace {

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
  int power = std::string("BKMGT").find(unit[0]);
  for (int i = 0; i < power; ++i) value *= base;
  return static_cast<int64_t>(value);
}

}  // namespace

void Accelerator::save_module(const torch::nn::Module& module, const std::string& dir, const std::string& max_shard_size) const {
  const int64_t limit = parse_size(max_shard_size);
  if (is_main_process()) filesystem_guard(fmt::format("save_model({:?})", dir), [&] {
    fs::create_directories(dir);
    std::vector<NamedTensors> shards(1);
    int64_t used = 0, total = 0;
    for (auto& [name, t] : state_dict(module)) {
      int64_t bytes = t.numel() * t.element_size();
      if (!shards.back().empty() && used + bytes > limit) shards.emplace_back(), used = 0;
      shards.back().emplace_back(name, t);
      used += bytes;
      total += bytes;
    }
    static const std::regex stale("model-\\d{5}-of-\\d{5}\\.safetensors");
    for (auto& e : fs::directory_iterator(dir))
      if (std::regex_match(e.path().filename().string(), stale)) fs::remove(e.path());
    if (shards.size() == 1) {
      fs::remove(fs::path(dir) / "model.safetensors.index.json");
      save_safetensors((fs::path(dir) / "model.safetensors").string(), shards[0], {{"format", "pt"}});
    } else {
      nlohmann::ordered_json index{{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::ordered_json::object()}};
      for (size_t i = 0; i < shards.size(); ++i) {
        std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
        save_safetensors((fs::path(dir) / name).string(), shards[i], {{"format", "pt"}});
        for (auto& [tensor_name, t] : shards[i]) index["weight_map"][tensor_name] = name;
      }
      fs::remove(fs::path(dir) / "model.safetensors");
      files::write_durably((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2));
    }
    return 0;
  });
  wait_for_everyone();
}

}  // namespace xlr8
