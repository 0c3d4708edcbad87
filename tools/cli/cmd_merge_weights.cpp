// `xlr8 merge-weights CHECKPOINT OUT`: Accelerate's `accelerate merge-weights` and DeepSpeed's
// zero_to_fp32.py. Turns a checkpoint's model (each rank's shards, or a whole model file) into Hugging
// Face safetensors, tensor by tensor: each tensor is read from the ranges the ranks wrote, converted,
// written and dropped, so the peak memory is about the largest tensor, not the model.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "checkpoint/hf_export.hpp"
#include "checkpoint/sharded_pieces.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "cli/commands.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8::cli {
namespace {

std::optional<at::ScalarType> parse_dtype(const std::string& text) {
  if (text.empty()) return std::nullopt;
  if (text == "fp32" || text == "float32") return at::kFloat;
  if (text == "bf16" || text == "bfloat16") return at::kBFloat16;
  if (text == "fp16" || text == "float16") return at::kHalf;
  throw ConfigError(fmt::format("--dtype {:?} is not a dtype merge-weights writes; use fp32, bf16 or fp16", text));
}

struct Args {
  std::string checkpoint, out, max_shard_size = "10GB", dtype;
  size_t model = 0;
};

// DeepSpeed's checkpoint root (what zero_to_fp32.py takes): a directory whose `latest` file names the tag saved
// last. Followed as DeepSpeed follows it; any other directory is the checkpoint itself.
std::string followed_latest(const std::string& checkpoint) {
  const fs::path dir = checkpoints::directory_path(checkpoint);
  if (!fs::is_regular_file(dir / "latest") || fs::exists(dir / "MANIFEST.json")) return checkpoint;
  std::ifstream file(dir / "latest");
  std::string tag;
  std::getline(file, tag);
  if (tag.empty())
    throw ConfigError(fmt::format("merge-weights: {} is empty; it should name the tag of the checkpoint saved last (give "
                                  "that checkpoint's directory instead)",
                                  (dir / "latest").string()));
  if (!fs::is_directory(dir / tag))
    throw ConfigError(fmt::format("merge-weights: {} names the tag {:?}, but {} does not exist", (dir / "latest").string(),
                                  tag, (dir / tag).string()));
  fmt::print("merge-weights: {} names the tag {:?}: merging {}\n", (dir / "latest").string(), tag, (dir / tag).string());
  return (dir / tag).string();
}

int merge(Args a) {
  a.checkpoint = followed_latest(a.checkpoint);
  const auto dtype = parse_dtype(a.dtype);
  const int64_t limit = checkpoints::parse_size(a.max_shard_size);
  if (!fs::is_directory(checkpoints::directory_path(a.checkpoint)))
    throw ConfigError(fmt::format("merge-weights: checkpoint {} does not exist; give a directory save_state wrote "
                                  "(such as <project_dir>/checkpoints/checkpoint_0)",
                                  a.checkpoint));
  // The output must not be the checkpoint or inside it (its model.safetensors would be overwritten), nor a file.
  std::error_code ignored;
  const auto source = fs::weakly_canonical(checkpoints::directory_path(a.checkpoint), ignored);
  const auto target = fs::weakly_canonical(fs::absolute(a.out), ignored);
  const auto [end, rest] = std::mismatch(source.begin(), source.end(), target.begin(), target.end());
  if (end == source.end())
    throw ConfigError(fmt::format("merge-weights: output {} is the checkpoint {} or inside it, whose files it would "
                                  "overwrite; give another directory",
                                  a.out, a.checkpoint));
  if (fs::exists(a.out, ignored) && !fs::is_directory(a.out, ignored))
    throw ConfigError(fmt::format("merge-weights: output {} is a file; give a directory to write into", a.out));
  const checkpoints::Verified saved(checkpoints::directory_path(a.checkpoint));
  const checkpoints::PieceReader reader(saved);
  // The model's own order (parameters, then buffers) when the checkpoint records it; else by name.
  const auto prefix = checkpoints::model_key(a.model, "");
  std::vector<std::string> names;
  auto state = saved.state();
  if (state.contains("model_tensors") && a.model < state["model_tensors"].size())
    names = state["model_tensors"][a.model].get<std::vector<std::string>>();
  else
    for (const auto& [key, entry] : reader.tensors())
      if (key.rfind(prefix, 0) == 0) names.push_back(key.substr(prefix.size()));
  if (names.empty())
    throw ConfigError(fmt::format("{} holds no model {} (--model counts the prepared models from 0)", a.checkpoint,
                                  a.model));
  std::vector<SafetensorsSpec> specs;
  int64_t bytes = 0;
  for (const auto& name : names) {
    const auto* entry = reader.find(prefix + name);
    if (!entry) throw Error(fmt::format("{} lists {:?} but holds no data for it", a.checkpoint, name));
    specs.push_back({name, dtype && at::isFloatingType(entry->dtype) ? *dtype : entry->dtype, entry->shape});
    bytes += entry->numel() * static_cast<int64_t>(at::elementSize(specs.back().dtype));
  }
  checkpoints::export_hf_model(
      specs,
      [&](size_t i) {
        const auto* entry = reader.find(prefix + names[i]);
        return reader.read(prefix + names[i], Placement::whole_tensor(entry->shape)).view(entry->shape).to(specs[i].dtype);
      },
      a.out, limit);
  const bool sharded = !saved.has(checkpoints::model_file(a.model));
  fmt::print("merged {} tensors ({:.1f} MB) of {} ({}) into {}\n", specs.size(), bytes / 1e6, a.checkpoint,
             sharded ? fmt::format("sharded over {} rank(s)", saved.saved_world_size()) : "a whole model file",
             (fs::path(a.out) / (fs::exists(fs::path(a.out) / "model.safetensors.index.json") ? "model.safetensors.index.json"
                                                                                              : "model.safetensors"))
                 .string());
  return 0;
}

}  // namespace

Handler add_merge_weights(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "merge-weights", "Merge a checkpoint's model (sharded over ranks or whole) into Hugging Face safetensors");
  auto a = std::make_shared<Args>();
  cmd->add_option("checkpoint", a->checkpoint, "A directory save_state wrote, or a DeepSpeed checkpoint root (its latest file names the tag)")->required();
  cmd->add_option("output", a->out, "Directory to write model.safetensors (or shards and their index) into")->required();
  cmd->add_option("--max_shard_size,--max-shard-size", a->max_shard_size,
                  "Largest file before the model is split into shards plus model.safetensors.index.json");
  cmd->add_option("--dtype", a->dtype, "fp32, bf16 or fp16 (default: as saved, fp32 for fp32 training)");
  cmd->add_option("--model", a->model, "Which prepared model, when the checkpoint holds several (default 0)");
  return [a]() {
    try {
      return merge(*a);
    } catch (const ConfigError&) {
      throw;
    } catch (const Error& e) {  // the checkpoint readers speak for load_state; here merge-weights was run
      std::string message = e.what();
      if (message.starts_with("load_state: ")) message.replace(0, 10, "merge-weights");
      throw Error(message);
    }
  };
}

}  // namespace xlr8::cli
