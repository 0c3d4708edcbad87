#include "accelerate/portable_state.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ATen/ATen.h>

#include <map>
#include <set>

#include "checkpoint/sharded_pieces.hpp"
#include "compat/torch_compat.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {
namespace {

using checkpoints::model_key;

// Every prepared model's parameter pieces on this rank, where each optimizer leaf is among them, and which
// parameters are tensor-parallel slices.
struct Layout {
  std::vector<std::vector<ParameterPiece>> pieces;  // per model
  std::map<const c10::TensorImpl*, std::pair<size_t, size_t>> leaves;  // leaf -> (model, piece)
  std::vector<std::map<std::string, tp::SliceLayout>> slices;  // per model, by parameter name

  explicit Layout(const AcceleratorImpl& s) {
    for (size_t i = 0; i < s.models.size(); ++i) {
      slices.push_back(tp::slice_layouts(*s.models[i]->module()));
      pieces.push_back(s.models[i]->parameter_pieces());
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
  // The layout of a sliced parameter, or null.
  const tp::SliceLayout* slice_of(size_t model, const std::string& name) const {
    auto it = slices[model].find(name);
    return it == slices[model].end() ? nullptr : &it->second;
  }
};

std::string optimizer_key(size_t optimizer, size_t model, const std::string& name, const std::string& state) {
  return fmt::format("optimizer{}/{}/{}", optimizer, model_key(model, name), state);
}

// Which elements of a piece's `values` this rank writes: all of them when sharded (and it is the
// writer); an even share of each whole parameter when every rank holds it, so replicas write in parallel.
// Under tensor parallelism a slice is held by the ranks of one tp coordinate (they share its writing), and
// a parameter the plan left whole is held alike by every tp peer (sharded, the first of them writes).
std::pair<int64_t, int64_t> written_range(const ParallelStrategy& strategy, const ParameterPiece& piece,
                                          const Communicator& world, const DeviceMesh& mesh, bool sliced) {
  const int64_t n = piece.values.numel();
  if (!piece.writes || n == 0) return {0, 0};
  if (!strategy.replicated()) return !sliced && mesh.size(MeshDim::tp) > 1 && mesh.rank(MeshDim::tp) != 0 ? std::pair<int64_t, int64_t>{0, 0}
                                                                                            : std::pair<int64_t, int64_t>{0, n};
  const int writers = sliced ? mesh.size(MeshDim::dp_cp) : world.size(), me = sliced ? mesh.rank(MeshDim::dp_cp) : world.rank();
  const int64_t share = (n + writers - 1) / writers;
  const int64_t a = std::min(n, share * me);
  return {a, std::min(n, a + share)};
}

// Where a tensor-parallel slice lies in the whole: one box per fused part (the slice stacks them on dim 0),
// each `numel` elements of the slice flattened from `local_begin`.
struct SliceBox {
  std::vector<int64_t> offsets, sizes;
  int64_t local_begin = 0, numel = 0;
};

std::vector<SliceBox> slice_boxes(const tp::SliceLayout& layout, const std::vector<int64_t>& local_sizes) {
  const auto dim = static_cast<size_t>(layout.dim);
  const int n = layout.group.size();
  std::vector<SliceBox> boxes;
  int64_t whole_begin = 0, local_begin = 0;
  for (const int64_t width : layout.parts) {
    SliceBox box{std::vector<int64_t>(local_sizes.size(), 0), local_sizes};
    box.sizes[dim] = width / n;
    box.offsets[dim] = whole_begin + layout.group.rank() * (width / n);
    box.numel = 1;
    for (auto d : box.sizes) box.numel *= d;
    box.local_begin = local_begin;
    local_begin += box.numel;
    whole_begin += width;
    boxes.push_back(std::move(box));
  }
  return boxes;
}

// Elements [start, start + count) of a slice flattened, read from whatever layout saved the whole.
at::Tensor read_slice(const checkpoints::PieceReader& reader, const std::string& key, const std::vector<SliceBox>& boxes,
                      int64_t start, int64_t count) {
  std::vector<at::Tensor> parts;
  for (const auto& box : boxes) {
    const int64_t a = std::max(start, box.local_begin), b = std::min(start + count, box.local_begin + box.numel);
    if (a < b) parts.push_back(reader.read_box(key, box.offsets, box.sizes, a - box.local_begin, b - a));
  }
  if (parts.empty()) return at::empty({0}, at::TensorOptions().dtype(reader.find(key)->dtype));  // a rank's empty shard
  return parts.size() == 1 ? parts.front() : at::cat(parts);
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

}  // namespace

bool models_saved_sharded(const AcceleratorImpl& s) {
  bool sharded = false;
  for (const auto& m : s.models) sharded = sharded || !m->replicated();
  if (!sharded) return false;
  const auto& settings = s.state->settings();
  if (settings.fsdp) return settings.fsdp->state_dict_type != "FULL_STATE_DICT";
  return true;  // DeepSpeed writes each rank's partition
}

std::vector<bool> collect_portable_state(const AcceleratorImpl& s, bool models_as_pieces, checkpoints::RankPieces& out,
                                         nlohmann::json& state) {
  const Layout layout(s);
  auto& world = s.world();
  const auto& mesh = s.state->mesh();
  // A slice's elements go out box by box, in the whole tensor's coordinates.
  auto add = [&](std::string key, const ParameterPiece& piece, const at::Tensor& values, std::pair<int64_t, int64_t> r,
                 const tp::SliceLayout* slice) {
    if (r.first >= r.second) return;
    auto flat = values.detach().reshape(-1);
    if (!slice) {
      out.pieces.push_back({std::move(key), piece.shape, flat.narrow(0, r.first, r.second - r.first), piece.start + r.first});
      return;
    }
    const int64_t begin = piece.start + r.first, end = piece.start + r.second;
    for (const auto& box : slice_boxes(*slice, piece.shape)) {
      const int64_t a = std::max(begin, box.local_begin), b = std::min(end, box.local_begin + box.numel);
      if (a < b)
        out.pieces.push_back({key, slice->whole_sizes, flat.narrow(0, a - piece.start, b - a), a - box.local_begin,
                              box.offsets, box.sizes});
    }
  };
  if (models_as_pieces)
    for (size_t i = 0; i < s.models.size(); ++i) {
      for (const auto& piece : layout.pieces[i]) {
        const auto* slice = layout.slice_of(i, piece.name);
        add(model_key(i, piece.name), piece, piece.values,
            written_range(*s.models[i], piece, world, mesh, slice != nullptr), slice);
      }
      if (world.rank() == 0)  // buffers are the same everywhere: the main process writes them whole
        for (const auto& item : s.models[i]->module()->named_buffers()) {
          const auto& b = item.value();
          out.pieces.push_back({model_key(i, item.key()), b.sizes().vec(), b.detach().reshape(-1), 0});
        }
    }
  std::vector<bool> portable;
  for (size_t j = 0; j < s.optimizers.size(); ++j) {
    const auto& optimizer = *s.optimizers[j]->optimizer;
    portable.push_back(optimizer_portable(optimizer, layout));
    state["optimizer_formats"].push_back(portable.back() ? *checkpoints::portable_optimizer_kind(optimizer) : "archive");
    state["optimizer_lrs"].push_back(learning_rates(optimizer));
    if (!portable.back()) continue;
    for (const auto& group : optimizer.param_groups())
      for (const auto& leaf : group.params()) {
        size_t model = 0;
        const auto* piece = layout.find(leaf, &model);
        auto param_state = checkpoints::read_parameter_state(optimizer, leaf);
        if (!param_state) continue;
        const auto* slice = layout.slice_of(model, piece->name);
        const auto range = written_range(*s.models[model], *piece, world, mesh, slice != nullptr);
        for (const auto& [name, tensor] : param_state->tensors)
          add(optimizer_key(j, model, piece->name, name), *piece, tensor, range, slice);
        for (const auto& [name, value] : param_state->counters)
          out.counters[optimizer_key(j, model, piece->name, name)] = value;
      }
  }
  return portable;
}

PortableLoad read_portable_state(const AcceleratorImpl& s, const checkpoints::Verified& saved, const nlohmann::json& st) {
  const Layout layout(s);
  const checkpoints::PieceReader reader(saved);
  const auto where = saved.dir().string();
  // A piece of a tensor-parallel slice is read from its boxes; any other from the whole's flat range.
  auto read_piece = [&](size_t model, const std::string& key, const ParameterPiece& piece, int64_t count) {
    const auto* slice = layout.slice_of(model, piece.name);
    if (!slice) return reader.read(key, piece.start, count);
    return read_slice(reader, key, slice_boxes(*slice, piece.shape), piece.start, count);
  };
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
    for (const auto& piece : layout.pieces[i]) {
      const auto* slice = layout.slice_of(i, piece.name);
      check(piece.name, slice ? slice->whole_sizes : piece.shape);  // a slice: the whole's
    }
    for (const auto& item : s.models[i]->module()->named_buffers()) check(item.key(), item.value().sizes().vec());
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
        copies.push_back({piece.values, read_piece(i, model_key(i, piece.name), piece, piece.values.numel())});
    for (const auto& item : s.models[i]->module()->named_buffers())
      copies.push_back({item.value(), reader.read(model_key(i, item.key()), 0, item.value().numel())});
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
        checkpoints::ParameterState state;
        for (const auto& name : checkpoints::state_tensor_names(*kind)) {
          const auto key = optimizer_key(j, model, piece->name, name);
          if (!reader.find(key)) continue;
          state.tensors[name] = read_piece(model, key, *piece, leaf.numel());
        }
        if (auto step = reader.counter(optimizer_key(j, model, piece->name, "step"))) state.counters["step"] = *step;
        const bool any = !state.tensors.empty() || !state.counters.empty();
        target.leaves.emplace_back(leaf, any ? std::optional(std::move(state)) : std::nullopt);
      }
  }
  return load;
}

void apply_model_state(AcceleratorImpl& s, const PortableLoad& load) {
  {
    at::NoGradGuard no_grad;
    for (const auto& copies : load.models)
      for (const auto& c : copies) c.target.detach().copy_(c.values.view(c.target.sizes()));
  }
  for (auto& m : s.models) m->parameter_pieces_loaded();
}

void apply_optimizer_state(AcceleratorImpl& s, const PortableLoad& load) {
  for (size_t j = 0; j < load.optimizers.size(); ++j) {
    const auto& target = load.optimizers[j];
    if (!target.portable) continue;
    auto& optimizer = *s.optimizers[j]->optimizer;
    for (const auto& [leaf, state] : target.leaves) {
      if (state) checkpoints::write_parameter_state(optimizer, leaf, *state);
      else optimizer.state().erase(compat::optimizer_state_key(leaf));
    }
    for (size_t g = 0; g < target.lrs.size(); ++g) optimizer.param_groups()[g].options().set_lr(target.lrs[g]);
  }
}

}  // namespace xlr8
