// Plans nobody wrote by hand: AutoTP (from layer names) and DeepSpeed's partition_config rules.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <regex>
#include <set>

#include "parallel/tensor/tp_layer_kinds.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::tp {
namespace {

// Layer-name conventions of GPT-2, Llama, Mistral, Falcon, GPT-NeoX and Megatron.
const std::set<std::string> kColumn{"q",  "k",   "v",     "q_proj", "k_proj", "v_proj",    "query",   "key",
                                    "value", "wq", "wk", "wv", "fc", "fc1", "fc_in", "c_fc", "gate", "gate_proj",
                                    "up", "up_proj", "w1", "w3", "dense_h_to_4h"};
const std::set<std::string> kFusedQkv{"qkv", "qkv_proj", "c_attn", "query_key_value", "wqkv"};
const std::set<std::string> kFusedGateUp{"gate_up", "gate_up_proj", "w13"};
const std::set<std::string> kRow{"o",  "o_proj", "out_proj", "proj", "c_proj",       "wo",   "w2",
                                 "fc2", "fc_out", "down",     "down_proj", "dense_4h_to_h", "dense"};
const std::set<std::string> kHead{"head", "lm_head", "embed_out", "output"};
// Projections that carry attention heads (a model-wide head size applies to them).
const std::set<std::string> kAttention{"q",     "k",  "v",  "q_proj", "k_proj", "v_proj", "query", "key", "value",
                                       "wq",    "wk", "wv", "qkv",    "qkv_proj", "c_attn", "query_key_value",
                                       "wqkv",  "o",  "o_proj", "out_proj", "wo"};

std::string last_component(const std::string& path) {
  auto dot = path.rfind('.');
  std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

struct Layer {
  std::string path;
  torch::nn::Module* module;
};

// The model's Linear and Embedding layers (ours and LibTorch's), in registration order.
std::vector<Layer> layers_of(const torch::nn::Module& model) {
  std::vector<Layer> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (detail::is_layer(*item.value())) out.push_back({item.key(), item.value().get()});
  }
  return out;
}

bool is_embedding(const torch::nn::Module* m) {
  return dynamic_cast<const nn::EmbeddingImpl*>(m) || dynamic_cast<const torch::nn::EmbeddingImpl*>(m);
}

std::pair<int64_t, int64_t> linear_features(const torch::nn::Module* m) {
  if (auto* ours = dynamic_cast<const nn::LinearImpl*>(m)) return {ours->options.in_features(), ours->options.out_features()};
  auto& theirs = dynamic_cast<const torch::nn::LinearImpl&>(*m);
  return {theirs.options.in_features(), theirs.options.out_features()};
}

// Parameters held under more than one name (a head tied to an embedding): such layers stay whole.
std::set<const torch::nn::Module*> tied_layers(const torch::nn::Module& model, const std::vector<Layer>& layers) {
  std::map<const c10::TensorImpl*, int> uses;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) ++uses[p.value().unsafeGetTensorImpl()];
  std::set<const torch::nn::Module*> out;
  for (const auto& layer : layers)
    for (const auto& p : layer.module->named_parameters(/*recurse=*/false))
      if (uses[p.value().unsafeGetTensorImpl()] > 1) out.insert(layer.module);
  return out;
}

// A model-wide head size goes to the attention projections' entries (by name).
void set_head_dim(const Layer& layer, PlanEntry& entry, int64_t head_dim) {
  if (head_dim != 0 && !is_embedding(layer.module) && kAttention.count(last_component(layer.path))) entry.head_dim = head_dim;
}

// PlanEntry::head_dim checked where the plan is made, before anything is split: one line naming the layer,
// its features, the head size and tp. Fused parts that do not add up are parallelize()'s to name.
void check_heads(const Layer& layer, const PlanEntry& entry, int tp_size, const char* who) {
  if (entry.head_dim == 0 || entry.fused < 1 || is_embedding(layer.module)) return;
  auto [in, out] = linear_features(layer.module);
  const auto parts = detail::fused_part_widths(entry, out);
  if (std::accumulate(parts.begin(), parts.end(), int64_t{0}) != out) return;
  if (auto problem = detail::heads_problem(entry, in, out, tp_size); !problem.empty())
    throw ConfigError(fmt::format("{}'{}' ({}): {}", who, layer.path, to_string(entry.style), problem));
}

// AutoTP's entry for one layer, or nullopt when its name says nothing.
std::optional<PlanEntry> auto_entry(const Layer& layer, bool tied) {
  if (tied) return PlanEntry{layer.path, Style::Replicate};
  if (is_embedding(layer.module)) {
    auto* ours = dynamic_cast<nn::EmbeddingImpl*>(layer.module);
    // Options a vocabulary-parallel lookup cannot honour keep the embedding whole rather than failing.
    if (ours && !ours->tensor_parallel_problem({layer.path, Style::VocabParallel}, 1).empty())
      return PlanEntry{layer.path, Style::Replicate};
    return PlanEntry{layer.path, Style::VocabParallel};
  }
  const auto name = last_component(layer.path);
  auto [in, out] = linear_features(layer.module);
  if (kColumn.count(name)) return PlanEntry{layer.path, Style::Colwise};
  if (kRow.count(name)) return PlanEntry{layer.path, Style::Rowwise};
  if (kHead.count(name)) return PlanEntry{layer.path, Style::Colwise, /*gather_output=*/true};
  if (kFusedQkv.count(name)) {
    if (out == 3 * in) return PlanEntry{layer.path, Style::Colwise, false, 3};
    // Grouped-query attention: queries as wide as the model, keys and values narrower and equal.
    if (out > in && (out - in) % 2 == 0) {
      PlanEntry entry{layer.path, Style::Colwise};
      entry.fused_sizes = {in, (out - in) / 2, (out - in) / 2};
      return entry;
    }
    throw ConfigError(fmt::format("AutoTP: '{}' looks like a fused q/k/v projection but has out_features {} for "
                                  "in_features {} (neither 3 equal parts nor queries of {} and two equal key/value "
                                  "parts); give it a plan entry with its fused_sizes or split it into q, k and v",
                                  layer.path, out, in, in));
  }
  if (kFusedGateUp.count(name)) return PlanEntry{layer.path, Style::Colwise, false, 2};
  return std::nullopt;
}

}  // namespace

bool detail::is_attention_projection(const std::string& path) { return kAttention.count(last_component(path)) > 0; }

Plan auto_plan(const torch::nn::Module& model, int tp_size, int64_t head_dim, bool sequence_parallel) {
  if (tp_size < 1) throw ConfigError(fmt::format("AutoTP: tp size {} must be 1 or more", tp_size));
  if (head_dim < 0) throw ConfigError(fmt::format("AutoTP: head_dim {} must be 0 (unchecked) or more", head_dim));
  const auto layers = layers_of(model);
  const auto tied = tied_layers(model, layers);
  Plan plan;
  std::vector<std::string> unknown;
  for (const auto& layer : layers) {
    auto entry = auto_entry(layer, tied.count(layer.module) > 0);
    if (!entry) {
      unknown.push_back(layer.path);
      continue;
    }
    set_head_dim(layer, *entry, head_dim);
    check_heads(layer, *entry, tp_size, "AutoTP: ");
    plan.push_back(*entry);
  }
  if (!unknown.empty()) {
    for (auto& path : unknown) path = fmt::format("{:?}", path);  // quoted: a Sequential's layer is named by its index
    throw ConfigError(fmt::format(
        "AutoTP: cannot tell how to split the layer(s) {} from their names (column-wise: q/k/v/qkv, fc/fc1/fc_in, "
        "gate/up; row-wise: o/out_proj/proj, fc2/fc_out/down); rename them or give a plan",
        fmt::join(unknown, ", ")));
  }
  if (plan.empty()) throw ConfigError("AutoTP: the model has no Linear or Embedding layer to split");
  return sequence_parallel ? with_sequence_parallel(std::move(plan), model) : plan;
}

Plan with_sequence_parallel(Plan plan, const torch::nn::Module& model) {
  std::vector<std::string> whole;
  for (auto& entry : plan) {
    if (entry.style == Style::Colwise || entry.style == Style::Rowwise || entry.style == Style::VocabParallel)
      entry.sequence_parallel = true;
    else if (entry.style == Style::Replicate)
      whole.push_back(entry.pattern);
  }
  // A layer kept whole would read or write the residual stream whole where it is split on the sequence.
  if (!whole.empty())
    throw ConfigError(fmt::format("sequence parallelism: {} would stay whole (tied, or options a split cannot take) "
                                  "while the activations around them are split on the sequence; plan them (or untie "
                                  "them), or leave sequence parallelism off",
                                  fmt::join(whole, ", ")));
  // Norms and dropouts the plan does not name run on this rank's share of the sequence.
  std::vector<std::string> planned;
  for (const auto& entry : plan) planned.push_back(entry.pattern);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto* m = item.value().get();
    const bool norm_or_dropout = dynamic_cast<const torch::nn::LayerNormImpl*>(m) ||
                                 dynamic_cast<const torch::nn::GroupNormImpl*>(m) ||
                                 dynamic_cast<const torch::nn::DropoutImpl*>(m);
    const bool named = std::any_of(planned.begin(), planned.end(),
                                   [&](const std::string& pattern) { return path_matches(pattern, item.key()); });
    if (norm_or_dropout && !named) plan.push_back({item.key(), Style::SequenceParallel});
  }
  return plan;
}

namespace {

// DeepSpeed's `tensor_parallel` keys (the engine's config reader already refused any other), and xlr8's head_dim.
const std::set<std::string> kTensorParallelKeys{"autotp_size",   "partition_config", "preset_model",
                                                "tp_overlap_comm", "tp_grain_size",  "keep_module_on_host",
                                                "injection_policy_tuple", "dtype", "head_dim"};
const std::set<std::string> kPartitionKeys{"use_default_specs", "layer_specs"};
const std::set<std::string> kSpecKeys{"patterns", "partition_type", "shape", "partition_dim", "model_types",
                                      "gather_output", "grad_allreduce", "head_dim"};

void check_keys(const nlohmann::json& object, const std::set<std::string>& known, const std::string& where) {
  if (!object.is_object()) throw ConfigError(fmt::format("{} must be a JSON object", where));
  for (const auto& [key, value] : object.items())
    if (!known.count(key))
      throw ConfigError(fmt::format("{}: unknown key '{}'; known: {}", where, key, fmt::join(known, ", ")));
}

// xlr8's `head_dim` key (DeepSpeed's sections have none): the features of one attention head, or `fallback`.
int64_t head_dim_of(const nlohmann::json& object, const std::string& where, int64_t fallback) {
  if (!object.contains("head_dim") || object["head_dim"].is_null()) return fallback;
  const auto& value = object["head_dim"];
  if (!value.is_number_integer() || value.get<int64_t>() < 1)
    throw ConfigError(fmt::format("{}.head_dim = {}: the features of one attention head, an integer of 1 or more", where,
                                  value.dump()));
  return value.get<int64_t>();
}

// DeepSpeed's `shape` on a column spec: [k, -1] (k equal fused parts along the output) or [[a, b, ...], -1]
// (unequal parts: grouped-query q/k/v). Other shapes (a reshape to more dimensions) are refused by name.
void set_fused_parts(PlanEntry& entry, const nlohmann::json& spec, const std::string& where) {
  if (!spec.contains("shape") || spec["shape"].is_null()) return;
  const auto& shape = spec["shape"];
  if (shape.is_array() && shape.size() == 2 && shape[1] == -1) {
    if (shape[0].is_number_integer() && shape[0].get<int64_t>() >= 1) {
      entry.fused = static_cast<int>(shape[0].get<int64_t>());
      return;
    }
    const bool widths = shape[0].is_array() && !shape[0].empty() &&
                        std::all_of(shape[0].begin(), shape[0].end(), [](const nlohmann::json& w) {
                          return w.is_number_integer() && w.get<int64_t>() >= 1;
                        });
    if (widths) {
      for (const auto& w : shape[0]) entry.fused_sizes.push_back(w.get<int64_t>());
      return;
    }
  }
  throw ConfigError(fmt::format("{}.shape = {}: xlr8 splits [k, -1] (k equal fused parts) and [[a, b, ...], -1] "
                                "(fused parts of those widths, e.g. grouped-query [[q, kv, kv], -1]) only",
                                where, shape.dump()));
}

// DeepSpeed's AutoTP presets (its AutoTPPresets): the specs of each model family, by Hugging Face
// parameter names.
const std::map<std::string, nlohmann::json>& presets() {
  static const std::map<std::string, nlohmann::json> specs = [] {
    auto spec = [](std::vector<std::string> patterns, const char* type, nlohmann::json shape = nullptr) {
      nlohmann::json s{{"patterns", std::move(patterns)}, {"partition_type", type}};
      if (!shape.is_null()) s["shape"] = std::move(shape);
      return s;
    };
    const auto separate_qkv = nlohmann::json::array({
        spec({R"(.*\.self_attn\.o_proj\.weight$)"}, "row"),
        spec({R"(.*\.self_attn\.[qkv]_proj\.weight$)"}, "column"),
        spec({R"(.*\.mlp\.down_proj\.weight$)"}, "row"),
        spec({R"(.*\.mlp\.(up|gate)_proj\.weight$)"}, "column"),
    });
    std::map<std::string, nlohmann::json> out{{"llama", separate_qkv}, {"qwen2", separate_qkv}};
    out["bloom"] = nlohmann::json::array({
        spec({R"(.*\.self_attention\.dense\.weight$)"}, "row"),
        spec({R"(.*\.self_attention\.query_key_value\.weight$)"}, "column"),  // heads interleaved: a plain split
        spec({R"(.*\.mlp\.dense_4h_to_h\.weight$)"}, "row"),
        spec({R"(.*\.mlp\.dense_h_to_4h\.weight$)"}, "column"),
    });
    out["chatglm"] = nlohmann::json::array({
        spec({R"(.*\.self_attention\.dense\.weight$)"}, "row"),
        spec({R"(.*\.self_attention\.query_key_value\.weight$)"}, "column", {3, -1}),
        spec({R"(.*\.mlp\.dense_4h_to_h\.weight$)"}, "row"),
        spec({R"(.*\.mlp\.dense_h_to_4h\.weight$)"}, "column", {2, -1}),
    });
    out["mixtral"] = nlohmann::json::array({
        spec({R"(.*\.self_attn\.o_proj\.weight$)"}, "row"),
        spec({R"(.*\.self_attn\.[qkv]_proj\.weight$)"}, "column"),
        spec({R"(.*\.block_sparse_moe\.experts\.\d+\.w2\.weight$)"}, "row"),
        spec({R"(.*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$)"}, "column"),
        spec({R"(.*\.block_sparse_moe\.gate\.weight$)"}, "skip"),
    });
    out["deepseek_v2"] = nlohmann::json::array({
        spec({R"(.*\.self_attn\.o_proj\.weight$)"}, "row"),
        spec({R"(.*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$)"}, "skip"),
        spec({R"(.*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$)"}, "column"),
        spec({R"(.*\.mlp\.experts\.\d+\.down_proj\.weight$)"}, "row"),
        spec({R"(.*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$)"}, "column"),
        spec({R"(.*\.mlp\.gate\.weight$)"}, "skip"),
        spec({R"(.*\.mlp\.shared_experts\.down_proj\.weight$)"}, "row"),
        spec({R"(.*\.mlp\.shared_experts\.(up|gate)_proj\.weight$)"}, "column"),
    });
    out["phi3"] = nlohmann::json::array({
        spec({R"(.*\.self_attn\.o_proj\.weight$)"}, "row"),
        spec({R"(.*\.self_attn\.qkv_proj\.weight$)"}, "column", {3, -1}),
        spec({R"(.*\.mlp\.down_proj\.weight$)"}, "row"),
        spec({R"(.*\.mlp\.gate_up_proj\.weight$)"}, "column", {2, -1}),
    });
    return out;
  }();
  return specs;
}

// The preset's specs for `tensor_parallel.preset_model` (matched case-insensitively, as DeepSpeed does).
nlohmann::json preset_specs(const nlohmann::json& name) {
  std::vector<std::string> names;
  for (const auto& item : presets()) names.push_back(item.first);
  if (!name.is_string())
    throw ConfigError(fmt::format("tensor_parallel.preset_model = {}: a name, one of {}", name.dump(), fmt::join(names, ", ")));
  auto key = name.get<std::string>();
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  auto it = presets().find(key);
  if (it == presets().end())
    throw ConfigError(fmt::format("tensor_parallel.preset_model = {}: DeepSpeed's presets are {}; give layer_specs for "
                                  "another family",
                                  name.dump(), fmt::join(names, ", ")));
  return it->second;
}

// One layer_spec (checked whole): its regular expressions and the entry the layers they match get.
struct Rule {
  std::vector<std::regex> patterns;
  PlanEntry entry;  // pattern filled per layer
};

Rule rule_of(const nlohmann::json& spec, const std::string& where) {
  check_keys(spec, kSpecKeys, where);
  Rule rule;
  const auto type = spec.value("partition_type", std::string("column"));
  if (type == "column") {
    rule.entry = PlanEntry{"", Style::Colwise, spec.value("gather_output", false)};
    set_fused_parts(rule.entry, spec, where);
  } else if (type == "row") {
    rule.entry = PlanEntry{"", Style::Rowwise};
  } else if (type == "skip") {
    rule.entry = PlanEntry{"", Style::Replicate};
  } else {
    throw ConfigError(fmt::format("{}.partition_type = \"{}\": one of column, row, skip", where, type));
  }
  rule.entry.head_dim = head_dim_of(spec, where, 0);
  const int default_dim = rule.entry.style == Style::Rowwise ? 1 : 0;
  if (spec.contains("partition_dim") && !spec["partition_dim"].is_null() && spec["partition_dim"] != default_dim)
    throw ConfigError(fmt::format("{}.partition_dim = {}: xlr8 splits {} layers on dimension {} only", where,
                                  spec["partition_dim"].dump(), type, default_dim));
  if (spec.contains("model_types") && !spec["model_types"].is_null())
    throw ConfigError(fmt::format("{}.model_types: a LibTorch model has no model_type to filter on; remove the key",
                                  where));
  if (spec.value("grad_allreduce", false))
    throw ConfigError(fmt::format("{}.grad_allreduce = true: summing a kept-whole parameter's gradient over tp is "
                                  "not supported yet; leave it out",
                                  where));
  for (const auto& pattern : spec.value("patterns", nlohmann::json::array())) {
    try {
      rule.patterns.emplace_back(pattern.get<std::string>(), std::regex::ECMAScript);
    } catch (const std::exception& e) {
      throw ConfigError(fmt::format("{}.patterns: {} is not a regular expression: {}", where, pattern.dump(), e.what()));
    }
  }
  return rule;
}

}  // namespace

Plan plan_from_file(const std::string& path, const torch::nn::Module& model, int tp_size, int64_t head_dim) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("tensor-parallel plan file {}: cannot be read; give a JSON file", path));
  nlohmann::json rules;
  try {
    rules = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(fmt::format("tensor-parallel plan file {}: not valid JSON: {}", path, e.what()));
  }
  if (!rules.is_object())
    throw ConfigError(fmt::format("tensor-parallel plan file {}: must hold a JSON object (DeepSpeed's tensor_parallel "
                                  "section, or a DeepSpeed config with one)",
                                  path));
  try {
    return plan_from_deepspeed(rules.contains("tensor_parallel") ? rules["tensor_parallel"] : rules, model, tp_size,
                               head_dim);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("tensor-parallel plan file {}: {}", path, e.what()));
  }
}

Plan plan_from_deepspeed(const nlohmann::json& tensor_parallel, const torch::nn::Module& model, int tp_size,
                         int64_t head_dim) {
  check_keys(tensor_parallel, kTensorParallelKeys, "tensor_parallel");
  if (head_dim < 0) throw ConfigError(fmt::format("tensor_parallel: head_dim {} must be 0 (unchecked) or more", head_dim));
  head_dim = head_dim_of(tensor_parallel, "tensor_parallel", head_dim);
  if (auto size = tensor_parallel.value("autotp_size", 0); size > 1 && size != tp_size)
    throw ConfigError(fmt::format("tensor_parallel.autotp_size = {} but the tp group has {} ranks; make them equal",
                                  size, tp_size));
  const bool preset = tensor_parallel.contains("preset_model") && !tensor_parallel["preset_model"].is_null();
  const nlohmann::json none = nlohmann::json::object();
  const auto& partition = tensor_parallel.contains("partition_config") && !tensor_parallel["partition_config"].is_null()
                              ? tensor_parallel["partition_config"]
                              : none;
  check_keys(partition, kPartitionKeys, "tensor_parallel.partition_config");
  auto specs = partition.value("layer_specs", nlohmann::json::array());
  // With a preset, the default specs are the preset's (after the custom ones); without, AutoTP's names.
  const bool defaults = partition.value("use_default_specs", preset || specs.empty());
  const size_t custom = specs.size();
  if (preset && defaults)
    for (const auto& spec : preset_specs(tensor_parallel["preset_model"])) specs.push_back(spec);
  else if (preset)
    preset_specs(tensor_parallel["preset_model"]);  // a bad name is an error even when its specs are not used
  // Every rule is checked before any is used: a bad one is an error even where it would match nothing.
  std::vector<Rule> rules;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto where = i < custom ? fmt::format("tensor_parallel.partition_config.layer_specs[{}]", i)
                                  : fmt::format("tensor_parallel.preset_model {} spec {}",
                                                tensor_parallel["preset_model"].dump(), i - custom);
    rules.push_back(rule_of(specs[i], where));
  }
  const auto layers = layers_of(model);
  const auto tied = tied_layers(model, layers);
  Plan plan;
  std::vector<std::string> unmatched;
  for (const auto& layer : layers) {
    // Rules match parameter names (Python's re.match: anchored at the start), tried on the layer's weight.
    const std::string weight = layer.path + ".weight";
    std::optional<PlanEntry> entry;
    for (const auto& rule : rules) {
      const bool hit = std::any_of(rule.patterns.begin(), rule.patterns.end(), [&](const std::regex& re) {
        return std::regex_search(weight, re, std::regex_constants::match_continuous);
      });
      if (!hit) continue;
      entry = rule.entry;
      entry->pattern = layer.path;
      if (is_embedding(layer.module) && entry->style == Style::Colwise) entry->style = Style::VocabParallel;
      if (is_embedding(layer.module)) entry->head_dim = 0;  // heads are a Linear's
      break;
    }
    if (!entry && defaults && !preset) entry = auto_entry(layer, tied.count(layer.module) > 0);
    if (entry && entry->head_dim == 0) set_head_dim(layer, *entry, head_dim);
    if (entry) check_heads(layer, *entry, tp_size, "tensor_parallel: ");
    // Custom or preset specs alone: DeepSpeed (strict_mode off) keeps an unmatched layer whole, and so does
    // this plan.
    if (!entry && (preset || !defaults)) entry = PlanEntry{layer.path, Style::Replicate};
    if (entry) plan.push_back(*entry);
    else unmatched.push_back(layer.path);
  }
  if (!unmatched.empty())
    throw ConfigError(fmt::format("tensor_parallel: no layer_spec matches {} and AutoTP cannot place them by name; add "
                                  "a spec (partition_type column, row or skip)",
                                  fmt::join(unmatched, ", ")));
  return plan;
}

}  // namespace xlr8::tp
