// `xlr8 estimate-memory`: Accelerate's `accelerate estimate-memory` for C++ users, with the training
// bytes per rank of each strategy. Static memory with Adam (reference/003, "Static Memory" and ZeRO):
//   fp32 training:          parameters 4, gradients 4, Adam moments 8 bytes per parameter (K = 8)
//   bf16 / fp16 (mixed):    parameters 2, gradients 2, fp32 master + moments 12 bytes per parameter (K = 12)
//   per rank on N ranks:    DDP (p + g + K)Ψ; ZeRO-1 (p + g)Ψ + KΨ/N; ZeRO-2 pΨ + (g + K)Ψ/N; ZeRO-3 (p + g + K)Ψ/N
// Activations of a transformer of L layers, hidden size h, a heads, sequence s, batch b (reference/003):
//   L·s·b·h·(34 + 5·a·s/h) bytes with 2-byte activations (twice that in fp32); with full activation
//   checkpointing each layer keeps only its input (2·s·b·h bytes, or 4) and one layer is recomputed at a time.
#include <fmt/format.h>

#include <optional>
#include <nlohmann/json.hpp>

#include "checkpoint/hf_export.hpp"
#include "cli/commands.hpp"
#include "cli/memory_formulas.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"
#include "xlr8/safetensors.hpp"

namespace xlr8::cli {
namespace {

struct Model {
  double parameters = 0;
  // The layers in order (the GPT shape: as examples/gpt's pipeline_layers, a tied head counted again as its
  // PipelineModule counts it), for the cut under pp; empty when unknown.
  std::vector<int64_t> layers;
  std::vector<bool> blocks;   // which of them are transformer blocks (they hold the activations)
  int64_t tied_copy = 0;      // parameters of the last stage's copy of the tied embeddings (no optimizer state)
  double largest_layer = 0;  // parameters of the largest layer (tensor, for a file), 0 when unknown
  std::string largest_name;
  bool has_shape = false;    // layers, hidden size and heads known: activations can be estimated
  int64_t n_layer = 0, d_model = 0, n_head = 0;
};

// Parameters of a safetensors file, a model.safetensors.index.json, or a directory holding either.
Model model_of_file(const std::string& path) {
  std::optional<checkpoints::HfModelReader> reader;
  try {
    reader.emplace(path);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("--model {:?}: {}", path, e.what()));
  }
  Model m;
  for (const auto& [name, e] : reader->tensors()) {
    double count = 1;
    for (auto d : e.shape) count *= static_cast<double>(d);
    m.parameters += count;
    if (count > m.largest_layer) m.largest_layer = count, m.largest_name = name;
  }
  return m;
}

// The GPT example's shape (examples/gpt): embeddings, L blocks of 12h² + 13h, a final norm, an optional head.
Model model_of_gpt(int64_t layers, int64_t d, int64_t heads, int64_t vocab, int64_t seq, bool untied) {
  Model m;
  const double block = 12.0 * d * d + 13.0 * d, embedding = static_cast<double>(vocab) * d;
  m.parameters = embedding + static_cast<double>(seq) * d + layers * block + 2.0 * d + (untied ? embedding : 0);
  m.largest_layer = std::max(block, embedding);
  m.largest_name = block >= embedding ? "a block" : "the token embedding";
  m.has_shape = true;
  m.n_layer = layers, m.d_model = d, m.n_head = heads;
  const auto embeddings = static_cast<int64_t>(vocab * d + seq * d);
  m.layers.push_back(embeddings);
  for (int64_t i = 0; i < layers; ++i) m.layers.push_back(static_cast<int64_t>(block));
  m.layers.push_back(2 * d);
  m.layers.push_back(untied ? vocab * d : embeddings);
  m.blocks.assign(m.layers.size(), false);
  for (int64_t i = 0; i < layers; ++i) m.blocks[static_cast<size_t>(i + 1)] = true;
  m.tied_copy = untied ? 0 : embeddings;
  return m;
}

struct EstimateArgs {
  double params = 0;
  std::string model;
  int64_t n_layer = 0, d_model = 0, n_head = 0, vocab_size = 256, seq_len = 0, batch_size = 1;
  bool untied_head = false, json = false;
  int num_processes = 1;
  int pp_size = 1, pp_microbatches = 0;  // 0: pp_size
  std::string pp_schedule = "1F1B";
  std::vector<std::string> dtypes{"float32", "bfloat16"};
  std::vector<std::string> strategies{"ddp", "zero1", "zero2", "zero3"};
};

// The model the flags describe (exactly one of --params, --model, the GPT shape), its flags checked.
Model model_of_args(const EstimateArgs& a) {
  if (a.params < 0) throw ConfigError(fmt::format("--params {} must be a number of parameters above 0", a.params));
  const int given = (a.params > 0) + !a.model.empty() + (a.n_layer > 0 || a.d_model > 0);
  if (given != 1)
    throw ConfigError("estimate-memory: give exactly one of --params N, --model FILE, or the GPT shape "
                      "(--n_layer, --d_model, --n_head, --seq_len)");
  if (a.num_processes < 1)
    throw ConfigError(fmt::format("--num_processes {} must be 1 or more", a.num_processes));
  if (a.batch_size < 1) throw ConfigError(fmt::format("--batch_size {} must be 1 or more", a.batch_size));
  if (a.pp_size < 1 || a.num_processes % a.pp_size != 0)
    throw ConfigError(fmt::format("--pp_size {} must be 1 or more and divide --num_processes {} (the stages' data "
                                  "parallelism is num_processes / pp_size)",
                                  a.pp_size, a.num_processes));
  if (pp::parse_schedule(a.pp_schedule) == pp::Schedule::Interleaved1F1B)
    throw ConfigError("--pp_schedule Interleaved1F1B is not estimated (its chunks hold another number of "
                      "micro-batches); give GPipe, 1F1B or InterleavedZeroBubble");
  if (a.pp_microbatches < 0) throw ConfigError(fmt::format("--pp_microbatches {} must be 1 or more", a.pp_microbatches));
  Model m;
  if (a.params > 0) m.parameters = a.params;
  else if (!a.model.empty()) m = model_of_file(a.model);
  else {
    if (a.n_layer < 1 || a.d_model < 1 || a.n_head < 1 || a.seq_len < 1 || a.vocab_size < 1)
      throw ConfigError(fmt::format("estimate-memory: the GPT shape needs --n_layer, --d_model, --n_head and "
                                    "--seq_len, all 1 or more (got {}, {}, {}, {})",
                                    a.n_layer, a.d_model, a.n_head, a.seq_len));
    if (a.d_model % a.n_head != 0)
      throw ConfigError(fmt::format("--d_model {} is not a multiple of --n_head {}", a.d_model, a.n_head));
    m = model_of_gpt(a.n_layer, a.d_model, a.n_head, a.vocab_size, a.seq_len, a.untied_head);
  }
  if (!(m.parameters > 0)) throw ConfigError(fmt::format("--params {} must be above 0", m.parameters));
  return m;
}

// One pipeline stage of the model: its own parameters, the tied embeddings' copy it runs (parameters and
// gradients, no optimizer state), its blocks, and the most micro-batches whose activations it holds.
struct Stage {
  double parameters = 0, copy = 0, blocks = 0, held = 1;
};

// The stages a PipelineModule of the GPT shape cuts by parameters (pp::partition, as it does); without the layers,
// an even split. One stage without pp.
std::vector<Stage> stages_of(const EstimateArgs& a, const Model& m) {
  const int p = a.pp_size, micro = a.pp_microbatches > 0 ? a.pp_microbatches : p;
  std::vector<Stage> out(static_cast<size_t>(p));
  // GPipe holds every micro-batch, 1F1B at most p - s of them, InterleavedZeroBubble (one chunk) at most p: stage s
  // defers s micro-batches' weight gradients.
  const auto schedule = pp::parse_schedule(a.pp_schedule);
  for (int s = 0; s < p; ++s)
    out[static_cast<size_t>(s)].held = schedule == pp::Schedule::GPipe                  ? micro
                                       : schedule == pp::Schedule::InterleavedZeroBubble ? std::min(micro, p)
                                                                                         : std::min(micro, p - s);
  if (p == 1 || m.layers.empty()) {
    for (auto& stage : out) stage.parameters = m.parameters / p, stage.blocks = static_cast<double>(m.n_layer) / p;
    return out;
  }
  const auto parts = pp::partition(m.layers, p, pp::Partition::Parameters);
  for (size_t s = 0; s < parts.size(); ++s)
    for (size_t i = parts[s].first; i < parts[s].second; ++i) {
      const bool copy = m.tied_copy > 0 && i + 1 == m.layers.size();
      (copy ? out[s].copy : out[s].parameters) += static_cast<double>(m.layers[i]);
      out[s].blocks += m.blocks[i] ? 1 : 0;
    }
  return out;
}

// Bytes per rank by dtype and strategy (the largest stage's under pp, sharded over its data-parallel ranks), with
// the activations when the shape is known.
nlohmann::json estimate(const EstimateArgs& a, const Model& m) {
  nlohmann::json out{{"parameters", m.parameters}, {"num_processes", a.num_processes}, {"rows", nlohmann::json::array()}};
  if (m.largest_layer > 0) out["largest_layer"] = {{"name", m.largest_name}, {"parameters", m.largest_layer}};
  const auto stages = stages_of(a, m);
  const int dp = a.num_processes / a.pp_size, micro = a.pp_microbatches > 0 ? a.pp_microbatches : a.pp_size;
  if (a.pp_size > 1) {
    out["pp"] = {{"size", a.pp_size}, {"schedule", a.pp_schedule}, {"micro_batches", micro}, {"data_parallel", dp},
                 {"stage_parameters", nlohmann::json::array()}, {"stage_blocks", nlohmann::json::array()},
                 {"tied_copy_parameters", m.tied_copy}};
    for (const auto& stage : stages) {
      out["pp"]["stage_parameters"].push_back(stage.parameters);
      out["pp"]["stage_blocks"].push_back(stage.blocks);
    }
  }
  // A zero-bubble schedule keeps ZeRO-3's units gathered through the step: its parameters are ZeRO-2's.
  const bool gathered_through_step =
      a.pp_size > 1 && pp::parse_schedule(a.pp_schedule) == pp::Schedule::InterleavedZeroBubble;
  for (const auto& text : a.dtypes) {
    const auto d = dtype_bytes(text);
    nlohmann::json row{{"dtype", d.name},
                       {"total_size_bytes", d.param * m.parameters},
                       {"training_bytes_per_rank", nlohmann::json::object()}};
    if (m.largest_layer > 0) row["largest_layer_bytes"] = d.param * m.largest_layer;
    for (const auto& s : a.strategies) {
      const std::string held_as = gathered_through_step && s == "zero3" ? "zero2" : s;
      double most = 0;
      for (const auto& stage : stages)
        most = std::max(most, per_rank(held_as, d, stage.parameters, dp) + (d.param + d.grad) * stage.copy);
      row["training_bytes_per_rank"][s] = most;
    }
    if (m.has_shape) {  // a stage holds `held` micro-batches of batch / micro samples through its blocks
      const double s = static_cast<double>(a.seq_len), h = static_cast<double>(m.d_model);
      const double b = static_cast<double>(a.batch_size) / (a.pp_size > 1 ? micro : 1);  // a micro-batch under pp
      const double heads = static_cast<double>(m.n_head), scale = d.activation / 2;  // the formula's 2-byte values
      const double layer = s * b * h * (34 + 5 * heads * s / h) * scale;
      double plain = 0, checkpointed = 0;
      for (const auto& stage : stages) {
        plain = std::max(plain, stage.blocks * layer * stage.held);
        checkpointed = std::max(checkpointed, stage.blocks * s * b * h * d.activation * stage.held + layer);
      }
      row["activation_bytes"] = plain;
      row["activation_bytes_checkpointed"] = checkpointed;
    }
    out["rows"].push_back(row);
  }
  return out;
}

void print_estimate(const EstimateArgs& a, const Model& m, const nlohmann::json& out) {
  fmt::print("Memory to train a model of {:.4g} parameters with Adam on {} rank(s)", m.parameters, a.num_processes);
  if (m.largest_layer > 0) fmt::print(" (largest layer: {}, {:.4g} parameters)", m.largest_name, m.largest_layer);
  fmt::print("\n\n{:<10} {:>12} {:>14}", "dtype", "total size", "largest layer");
  for (const auto& s : a.strategies) fmt::print(" {:>12}", s);
  if (m.has_shape) fmt::print(" {:>12} {:>12}", "activations", "act. ckpt");
  fmt::print("\n");
  for (const auto& row : out["rows"]) {
    fmt::print("{:<10} {:>12} {:>14}", row["dtype"].get<std::string>(), human(row["total_size_bytes"]),
               row.contains("largest_layer_bytes") ? human(row["largest_layer_bytes"]) : "-");
    for (const auto& s : a.strategies) fmt::print(" {:>12}", human(row["training_bytes_per_rank"][s]));
    if (m.has_shape) fmt::print(" {:>12} {:>12}", human(row["activation_bytes"]), human(row["activation_bytes_checkpointed"]));
    fmt::print("\n");
  }
  if (out.contains("pp"))
    fmt::print("\npp {} ({} over {} micro-batches): the largest stage's state, each stage's over {} data-parallel "
               "rank(s); stages of {} parameters.\n",
               a.pp_size, a.pp_schedule, out["pp"]["micro_batches"].get<int>(), out["pp"]["data_parallel"].get<int>(),
               out["pp"]["stage_parameters"].dump());
  fmt::print("\nPer rank: parameters, gradients and Adam state (fp32 master weights in bf16/fp16); add the "
             "activations{} and framework overhead.\n",
             m.has_shape ? fmt::format(" (batch {} x sequence {})", a.batch_size, a.seq_len) : "");
}

}  // namespace

Handler add_estimate_memory(CLI::App& app) {
  auto* cmd = app.add_subcommand("estimate-memory",
                                 "Estimate the memory of training a model per rank, by dtype and strategy (Adam)");
  cmd->footer(
      "Training bytes per rank with Adam (reference: the ZeRO paper's formulas), Ψ parameters on N ranks:\n"
      "  float32: p = g = 4, K = 8 (moments); bfloat16/float16 (mixed): p = g = 2, K = 12 (fp32 master + moments)\n"
      "  ddp (p+g+K)Ψ   zero1 (p+g)Ψ + KΨ/N   zero2 pΨ + (g+K)Ψ/N   zero3 (p+g+K)Ψ/N\n"
      "Activations of L layers, hidden h, a heads, sequence s, batch b: L·s·b·h·(34 + 5·a·s/h) bytes with\n"
      "2-byte activations (twice in float32); with full activation checkpointing each layer keeps its input\n"
      "(s·b·h values) and one layer's activations are recomputed at a time.\n"
      "Under --pp_size P: the model cut by parameters as a PipelineModule cuts it (the GPT shape; else an even\n"
      "split), each stage's state sharded over num_processes / P ranks, the largest stage's shown (a tied head's\n"
      "copy on the last stage adds its parameters and gradients); a stage holds M micro-batches of b / M under\n"
      "GPipe, at most P - stage of them under 1F1B and P under InterleavedZeroBubble, which also keeps zero3's\n"
      "parameters gathered through the step (zero3 then holds zero2's pΨ).");
  auto a = std::make_shared<EstimateArgs>();
  cmd->add_option("--params", a->params, "Number of parameters, such as 7e9")->check(number_in(0, false, 1e18));
  cmd->add_option("--model", a->model, "A safetensors file, a model.safetensors.index.json, or a directory with one");
  cmd->add_option("--n_layer", a->n_layer, "GPT shape: layers (with --d_model, --n_head; activations need it)");
  cmd->add_option("--d_model", a->d_model, "GPT shape: hidden size");
  cmd->add_option("--n_head", a->n_head, "GPT shape: attention heads");
  cmd->add_option("--vocab_size", a->vocab_size, "GPT shape: vocabulary (default 256, the example's bytes)");
  cmd->add_option("--seq_len", a->seq_len, "Sequence length (GPT position embedding; activations)");
  cmd->add_option("--batch_size", a->batch_size, "Per-process batch, for the activations (default 1)");
  cmd->add_flag("--untied_head", a->untied_head, "GPT shape: an LM head of its own");
  cmd->add_option("--num_processes", a->num_processes, "Ranks the model is sharded over (default 1)");
  cmd->add_option("--pp_size", a->pp_size,
                  "Pipeline stages (default 1): each rank holds its stage, sharded over num_processes / pp_size ranks");
  cmd->add_option("--pp_microbatches", a->pp_microbatches, "Micro-batches a step under pp (default pp_size)");
  cmd->add_option("--pp_schedule", a->pp_schedule, "GPipe, 1F1B (default) or InterleavedZeroBubble: the micro-batches a stage holds");
  cmd->add_option("--dtypes", a->dtypes, "Training dtypes: float32, bfloat16, float16 (default float32 bfloat16)");
  cmd->add_option("--strategies", a->strategies, "Any of ddp zero1 zero2 zero3 (default all)");
  cmd->add_flag("--json", a->json, "One JSON object instead of the tables");
  return [a]() {
    const Model m = model_of_args(*a);
    const nlohmann::json out = estimate(*a, m);
    if (a->json) fmt::print("{}\n", out.dump());
    else print_estimate(*a, m, out);
    return 0;
  };
}

}  // namespace xlr8::cli
