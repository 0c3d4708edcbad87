#include "accelerate/portable_state.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ATen/ATen.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>

#include "checkpoint/sharded_pieces.hpp"
#include "compat/torch_compat.hpp"
#include "core/log.hpp"
#include "core/text.hpp"
#include "xlr8/env.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

using checkpoints::model_key;

// Every prepared model's parameter pieces on this rank, and where each optimizer leaf is among them.
struct Layout {
  std::vector<std::vector<ParameterPiece>> pieces;  // per model
  std::map<const c10::TensorImpl*, std::pair<size_t, size_t>> leaves;  // leaf -> (model, piece)

  explicit Layout(const AcceleratorImpl& s) {
    for (size_t i = 0; i < s.models.size(); ++i) {
      pieces.push_back(s.models[i]->parameter_pieces_where_they_are());
      for (size_t k = 0; k < pieces.back().size(); ++k)
        leaves[pieces.back()[k].values.unsafeGetTensorImpl()] = {i, k};
    }
  }
  const ParameterPiece* find(const at::Tensor& leaf, size_t* model = nullptr) const {
    auto it = leaves.find(leaf.unsafeGetTensorImpl());
    if (it == leaves.end()) return nullptr;
    if (model) *model = it->second.first;
    return &pieces[it->second.first][it->second.second];
  }
};

std::string optimizer_key(size_t optimizer, size_t model, const std::string& name, const std::string& state) {
  return fmt::format("optimizer{}/{}/{}", optimizer, model_key(model, name), state);
}

// Which of a piece's elements this rank writes: all of them when sharded (and it is the writer); an even
// share of each whole parameter when every rank holds it, so replicas write in parallel. Under tensor
// parallelism a slice is held by the ranks of one tp coordinate (they share its writing), and a parameter
// the plan left whole is held alike by every tp peer (sharded, the first of them writes).
Placement written_part(const ParallelStrategy& strategy, const ParameterPiece& piece, const Communicator& world,
                       const DeviceMesh& mesh) {
  const auto& held = piece.placement;
  const int64_t n = held.count();
  const bool sliced = !held.unsplit();
  if (!piece.writes || n == 0) return held.chunk(0, 0);
  if (!strategy.replicated())
    return !sliced && mesh.size(MeshDim::tp) > 1 && mesh.rank(MeshDim::tp) != 0 ? held.chunk(0, 0) : held;
  // Under pp only the ranks of this stage hold it: pp is the mesh's outermost dimension, so they are consecutive.
  const int holders = world.size() / mesh.size(MeshDim::pp);
  const int writers = sliced ? mesh.size(MeshDim::dp_cp) : holders;
  const int me = sliced ? mesh.rank(MeshDim::dp_cp) : world.rank() % holders;
  const int64_t share = (n + writers - 1) / writers;
  const int64_t begin = std::min(n, share * me);
  return held.chunk(begin, std::min(n, begin + share) - begin);
}

// The elements of `values` (shaped as the piece's values) that `part`, a chunk of the piece, names.
at::Tensor mine(const ParameterPiece& piece, const Placement& part, const at::Tensor& values) {
  return values.detach().reshape(-1).narrow(0, part.start() - piece.placement.start(), part.count());
}

bool optimizer_portable(const torch::optim::Optimizer& optimizer, const Layout& layout) {
  if (!checkpoints::portable_optimizer_kind(optimizer)) return false;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (!layout.find(p)) return false;  // it updates a tensor no prepared model has
  return true;
}

std::vector<double> learning_rates(const torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (const auto& group : optimizer.param_groups()) out.push_back(group.options().get_lr());
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// `items` reordered to keep the tensors of one storage together (storages in the order they first appear). A flat
// group's leaves share its storage, and the module's order alternates between groups (a block's weights in its
// unit's group, its biases and norms in the persistent one): offload's disk tier then brings each group into memory
// once, not once per switch.
template <class T, class TensorOf>
std::vector<const T*> grouped_by_storage(const std::vector<T>& items, TensorOf tensor_of) {
  std::vector<const c10::StorageImpl*> order;
  std::unordered_map<const c10::StorageImpl*, std::vector<const T*>> by_storage;
  for (const auto& item : items) {
    const at::Tensor& t = tensor_of(item);
    const auto* key = t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
    auto& list = by_storage[key];
    if (list.empty()) order.push_back(key);
    list.push_back(&item);
  }
  std::vector<const T*> out;
  for (const auto* key : order) out.insert(out.end(), by_storage[key].begin(), by_storage[key].end());
  return out;
}

}  // namespace

bool models_saved_sharded(const AcceleratorImpl& s) {
  if (s.pipeline) return true;  // no rank holds the whole model: each stage writes its pieces
  bool sharded = false;
  for (const auto& m : s.models) sharded = sharded || !m->replicated();
  if (!sharded) return false;
  const auto& settings = s.state->settings();
  if (settings.fsdp) return settings.fsdp->state_dict_type != "FULL_STATE_DICT";
  return true;  // DeepSpeed writes each rank's partition
}

std::vector<bool> collect_portable_state(const AcceleratorImpl& s, bool models_as_pieces, checkpoints::RankPieces& out,
                                         nlohmann::json& state, const std::shared_ptr<GroupInMemory>& held) {
  const Layout layout(s);
  auto& world = s.world();
  const auto& mesh = s.state->mesh();
  if (models_as_pieces)
    for (size_t i = 0; i < s.models.size(); ++i) {
      for (const auto* in_order : grouped_by_storage(layout.pieces[i], [](const auto& p) -> auto& { return p.values; })) {
        const auto& piece = *in_order;
        const auto part = written_part(*s.models[i], piece, world, mesh);
        out.add_later(model_key(i, piece.name), part, piece.values.scalar_type(),
                      [held, &model = *s.models[i], piece, part] {
                        held->hold(model, piece.values, nullptr, HoldFor::reading);
                        return mine(piece, part, piece.values);
                      });
      }
      // Buffers are the same on every rank of a stage: its first rank writes them whole.
      if (world.rank() % (world.size() / mesh.size(MeshDim::pp)) == 0)
        for (const auto& item : s.models[i]->module()->named_buffers())
          out.add(model_key(i, item.key()), Placement::whole_tensor(item.value().sizes().vec()), item.value());
    }
  std::vector<bool> portable;
  for (size_t j = 0; j < s.optimizers.size(); ++j) {
    auto& optimizer = *s.optimizers[j]->optimizer;
    portable.push_back(optimizer_portable(optimizer, layout));
    state["optimizer_formats"].push_back(portable.back() ? *checkpoints::portable_optimizer_kind(optimizer) : "archive");
    state["optimizer_lrs"].push_back(learning_rates(optimizer));
    if (!portable.back()) continue;
    std::vector<at::Tensor> leaves;
    for (const auto& group : optimizer.param_groups())
      leaves.insert(leaves.end(), group.params().begin(), group.params().end());
    for (const auto* in_order : grouped_by_storage(leaves, [](const at::Tensor& t) -> auto& { return t; })) {
      const auto& leaf = *in_order;
      size_t model = 0;
      const auto* piece = layout.find(leaf, &model);
      auto param_state = checkpoints::read_parameter_state(optimizer, leaf);
      if (!param_state) continue;
      const auto part = written_part(*s.models[model], *piece, world, mesh);
      for (const auto& [name, tensor] : param_state->tensors)
        out.add_later(optimizer_key(j, model, piece->name, name), part, tensor.scalar_type(),
                      [held, &owner = *s.models[model], &optimizer, leaf, state_name = name, piece = *piece, part] {
                        held->hold(owner, leaf, &optimizer, HoldFor::reading);
                        const auto now = checkpoints::read_parameter_state(optimizer, leaf);
                        if (!now || !now->tensors.count(state_name))
                          throw Error(fmt::format("save_state: the optimizer's {} of {} went while it was saved",
                                                  state_name, piece.name));
                        return mine(piece, part, now->tensors.at(state_name));
                      });
      for (const auto& [name, value] : param_state->counters)
        out.counters[optimizer_key(j, model, piece->name, name)] = value;
    }
  }
  return portable;
}

namespace {

// XLR8_TEST_ONLY_FAIL_CHECKPOINT_READ=<rank>:<n>: on that rank, the n-th read in this process fails as an I/O error
// would, past the checks (for the tests of what such a failure leaves); the reads after it succeed. Null elsewhere.
std::shared_ptr<std::atomic<int>> reads_before_injected_failure(int rank) {
  const auto spec = env_var("XLR8_TEST_ONLY_FAIL_CHECKPOINT_READ");
  if (!spec) return nullptr;
  int failing_rank = -1, nth = 0;
  if (std::sscanf(spec->c_str(), "%d:%d", &failing_rank, &nth) != 2)
    throw ConfigError(fmt::format("XLR8_TEST_ONLY_FAIL_CHECKPOINT_READ={:?} must be <rank>:<n> (a test's; unset it)",
                                  *spec));
  static const auto reads_left = std::make_shared<std::atomic<int>>(nth);  // over the process's loads: one failure
  return failing_rank == rank ? reads_left : nullptr;
}

// The checkpoint's reader, shared with the reads a streamed load leaves for later.
struct Reads {
  std::shared_ptr<const checkpoints::PieceReader> reader;
  std::shared_ptr<std::atomic<int>> reads_left;  // reads_before_injected_failure's

  at::Tensor read(const std::string& key, const Placement& placement) const {
    if (reads_left && --*reads_left == 0)
      throw Error(fmt::format("reading {}: an injected failure (XLR8_TEST_ONLY_FAIL_CHECKPOINT_READ)", key));
    return reader->read(key, placement);
  }
};

// Offload's disk tier (`stream`): checked now (in the index, its shape, the files' CRC32), read when called, so that a
// state larger than memory is loaded. Otherwise read now: a load changes nothing until everything was read.
std::function<at::Tensor()> read_later(const Reads& reads, const std::string& key, const Placement& placement,
                                       bool stream) {
  if (!stream) return [values = reads.read(key, placement)] { return values; };
  reads.reader->check(key, placement);
  return [reads, key, placement] { return reads.read(key, placement); };
}

// The state optimizer `j` saved for a piece of model `model`, checked now and read when called (none when the
// checkpoint holds none for it).
std::function<std::optional<checkpoints::ParameterState>()> state_read_later(const Reads& reads,
                                                                            const std::string& kind, size_t j,
                                                                            size_t model, const ParameterPiece& piece,
                                                                            bool stream) {
  std::vector<std::pair<std::string, std::function<at::Tensor()>>> tensors;
  for (const auto& name : checkpoints::state_tensor_names(kind))
    if (const auto key = optimizer_key(j, model, piece.name, name); reads.reader->find(key))
      tensors.emplace_back(name, read_later(reads, key, piece.placement, stream));
  const auto step = reads.reader->counter(optimizer_key(j, model, piece.name, "step"));
  return [tensors = std::move(tensors), step]() -> std::optional<checkpoints::ParameterState> {
    if (tensors.empty() && !step) return std::nullopt;
    checkpoints::ParameterState out;
    for (const auto& [name, read] : tensors) out.tensors[name] = read();
    if (step) out.counters["step"] = *step;
    return out;
  };
}

}  // namespace

PortableLoad read_portable_state(const AcceleratorImpl& s, const checkpoints::Verified& saved, const nlohmann::json& st) {
  const Layout layout(s);
  const Reads reads{std::make_shared<const checkpoints::PieceReader>(saved),
                    reads_before_injected_failure(s.world().rank())};
  const auto& reader = *reads.reader;
  auto later = [&](size_t model, const std::string& key, const Placement& placement) {
    return read_later(reads, key, placement, s.models[model]->keeps_state_on_disk());
  };
  const auto where = saved.dir().string();
  PortableLoad load;
  for (size_t i = 0; i < s.models.size(); ++i) {
    // Exactly the model's tensors, by name and shape, before anything is read.
    std::vector<std::string> missing, mismatched;
    std::set<std::string> expected;
    auto check = [&](const std::string& name, const std::vector<int64_t>& shape) {
      expected.insert(model_key(i, name));
      const auto* entry = reader.find(model_key(i, name));
      if (!entry) missing.push_back(name);
      else if (entry->shape != shape)
        mismatched.push_back(fmt::format("{} ({} saved, {} in the model)", name, shape_text(entry->shape), shape_text(shape)));
    };
    for (const auto& piece : layout.pieces[i]) check(piece.name, piece.placement.whole());
    for (const auto& item : s.models[i]->module()->named_buffers()) check(item.key(), item.value().sizes().vec());
    // Under pp the stage reads its own tensors; the other stages' are the whole model's, expected in the file.
    if (s.pipeline)
      for (const auto& [name, t] : module_state_dict(*s.pipelined_model)) expected.insert(model_key(i, name));
    std::vector<std::string> unexpected;
    const auto prefix = model_key(i, "");
    for (const auto& [key, entry] : reader.tensors())
      if (key.rfind(prefix, 0) == 0 && !expected.count(key)) unexpected.push_back(key.substr(prefix.size()));
    if (!missing.empty() || !mismatched.empty() || !unexpected.empty())
      throw Error(fmt::format("load_state: model {} of {} does not match the prepared model: missing {}, mismatched "
                              "{}, unexpected {}{}; nothing was loaded",
                              i, where, text::listing(missing), text::listing(mismatched), text::listing(unexpected),
                              text::prefix_hint(missing, unexpected)));
    auto& copies = load.models.emplace_back();
    for (const auto& piece : layout.pieces[i])
      if (piece.values.numel() > 0)
        copies.push_back({s.models[i].get(), piece.values, later(i, model_key(i, piece.name), piece.placement)});
    for (const auto& item : s.models[i]->module()->named_buffers())
      copies.push_back({nullptr, item.value(),
                        later(i, model_key(i, item.key()), Placement::whole_tensor(item.value().sizes().vec()))});
  }
  auto formats = st.value("optimizer_formats", nlohmann::json::array());
  auto lrs = st.value("optimizer_lrs", nlohmann::json::array());
  for (size_t j = 0; j < s.optimizers.size(); ++j) {
    auto& target = load.optimizers.emplace_back();
    const auto& optimizer = *s.optimizers[j]->optimizer;
    const std::string saved_format = j < formats.size() ? formats[j].get<std::string>() : "archive";
    if (saved_format == "archive") continue;
    const auto kind = checkpoints::portable_optimizer_kind(optimizer);
    if (kind != saved_format || !optimizer_portable(optimizer, layout))
      throw Error(fmt::format("load_state: optimizer {} of {} holds {} state, but the prepared optimizer is {}; "
                              "prepare the same optimizer type; nothing was loaded",
                              j, where, saved_format, kind.value_or("of a type without portable state")));
    target.portable = true;
    if (j < lrs.size()) target.lrs = lrs[j].get<std::vector<double>>();
    if (target.lrs.size() != optimizer.param_groups().size())
      throw Error(fmt::format("load_state: optimizer {} of {} has {} parameter group(s), the prepared one {}; nothing "
                              "was loaded",
                              j, where, target.lrs.size(), optimizer.param_groups().size()));
    for (const auto& group : optimizer.param_groups())
      for (const auto& leaf : group.params()) {
        size_t model = 0;
        const auto* piece = layout.find(leaf, &model);
        target.leaves.push_back({leaf, s.models[model].get(),
                                 state_read_later(reads, *kind, j, model, *piece,
                                                  s.models[model]->keeps_state_on_disk())});
      }
  }
  return load;
}

void apply_model_state(AcceleratorImpl&, const PortableLoad& load) {
  at::NoGradGuard no_grad;
  GroupInMemory held;  // parameters on disk: a group's shard read, written and put back before the next
  for (const auto& copies : load.models)
    for (const auto* c : grouped_by_storage(copies, [](const auto& copy) -> auto& { return copy.target; })) {
      if (c->model) held.hold(*c->model, c->target, nullptr, HoldFor::writing);
      c->target.detach().copy_(c->values().view(c->target.sizes()));
    }
  held.release();
}

void apply_optimizer_state(AcceleratorImpl& s, const PortableLoad& load) {
  for (size_t j = 0; j < load.optimizers.size(); ++j) {
    const auto& target = load.optimizers[j];
    if (!target.portable) continue;
    auto& optimizer = *s.optimizers[j]->optimizer;
    GroupInMemory held;  // state on disk: a group's in memory, replaced and written before the next
    for (const auto* l : grouped_by_storage(target.leaves, [](const auto& leaf) -> auto& { return leaf.leaf; })) {
      held.hold(*l->model, l->leaf, &optimizer, HoldFor::writing);
      if (auto state = l->state()) checkpoints::write_parameter_state(optimizer, l->leaf, *state);
      else optimizer.state().erase(compat::optimizer_state_key(l->leaf));
    }
    held.release();
    for (size_t g = 0; g < target.lrs.size(); ++g) optimizer.param_groups()[g].options().set_lr(target.lrs[g]);
  }
}

OptimizerStateInMemory::OptimizerStateInMemory(AcceleratorImpl& s, std::vector<torch::optim::Optimizer*> optimizers)
    : s_(s), optimizers_(std::move(optimizers)) {
  each(true);
}

OptimizerStateInMemory::~OptimizerStateInMemory() {
  try {
    each(false);
  } catch (const std::exception& e) {  // the state stays in memory, where the next step still finds it
    log::warning("xlr8: the optimizer state could not go back to disk after the checkpoint ({}); it stays in memory",
                 e.what());
  }
}

void OptimizerStateInMemory::each(bool in_memory) {
  for (auto* o : optimizers_)
    for (const auto& m : s_.models) m->optimizer_state_in_memory(*o, in_memory);
}

}  // namespace xlr8
