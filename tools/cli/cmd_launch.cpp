// `xlr8 launch`: Accelerate's and torchrun's flag spellings over one LaunchRequest.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <thread>

#include "cli/commands.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"

namespace xlr8::cli {

namespace {

// "--a_b" also answers to "--a-b", as in `accelerate launch`.
std::string spellings(const std::string& underscored) {
  std::string hyphen = underscored;
  std::replace(hyphen.begin() + 2, hyphen.end(), '_', '-');
  return hyphen == underscored ? underscored : underscored + "," + hyphen;
}

// The option a mistyped one most likely meant: the closest spelling, else the one it begins (--config for
// --config_file), else one sharing most of its start (--num_procs for --num_processes); none when several options
// would fit as well (--m).
std::string closest_option(const std::string& name, const std::vector<std::string>& names) {
  if (auto hint = text::closest(name, names); !hint.empty()) return hint;
  auto option_of = [](std::string n) {  // --a-b and --a_b are one option
    std::replace(n.begin(), n.end(), '-', '_');
    return n;
  };
  size_t most = 0;  // characters of `name` the best candidates begin with
  std::set<std::string> best;
  std::string hint;
  for (const auto& n : names) {
    size_t shared = 0;
    while (shared < name.size() && shared < n.size() && name[shared] == n[shared]) ++shared;
    if (shared > most) most = shared, best.clear(), hint = n;
    if (shared == most) best.insert(option_of(n));
  }
  return best.size() == 1 && most * 3 >= name.size() * 2 ? hint : "";
}

// torchrun's words for --nproc_per_node: cpu (this machine's cores), gpu (its NVIDIA GPUs: the driver's list, or
// CUDA_VISIBLE_DEVICES's where set), auto (the GPUs, else the cores).
CLI::Validator torchrun_process_counts() {
  return CLI::Validator(
      [](std::string& value) {
        if (value != "auto" && value != "cpu" && value != "gpu") return std::string();
        int gpus = 0;
        std::error_code ignored;
        for (auto it = std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ignored);
             it != std::filesystem::directory_iterator(); ++it)
          ++gpus;
        if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible && gpus > 0) {
          const std::string list = visible;
          const int listed = list.empty() ? 0 : static_cast<int>(std::count(list.begin(), list.end(), ',')) + 1;
          gpus = std::min(gpus, listed);
        }
        if (value == "gpu" && gpus == 0)
          return std::string("gpu: this machine shows no NVIDIA GPU (none under /proc/driver/nvidia/gpus, or "
                             "CUDA_VISIBLE_DEVICES empty); give a number of processes, or cpu");
        value = std::to_string(value == "cpu" || gpus == 0 ? std::max(1u, std::thread::hardware_concurrency()) : gpus);
        return std::string();
      },
      "N|auto|cpu|gpu");
}

}  // namespace

std::vector<std::string> normalize_launch_args(const CLI::App& launch, const std::vector<std::string>& args) {
  std::vector<std::string> out;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& word = args[i];
    if (word == "--") {
      ++i;
      break;
    }
    if (word.size() < 2 || word[0] != '-') break;  // the program: it and everything after it are its own
    std::string name = word.substr(0, word.find('='));
    const CLI::Option* opt = launch.get_option_no_throw(name);
    if (!opt) {
      std::vector<std::string> names;
      for (const auto* o : launch.get_options())
        for (const auto& n : o->get_lnames()) names.push_back("--" + n);
      std::string hint = closest_option(name, names);
      throw ConfigError(fmt::format("xlr8 launch: unknown option {}{}; to pass it to the program, put it after the "
                                    "program's name",
                                    name, hint.empty() ? "" : fmt::format(" (did you mean {}?)", hint)));
    }
    out.push_back(word);
    bool takes_value = opt->get_items_expected_max() > 0 && word.find('=') == std::string::npos;
    if (takes_value && i + 1 < args.size()) out.push_back(args[++i]);
  }
  out.push_back("--");
  out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  return out;
}

Handler add_launch(CLI::App& app) {
  auto* cmd = app.add_subcommand("launch", "Start the worker processes of a distributed job on this machine");
  auto req = std::make_shared<LaunchRequest>();
  add_launch_options(cmd, req);
  cmd->footer("Usage: xlr8 launch [options] [--] program [args...]\n"
              "Everything from the program's name on (or after --) is the program's, even --help.");
  return [req]() {
    LaunchOptions options = plan_launch(*req);
    return launch(options);
  };
}

// One option per config-file key, each stored under its key in one of the request's maps (fsdp, deepspeed, ...).
static void add_config_key_options(CLI::App* cmd, const std::shared_ptr<LaunchRequest>& req,
                                   std::map<std::string, std::string> LaunchRequest::*into, const std::string& group,
                                   const std::string& help, std::initializer_list<const char*> keys) {
  for (std::string k : keys)
    cmd->add_option_function<std::string>(
           spellings("--" + k), [req, into, k](const std::string& v) { ((*req).*into)[k] = v; }, help + k)
        ->group(group);
}

// The config file's sections as flags (FSDP, DeepSpeed, the mesh, fp8), stored under their keys.
static void add_config_section_options(CLI::App* cmd, const std::shared_ptr<LaunchRequest>& req) {
  add_config_key_options(cmd, req, &LaunchRequest::fsdp, "FSDP", "FSDP: as fsdp_config.",
                         {"fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy",
                          "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params", "fsdp_backward_prefetch",
                          "fsdp_state_dict_type", "fsdp_forward_prefetch", "fsdp_use_orig_params",
                          "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_offload_params",
                          "fsdp_activation_checkpointing"});
  add_config_key_options(cmd, req, &LaunchRequest::deepspeed, "DeepSpeed", "DeepSpeed: as deepspeed_config.",
                         {"zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                          "offload_param_nvme_path", "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model",
                          "deepspeed_config_file", "deepspeed_hostfile", "deepspeed_multinode_launcher",
                          "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names"});
  // Accelerate's ParallelismConfig flags: the device mesh (dp_replicate x dp_shard x cp x sp x tp).
  add_config_key_options(cmd, req, &LaunchRequest::parallelism, "Parallelism", "Device mesh: as parallelism_config.",
                         {"parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
                          "parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_cp_comm_strategy",
                          "parallelism_config_cp_backend",
                          "parallelism_config_sp_size", "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
                          "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation",
                          "parallelism_config_tp_head_dim", "parallelism_config_pp_size", "parallelism_config_pp_schedule",
                          "parallelism_config_pp_microbatches", "parallelism_config_pp_virtual_stages"});
  // Accelerate's fp8 flags (with --mixed_precision fp8): --fp8_<key> is fp8_config's <key>, fp8_format its own.
  add_config_key_options(cmd, req, &LaunchRequest::fp8, "FP8", "fp8, with --mixed_precision fp8: ",
                         {"fp8_backend", "fp8_margin", "fp8_interval", "fp8_format", "fp8_amax_history_len",
                          "fp8_amax_compute_algo", "fp8_override_linear_precision", "fp8_opt_level",
                          "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim"});
  // `accelerate launch`'s TorchDynamo and TPU flags, as their keys: off is accepted (no dynamo backend, no bf16
  // downcast), anything on is refused in one line as the file's key is.
  add_config_key_options(cmd, req, &LaunchRequest::other_keys, "Compatibility", "as the config file's ",
                         {"main_training_function"});
  for (const char* key : {"dynamo_backend", "dynamo_mode"})
    cmd->add_option_function<std::string>(
           spellings(std::string("--") + key),
           [req, key](const std::string& v) { req->other_keys[std::string("dynamo_config.") + key] = v; },
           std::string("as the config file's dynamo_config.") + key)
        ->group("Compatibility");
  for (const char* key : {"dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation"})
    cmd->add_flag_callback(
           spellings(std::string("--") + key),
           [req, key] { req->other_keys[std::string("dynamo_config.") + key] = "true"; },
           std::string("as the config file's dynamo_config.") + key)
        ->group("Compatibility");
  cmd->add_flag_callback(
         spellings("--downcast_bf16"), [req] { req->other_keys["downcast_bf16"] = "true"; },
         "as the config file's downcast_bf16 (TPU only: refused)")
      ->group("Compatibility");
  const auto autocast_in_eval = [req] { req->fp8["fp8_use_autocast_during_eval"] = "true"; };
  cmd->add_flag_callback(spellings("--fp8_use_autocast_during_eval"), autocast_in_eval,
                         "fp8: evaluate in fp8 too (fp8_config.use_autocast_during_eval)")
      ->group("FP8");
}

void add_launch_options(CLI::App* cmd, const std::shared_ptr<LaunchRequest>& req) {
  // The program and its arguments: normalize_launch_args puts a `--` before them, so CLI11 never reads
  // them as options (`xlr8 launch prog --help` is prog's help).
  cmd->add_option("program", req->command, "The program to start, and its arguments: program [args...]");
  auto opt = [&](const std::string& name, auto& target, const std::string& help) {
    return cmd->add_option(spellings(name), target, help);
  };
  auto& r = *req;
  opt("--config_file", r.config_file, "Accelerate-format YAML config (default: ~/.cache/xlr8/default_config.yaml)");
  opt("--num_processes", r.num_processes, "Total processes over all machines")
      ->check(CLI::Validator(
          [](std::string& v) {
            const bool count = !v.empty() && v.size() < 9 && v.find_first_not_of("0123456789") == std::string::npos;
            return count && std::stoi(v) >= 1 ? std::string()
                                               : fmt::format("{} is not a number of processes: give 1 or more (the "
                                                             "total over all machines)",
                                                             v);
          },
          "N>=1"));
  opt("--num_machines", r.num_machines, "Number of machines");
  opt("--machine_rank", r.machine_rank, "Rank of this machine, from 0");
  opt("--main_process_ip", r.main_process_ip, "Address of machine 0");
  opt("--main_process_port", r.main_process_port, "Rendezvous port on machine 0 (0 or unset: a free port)");
  opt("--mixed_precision", r.mixed_precision, "no | fp16 | bf16 | fp8");
  opt("--gradient_accumulation_steps", r.gradient_accumulation_steps, "Gradient accumulation steps");
  cmd->add_flag("--cpu", r.cpu, "Run on CPU even when GPUs are present");
  cmd->add_flag("--use_fsdp,--use-fsdp", r.use_fsdp, "Shard with FSDP");
  cmd->add_flag("--use_deepspeed,--use-deepspeed", r.use_deepspeed, "Use DeepSpeed-style ZeRO");
  opt("--max_restarts", r.max_restarts, "Restart the whole group up to N times when a worker fails");
  opt("--log_dir", r.log_dir, "Also write each rank's output to <dir>/attempt_<n>/<local_rank>/{stdout,stderr}.log");
  opt("--rdzv_timeout", r.rdzv_timeout_s, "Seconds the workers wait for all ranks to join (default 300)");
  opt("--num_cpu_threads_per_process", r.num_cpu_threads_per_process, "Intra-op threads per worker (OMP_NUM_THREADS)");
  opt("--gpu_ids", r.gpu_ids, "GPUs to use, e.g. 0,1 (CUDA_VISIBLE_DEVICES); default all");
  opt("--log_with", r.log_with, "Trackers for Accelerator::log: jsonl, csv, tensorboard or all (XLR8_LOG_WITH)");
  opt("--mpirun_hostfile", r.mpirun_hostfile,
      "Start the job through mpirun over this host file's machines, run once on machine 0 (mpirun_config)");
  cmd->add_flag("--debug", r.debug, "Set ACCELERATE_DEBUG_MODE for the workers");
  cmd->add_flag("--enable_cpu_affinity,--enable-cpu-affinity", r.enable_cpu_affinity,
                "Bind each worker to its own share of this machine's cores (ACCELERATE_CPU_AFFINITY)");
  // torchrun spellings.
  cmd->add_option("--nproc-per-node,--nproc_per_node", r.nproc_per_node,
                  "Processes on this machine (torchrun): a number, or cpu, gpu or auto (the GPUs, else the cores)")
      ->transform(torchrun_process_counts());
  cmd->add_option("--nnodes", r.nnodes, "Number of machines, N or MIN:MAX (torchrun; a range needs --rdzv_backend c10d)");
  cmd->add_option("--node-rank,--node_rank", r.machine_rank, "Rank of this machine (torchrun)");
  cmd->add_option("--master-addr,--master_addr", r.main_process_ip, "Address of machine 0 (torchrun)");
  cmd->add_option("--master-port,--master_port", r.main_process_port, "Rendezvous port (torchrun)");
  opt("--rdzv_backend", r.rdzv_backend, "static (machine ranks given) or c10d (elastic: machines join and leave)");
  opt("--rdzv_endpoint", r.rdzv_endpoint, "host[:port] of the c10d rendezvous, served by that machine's xlr8 launch (port 29400)");
  opt("--rdzv_id", r.rdzv_id, "Job id: every machine of one job gives the same");
  opt("--rdzv_conf", r.rdzv_conf,
      "key=value,...: join_timeout (600), last_call_timeout (30), close_timeout (300), keep_alive_interval (5), "
      "keep_alive_max_attempt (3)");
  // Accepted for compatibility with `accelerate launch`; xlr8 needs nothing from them.
  auto compat_flags = std::make_shared<std::vector<std::string>>();
  auto compat_switch = std::make_shared<bool>(false);
  // --use_parallelism_config: xlr8 applies the parallelism_config_* flags without it.
  for (auto name : {"--multi_gpu", "--quiet", "--same_network", "--standalone", "--no_python", "--use_parallelism_config"})
    cmd->add_flag(spellings(name), *compat_switch, "Accepted for compatibility")->group("Compatibility");
  for (auto name : {"--monitor_interval", "--role", "--tee"})
    cmd->add_option(spellings(name), *compat_flags, "Accepted for compatibility")->group("Compatibility")->expected(1);
  add_config_section_options(cmd, req);
  // Kept alive with the command: CLI11 writes into them while parsing.
  cmd->callback([compat_flags, compat_switch] {});
}

}  // namespace xlr8::cli
