// Accelerator::build_model: the model built empty for rank-0 or tensor-parallel loading, or recorded
// (DeferredInitScope, DeepSpeed's zero.Init) so that sharding computes each group's values as it makes it;
// and what prepare() completes of such a model.
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "accelerate/accelerator_impl.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "parallel/tensor/tp_layer_kinds.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

bool Accelerator::rank0_loading() const {
  const auto& s = *impl_;
  const auto& settings = s.state->settings();
  if (s.state->world_size() == 1 || !settings.fsdp || !settings.fsdp->cpu_ram_efficient_loading) return false;
  const auto& zero = s.plan.data_parallel.zero;
  const int dp = s.state->mesh().size(MeshDim::dp_cp);  // what the strategy shards over
  return zero.stage == 3 && shard::units_open_guards(zero.auto_wrap_policy) &&
         (zero.hybrid_shard_size == 0 || zero.hybrid_shard_size == dp) && dp == num_processes();
}

bool Accelerator::tp_loading() const {
  const auto& s = *impl_;
  const auto& fsdp = s.state->settings().fsdp;
  // Not under pipeline stages: the main process's whole model would be compared with other stages' (pp x tp builds
  // whole on every rank, records_build).
  return s.state->world_size() > 1 && s.plan.mesh.tp > 1 && s.plan.mesh.pp == 1 &&
         (!fsdp || fsdp->cpu_ram_efficient_loading);
}

struct Accelerator::ModelBuild {
  std::optional<EmptyInitScope> empty;                 // every rank but the main process
  std::optional<tp::detail::KeepWholeValues> wholes;   // the main process, under tensor parallelism
  std::optional<DeferredInitScope> deferred;           // the process whose sharding groups compute their values
};

namespace {

// Whether this process records the build instead of running it, each sharding group then computing its
// values when it is made (DeepSpeed's zero.Init), so that no process holds the whole model: rank-0 loading's
// main process; one process sharding at stage 3 (with offload) when fsdp_cpu_ram_efficient_loading or
// DeepSpeed's zero3_init_flag asks; and every process under DeepSpeed ZeRO-3 when zero3_init_flag asks (unset:
// on, as Accelerate's default at ZeRO-3; rank 0 computes each group's values and sends them), but not under
// tensor parallelism (which slices whole values) or hybrid sharding (whose replicas start from the whole model).
// Under pipeline stages every process records, and computes its own stage's layers alone when prepare() cuts them,
// unless zero3_init_flag or fsdp_cpu_ram_efficient_loading is set false, or under pp x tp.
bool records_build(const AcceleratorImpl& s, bool rank0_loading, bool tp_loading, bool main_process) {
  if (tp_loading) return false;
  if (rank0_loading) return main_process;
  const auto& settings = s.state->settings();
  if (s.plan.mesh.pp > 1)  // pp x tp: whole on every rank (a recording's values are not sliced)
    return s.plan.mesh.tp == 1 && !(settings.deepspeed && settings.deepspeed->zero3_init_flag == false) &&
           !(settings.fsdp && !settings.fsdp->cpu_ram_efficient_loading);
  if (s.plan.strategy != "zero3") return false;  // one process shards when it offloads
  const bool zero_init = settings.deepspeed && settings.deepspeed->zero3_init_flag.value_or(true);
  if (s.state->world_size() == 1) return zero_init || (settings.fsdp && settings.fsdp->cpu_ram_efficient_loading);
  const auto& zero = s.plan.data_parallel.zero;
  const int dp = s.state->mesh().size(MeshDim::dp_cp);
  return zero_init && s.plan.mesh.pp == 1 && s.plan.mesh.tp == 1 &&
         (zero.hybrid_shard_size == 0 || zero.hybrid_shard_size == dp);
}

// Module::to for everything but the deferred tensors, which their groups make on the device.
void move_all_but_deferred(torch::nn::Module& module, const at::Device& device) {
  auto move = [&](at::Tensor t) {
    if (!is_deferred(t) && t.device() != device) t.set_data(t.to(device));
  };
  for (const auto& p : module.parameters()) move(p);
  for (const auto& b : module.buffers()) move(b);
}

}  // namespace

std::shared_ptr<Accelerator::ModelBuild> Accelerator::begin_model_build() {
  auto building = std::make_shared<ModelBuild>();
  const bool rank0 = rank0_loading(), tp = tp_loading(), from_main = rank0 || tp;
  if (from_main && !is_main_process()) building->empty.emplace();
  if (from_main && is_main_process() && tp) building->wholes.emplace();
  if (records_build(*impl_, rank0, tp, is_main_process())) building->deferred.emplace();
  return building;
}

void Accelerator::build_failed(ModelBuild& building) {
  if (!building.deferred) throw;
  std::string what = "unknown exception";
  try {
    throw;
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  if (impl_->plan.mesh.pp > 1)
    throw Error(fmt::format("{}\nxlr8: build_model recorded the build (DeferredInitScope) so that each pipeline stage "
                            "computes its own layers alone; a build that cannot be recorded runs whole when the "
                            "model is built without build_model and passed to prepare() (or with zero3_init_flag / "
                            "fsdp_cpu_ram_efficient_loading false)",
                            what));
  throw Error(fmt::format("{}\nxlr8: build_model recorded the build (DeferredInitScope), as fsdp_cpu_ram_efficient_loading "
                          "or DeepSpeed's zero3_init_flag (on at ZeRO-3 unless set) asks; a build that cannot be "
                          "recorded runs whole with that setting false",
                          what));
}

void Accelerator::built_model(const std::shared_ptr<torch::nn::Module>& module, ModelBuild& building) {
  building.empty.reset();
  if (!module) throw Error("build_model(): the model is null");
  auto& s = *impl_;
  if (building.deferred) {
    // The generator ends as the whole build leaves it; buffers (small, and read before the groups are
    // made) get their values now, the parameters as their sharding groups are made.
    try {
      building.deferred->finish(*module, s.device);
      materialize(module->buffers());
    } catch (...) {
      build_failed(building);
    }
  }
  if (tp_loading()) {
    // The main process keeps every whole value (those a plan sliced inside build() included) until
    // prepare() has sent them; the others stay on the meta device until the plan has sliced them.
    AcceleratorImpl::BuiltForTp built{module, {}};
    if (building.wholes) {
      for (const auto& item : module->named_parameters()) built.wholes[item.key()] = building.wholes->whole_of(item.value());
      for (const auto& item : module->named_buffers()) built.wholes[item.key()] = building.wholes->whole_of(item.value());
    }
    building.wholes.reset();
    s.built_for_tp_loading.push_back(std::move(built));
  } else if (rank0_loading()) {
    if (!is_main_process()) to_empty(*module, s.device);  // untouched memory; prepare() fills its shards
    s.built_for_rank0_loading.push_back(module);
  } else {
    return;
  }
  // The main process's initialisers drew random numbers, the others' did not: every rank continues
  // from the main process's generator, as when every rank builds the model.
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto state = generator.get_state();
  s.world().broadcast(state, 0);
  if (!is_main_process()) generator.set_state(state);
}

// The values a model built for rank-0 or tensor-parallel loading still lacks come from the main process; every
// model moves to the device. Returns whether the strategy must send rank 0's values to the other ranks.
bool AcceleratorImpl::complete_values(const std::shared_ptr<torch::nn::Module>& module) {
  auto& tp_built = built_for_tp_loading;
  std::erase_if(tp_built, [](const auto& b) { return b.module.expired(); });
  auto tp_it = std::find_if(tp_built.begin(), tp_built.end(), [&](const auto& b) { return b.module.lock() == module; });
  if (tp_it != tp_built.end()) {
    auto wholes = std::move(tp_it->wholes);
    tp_built.erase(tp_it);
    tp::detail::take_whole_values_from_main(*module, world(), wholes, device);
  }
  if (has_deferred(*module)) move_all_but_deferred(*module, device);
  else module->to(device);
  auto& built = built_for_rank0_loading;
  std::erase_if(built, [](const auto& weak) { return weak.expired(); });
  auto it = std::find_if(built.begin(), built.end(), [&](const auto& weak) { return weak.lock() == module; });
  const bool values_from_rank0 = it != built.end();  // the other ranks hold no values until the strategy sends them
  if (values_from_rank0) built.erase(it);
  return values_from_rank0;
}

}  // namespace xlr8
