// Accelerator::save_state / load_state / save_model: gathers the Accelerator's counters and each
// strategy's state dicts into a checkpoint::Content and back; the file format, its crash safety and
// verification live in src/checkpoint/.
#include <filesystem>

#include "checkpoint/hf_export.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "core/log.hpp"
#include "train/accelerator_impl.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8 {
namespace {

// The full state dict of a prepared model (through its strategy: collective), or of any other module.
NamedTensors full_state_of(const AcceleratorImpl& s, const torch::nn::Module& module) {
  if (auto* strategy = s.strategy_for(&module)) return strategy->state_dict(StateDictKind::FULL_ON_MAIN);
  return module_state_dict(module);
}

// Whether `optimizer` updates a sharded model's shards (its state then differs on every rank).
bool optimizer_is_sharded(const AcceleratorImpl& s, const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (auto* owner = s.owner_of(p); owner && !owner->replicated()) return true;
  return false;
}

}  // namespace

std::string Accelerator::save_state(const std::string& dir) {
  return checkpoint::filesystem_guard(fmt::format("save_state({:?})", dir), [&] { return save_state_unguarded(dir); });
}

void Accelerator::load_state(const std::string& dir) {
  checkpoint::filesystem_guard(fmt::format("load_state({:?})", dir), [&] {
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
  checkpoint::Content content;
  content.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
  // Every rank asks for the state dicts (collective for sharded strategies); the main process writes them.
  for (const auto& m : s.models) {
    auto full = m->state_dict(StateDictKind::FULL_ON_MAIN);
    if (is_main_process()) content.models.push_back(std::move(full));
  }
  // An optimizer of a sharded model holds this rank's shard of the state: every rank writes its own.
  std::vector<bool> sharded;
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    sharded.push_back(optimizer_is_sharded(s, *s.optimizers[i]->optimizer));
    if (sharded[i]) content.rank_optimizers[i] = checkpoint::optimizer_bytes(*s.optimizers[i]->optimizer);
    else if (is_main_process()) content.optimizers[i] = checkpoint::optimizer_bytes(*s.optimizers[i]->optimizer);
  }
  if (is_main_process()) {
    content.state["sharded_optimizers"] = sharded;
    auto& st = content.state;
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
  }
  auto written = checkpoint::save(checkpoint::directory_path(target), content, s.world());
  if (is_main_process() && dir.empty() && s.options.total_limit) {
    auto all = checkpoint::automatic_checkpoints(s.options.project_dir);
    for (size_t i = 0; i + static_cast<size_t>(*s.options.total_limit) < all.size(); ++i) fs::remove_all(all[i]);
  }
  s.save_iteration += 1;
  wait_for_everyone();
  return written;
}

void Accelerator::load_state_unguarded(const std::string& dir) {
  auto& s = *impl_;
  fs::path source = checkpoint::directory_path(dir);
  if (dir.empty()) {
    auto all = checkpoint::automatic_checkpoints(s.options.project_dir);
    if (all.empty())
      throw Error(fmt::format("load_state(): no checkpoints under {}/checkpoints", s.options.project_dir));
    source = all.back();
  }
  const checkpoint::Verified saved(source);
  auto st = saved.state();

  // Parse and check everything before the first change.
  if (saved.models() != s.models.size())
    throw Error(fmt::format("load_state: {} holds {} model(s) but {} were prepared; nothing was loaded", source.string(),
                            saved.models(), s.models.size()));
  std::vector<SafetensorsContent> model_files;
  for (size_t i = 0; i < s.models.size(); ++i) model_files.push_back(saved.model(i));
  auto optimizer_steps = st.value("optimizer_steps", nlohmann::json::array());
  if (optimizer_steps.size() != s.optimizers.size())
    throw Error(fmt::format("load_state: {} holds {} optimizer(s) but {} were prepared; nothing was loaded",
                            source.string(), optimizer_steps.size(), s.optimizers.size()));
  std::vector<torch::serialize::InputArchive> optimizer_archives;
  std::vector<std::string> optimizer_paths;
  auto sharded = st.value("sharded_optimizers", std::vector<bool>(s.optimizers.size(), false));
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    const bool now_sharded = optimizer_is_sharded(s, *s.optimizers[i]->optimizer);
    if (i < sharded.size() && (sharded[i] != now_sharded || (sharded[i] && saved.saved_world_size() != num_processes())))
      throw Error(fmt::format("load_state: optimizer {} of {} was saved {} on {} process(es) and is loaded {} on {}; "
                              "resharding optimizer state between strategies or process counts is not supported yet, "
                              "so resume with the same strategy and number of processes; nothing was loaded",
                              i, source.string(), sharded[i] ? "sharded" : "whole", saved.saved_world_size(),
                              now_sharded ? "sharded" : "whole", num_processes()));
    const bool per_rank = i < sharded.size() && sharded[i];
    optimizer_paths.push_back(
        (source / (per_rank ? checkpoint::rank_optimizer_file(i, process_index()) : checkpoint::optimizer_file(i)))
            .string());
    optimizer_archives.push_back(checkpoint::read_optimizer_archive(
        per_rank ? saved.rank_optimizer(i, process_index()) : saved.optimizer(i), optimizer_paths.back()));
  }
  for (size_t i = 0; i < s.models.size(); ++i)
    checkpoint::check_matches(s.models[i]->state_dict(StateDictKind::FULL_ON_MAIN), model_files[i],
                              (source / checkpoint::model_file(i)).string());

  for (size_t i = 0; i < s.models.size(); ++i) s.models[i]->load_state_dict(model_files[i].tensors, StateDictKind::FULL);
  // Schedulers replay their steps before the optimizer state restores the exact learning rates.
  auto scheduler_steps = st.value("scheduler_steps", nlohmann::json::array());
  for (size_t i = 0; i < s.schedulers.size() && i < scheduler_steps.size(); ++i) {
    int64_t n = scheduler_steps[i].get<int64_t>();
    for (int64_t k = s.schedulers[i]->steps; k < n; ++k) s.schedulers[i]->scheduler->step();
    s.schedulers[i]->steps = n;
  }
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    checkpoint::load_optimizer(*s.optimizers[i]->optimizer, optimizer_archives[i], optimizer_paths[i]);
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
  if (auto rng = saved.rng(process_index())) {
    for (auto& [name, t] : rng->tensors)
      if (name == "cpu") {
        auto generator = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(t);
      }
  } else if (is_main_process()) {
    log::warning("xlr8: {} has no RNG state for rank {} (saved with {} processes); RNG not restored", source.string(),
                 process_index(), saved.saved_world_size());
  }
}

void Accelerator::save_module(const torch::nn::Module& module, const std::string& dir, const std::string& max_shard_size) const {
  const int64_t limit = checkpoint::parse_size(max_shard_size);  // on every rank: a bad size fails them all
  auto tensors = full_state_of(*impl_, module);  // on every rank: collective for sharded strategies
  if (is_main_process())
    checkpoint::filesystem_guard(fmt::format("save_model({:?})", dir), [&] {
      checkpoint::export_hf_model(tensors, dir, limit);
      return 0;
    });
  wait_for_everyone();
}

}  // namespace xlr8
