// DeepSpeed's JSON config: keys checked against DeepSpeed's own (runtime/config.py, runtime/zero/config.py,
// offload_config.py), values read with DeepSpeed's defaults, "auto" recorded for Accelerate-style filling.
#include "xlr8/deepspeed_config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "config/deepspeed_keys.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::deepspeed {
namespace {

using namespace keys;

// One JSON object of the config, read with checks that name the full key path.
class Reader {
 public:
  Reader(const nlohmann::json& node, std::string path, const std::string& origin, std::vector<std::string>& autos)
      : node_(node), path_(std::move(path)), origin_(origin), autos_(autos) {
    if (!node_.is_object()) throw error(path_.empty() ? "the config" : path_, "must be a JSON object");
  }

  // Every key is one of `keys`, used as its row says (unknown: the closest valid key).
  void check(const std::vector<Key>& keys) const {
    for (const auto& [name, value] : node_.items()) {
      auto it = std::find_if(keys.begin(), keys.end(), [&](const Key& k) { return name == k.name; });
      if (it == keys.end()) {
        std::vector<std::string> valid;
        for (const auto& k : keys) valid.push_back(k.name);
        const auto hint = text::closest(name, valid);
        throw ConfigError(fmt::format("{}: DeepSpeed has no key {:?}{}", origin_, key(name),
                                      hint.empty() ? fmt::format("; the keys here are {}", text::join(valid))
                                                   : fmt::format(" (did you mean {:?}?)", key(hint))));
      }
      if (it->use == Use::DEFAULT && value != nlohmann::json::parse(it->off) && !is_auto(value))
        throw ConfigError(fmt::format("{}: {} = {} turns on {}, which xlr8 does not implement; remove the key or set "
                                      "it to {}",
                                      origin_, key(name), value.dump(), it->feature, it->off));
      if (it->use == Use::FEATURE) {
        if (auto on = first_enabled(value, key(name)))
          throw ConfigError(fmt::format("{}: {} = true turns on {}, which xlr8 does not implement; remove the {:?} "
                                        "section or set it to false",
                                        origin_, *on, it->feature, name));
      }
    }
  }

  const std::string& origin() const { return origin_; }
  bool has(const std::string& name) const { return node_.contains(name) && !node_.at(name).is_null(); }
  std::string key(const std::string& name) const { return path_.empty() ? name : path_ + "." + name; }
  Reader child(const std::string& name) const { return Reader(node_.at(name), key(name), origin_, autos_); }
  const nlohmann::json& raw(const std::string& name) const { return node_.at(name); }

  // The value at `name`, or nothing when absent, null or "auto" (then recorded).
  template <class T>
  std::optional<T> get(const std::string& name) const {
    if (!has(name)) return std::nullopt;
    const auto& v = node_.at(name);
    if (is_auto(v)) {
      autos_.push_back(key(name));
      return std::nullopt;
    }
    if constexpr (std::is_same_v<T, bool>) {
      if (v.is_boolean()) return v.get<bool>();
      throw error(key(name), fmt::format("must be true or false, not {}", v.dump()));
    } else if constexpr (std::is_integral_v<T>) {
      // DeepSpeed's integer keys take 5e8 as well as 500000000.
      if (v.is_number_integer()) return static_cast<T>(v.get<int64_t>());
      if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
          std::abs(v.get<double>()) < 9.2e18)
        return static_cast<T>(v.get<double>());
      throw error(key(name), fmt::format("must be a whole number, not {}", v.dump()));
    } else if constexpr (std::is_floating_point_v<T>) {
      if (v.is_number()) return v.get<double>();
      throw error(key(name), fmt::format("must be a number, not {}", v.dump()));
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (v.is_string()) return v.get<std::string>();
      throw error(key(name), fmt::format("must be a string, not {}", v.dump()));
    } else {
      if (v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_string(); }))
        return v.get<std::vector<std::string>>();
      throw error(key(name), fmt::format("must be a list of strings, not {}", v.dump()));
    }
  }
  template <class T>
  void read(const std::string& name, T& into) const {
    if (auto v = get<T>(name)) into = *v;
  }

  ConfigError error(const std::string& key, const std::string& what) const {
    return ConfigError(fmt::format("{}: {} {}", origin_, key, what));
  }

  static bool is_auto(const nlohmann::json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

 private:
  // The first `enabled` (or DeepCompile's `deepcompile`) that is true anywhere inside `value`.
  static std::optional<std::string> first_enabled(const nlohmann::json& value, const std::string& at) {
    if (value.is_boolean() && value.get<bool>()) return at;
    if (!value.is_object()) return std::nullopt;
    for (const auto& [k, v] : value.items()) {
      if ((k == "enabled" || k == "deepcompile") && v.is_boolean() && v.get<bool>()) return at + "." + k;
      if (k == "partition_activations" || k == "cpu_checkpointing" || k == "contiguous_memory_optimization")
        if (v.is_boolean() && v.get<bool>()) return at + "." + k;
      if (auto inner = first_enabled(v, at + "." + k); inner && v.is_object()) return inner;
    }
    return std::nullopt;
  }

  const nlohmann::json& node_;
  std::string path_;
  const std::string& origin_;
  std::vector<std::string>& autos_;
};

void read_fp16(const Reader& r, Fp16Config& f) {
  r.check(kFp16);
  r.read("enabled", f.enabled);
  r.read("auto_cast", f.auto_cast);
  r.read("loss_scale", f.loss_scale);
  r.read("initial_scale_power", f.initial_scale_power);
  r.read("loss_scale_window", f.loss_scale_window);
  r.read("hysteresis", f.hysteresis);
  r.read("consecutive_hysteresis", f.consecutive_hysteresis);
  r.read("min_loss_scale", f.min_loss_scale);
  if (f.loss_scale < 0) throw r.error(r.key("loss_scale"), "must be 0 (dynamic) or a positive static scale");
  if (f.enabled && f.loss_scale == 0) {  // DeepSpeed's checks on the dynamic scaler's arguments
    if (f.loss_scale_window <= 0) throw r.error(r.key("loss_scale_window"), "must be > 0 when loss_scale is 0 (dynamic)");
    if (f.min_loss_scale <= 0) throw r.error(r.key("min_loss_scale"), "must be > 0 when loss_scale is 0 (dynamic)");
    if (f.hysteresis < 1) throw r.error(r.key("hysteresis"), "must be at least 1");
  }
}

void read_offload(const Reader& r, OffloadConfig& o, const std::vector<Key>& keys) {
  r.check(keys);
  r.read("device", o.device);
  r.read("nvme_path", o.nvme_path);
  r.read("pin_memory", o.pin_memory);
  r.read("ratio", o.ratio);
  r.read("buffer_count", o.buffer_count);
  r.read("buffer_size", o.buffer_size);
  r.read("max_in_cpu", o.max_in_cpu);
  r.read("pipeline_read", o.pipeline_read);
  r.read("pipeline_write", o.pipeline_write);
  o.device = text::lower(o.device);
  if (o.device != "none" && o.device != "cpu" && o.device != "nvme")
    throw r.error(r.key("device"), fmt::format("{:?} is not a device; use none, cpu or nvme", o.device));
  if (o.device == "nvme" && o.nvme_path.empty())
    throw r.error(r.key("nvme_path"), "is required with device \"nvme\": the directory of the swap files (a local disk)");
  if (r.has("buffer_count") && o.buffer_count < 1) throw r.error(r.key("buffer_count"), "must be 1 or more");
  if (o.buffer_size < 1) throw r.error(r.key("buffer_size"), "must be 1 or more (it counts elements)");
  if (!(o.ratio > 0 && o.ratio <= 1))  // DeepSpeed's schema allows 0 to 1; 0 would offload nothing
    throw r.error(r.key("ratio"), fmt::format("{} must be above 0 and at most 1 (the share of the optimizer's state "
                                              "offloaded; 1: all)",
                                              o.ratio));
  if (o.max_in_cpu < 0) throw r.error(r.key("max_in_cpu"), "must be 0 or more");
}

void read_aio(const Reader& r, AioConfig& a) {
  r.check(kAio);
  r.read("block_size", a.block_size);
  r.read("queue_depth", a.queue_depth);
  r.read("thread_count", a.intra_op_parallelism);  // the old name; the new one wins when both are given
  r.read("intra_op_parallelism", a.intra_op_parallelism);
  r.read("single_submit", a.single_submit);
  r.read("overlap_events", a.overlap_events);
  r.read("use_gds", a.use_gds);
  if (a.block_size <= 0 || a.block_size % 4096 != 0)
    throw r.error(r.key("block_size"), fmt::format("{} must be a positive multiple of 4096 (direct I/O's alignment)", a.block_size));
  if (a.queue_depth < 1) throw r.error(r.key("queue_depth"), "must be 1 or more");
  // Threads per rank for the swaps; thousands would exhaust the machine's threads before training starts.
  if (a.intra_op_parallelism < 1 || a.intra_op_parallelism > 1024)
    throw r.error(r.key("intra_op_parallelism"),
                  fmt::format("{} must be 1 to 1024 (threads a rank moves its swaps with; a few are enough)",
                              a.intra_op_parallelism));
  if (a.use_gds)
    throw r.error(r.key("use_gds"), "is true: GPUDirect Storage is not supported; set it to false (swaps go through host "
                                    "buffers)");
}

void read_zero(const Reader& r, ZeroConfig& z) {
  r.check(kZero);
  r.read("stage", z.stage);
  if (z.stage < 0 || z.stage > 3) throw r.error(r.key("stage"), fmt::format("{} is not a ZeRO stage; use 0, 1, 2 or 3", z.stage));
  z.overlap_comm = z.stage == 3;  // DeepSpeed's default when the key is absent
  r.read("overlap_comm", z.overlap_comm);
  r.read("reduce_bucket_size", z.reduce_bucket_size);
  r.read("allgather_bucket_size", z.allgather_bucket_size);
  // Each of these has its stage3_ name and a short one (DeepSpeed accepts both).
  auto either = [&](const char* long_name, const char* short_name, auto& into) {
    r.read(long_name, into);
    r.read(short_name, into);
  };
  either("stage3_prefetch_bucket_size", "prefetch_bucket_size", z.stage3_prefetch_bucket_size);
  either("stage3_param_persistence_threshold", "param_persistence_threshold", z.stage3_param_persistence_threshold);
  either("stage3_max_live_parameters", "max_live_parameters", z.stage3_max_live_parameters);
  either("stage3_max_reuse_distance", "max_reuse_distance", z.stage3_max_reuse_distance);
  either("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
         z.stage3_gather_16bit_weights_on_model_save);
  r.read("stage3_gather_fp16_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);  // the old name
  r.read("ignore_unused_parameters", z.ignore_unused_parameters);
  if (z.reduce_bucket_size <= 0) throw r.error(r.key("reduce_bucket_size"), "must be > 0 (it counts elements)");
  if (z.allgather_bucket_size <= 0) throw r.error(r.key("allgather_bucket_size"), "must be > 0 (it counts elements)");
  // The deprecated booleans mean CPU offload.
  if (r.get<bool>("cpu_offload").value_or(false)) z.offload_optimizer.device = "cpu";
  if (r.get<bool>("cpu_offload_param").value_or(false)) z.offload_param.device = "cpu";
  if (r.has("offload_optimizer")) read_offload(r.child("offload_optimizer"), z.offload_optimizer, kOffloadOptimizer);
  if (r.has("offload_param")) read_offload(r.child("offload_param"), z.offload_param, kOffloadParam);
  if (z.offload_param.device != "none" && z.stage != 3)
    throw r.error(r.key("offload_param"), fmt::format("offloads parameters, which needs stage 3 (stage is {})", z.stage));
  if (z.offload_optimizer.ratio < 1.0 && z.stage != 3)
    throw r.error(r.key("offload_optimizer.ratio"), "below 1 (partial offload) needs stage 3");
  if (r.has("leaf_module")) {
    auto leaf = r.child("leaf_module");
    leaf.check(kLeafModule);
    leaf.read("classes", z.leaf_module.classes);
    leaf.read("names", z.leaf_module.names);
    leaf.read("name_suffixes", z.leaf_module.name_suffixes);
  }
}

TypedSection read_typed(const Reader& r, const char* kind) {
  const std::vector<Key> keys = {{"type", Use::READ}, {"params", Use::READ}};
  r.check(keys);
  TypedSection section;
  auto type = r.get<std::string>("type");
  if (!type) throw r.error(r.key("type"), fmt::format("is required: the {}'s name", kind));
  section.type = *type;
  if (r.has("params")) {
    const auto& params = r.raw("params");
    if (!params.is_object()) throw r.error(r.key("params"), "must be a JSON object");
    section.params = params;
    for (const auto& [name, value] : params.items())
      if (Reader::is_auto(value)) r.child("params").get<std::string>(name);  // records the "auto"
  }
  return section;
}

void read_pipeline(const Reader& r, Config::Pipeline& p) {
  r.check(kPipeline);
  if (r.has("stages") && !Reader::is_auto(r.raw("stages"))) {
    p.stages = r.get<int64_t>("stages");
    if (*p.stages < 1) throw r.error(r.key("stages"), "must be at least 1 (or \"auto\": the PipelineModule's)");
  }
  r.read("partition", p.partition);
  r.read("activation_checkpoint_interval", p.activation_checkpoint_interval);
  if (p.activation_checkpoint_interval < 0) throw r.error(r.key("activation_checkpoint_interval"), "must be 0 or more");
}

void read_top_level(const Reader& r, Config& c) {
  r.check(kTopLevel);
  c.train_batch_size = r.get<int64_t>("train_batch_size");
  c.train_micro_batch_size_per_gpu = r.get<int64_t>("train_micro_batch_size_per_gpu");
  c.gradient_accumulation_steps = r.get<int64_t>("gradient_accumulation_steps");
  r.read("gradient_clipping", c.gradient_clipping);
  c.sequence_parallel_size = r.get<int64_t>("sequence_parallel_size");
  c.data_parallel_size = r.get<int64_t>("data_parallel_size");
  for (const auto& [key, size] : {std::pair{"sequence_parallel_size", c.sequence_parallel_size},
                                  std::pair{"data_parallel_size", c.data_parallel_size}})
    if (size && *size < 1) throw r.error(r.key(key), "must be at least 1");
  if (c.gradient_clipping < 0) throw r.error("gradient_clipping", "must be >= 0 (0 disables clipping)");
  if (r.has("fp16")) read_fp16(r.child("fp16"), c.fp16);
  for (const char* name : {"bf16", "bfloat16"})
    if (r.has(name)) {
      auto bf16 = r.child(name);
      bf16.check(kBf16);
      bf16.read("enabled", c.bf16);
    }
  if (c.fp16.enabled && c.bf16)
    throw r.error("fp16.enabled", "and bf16.enabled are both true; DeepSpeed allows one of them");
  if (r.has("zero_optimization")) {
    if (r.raw("zero_optimization").is_boolean())
      throw r.error("zero_optimization", "as a boolean is DeepSpeed's old format; write {\"stage\": 1} (or 0 to 3)");
    read_zero(r.child("zero_optimization"), c.zero_optimization);
  }
  if (r.has("optimizer")) c.optimizer = read_typed(r.child("optimizer"), "optimizer");
  if (r.has("scheduler")) c.scheduler = read_typed(r.child("scheduler"), "scheduler");
  r.read("steps_per_print", c.steps_per_print);
  r.read("wall_clock_breakdown", c.wall_clock_breakdown);
  r.read("dataloader_drop_last", c.dataloader_drop_last);
  if (r.has("checkpoint")) {
    auto checkpoint = r.child("checkpoint");
    checkpoint.check(kCheckpoint);
    checkpoint.read("tag_validation", c.tag_validation);
    const auto lowered = text::lower(c.tag_validation);
    if (lowered != "warn" && lowered != "ignore" && lowered != "fail")
      throw checkpoint.error(checkpoint.key("tag_validation"),
                             fmt::format("{:?} is not a mode; use Warn, Ignore or Fail", c.tag_validation));
    c.tag_validation = lowered == "warn" ? "Warn" : lowered == "ignore" ? "Ignore" : "Fail";
  }
  if (r.has("pipeline")) read_pipeline(r.child("pipeline"), c.pipeline);
  if (r.has("elasticity")) c.elasticity = read_elasticity(r.raw("elasticity"), r.origin());
  if (r.has("aio")) read_aio(r.child("aio"), c.zero_optimization.aio);
  if (r.has("tensor_parallel")) {
    auto tp = r.child("tensor_parallel");
    tp.check(kTensorParallel);
    c.autotp_size = tp.get<int64_t>("autotp_size").value_or(0);
    if (c.autotp_size < 0) throw tp.error(tp.key("autotp_size"), "must be 0 or more");
  }
}

// The dotted path's parent object and last key inside `doc`, or null when the path does not exist.
nlohmann::json* locate(nlohmann::json& doc, const std::string& path, std::string& last) {
  auto parts = text::split(path, '.');
  nlohmann::json* node = &doc;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (!node->is_object() || !node->contains(parts[i])) return nullptr;
    node = &(*node)[parts[i]];
  }
  last = parts.back();
  return node->is_object() && node->contains(last) ? node : nullptr;
}

}  // namespace

Config parse_config(const nlohmann::json& document, const std::string& origin) {
  Config c;
  c.document = document;
  c.origin = origin;
  Reader reader(c.document, "", c.origin, c.auto_keys);
  read_top_level(reader, c);
  return c;
}

Config load_config(const std::string& path_or_json) {
  const auto start = path_or_json.find_first_not_of(" \t\r\n");
  const bool inline_json = start != std::string::npos && path_or_json[start] == '{';
  std::string text = path_or_json, origin = "the DeepSpeed config";
  if (!inline_json) {
    std::ifstream in(path_or_json);
    if (!in)
      throw ConfigError(fmt::format("DeepSpeed config {:?} does not exist or cannot be read (give a path to a JSON file, "
                                    "or the JSON itself)",
                                    path_or_json));
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
    origin = path_or_json;
  }
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(fmt::format("{} is not valid JSON: {}", origin, e.what()));
  }
  return parse_config(document, origin);
}

void check_section_params(const TypedSection& section, const char* kind, const std::vector<std::string>& known) {
  for (const auto& [key, value] : section.params.items())
    if (std::find(known.begin(), known.end(), key) == known.end())
      throw ConfigError(fmt::format("DeepSpeed config: {} {} has no parameter {:?}{}; its parameters are {}", kind,
                                    section.type, key, text::suggestion(key, known), text::join(known)));
}

Config fill_auto(const Config& config, const std::map<std::string, nlohmann::json>& values) {
  nlohmann::json doc = config.document;
  for (const auto& [path, value] : values) {
    std::string last;
    auto* parent = locate(doc, path, last);
    if (parent && Reader::is_auto((*parent)[last])) (*parent)[last] = value;
  }
  return parse_config(doc, config.origin);
}

void require_resolved(const Config& config) {
  if (config.auto_keys.empty()) return;
  throw ConfigError(fmt::format("{} leaves {} as \"auto\": only Accelerator (under --use_deepspeed) "
                                "fills \"auto\" values, from its own options, the data loader and the model; give a "
                                "value instead",
                                config.origin, text::join(config.auto_keys)));
}

namespace {

// DeepSpeed's elastic batch for `world` data-parallel ranks, which overrides the JSON's own batch keys (their mere
// presence is an error unless ignore_non_elastic_batch_info, as DeepSpeed's runtime config has it).
BatchSizes elastic_batch_sizes(const Config& config, int world) {
  const ElasticBatch b = compute_elastic_batch(config.elasticity, world);
  for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
    if (config.document.contains(key) && !config.elasticity.ignore_non_elastic_batch_info)
      throw ConfigError(fmt::format("{}: {} is set, but elasticity is enabled and chooses the batch sizes itself; remove "
                                    "the batch keys, or set elasticity.ignore_non_elastic_batch_info to true to have them "
                                    "ignored",
                                    config.origin, key));
  return {b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps};
}

}  // namespace

BatchSizes resolve_batch_sizes(const Config& config, int world) {
  auto tbs = config.train_batch_size, micro = config.train_micro_batch_size_per_gpu,
       gas = config.gradient_accumulation_steps;
  if (config.elasticity.enabled) {
    const BatchSizes elastic = elastic_batch_sizes(config, world);
    tbs = elastic.train_batch_size, micro = elastic.micro_batch_per_gpu, gas = elastic.gradient_accumulation_steps;
  }
  // DeepSpeed's _set_batch_related_parameters, integer divisions included.
  if (tbs && micro && !gas) gas = *tbs / *micro / world;
  else if (tbs && gas && !micro) micro = *tbs / world / *gas;
  else if (micro && gas && !tbs) tbs = *micro * *gas * world;
  else if (tbs && !micro && !gas) gas = 1, micro = *tbs / world;
  else if (micro && !tbs && !gas) tbs = *micro * world, gas = 1;
  else if (!tbs && !micro)
    throw ConfigError("DeepSpeed config: either train_batch_size or train_micro_batch_size_per_gpu needs to be provided");
  // _batch_assertion
  if (*tbs <= 0) throw ConfigError(fmt::format("DeepSpeed config: train batch size: {} has to be greater than 0", *tbs));
  if (*micro <= 0)
    throw ConfigError(fmt::format("DeepSpeed config: micro batch size per gpu: {} has to be greater than 0", *micro));
  if (*gas <= 0)
    throw ConfigError(fmt::format("DeepSpeed config: gradient accumulation steps: {} has to be greater than 0", *gas));
  if (*tbs != *micro * *gas * world)
    throw ConfigError(fmt::format("DeepSpeed config: check batch related parameters. train_batch_size is not equal to "
                                  "micro_batch_per_gpu * gradient_acc_step * world_size {} != {} * {} * {}",
                                  *tbs, *micro, *gas, world));
  return {*tbs, *micro, *gas};
}

LossScalerOptions loss_scaler_options(const Fp16Config& fp16, int zero_stage) {
  LossScalerOptions o;
  o.initial_scale_power = fp16.initial_scale_power;
  o.scale_window = fp16.loss_scale_window;
  o.hysteresis = fp16.hysteresis;
  o.min_scale = fp16.min_loss_scale;
  o.consecutive_hysteresis = fp16.consecutive_hysteresis;
  o.static_scale = fp16.loss_scale;
  if (zero_stage == 0) {  // fp16/fused_optimizer.py: each overflow halves, floored at the minimum, no error
    o.hysteresis = 1;
    o.raise_error_at_min_scale = false;
  }
  return o;
}

}  // namespace xlr8::deepspeed
