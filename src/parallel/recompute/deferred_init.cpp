// DeferredInitScope: EmptyInitScope's meta tensors, with the DeferredInit dispatch key (the one LibTorch
// keeps for this purpose, above autograd) included on the thread, whose fallback records each operator the
// build calls (not those it calls inside: they run on the meta device only) with the storages it reads and
// writes. The registry maps each deferred parameter or buffer to its recording.
#include "xlr8/deferred_init.hpp"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <fmt/format.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_set>

#include "os/memory.hpp"
#include "parallel/recompute/deferred_recording.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace deferred {
namespace {

thread_local Recording* recording_now = nullptr;
thread_local const c10::impl::LocalDispatchKeySet* keys_outside = nullptr;  // this thread's before the scope

// Operators that write every element of their first argument without reading it.
bool overwrites_first_argument(std::string_view name) {
  static const std::unordered_set<std::string_view> names = {
      "aten::uniform_", "aten::normal_",     "aten::fill_",  "aten::zero_",      "aten::random_",   "aten::bernoulli_",
      "aten::exponential_", "aten::cauchy_", "aten::log_normal_", "aten::geometric_", "aten::copy_"};
  return names.count(name) > 0;
}

void classify(RecordedOp& r) {
  const auto& schema = r.op.schema();
  const bool overwrites = overwrites_first_argument(schema.name());
  std::unordered_set<size_t> inputs;
  for (const auto& u : r.input_uses) {
    inputs.insert(u.storage);
    const auto* alias = schema.arguments()[u.argument].alias_info();
    if (alias && alias->isWrite()) {
      r.writes.push_back(u.storage);
      if (overwrites && u.argument == 0 && u.covers_storage) {
        r.kills.push_back(u.storage);
        continue;
      }
    }
    r.reads.push_back(u.storage);
  }
  for (auto& u : r.output_uses)
    if (!inputs.count(u.storage)) {  // a new tensor: made here
      u.made_here = true;
      r.writes.push_back(u.storage);
      r.kills.push_back(u.storage);
    }
}

void record_operator(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto* rec = recording_now;
  if (!rec) throw Error("internal: the DeferredInit dispatch key is on without a DeferredInitScope on this thread");
  const auto& schema = op.schema();
  RecordedOp r{op, {}, {}, {}, {}, {}, {}, {}};
  const size_t n_in = schema.arguments().size();
  r.inputs.assign(stack->end() - static_cast<std::ptrdiff_t>(n_in), stack->end());
  const size_t known = rec->storages.size();
  for (size_t a = 0; a < n_in; ++a) {
    auto& input = r.inputs[a];
    if (input.isStorage())
      throw Error(fmt::format("deferred init: {} takes a storage; build the model without set_() on storages",
                              schema.name()));
    if (input.isDevice() && input.toDevice().is_meta()) input = c10::IValue(at::Device(at::kCPU));  // x.options()
    for_each_tensor(input, [&](const at::Tensor& t) {
      r.input_uses.push_back(rec->use_of(t, a));
      if (t.is_meta() && r.input_uses.back().storage >= known)  // no recorded operator made it
        throw Error(fmt::format("deferred init: {} read a meta tensor made outside this DeferredInitScope (an "
                                "EmptyInitScope's, or another deferred model's); make every tensor the build "
                                "reads inside it, or materialize() that model first",
                                schema.name()));
    });
  }
  if (!rec->generator_moved) {  // a seed set inside the build shows as another state (cheap: ~5 KB compared)
    c10::impl::ForceDispatchKeyGuard outside(*keys_outside);
    auto cpu = at::detail::getDefaultCPUGenerator();
    rec->generator_moved = !same_state(state_of(cpu), rec->generator_at_start);
  }
  {
    c10::impl::ExcludeDispatchKeyGuard inner_calls_unrecorded(c10::DispatchKey::DeferredInit);
    op.callBoxed(stack);
  }
  const size_t n_out = schema.returns().size();
  for (size_t k = 0; k < n_out; ++k)
    for_each_tensor(*(stack->end() - static_cast<std::ptrdiff_t>(n_out - k)),
                    [&](const at::Tensor& t) { r.output_uses.push_back(rec->use_of(t, k)); });
  classify(r);
  if (!r.writes.empty()) rec->ops.push_back(std::move(r));  // views and queries need no replay
}

TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&record_operator>()); }

struct Registered {
  std::shared_ptr<Recording> recording;
  size_t target = 0;
};
std::mutex registry_mutex;
std::unordered_map<const c10::TensorImpl*, Registered>& registry() {
  static auto* map = new std::unordered_map<const c10::TensorImpl*, Registered>();  // outlives static destructors
  return *map;
}

// A real tensor the build read: its whole storage copied now, outside the scope, as its value then.
at::Tensor copy_of_storage(const at::Tensor& real) {
  c10::impl::ForceDispatchKeyGuard outside(*keys_outside);
  const TensorUse every_byte{.dtype = at::kByte, .sizes = {static_cast<int64_t>(real.storage().nbytes())}, .strides = {1}};
  return view_of(real.storage(), every_byte).clone();
}

}  // namespace

TensorUse Recording::use_of(const at::Tensor& t, size_t argument) {
  if (!t.has_storage())
    throw Error(fmt::format("deferred init: a tensor without storage ({}) cannot be recorded; build the model with "
                            "dense tensors",
                            t.toString()));
  const auto* key = t.storage().unsafeGetStorageImpl();
  auto [it, added] = storage_index.try_emplace(key, storages.size());
  if (added) {
    StorageInfo info{t.storage().nbytes(), std::nullopt};
    if (!t.is_meta()) info.external = copy_of_storage(t);
    storages.push_back(std::move(info));
    meta_storages.push_back(t.storage());
  }
  TensorUse u;
  u.storage = it->second;
  u.dtype = t.scalar_type();
  u.sizes = t.sizes().vec();
  u.strides = t.strides().vec();
  u.offset = t.storage_offset();
  u.covers_storage = u.offset == 0 && t.is_non_overlapping_and_dense() &&
                     static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
  storages[u.storage].nbytes = std::max(storages[u.storage].nbytes, t.storage().nbytes());  // resize_ grows it
  u.argument = argument;
  return u;
}

}  // namespace deferred

struct DeferredInitScope::Impl {
  std::shared_ptr<deferred::Recording> recording = std::make_shared<deferred::Recording>();
  c10::impl::LocalDispatchKeySet outside = c10::impl::tls_local_dispatch_key_set();
  deferred::Recording* outer_recording = deferred::recording_now;
  const c10::impl::LocalDispatchKeySet* outer_keys = deferred::keys_outside;
  std::optional<EmptyInitScope> empty;
  std::optional<c10::impl::IncludeDispatchKeyGuard> recorded;
  std::thread::id thread = std::this_thread::get_id();
  bool open = false;

  void close() {
    if (!open) return;
    recorded.reset();
    empty.reset();
    deferred::recording_now = outer_recording;
    deferred::keys_outside = outer_keys;
    open = false;
  }
};

DeferredInitScope::DeferredInitScope() : impl_(std::make_unique<Impl>()) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Meta))
    throw Error("DeferredInitScope inside an EmptyInitScope or another DeferredInitScope: open one of them");
  auto cpu = at::detail::getDefaultCPUGenerator();
  impl_->recording->generator_at_start = deferred::state_of(cpu);  // the build must not move it
  deferred::recording_now = impl_->recording.get();
  deferred::keys_outside = &impl_->outside;
  impl_->empty.emplace();
  impl_->recorded.emplace(c10::DispatchKey::DeferredInit);
  impl_->open = true;
}

DeferredInitScope::~DeferredInitScope() { impl_->close(); }

void DeferredInitScope::finish(torch::nn::Module& module, const at::Device& device) {
  if (!impl_->open) throw Error("DeferredInitScope::finish: already finished");
  if (std::this_thread::get_id() != impl_->thread)
    throw Error("DeferredInitScope::finish: call it on the thread that opened the scope");
  impl_->close();
  auto cpu = at::detail::getDefaultCPUGenerator();
  auto rec = std::move(impl_->recording);
  if (rec->generator_moved || !deferred::same_state(deferred::state_of(cpu), rec->generator_at_start))
    throw Error("deferred init: the build moved the CPU generator itself (manual_seed, or drawing from it outside "
                "an operator), even if it set it back; seed before build_model / the DeferredInitScope, not inside "
                "(a DeepSpeed PipelineModule seeds each layer: it builds only its stage's layers anyway, so build it "
                "without build_model)");
  rec->device = device;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_meta() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    if (!t.has_storage() || !rec->storage_index.count(t.storage().unsafeGetStorageImpl())) return;  // made before
    rec->targets.push_back({t.getIntrusivePtr(), rec->use_of(t, 0), t.unsafeGetTensorImpl()->version_counter().current_version()});
  };
  for (const auto& p : module.parameters()) add(p);
  for (const auto& b : module.buffers()) add(b);
  rec->done.assign(rec->targets.size(), false);
  // Freed tensors must go back to the system at once, or glibc's heap keeps each one (its mmap threshold
  // rises to the size of the last tensor freed) and the replays hold the whole model after all.
  os::PromptlyFreedMemory prompt;
  // Run once in order, keeping nothing: the generator ends where the whole build leaves it, and each
  // drawing operator's generator state is known for later.
  std::vector<size_t> every(rec->ops.size());
  std::iota(every.begin(), every.end(), size_t{0});
  try {
    deferred::replay(*rec, every, {}, /*first_run=*/true);
  } catch (...) {  // the build failed: the generator goes back to where it was, as if it had not run
    deferred::set_state(cpu, rec->generator_at_start);
    throw;
  }
  std::lock_guard<std::mutex> lock(deferred::registry_mutex);
  for (size_t i = 0; i < rec->targets.size(); ++i) deferred::registry()[rec->targets[i].tensor.get()] = {rec, i};
}

bool is_deferred(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.is_meta()) return false;
  std::lock_guard<std::mutex> lock(deferred::registry_mutex);
  return deferred::registry().count(tensor.unsafeGetTensorImpl()) > 0;
}

bool has_deferred(const torch::nn::Module& module) {
  for (const auto& p : module.parameters())
    if (is_deferred(p)) return true;
  for (const auto& b : module.buffers())
    if (is_deferred(b)) return true;
  return false;
}

namespace {

// A write or a replaced value since finish() would be lost silently: refused before any work.
void check_unchanged(const deferred::Recording& rec, size_t t) {
  const auto& target = rec.targets[t];
  const auto* impl = target.tensor.get();
  const bool replaced = !impl->has_storage() ||
                        impl->storage().unsafeGetStorageImpl() != rec.meta_storages[target.use.storage].unsafeGetStorageImpl() ||
                        impl->dtype() != c10::scalarTypeToTypeMeta(target.use.dtype) ||
                        impl->sizes() != c10::IntArrayRef(target.use.sizes);
  if (replaced || impl->version_counter().current_version() != target.version)
    throw Error("deferred init: a parameter or buffer of a deferred model was written or replaced after the build "
                "(in place, set_data, to(dtype), before its values exist): do it inside build_model's build(), or "
                "after prepare(); or build the model whole (zero3_init_flag / fsdp_cpu_ram_efficient_loading false; "
                "under pipeline stages, without build_model)");
}

// Materialises the targets `wanted` of one recording, with every target sharing their storages: their
// values computed, or (`compute` false) uninitialised memory on the device for values that will come from
// elsewhere.
void materialize_targets(deferred::Recording& rec, std::vector<size_t> wanted, bool compute) {
  std::unordered_set<size_t> storages;
  for (size_t t : wanted) storages.insert(rec.targets[t].use.storage);
  for (size_t t = 0; t < rec.targets.size(); ++t)
    if (!rec.done[t] && storages.count(rec.targets[t].use.storage) &&
        std::find(wanted.begin(), wanted.end(), t) == wanted.end())
      wanted.push_back(t);
  for (size_t t : wanted) check_unchanged(rec, t);
  const std::vector<size_t> kept(storages.begin(), storages.end());
  std::unordered_map<size_t, c10::Storage> values;
  if (compute) values = deferred::replay(rec, deferred::slice_for(rec, kept), kept, /*first_run=*/false);
  else
    for (size_t s : kept) {
      const auto bytes = static_cast<int64_t>(rec.meta_storages[s].nbytes());
      values.emplace(s, at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(rec.device)).storage());
    }
  for (size_t t : wanted) {
    auto& target = rec.targets[t];
    auto real = deferred::view_of(values.at(target.use.storage), target.use);
    if (rec.device != real.device()) real = real.to(rec.device);
    // The same tensor object gets the values (its autograd identity stays), as to_empty does.
    target.tensor->shallow_copy_from(real.getIntrusivePtr());
    rec.done[t] = true;
    deferred::registry().erase(target.tensor.get());
  }
}

size_t give_values(const std::vector<at::Tensor>& tensors, bool compute) {
  os::PromptlyFreedMemory prompt;  // as in finish()
  std::lock_guard<std::mutex> lock(deferred::registry_mutex);
  std::vector<std::pair<std::shared_ptr<deferred::Recording>, std::vector<size_t>>> by_recording;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    auto it = deferred::registry().find(t.unsafeGetTensorImpl());
    if (it == deferred::registry().end()) continue;
    auto& [rec, target] = it->second;
    auto group = std::find_if(by_recording.begin(), by_recording.end(), [&](const auto& g) { return g.first == rec; });
    if (group == by_recording.end()) group = by_recording.insert(by_recording.end(), {rec, {}});
    if (std::find(group->second.begin(), group->second.end(), target) == group->second.end())
      group->second.push_back(target);
  }
  size_t count = 0;
  for (auto& [rec, wanted] : by_recording) {
    count += wanted.size();
    materialize_targets(*rec, std::move(wanted), compute);
  }
  return count;
}

}  // namespace

size_t materialize(const std::vector<at::Tensor>& tensors) { return give_values(tensors, /*compute=*/true); }

size_t materialize_empty(const std::vector<at::Tensor>& tensors) { return give_values(tensors, /*compute=*/false); }

void check_deferred_unchanged(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(deferred::registry_mutex);
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    auto it = deferred::registry().find(t.unsafeGetTensorImpl());
    if (it != deferred::registry().end()) check_unchanged(*it->second.recording, it->second.target);
  }
}

size_t deferred::forget(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(deferred::registry_mutex);
  size_t count = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_meta()) continue;
    auto it = deferred::registry().find(t.unsafeGetTensorImpl());
    if (it == deferred::registry().end()) continue;
    it->second.recording->done[it->second.target] = true;  // a target sharing its storage leaves it alone
    deferred::registry().erase(it);
    ++count;
  }
  return count;
}

void materialize_module(const torch::nn::Module& module) {
  auto tensors = module.parameters();
  for (const auto& b : module.buffers()) tensors.push_back(b);
  materialize(tensors);
}

}  // namespace xlr8
