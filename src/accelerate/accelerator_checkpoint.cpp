// Accelerator::save_state / load_state: gathers the Accelerator's counters and each
// strategy's state dicts into a checkpoints::Content and back; the file format, its crash safety and
// verification live in src/checkpoint/.
#include <filesystem>
#include <map>
#include <optional>

#include "checkpoint/hf_export.hpp"
#include <fmt/ranges.h>
#include "checkpoint/training_checkpoint.hpp"
#include "core/log.hpp"
#include "accelerate/accelerator_impl.hpp"
#include "accelerate/portable_state.hpp"
#include "distributed/every_rank.hpp"
#include "precision/float8_linear.hpp"
#include "core/text.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace fs = std::filesystem;

namespace xlr8 {

void stream_full_state(const AcceleratorImpl& s, const torch::nn::Module& module, const std::string& what,
                       const std::function<void(std::vector<SafetensorsSpec>)>& open,
                       const std::function<void(const at::Tensor&)>& write, const std::function<void()>& close) {
  const bool main = s.world().rank() == 0;
  std::string problem;
  auto guarded = [&](auto&& fn) {
    if (!main || !problem.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      problem = e.what();
    }
  };
  if (s.pipeline && &module == s.pipelined_model.get()) {
    stream_pipeline_state(s, guarded, open, write);
  } else {
    auto whole = whole_state_of(s, module);
    guarded([&] { open(whole.specs()); });
    whole.visit([&](size_t, const at::Tensor& t) { guarded([&] { write(t); }); });
  }
  guarded(close);
  auto outcome = s.world().size() > 1 ? s.world().broadcast_object(problem, 0) : problem;
  if (!outcome.empty()) throw Error(fmt::format("{}: {}", what, outcome));
}

namespace {

std::string custom_file(size_t i) { return fmt::format("custom_checkpoint_{}.bin", i); }

// Whether `optimizer` updates a sharded model's shards, or a pipeline stage's parameters (its state then differs
// on every rank, or every stage).
bool optimizer_is_sharded(const AcceleratorImpl& s, const torch::optim::Optimizer& optimizer) {
  if (s.pipeline) return true;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (auto* owner = s.owner_of(p); owner && !owner->replicated()) return true;
  return false;
}

// ------------------------------------------------------------------------------------------ save and load steps

// The counters a resumed run continues from (main process; the state file's fields).
void record_training_state(const AcceleratorImpl& s, nlohmann::json& st) {
  st["micro_step"] = s.micro_step;
  st["save_iteration"] = s.save_iteration + 1;
  st["seed"] = s.seed;
  st["mixed_precision"] = to_string(s.plan.mixed_precision);
  st["gradient_accumulation_steps"] = s.gradient_state->num_steps;
  st["last_step_applied"] = s.last_step_applied;
  if (s.scaler) st["scaler"] = s.scaler->state();
  for (size_t i = 0; i < s.models.size(); ++i)  // fp8's delayed scaling: amax histories and scales, alike on every rank
    if (auto fp8 = fp8::delayed_state_of(*s.models[i]->module()); !fp8.is_null()) st["fp8"][std::to_string(i)] = fp8;
  for (auto& o : s.optimizers) st["optimizer_steps"].push_back(o->steps);
  for (auto& sc : s.schedulers) st["scheduler_steps"].push_back(sc->steps);
  st["loaders"] = nlohmann::json::array();
  for (auto& weak : s.loaders)
    if (auto loader = weak.lock()) st["loaders"].push_back(loader->state());
}

// Everything load_state reads, read and checked before anything changes.
struct LoadPlan {
  std::optional<PortableLoad> portable;
  std::vector<torch::serialize::InputArchive> optimizer_archives;
  std::vector<std::string> optimizer_paths;
};

LoadPlan read_and_check(const AcceleratorImpl& s, const checkpoints::Verified& saved, const fs::path& source, int rank) {
  const auto st = saved.state();
  const int ranks = s.state->world_size();
  LoadPlan plan;
  plan.optimizer_archives.resize(s.optimizers.size());
  plan.optimizer_paths.resize(s.optimizers.size());
  if (saved.models() != 0 && saved.models() != s.models.size())
    throw Error(fmt::format("load_state: {} holds {} model(s) but {} were prepared; nothing was loaded",
                            source.string(), saved.models(), s.models.size()));
  if (st.value("micro_step", int64_t{0}) < 0 || st.value("gradient_accumulation_steps", int64_t{1}) < 1)
    throw Error(fmt::format("load_state: {} holds micro_step {} and gradient_accumulation_steps {}, which xlr8 never "
                            "writes (0 or more, 1 or more): it was edited or damaged; nothing was loaded",
                            source.string(), st.value("micro_step", int64_t{0}),
                            st.value("gradient_accumulation_steps", int64_t{1})));
  auto optimizer_steps = st.value("optimizer_steps", nlohmann::json::array());
  if (optimizer_steps.size() != s.optimizers.size())
    throw Error(fmt::format("load_state: {} holds {} optimizer(s) but {} were prepared; nothing was loaded",
                            source.string(), optimizer_steps.size(), s.optimizers.size()));
  plan.portable = read_portable_state(s, saved, st);
  auto custom = st.value("custom_objects", std::vector<std::string>{});
  std::vector<std::string> registered;
  for (const auto& c : s.custom) registered.push_back(c.kind);
  if (custom != registered)
    throw Error(fmt::format("load_state: {} holds {} registered object(s) [{}] but [{}] are registered now (same "
                            "kinds, same order); nothing was loaded",
                            source.string(), custom.size(), fmt::join(custom, ", "), fmt::join(registered, ", ")));
  for (size_t i = 0; i < s.custom.size(); ++i) (void)saved.file(custom_file(i));  // present and intact
  for (size_t i = 0; i < s.models.size(); ++i)
    fp8::load_delayed_state(*s.models[i]->module(), fp8::saved_delayed_state(st, i), source.string(), /*apply=*/false);
  auto sharded = st.value("sharded_optimizers", std::vector<bool>(s.optimizers.size(), false));
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    if (plan.portable->optimizers[i].portable) continue;
    const bool now_sharded = optimizer_is_sharded(s, *s.optimizers[i]->optimizer);
    if (i < sharded.size() && (sharded[i] != now_sharded || (sharded[i] && saved.saved_world_size() != ranks)))
      throw Error(fmt::format("load_state: optimizer {} of {} (a type without portable state, saved as an archive) "
                              "was saved {} on {} process(es) and is loaded {} on {}; such state cannot be resharded, "
                              "so resume with the same strategy and number of processes; nothing was loaded",
                              i, source.string(), sharded[i] ? "sharded" : "whole", saved.saved_world_size(),
                              now_sharded ? "sharded" : "whole", ranks));
    const bool per_rank = i < sharded.size() && sharded[i];
    plan.optimizer_paths[i] =
        (source / (per_rank ? checkpoints::rank_optimizer_file(i, rank) : checkpoints::optimizer_file(i))).string();
    plan.optimizer_archives[i] = checkpoints::read_optimizer_archive(
        per_rank ? saved.rank_optimizer(i, rank) : saved.optimizer(i), plan.optimizer_paths[i]);
  }
  return plan;
}

// Where the next micro-step falls in its accumulation window. The saved count runs on from the epoch's start, so it is
// taken modulo the saved accumulation: a run resumed with another one (the same global batch in other micro-batches)
// then starts its windows where the saved run's ended, not wherever the count modulo the new accumulation falls.
int64_t position_in_window(const nlohmann::json& st, int accumulation_now, const fs::path& source, bool main_process) {
  const int64_t saved_count = st.value("micro_step", int64_t{0});
  const int64_t saved_accumulation = st.value("gradient_accumulation_steps", int64_t{accumulation_now});  // checked
  const int64_t position = saved_count % saved_accumulation;
  if (position == 0 || saved_accumulation == accumulation_now) return position;
  if (main_process)
    log::warning("xlr8: {} was saved {} micro-step(s) into a window of {} and gradient_accumulation_steps is now {}: "
                 "the window starts again (a checkpoint holds no partly accumulated gradients)",
                 source.string(), position, saved_accumulation, accumulation_now);
  return 0;
}

// After the models: schedulers, optimizers, registered objects, counters and loaders.

void apply_training_state(AcceleratorImpl& s, const checkpoints::Verified& saved, const fs::path& source,
                          LoadPlan& plan) {
  const auto st = saved.state();
  auto optimizer_steps = st.value("optimizer_steps", nlohmann::json::array());
  // Schedulers replay their steps before the optimizer state restores the exact learning rates.
  auto scheduler_steps = st.value("scheduler_steps", nlohmann::json::array());
  for (size_t i = 0; i < s.schedulers.size() && i < scheduler_steps.size(); ++i) {
    int64_t n = scheduler_steps[i].get<int64_t>();
    for (int64_t k = s.schedulers[i]->steps; k < n; ++k) s.schedulers[i]->scheduler->step();
    s.schedulers[i]->steps = n;
  }
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    if (!plan.portable->optimizers[i].portable) {
      auto& optimizer = *s.optimizers[i]->optimizer;
      const OptimizerStateInMemory replaced(s, {&optimizer});  // then what was loaded goes to disk
      checkpoints::load_optimizer(optimizer, plan.optimizer_archives[i], plan.optimizer_paths[i]);
    }
    s.optimizers[i]->steps = optimizer_steps[i].get<int64_t>();
  }
  apply_optimizer_state(s, *plan.portable);  // state on disk: one group in memory at a time
  for (size_t i = 0; i < s.custom.size(); ++i)
    s.custom[i].load(saved.file(custom_file(i)), (source / custom_file(i)).string());
  for (size_t i = 0; i < s.models.size(); ++i)
    fp8::load_delayed_state(*s.models[i]->module(), fp8::saved_delayed_state(st, i), source.string(), /*apply=*/true);
  s.micro_step = position_in_window(st, s.gradient_state->num_steps, source, s.state->is_main_process());
  s.save_iteration = st.value("save_iteration", int64_t{0});
  s.seed = st.value("seed", uint64_t{0});
  s.last_step_applied = st.value("last_step_applied", false);
  if (s.scaler && st.contains("scaler")) s.scaler->load_state(st["scaler"]);
  auto loaders = st.value("loaders", nlohmann::json::array());
  size_t li = 0;
  for (auto& weak : s.loaders)
    if (auto loader = weak.lock(); loader && li < loaders.size()) loader->load_state(loaders[li++]);
}

}  // namespace

std::string Accelerator::save_state(const std::string& dir) {
  return checkpoints::filesystem_guard(fmt::format("save_state({:?})", dir), [&] { return save_state_unguarded(dir); });
}

void Accelerator::load_state(const std::string& dir) {
  checkpoints::filesystem_guard(fmt::format("load_state({:?})", dir), [&] {
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
  checkpoints::Content content;
  content.rng = {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
  // Models: whole on the main process (FULL_STATE_DICT; gathered one unit at a time when sharded), or
  // each rank's pieces. Optimizers of LibTorch's types: each rank's pieces, by parameter name, so any
  // strategy and process count reads them back; others as archives.
  const bool sharded_models = models_saved_sharded(s);
  if (!sharded_models)
    content.write_models = [&](const fs::path& tmp) {
      std::vector<std::string> names;
      for (size_t i = 0; i < s.models.size(); ++i) {
        names.push_back(checkpoints::model_file(i));
        std::unique_ptr<SafetensorsWriter> writer;
        stream_full_state(
            s, *s.models[i]->module(), "save_state",
            [&](std::vector<SafetensorsSpec> specs) {
              writer = std::make_unique<SafetensorsWriter>((tmp / names.back()).string(), std::move(specs),
                                                           std::map<std::string, std::string>{{"format", "pt"}});
            },
            [&](const at::Tensor& t) { writer->write(t); }, [&] { writer->commit(); });
      }
      return names;
    };
  // State on disk is read as it is written, one group in memory at a time.
  const auto held = std::make_shared<GroupInMemory>();
  const auto portable = collect_portable_state(s, sharded_models, content.pieces, content.state, held);
  std::vector<bool> sharded;
  for (size_t i = 0; i < s.optimizers.size(); ++i) {
    auto& optimizer = *s.optimizers[i]->optimizer;
    sharded.push_back(optimizer_is_sharded(s, optimizer));
    if (portable[i]) continue;
    const OptimizerStateInMemory from_disk(s, {&optimizer});  // an archive holds it all at once
    if (sharded[i]) content.rank_optimizers[i] = checkpoints::optimizer_bytes(optimizer);
    else if (is_main_process()) content.optimizers[i] = checkpoints::optimizer_bytes(optimizer);
  }
  if (is_main_process()) {
    for (size_t i = 0; i < s.custom.size(); ++i) {  // registered objects, as Accelerate's custom_checkpoint_<i>
      content.main_files[custom_file(i)] = s.custom[i].save();
      content.state["custom_objects"].push_back(s.custom[i].kind);
    }
    content.state["sharded_optimizers"] = sharded;
    content.state["models_sharded"] = sharded_models;
    for (const auto& m : s.models) {  // the order merge-weights writes them in (under pp, the whole model's)
      std::vector<std::string> names;
      for (const auto& [name, t] : module_state_dict(s.pipeline ? *s.pipelined_model : *m->module())) names.push_back(name);
      content.state["model_tensors"].push_back(names);
    }
    record_training_state(s, content.state);
  }
  auto written = checkpoints::save(checkpoints::directory_path(target), content, s.world());
  held->release();
  if (is_main_process() && dir.empty() && s.options.total_limit) checkpoints::prune_automatic_checkpoints(s.options.project_dir, *s.options.total_limit);
  s.save_iteration += 1;
  wait_for_everyone();
  return written;
}

std::optional<std::string> Accelerator::latest_checkpoint() const {
  return checkpoints::filesystem_guard("latest_checkpoint()", [&]() -> std::optional<std::string> {
    const auto all = checkpoints::automatic_checkpoints(impl_->options.project_dir);
    if (all.empty()) return std::nullopt;
    return all.back().string();
  });
}

void Accelerator::load_state_unguarded(const std::string& dir) {
  auto& s = *impl_;
  const auto context = fmt::format("load_state({:?})", dir);
  // Which checkpoint, and everything in it read and checked before the first change, on every rank; then agree, so
  // that a bad shard one rank read (or a checkpoint it cannot see) stops them all.
  fs::path source = checkpoints::directory_path(dir);
  std::optional<checkpoints::Verified> saved;
  LoadPlan plan;
  auto read = [&] {
    if (dir.empty()) {
      auto all = checkpoints::automatic_checkpoints(s.options.project_dir);
      if (all.empty())
        throw Error(fmt::format("load_state(): no checkpoints under {}/checkpoints", s.options.project_dir));
      source = all.back();
    }
    saved.emplace(source);
    plan = read_and_check(s, *saved, source, process_index());
  };
  on_every_rank_or_none(s.world(), read, context, "nothing was loaded");
  // Past the checks a rank can still fail (an I/O error while the disk tier reads one group at a time, or writes a
  // shard back; a registered object's load): every rank learns it before the next collective, and what it left.
  constexpr std::string_view partly = "the training state is now partly the checkpoint's: load_state again (or "
                                      "restart) before training on";
  on_every_rank_or_none(s.world(), [&] { apply_model_state(s, *plan.portable); }, context, partly);
  // Collective (sharded strategies refresh their whole copies); a rank's I/O error comes after its collectives.
  on_every_rank_or_none(s.world(), [&] { for (auto& m : s.models) m->parameter_pieces_loaded(); }, context, partly);
  on_every_rank_or_none(s.world(), [&] { apply_training_state(s, *saved, source, plan); }, context, partly);
  if (auto rng = saved->rng(process_index())) {
    for (auto& [name, t] : rng->tensors)
      if (name == "cpu") {
        auto generator = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(t);
      }
  } else if (is_main_process()) {
    log::warning("xlr8: {} has no RNG state for rank {} (saved with {} processes); RNG not restored", source.string(),
                 process_index(), saved->saved_world_size());
  }
}

void Accelerator::register_checkpointable(detail::Checkpointable object) { impl_->custom.push_back(std::move(object)); }

std::string Accelerator::module_bytes(const torch::nn::Module& module) {
  return safetensors_bytes(module_state_dict(module));
}

void Accelerator::load_module_bytes(torch::nn::Module& module, const std::string& bytes, const std::string& origin) {
  auto saved = parse_safetensors(bytes, origin);
  auto own = module_state_dict(module);
  checkpoints::check_matches(own, saved, origin);
  std::map<std::string, at::Tensor> by_name(own.begin(), own.end());
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : saved.tensors) by_name.at(name).copy_(t);
}

std::string Accelerator::optimizer_archive(const torch::optim::Optimizer& optimizer) {
  return checkpoints::optimizer_bytes(optimizer);
}

void Accelerator::load_optimizer_archive(torch::optim::Optimizer& optimizer, const std::string& bytes,
                                         const std::string& origin) {
  auto archive = checkpoints::read_optimizer_archive(bytes, origin);
  checkpoints::load_optimizer(optimizer, archive, origin);
}

}  // namespace xlr8

