// Replaying a deferred build: the operators a set of storages depends on (a backward slice over the
// storages each operator reads, writes and overwrites whole), run on the CPU with each storage's memory
// given back as soon as no later operator reads it. A storage overwritten whole (a Linear's initialiser
// redone by the model's own init) holds nothing between the two writes, so a replay holds about one
// tensor at a time besides what it keeps.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "parallel/recompute/deferred_recording.hpp"
#include "xlr8/error.hpp"

namespace xlr8::deferred {

at::Tensor state_of(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

bool same_state(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

c10::Storage new_storage(size_t nbytes) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/true);
}

namespace {

// For each operator of `wanted`, the storages no later operator needs once it has run.
std::vector<std::vector<size_t>> dead_after(const Recording& rec, const std::vector<size_t>& wanted,
                                            const std::vector<size_t>& kept) {
  std::vector<std::vector<size_t>> dead(wanted.size());
  std::unordered_set<size_t> live(kept.begin(), kept.end());
  for (size_t k = wanted.size(); k-- > 0;) {
    const auto& op = rec.ops[wanted[k]];
    std::unordered_set<size_t> touched(op.reads.begin(), op.reads.end());
    touched.insert(op.writes.begin(), op.writes.end());
    for (size_t s : touched)
      if (!live.count(s)) dead[k].push_back(s);
    for (size_t s : op.kills) live.erase(s);
    live.insert(op.reads.begin(), op.reads.end());
  }
  return dead;
}

// Rebuilds an argument with each recorded tensor replaced by `real(k)`, k counting tensors in order.
template <class Real>
c10::IValue with_real_tensors(const c10::IValue& value, Real&& real, size_t& k) {
  bool any = false;
  for_each_tensor(value, [&](const at::Tensor&) { any = true; });
  if (!any) return value;  // lists of numbers stay as they are
  if (value.isTensor()) return value.toTensor().defined() ? c10::IValue(real(k++)) : value;
  if (value.isTensorList()) {
    c10::List<at::Tensor> list;
    for (const at::Tensor& t : value.toTensorList()) list.push_back(t.defined() ? real(k++) : t);
    return list;
  }
  if (value.isList()) {
    c10::impl::GenericList list(value.toList().elementType());
    for (const auto& element : value.toListRef()) list.push_back(with_real_tensors(element, real, k));
    return list;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& element : value.toTupleRef().elements()) elements.push_back(with_real_tensors(element, real, k));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return value;
}

class Replayer {
 public:
  explicit Replayer(Recording& rec) : rec_(rec) {}

  void run(RecordedOp& op, bool first_run) {
    if (!first_run)
      for (auto& [generator, state] : op.generators_before) set_state(generator, state);
    std::vector<std::pair<at::Generator, at::Tensor>> explicit_before;
    if (first_run)
      for (const auto& input : op.inputs)
        if (input.isGenerator()) {
          auto generator = input.toGenerator();
          explicit_before.emplace_back(generator, state_of(generator));
        }
    torch::jit::Stack stack;
    size_t k = 0;
    auto real = [&](size_t i) { return tensor_for(op.input_uses.at(i)); };
    for (const auto& input : op.inputs) stack.push_back(with_real_tensors(input, real, k));
    try {
      op.op.callBoxed(stack);
    } catch (const c10::Error& e) {
      throw Error(fmt::format("deferred init: replaying {} failed: {}", op.op.schema().name(), e.what_without_backtrace()));
    }
    adopt_outputs(op, stack);
    if (first_run) op.generators_before = std::move(explicit_before);
  }

  void drop(size_t storage) { buffers_.erase(storage); }
  std::unordered_map<size_t, c10::Storage>& buffers() { return buffers_; }

 private:
  at::Tensor tensor_for(const TensorUse& use) {
    auto it = buffers_.find(use.storage);
    if (it == buffers_.end()) {
      const auto& info = rec_.storages.at(use.storage);
      // Written whole before it is read (or never written, as an empty tensor left so by the build); a real
      // tensor the build read is copied, as an operator may write it.
      c10::Storage storage = info.external ? info.external->clone().storage() : new_storage(info.nbytes);
      it = buffers_.emplace(use.storage, std::move(storage)).first;
    }
    return view_of(it->second, use);
  }

  void adopt_outputs(const RecordedOp& op, const torch::jit::Stack& stack) {
    std::unordered_set<const c10::StorageImpl*> input_memory;
    for (const auto& u : op.input_uses)
      if (auto it = buffers_.find(u.storage); it != buffers_.end()) input_memory.insert(it->second.unsafeGetStorageImpl());
    std::vector<at::Tensor> results;
    const size_t n_out = op.op.schema().returns().size();
    for (size_t i = stack.size() - n_out; i < stack.size(); ++i)
      for_each_tensor(stack[i], [&](const at::Tensor& t) { results.push_back(t); });
    if (results.size() != op.output_uses.size())
      throw Error(fmt::format("deferred init: {} returned {} tensors when replayed, {} when recorded",
                              op.op.schema().name(), results.size(), op.output_uses.size()));
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& use = op.output_uses[i];
      if (!use.made_here) continue;  // a view of, or written into, an input
      const auto& t = results[i];
      if (!t.device().is_cpu() || t.sizes() != c10::IntArrayRef(use.sizes) || t.scalar_type() != use.dtype)
        throw Error(fmt::format("deferred init: {} made a {} tensor of shape {} when replayed, a {} of shape {} when "
                                "recorded; build the model on the CPU (the Accelerator moves it)",
                                op.op.schema().name(), t.device().str(), fmt::join(t.sizes(), "x"),
                                c10::toString(use.dtype), fmt::join(use.sizes, "x")));
      const bool aliases = input_memory.count(t.storage().unsafeGetStorageImpl()) > 0;  // x.to(kCPU) returns x
      if (!aliases && t.strides() == c10::IntArrayRef(use.strides) && t.storage_offset() == use.offset) {
        buffers_[use.storage] = t.storage();
        continue;
      }
      // New on the meta device: its own memory, laid out as recorded (later views are rebuilt from that).
      auto own = new_storage(rec_.storages.at(use.storage).nbytes);
      view_of(own, use).copy_(t);
      buffers_[use.storage] = std::move(own);
    }
  }

  Recording& rec_;
  std::unordered_map<size_t, c10::Storage> buffers_;
};

}  // namespace

at::Tensor view_of(const c10::Storage& storage, const TensorUse& use) {
  auto t = at::empty({0}, at::TensorOptions().dtype(use.dtype).device(storage.device()));
  t.set_(storage, use.offset, use.sizes, use.strides);
  return t;
}

std::vector<size_t> slice_for(const Recording& rec, const std::vector<size_t>& storages) {
  std::unordered_set<size_t> needed(storages.begin(), storages.end());
  std::vector<size_t> slice;
  for (size_t i = rec.ops.size(); i-- > 0;) {
    const auto& op = rec.ops[i];
    if (std::none_of(op.writes.begin(), op.writes.end(), [&](size_t s) { return needed.count(s) > 0; })) continue;
    slice.push_back(i);
    for (size_t s : op.kills) needed.erase(s);
    needed.insert(op.reads.begin(), op.reads.end());
  }
  std::reverse(slice.begin(), slice.end());
  return slice;
}

// Puts back, however the replay ends, the states of the generators a replay sets (the caller's streams go
// on as before); the first run leaves them where the whole build would.
class GeneratorsKept {
 public:
  GeneratorsKept(Recording& rec, const std::vector<size_t>& wanted, bool first_run) {
    if (first_run) return;
    auto cpu = at::detail::getDefaultCPUGenerator();
    saved_.emplace_back(cpu, state_of(cpu));
    for (size_t i : wanted)
      for (const auto& input : rec.ops[i].inputs)
        if (input.isGenerator()) {
          auto generator = input.toGenerator();
          saved_.emplace_back(generator, state_of(generator));
        }
  }
  ~GeneratorsKept() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) set_state(it->first, it->second);
  }
  GeneratorsKept(const GeneratorsKept&) = delete;
  GeneratorsKept& operator=(const GeneratorsKept&) = delete;

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

std::unordered_map<size_t, c10::Storage> replay(Recording& rec, const std::vector<size_t>& wanted,
                                                const std::vector<size_t>& kept, bool first_run) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Meta))
    throw Error("deferred init: materialize() inside an EmptyInitScope or DeferredInitScope; call it outside");
  at::NoGradGuard no_grad;
  auto cpu = at::detail::getDefaultCPUGenerator();
  GeneratorsKept kept_generators(rec, wanted, first_run);
  auto state = state_of(cpu);
  const auto dead = dead_after(rec, wanted, kept);
  Replayer replayer(rec);
  for (size_t k = 0; k < wanted.size(); ++k) {
    auto& op = rec.ops[wanted[k]];
    replayer.run(op, first_run);
    if (first_run) {  // which operators draw: those that move the generator
      auto after = state_of(cpu);
      if (!same_state(state, after)) op.generators_before.emplace_back(cpu, state);
      state = std::move(after);
    }
    for (size_t s : dead[k]) replayer.drop(s);
  }
  std::unordered_map<size_t, c10::Storage> values;
  for (size_t s : kept) {
    auto it = replayer.buffers().find(s);
    if (it == replayer.buffers().end()) throw Error("internal: deferred init lost a value it was asked to keep");
    values.emplace(s, it->second);
  }
  return values;
}

}  // namespace xlr8::deferred
