// Accelerator::save_model / load_model: the whole model in Hugging Face's layout (model.safetensors, or shards and
// their index), written as each rank's pieces stream in, and read by rank 0 into every rank's part one tensor at a time.
#include <fmt/ranges.h>

#include <map>
#include <optional>

#include "accelerate/accelerator_impl.hpp"
#include "checkpoint/hf_export.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "core/text.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

void Accelerator::save_module(const torch::nn::Module& module, const std::string& dir, const std::string& max_shard_size) const {
  // The size is parsed on every rank: a bad one fails them all.
  write_full_model(*impl_, module, dir, checkpoints::parse_size(max_shard_size));
}

void write_full_model(const AcceleratorImpl& impl, const torch::nn::Module& module, const std::string& dir,
                      int64_t limit) {
  std::unique_ptr<checkpoints::HfModelWriter> writer;
  stream_full_state(
      impl, module, fmt::format("save_model({:?})", dir),
      [&](std::vector<SafetensorsSpec> specs) {
        writer = checkpoints::filesystem_guard(fmt::format("save_model({:?})", dir), [&] {
          return std::make_unique<checkpoints::HfModelWriter>(dir, std::move(specs), limit);
        });
      },
      [&](const at::Tensor& t) { writer->write(t); },
      [&] { checkpoints::filesystem_guard(fmt::format("save_model({:?})", dir), [&] { writer->finish(); return 0; }); });
}

namespace {

// What load_model copies: for each tensor name, where the part this rank holds goes.
struct LoadTarget {
  at::Tensor values;    // a parameter's piece or a whole buffer
  Placement placement;  // which elements of the file's (whole) tensor `values` holds
  at::Tensor whole;     // the parameter itself when sharded and it holds memory now (written whole too)
};

// Rank 0's verdict on a model file against the model: the names to load, in order, with dtype and size;
// or why not.
nlohmann::json plan_load(const std::string& path, const std::map<std::string, LoadTarget>& targets,
                         const std::vector<std::string>& order, bool strict,
                         std::optional<checkpoints::HfModelReader>& reader) {
  try {
    reader.emplace(path);
  } catch (const Error& e) {
    return {{"problem", std::string("load_model: ") + e.what()}};
  }
  std::vector<std::string> missing, mismatched, unexpected;
  nlohmann::json plan = nlohmann::json::array();
  for (const auto& name : order) {
    auto it = reader->tensors().find(name);
    if (it == reader->tensors().end()) {
      missing.push_back(name);
      continue;
    }
    const auto& shape = targets.at(name).placement.whole();
    if (it->second.shape != shape) {
      mismatched.push_back(fmt::format("{} ([{}] in the file, [{}] in the model)", name, fmt::join(it->second.shape, ", "),
                                       fmt::join(shape, ", ")));
      continue;
    }
    plan.push_back({{"name", name},
                    {"dtype", safetensors_dtype_code(it->second.dtype)},
                    {"numel", targets.at(name).placement.whole_numel()}});
  }
  for (const auto& [name, entry] : reader->tensors())
    if (!targets.count(name)) unexpected.push_back(name);
  if (!mismatched.empty() || (strict && (!missing.empty() || !unexpected.empty()))) {
    const auto prefix = text::prefix_hint(missing, unexpected);
    // strict = false is a fix only when the two share names and no prefix sets every name apart.
    const bool partial_load_helps = mismatched.empty() && !plan.empty() && prefix.empty();
    return {{"problem", fmt::format("load_model: {} does not match the model: missing {}, mismatched {}, "
                                    "unexpected {}{}{}; nothing was loaded",
                                    path, text::listing(missing), text::listing(mismatched), text::listing(unexpected),
                                    prefix, partial_load_helps ? " (strict = false loads the names both have)" : "")}};
  }
  return {{"plan", plan}};
}

}  // namespace

void Accelerator::load_module(torch::nn::Module& module, const std::string& path, bool strict) {
  impl_->refuse_under_pipeline("load_model()");
  auto& s = *impl_;
  auto* strategy = s.strategy_for(&module);
  if (!strategy && has_deferred(module))  // recorded by build_model: no values to write into yet
    throw Error("load_model() before prepare() on a model build_model recorded (values computed at prepare): load after");
  auto world = s.world();
  const bool collective = strategy && world.size() > 1;
  const bool reads = !collective || world.rank() == 0;
  std::map<std::string, LoadTarget> targets;
  std::vector<std::string> order;
  if (strategy) {
    std::map<std::string, at::Tensor> params;
    for (const auto& item : module.named_parameters()) params[item.key()] = item.value();
    for (auto& piece : strategy->parameter_pieces()) {
      order.push_back(piece.name);
      const auto& p = params.at(piece.name);
      const bool whole = !p.is_same(piece.values) && p.has_storage() && p.storage().nbytes() > 0;
      targets[piece.name] = {piece.values, piece.placement, whole ? p : at::Tensor()};
    }
  } else {
    auto placements = tp::parameter_placements(module);
    for (const auto& item : module.named_parameters()) {
      order.push_back(item.key());
      targets[item.key()] = {item.value(), std::move(placements.at(item.key()))};
    }
  }
  for (const auto& item : module.named_buffers()) {
    order.push_back(item.key());
    targets[item.key()] = {item.value(), Placement::whole_tensor(item.value().sizes().vec())};
  }
  std::optional<checkpoints::HfModelReader> reader;
  nlohmann::json verdict = reads ? plan_load(path, targets, order, strict, reader) : nlohmann::json();
  if (collective) verdict = nlohmann::json::parse(world.broadcast_object(verdict.dump(), 0));
  if (verdict.contains("problem")) throw Error(verdict["problem"].get<std::string>());
  // One tensor at a time: read once (by rank 0 when collective), sent to all, each keeps its part. One
  // buffer per dtype, as large as the largest tensor, serves them all.
  std::map<at::ScalarType, at::Tensor> buffers;
  for (const auto& item : verdict["plan"]) {
    auto& b = buffers[*safetensors_dtype_from_code(item["dtype"])];
    b = at::empty({std::max(b.defined() ? b.numel() : 0, item["numel"].get<int64_t>())},
                  at::TensorOptions().dtype(*safetensors_dtype_from_code(item["dtype"])));
  }
  at::NoGradGuard no_grad;
  for (const auto& item : verdict["plan"]) {
    const auto name = item["name"].get<std::string>();
    const auto& target = targets.at(name);
    at::Tensor whole = buffers.at(*safetensors_dtype_from_code(item["dtype"])).narrow(0, 0, item["numel"].get<int64_t>());
    if (reads) reader->read_into(name, whole);
    if (collective) {
      if (whole.device() != s.device) whole = whole.to(s.device);  // NCCL carries device tensors
      world.broadcast(whole, 0);
    }
    // This rank's part of the whole (every rank received it): a tensor-parallel slice's boxes, a shard's
    // elements of those.
    const auto shaped = whole.view(target.placement.whole());
    if (target.values.numel() > 0) target.values.detach().view(-1).copy_(target.placement.take(shaped));
    // A whole copy the strategy keeps (the parameter the shard is a chunk of) is written here too, so no
    // gather is needed afterwards.
    if (target.whole.defined()) target.whole.detach().view(-1).copy_(target.placement.unchunked().take(shaped));
  }
  if (strategy) strategy->parameter_pieces_loaded(/*whole_parameters_written=*/collective);
}

}  // namespace xlr8
