#pragma once
// What a DeferredInitScope records: the operators a model's build ran on meta tensors, described by the
// storages they read and write, so that any set of final tensors can be recomputed alone.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

namespace xlr8::deferred {

// One tensor argument or result of a recorded operator: where it lies in which storage.
struct TensorUse {
  size_t storage = 0;  // index into Recording::storages
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  bool covers_storage = false;  // dense over every byte of its storage
  size_t argument = 0;          // the schema argument (or return) it came from
  bool made_here = false;       // a result in a storage no argument had: the operator made it
};

struct RecordedOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> inputs;  // each tensor inside stands for the next entry of `input_uses`
  std::vector<TensorUse> input_uses, output_uses;
  std::vector<size_t> reads, writes, kills;  // storages; a kill overwrites all of one without reading it
  // Set by the first run: the generators this operator drew from, each with its state before.
  std::vector<std::pair<at::Generator, at::Tensor>> generators_before;
};

struct StorageInfo {
  size_t nbytes = 0;
  std::optional<at::Tensor> external;  // a real tensor the build read (its value copied when recorded)
};

struct Target {  // a parameter or buffer of the finished module
  c10::intrusive_ptr<c10::TensorImpl> tensor;
  TensorUse use;
  uint32_t version = 0;  // its version counter when the build ended: an in-place write since is refused
};

struct Recording {
  std::vector<RecordedOp> ops;
  std::vector<StorageInfo> storages;
  std::unordered_map<const c10::StorageImpl*, size_t> storage_index;
  std::vector<c10::Storage> meta_storages;  // kept so that their addresses stay unique
  std::vector<Target> targets;
  std::vector<bool> done;  // per target
  at::Device device = at::kCPU;
  // The CPU generator's state when the scope opened, and whether an operator found it elsewhere: seeded inside
  // the build (the replay draws from the start state alone, so a seed inside would be lost), even if restored.
  at::Tensor generator_at_start;
  bool generator_moved = false;

  TensorUse use_of(const at::Tensor& meta, size_t argument);  // registers its storage when new
};

// Calls f on each defined tensor in `value`, in a fixed order (lists and tuples included).
template <class F>
void for_each_tensor(const c10::IValue& value, F&& f) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) f(value.toTensor());
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList())
      if (t.defined()) f(t);
  } else if (value.isList()) {
    for (const auto& element : value.toListRef()) for_each_tensor(element, f);
  } else if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements()) for_each_tensor(element, f);
  }
}

// Runs the operators `wanted` (indices into rec.ops, ascending), keeping the final values of the storages
// `kept`; returns them (index → a real storage). Restores each drawing operator's generator state first,
// unless `first_run`, which runs every operator in order and records those states instead.
std::unordered_map<size_t, c10::Storage> replay(Recording& rec, const std::vector<size_t>& wanted,
                                                const std::vector<size_t>& kept, bool first_run);
// The operators the values of `storages` depend on, ascending.
std::vector<size_t> slice_for(const Recording& rec, const std::vector<size_t>& storages);
// A real tensor as `use` describes it, over `storage`.
at::Tensor view_of(const c10::Storage& storage, const TensorUse& use);
// Uninitialised CPU memory for a storage of `nbytes`.
c10::Storage new_storage(size_t nbytes);
// A generator's state, taken and set under its lock; whether two states are the same.
at::Tensor state_of(at::Generator& generator);
void set_state(at::Generator& generator, const at::Tensor& state);
bool same_state(const at::Tensor& a, const at::Tensor& b);

// Drops the recordings of the deferred tensors among `tensors`, which will never get values (a pipeline's other
// stages' layers); they stay meta tensors until given other data. Returns how many were deferred.
size_t forget(const std::vector<at::Tensor>& tensors);

}  // namespace xlr8::deferred
