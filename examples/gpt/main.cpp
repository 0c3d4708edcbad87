// A byte-level GPT trained on the text of Debian's `fortunes` package with xlr8: the same program on 1
// process or many (`xlr8 launch`); the parallel strategy comes from the launcher or the config file,
// never from these flags. Prints progress, a held-out validation loss, and one JSON line last.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>

#include "args.hpp"
#include "gpt.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/deepspeed_dummy.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace {

namespace F = torch::nn::functional;

using gpt::Args;

// Bytes of parameters, gradients and optimizer state this process holds, each storage counted once
// (DDP's gradients are views of its buckets; sharded strategies' optimizers hold this rank's shards,
// which may be views of the whole parameters; a freed gathered unit holds no bytes).
// `where`: only the tensors in host memory (kCPU) or only those on an accelerator (kCUDA); all by default.
int64_t state_bytes(const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                    std::optional<c10::DeviceType> where = std::nullopt) {
  std::set<const void*> seen;
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || (where && (t.device().is_cpu() != (*where == c10::DeviceType::CPU)))) return;
    if (seen.insert(t.storage().data()).second) total += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : model.parameters()) {
    add(p);
    add(p.grad());
  }
  for (const auto& group : opt.param_groups())
    for (const auto& p : group.params()) {
      add(p);
      add(p.grad());
    }
  for (const auto& [key, state] : opt.state()) {
    if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      add(s->exp_avg());
      add(s->exp_avg_sq());
      add(s->max_exp_avg_sq());
    }
  }
  return total;
}

// Whether the split layers take activations split on the sequence (by the example's plan, or by the one
// AutoTP made at prepare()).
bool sequence_parallel_in(const torch::nn::Module& model) {
  for (const auto& m : model.modules())
    if (auto* linear = dynamic_cast<const xlr8::nn::LinearImpl*>(m.get()))
      if (const auto& slot = linear->tensor_parallel(); slot && slot->sequence_parallel) return true;
  return false;
}

// A line of /proc/self/status in MB: VmHWM (the peak RSS) or VmRSS (now).
double status_mb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(field.size())) / 1024.0;
  return 0;
}
double peak_rss_mb() { return status_mb("VmHWM:"); }

// Resets VmHWM to the current RSS, so that a later peak_rss_mb() measures what happened since.
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// The mean loss over the held-out windows; null when there are none (as the pipeline path reports it).
nlohmann::json validation_loss(xlr8::Accelerator& acc, gpt::Gpt& model,
                               const std::shared_ptr<xlr8::DataLoader<gpt::TextWindows>>& held_out) {
  if (!held_out) return nullptr;
  auto& val = *held_out;
  torch::NoGradGuard no_grad;
  model->eval();
  double sum = 0;
  int64_t windows = 0;
  for (auto& batch : val) {
    auto autocast = acc.autocast();
    // Under context parallelism each rank holds a share of every window's tokens (shard_sequence is the
    // identity otherwise): the per-token losses come back whole before the mean.
    auto logits = model->forward(acc.shard_sequence(batch.data));
    auto per_token = F::cross_entropy(logits.flatten(0, 1), acc.shard_sequence(batch.target).flatten(),
                                      F::CrossEntropyFuncOptions().reduction(torch::kNone))
                         .view({batch.data.size(0), -1});
    // One loss per window, gathered without even_batches' padding: exactly the held-out windows count.
    auto per_window = acc.unshard_sequence(per_token).mean(1);
    auto all = acc.gather_for_metrics(per_window.to(torch::kDouble));
    sum += all.sum().item<double>();
    windows += all.size(0);
  }
  model->train();
  return windows ? nlohmann::json(sum / static_cast<double>(windows)) : nlohmann::json();
}

int run(const Args& args) {
  xlr8::AcceleratorOptions options;
  options.gradient_accumulation_steps = args.gradient_accumulation_steps;
  options.project_dir = args.output_dir;
  if (args.autotp && args.sequence_parallel) options.tp_sequence_parallel = true;  // AutoTP places it at prepare()
  if (args.n_head > 0) options.tp_head_dim = args.d_model / args.n_head;  // prepare() refuses a split cutting a head
  options.automatic_checkpoint_naming = true;
  options.total_limit = 2;
  xlr8::Accelerator acc(options);
  acc.set_seed(args.seed);
  if (args.pipeline || acc.plan().mesh.pp > 1) return gpt::train_pipeline(acc, args);

  gpt::Config config{.seq_len = args.seq_len, .n_layer = args.n_layer, .d_model = args.d_model,
                     .n_head = args.n_head, .n_kv_head = args.n_kv_head, .dropout = args.dropout, .tied_head = !args.untied_head};
  // Under FULL_SHARD only the main process computes the initial weights; the others receive their
  // shards (fsdp_cpu_ram_efficient_loading). Elsewhere this just builds the model.
  int64_t frozen = 0, params = 0;
  // Tensor parallelism (parallelism_config_tp_size): the plan beside the model splits it, or AutoTP at
  // prepare() finds the same one from the layer names.
  auto& tp_group = acc.state().mesh().group(xlr8::MeshDim::tp);
  // Checks the heads (and under sequence parallelism the sequence) divide first; AutoTP checks its own.
  const auto plan = args.autotp ? xlr8::tp::Plan{} : gpt::tp_plan(config, tp_group.size(), args.sequence_parallel);
  auto model = acc.prepare(acc.build_model([&] {
    gpt::Gpt net(config);
    frozen = gpt::freeze(*net, args.freeze);
    for (const auto& p : net->parameters()) params += p.numel();  // the whole model, before any split
    if (tp_group.size() > 1 && !args.autotp) xlr8::tp::parallelize(*net, tp_group, plan, /*strict=*/true);
    return net;
  }));
  const double setup_peak_rss_mb = peak_rss_mb();  // building and preparing the model
  // Under a DeepSpeed JSON that defines the optimizer or scheduler (`--deepspeed_config_file`), placeholders
  // stand for them and supply the values its "auto" entries take, as Accelerate's examples do.
  const auto* ds = acc.deepspeed_config();
  auto opt = ds && ds->contains("optimizer")
                 ? acc.prepare(xlr8::DummyOptim(model->parameters(), args.lr, args.weight_decay))
                 : acc.prepare(xlr8::optim::FusedAdamW(
                       model->parameters(), torch::optim::AdamWOptions(args.lr).weight_decay(args.weight_decay)));
  std::optional<xlr8::PreparedScheduler> scheduler;
  if (ds && ds->contains("scheduler"))
    scheduler = acc.prepare(xlr8::DummyScheduler(opt.optimizer(), args.max_steps, args.warmup_steps));

  // 90% of the text for training, the rest held out.
  const auto text = gpt::load_text(args.data_dir);
  auto [train_windows, held_out_windows] = gpt::split_text(text, args.seq_len, args.val_windows);
  const auto held_out = *held_out_windows.size();
  auto train = acc.prepare_data_loader(std::move(train_windows),
                                       {.batch_size = args.batch_size, .shuffle = true,
                                        .pin_memory = acc.device().is_cuda()});  // copies overlap the step
  std::shared_ptr<xlr8::DataLoader<gpt::TextWindows>> val;  // none with --val_windows 0
  if (held_out > 0) val = acc.prepare_data_loader(std::move(held_out_windows), {.batch_size = args.batch_size});
  double load_growth_mb = 0;  // how far loading the weights raised this rank's peak RSS
  if (!args.init_from.empty()) {
    reset_peak_rss();
    const double before = peak_rss_mb();
    acc.load_model(model, args.init_from);  // rank 0 reads; each rank keeps only what it holds
    load_growth_mb = peak_rss_mb() - before;
    acc.print("initialised from {}", args.init_from);
  }
  double load_seconds = 0, save_seconds = 0;
  // "latest" on a first start (no automatic checkpoint yet) starts fresh and says so.
  const bool nothing_to_resume = args.resume_from == "latest" && !acc.latest_checkpoint();
  if (nothing_to_resume) acc.print("--resume_from latest: no checkpoint under {}/checkpoints yet; starting fresh", args.output_dir);
  if (!args.resume_from.empty() && !nothing_to_resume) {
    const auto began = std::chrono::steady_clock::now();
    acc.load_state(args.resume_from == "latest" ? "" : args.resume_from);
    load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    acc.print("resumed from {} at step {}", args.resume_from, acc.step());
  }
  if (frozen) acc.print("frozen: {} of the {} parameters ({})", frozen, params, args.freeze);
  acc.print("gpt: {} parameters, {} layers, d_model {}, {} heads; {} bytes of text, windows of {}; {} process(es), "
            "{} windows per global batch, {} batches per epoch per process",
            params, args.n_layer, args.d_model, args.n_head, text.numel(), args.seq_len, acc.num_processes(),
            args.batch_size * acc.state().mesh().size(xlr8::MeshDim::dp) * acc.gradient_accumulation_steps(), train->size());

  const auto start = std::chrono::steady_clock::now();
  const int64_t tp_bytes_before = xlr8::tp::region_wire_bytes();  // tensor-parallel traffic of training alone
  const int64_t cp_bytes_before = xlr8::cp::wire_bytes(), cp_blocks_before = xlr8::cp::attention_blocks();
  const auto ring_before = xlr8::cp::ring_time();
  int64_t micro_steps = 0;
  int64_t tokens = 0, steps_at_start = acc.step();
  double between_steps_rss_mb = 0;
  int64_t held = 0, peak = 0;
  double last_loss = 0;
  bool loss_read = false;
  xlr8::GradNorm grad_norm;  // stays on the device: read once, for the report
  bool done = acc.step() >= args.max_steps;
  // A bar on a terminal, a line every --log_every steps otherwise (XLR8_PROGRESS=off: none).
  auto bar = acc.progress(args.max_steps, {.description = "train", .unit = "step", .initial = acc.step(),
                                           .line_every = args.log_every});
  while (!done) {
    for (auto& batch : *train) {
      auto step = acc.accumulate(model);
      ++micro_steps;
      // parallelism_config_cp_size: this rank's share of each window's tokens. Every share has as many
      // tokens, and the strategy averages gradients over dp x cp, so the mean is the global batch's.
      auto logits = model->forward(acc.shard_sequence(batch.data));
      auto loss = F::cross_entropy(logits.flatten(0, 1), acc.shard_sequence(batch.target).flatten());
      acc.backward(loss);
      if (args.max_grad_norm > 0 && acc.sync_gradients())
        grad_norm = acc.clip_grad_norm(model->parameters(), args.max_grad_norm);
      peak = std::max(peak, state_bytes(*model, opt.optimizer()));
      opt.step();
      if (scheduler) scheduler->step();
      if (acc.sync_gradients()) {
        // What stays between steps; sharding under mixed precision also keeps low-precision copies that
        // neither the parameters nor the optimizer reach.
        held = state_bytes(*model, opt.optimizer()) +
               acc.parallel_stats(model).value("internal_state_bytes", int64_t{0});
        // Stage 3 gathers units inside the step and frees them: their largest total counts in the peak.
        // (The first step is left out: until a unit's guard has run once, its parameters stay whole.)
        if (acc.step() > steps_at_start + 1)
          peak = std::max(peak, held + acc.parallel_stats(model).value("step_peak_gathered_bytes", int64_t{0}));
      }
      peak = std::max(peak, held);
      opt.zero_grad();
      if (acc.sync_gradients()) between_steps_rss_mb = status_mb("VmRSS:");  // what a step leaves resident
      tokens += batch.data.numel() * acc.state().mesh().size(xlr8::MeshDim::dp);  // tp peers read the same batch
      if (!acc.sync_gradients()) continue;
      const int64_t global_step = acc.step();
      // Reading the loss waits for the device: only on the steps that show it.
      if ((args.log_every > 0 && global_step % args.log_every == 0) || global_step >= args.max_steps)
        last_loss = loss.item<double>(), loss_read = true;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // The loss shown is the last one read (none before the first --log_every step), never a stand-in 0.
      nlohmann::ordered_json postfix;
      if (loss_read) postfix["loss"] = last_loss;
      postfix["tokens/s"] = std::round(tokens / std::max(seconds, 1e-9));
      bar.set_postfix(postfix);
      bar.update();
      if (args.checkpoint_every > 0 && global_step % args.checkpoint_every == 0) {
        const auto began = std::chrono::steady_clock::now();
        auto dir = acc.save_state();
        save_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
        acc.print("saved {}", dir);
      }
      if (global_step >= args.max_steps) {
        done = true;
        break;
      }
    }
  }
  bar.close();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t tp_bytes = xlr8::tp::region_wire_bytes() - tp_bytes_before;
  const int64_t cp_bytes = xlr8::cp::wire_bytes() - cp_bytes_before;
  // The ring's compute and its waits for blocks, the largest rank's (what overlap left exposed).
  const auto ring_after = xlr8::cp::ring_time();
  auto ring = acc.reduce(torch::tensor({ring_after.compute_s - ring_before.compute_s, ring_after.wait_s - ring_before.wait_s},
                                       torch::kFloat64),
                         xlr8::ReduceOp::MAX);
  // Each rank's attention work per micro-step (query-key chunk pairs computed): the load balance.
  auto cp_blocks = acc.gather(torch::full(
      {1}, static_cast<double>(xlr8::cp::attention_blocks() - cp_blocks_before) / std::max<int64_t>(micro_steps, 1),
      torch::kFloat64));
  const auto val_loss = validation_loss(acc, model, val);
  if (val_loss.is_null()) acc.print("validation: no held-out window (--val_windows {}); val_loss is null", args.val_windows);
  else acc.print("validation loss {:.4f} over {} held-out windows", val_loss.get<double>(), held_out);
  auto mean_loss = acc.reduce(torch::full({1}, last_loss, torch::kFloat64), xlr8::ReduceOp::AVG).item<double>();
  auto largest = acc.reduce(torch::tensor({static_cast<double>(held), static_cast<double>(peak), peak_rss_mb(),
                                           between_steps_rss_mb},
                                          torch::kFloat64),
                            xlr8::ReduceOp::MAX);
  auto growth = acc.gather(torch::full({1}, load_growth_mb, torch::kFloat64));
  auto setup_peaks = acc.gather(torch::full({1}, setup_peak_rss_mb, torch::kFloat64));
  const auto stats = acc.parallel_stats(model);
  // Where the state lives (offload moves the optimizer's side, and under stage 3 the parameter shards, to the host).
  const int64_t device_bytes = state_bytes(*model, opt.optimizer(), c10::DeviceType::CUDA);
  const int64_t host_bytes = state_bytes(*model, opt.optimizer(), c10::DeviceType::CPU);
  acc.save_model(model, args.output_dir + "/model");
  acc.end_training();
  if (acc.is_main_process()) {
    nlohmann::json result{{"final_train_loss", mean_loss},
                          {"val_loss", val_loss},
                          {"global_step", acc.step()},
                          {"num_processes", acc.num_processes()},
                          {"tp_size", tp_group.size()},
                          {"sequence_parallel", sequence_parallel_in(*model)},
                          {"tp_wire_bytes_per_micro_step", micro_steps > 0 ? tp_bytes / micro_steps : 0},
                          {"cp_size", acc.state().mesh().size(xlr8::MeshDim::cp)},
                          {"sp_size", acc.state().mesh().size(xlr8::MeshDim::sp)},
                          {"cp_wire_bytes_per_micro_step", micro_steps > 0 ? cp_bytes / micro_steps : 0},
                          {"cp_ring_compute_s", ring[0].item<double>()},
                          {"cp_ring_wait_s", ring[1].item<double>()},
                          {"last_grad_norm", grad_norm.value()},
                          {"tokens_per_s", tokens / std::max(seconds, 1e-9)},
                          {"state_bytes_per_rank", static_cast<int64_t>(largest[0].item<double>())},
                          {"peak_state_bytes_per_rank", static_cast<int64_t>(largest[1].item<double>())},
                          {"peak_rss_mb", largest[2].item<double>()},
                          {"between_steps_rss_mb", largest[3].item<double>()},
                          {"parameters", params},
                          {"trainable_parameters", params - frozen},
                          {"frozen_released_in_backward", stats.value("frozen_released_in_backward", int64_t{0})},
                          {"rank0_loading", stats.value("values_from_rank0", false)},
                          {"groups_computed_when_made", stats.value("groups_computed_when_made", int64_t{0})},
                          {"forward_prefetches", stats.value("forward_prefetches", int64_t{0})},
                          {"backward_prefetches", stats.value("backward_prefetches", int64_t{0})},
                          {"gathers", stats.value("gathers", int64_t{0})},
                          {"device", acc.device().str()},
                          {"device_state_bytes_rank0", device_bytes},
                          {"host_state_bytes_rank0", host_bytes},
                          {"offloaded_optimizer_groups", stats.value("offloaded_optimizer_groups", int64_t{0})},
                          {"offloaded_parameter_groups", stats.value("offloaded_parameter_groups", int64_t{0})},
                          {"offload_host_bytes", stats.value("offload_host_bytes", int64_t{0})},
                          {"offload_pinned", stats.value("offload_pinned", false)},
                          // The disk tier (offload_optimizer nvme): rank 0's swap file, what moved, how fast.
                          {"optimizer_on_disk", stats.value("optimizer_on_disk", nlohmann::json())},
                          {"parameters_on_disk", stats.value("parameters_on_disk", nlohmann::json())},
                          {"heap_trim_seconds", stats.value("heap_trim_seconds", 0.0)},
                          {"save_state_seconds", save_seconds},
                          {"load_state_seconds", load_seconds}};
    // How a sharding strategy split the model: its units (stage 3; the blocks under TRANSFORMER_BASED_WRAP)
    // or buckets, the ranks each shards over and the replicas of each shard (HSDP: above 1).
    result["sharding_units"] = nlohmann::json::array();
    for (const auto& group : stats.value("groups", nlohmann::json::array()))
      if (!group.value("frozen", false)) result["sharding_units"].push_back(group.value("name", std::string()));
    result["shard_ranks"] = stats.value("ranks", 1);
    result["shard_replicas"] = stats.value("replicas", 1);
    result["cp_attention_blocks_per_micro_step_by_rank"] =
        std::vector<double>(cp_blocks.data_ptr<double>(), cp_blocks.data_ptr<double>() + cp_blocks.numel());
    result["setup_peak_rss_mb_by_rank"] =
        std::vector<double>(setup_peaks.data_ptr<double>(), setup_peaks.data_ptr<double>() + setup_peaks.numel());
    if (!args.init_from.empty()) {
      std::vector<double> per_rank(growth.data_ptr<double>(), growth.data_ptr<double>() + growth.numel());
      result["load_peak_rss_growth_mb"] = per_rank;
    }
    fmt::print("{}\n", result.dump());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpt: a byte-level GPT on the fortunes text, with xlr8"};
  Args a;
  app.add_option("--max_steps", a.max_steps, "Optimizer steps");
  app.add_option("--batch_size", a.batch_size, "Windows per process per micro-batch");
  app.add_option("--seq_len", a.seq_len, "Bytes per window (the model's context)");
  app.add_option("--n_layer", a.n_layer, "Transformer blocks");
  app.add_option("--d_model", a.d_model, "Model width");
  app.add_option("--n_head", a.n_head, "Attention heads");
  app.add_option("--n_kv_head", a.n_kv_head, "Key/value heads, fewer than --n_head for grouped-query attention (0: n_head)");
  app.add_option("--seed", a.seed, "Seed: same seed, same initialisation and data order on any number of processes");
  app.add_option("--lr", a.lr, "AdamW learning rate");
  app.add_option("--weight_decay", a.weight_decay, "AdamW weight decay");
  app.add_option("--warmup_steps", a.warmup_steps, "Warm-up steps of a DeepSpeed config's scheduler");
  app.add_option("--output_dir", a.output_dir, "Checkpoints and the final model go here");
  app.add_option("--init_from", a.init_from, "Start from weights save_model wrote (a directory or safetensors file)");
  app.add_option("--checkpoint_every", a.checkpoint_every, "Save a checkpoint every N optimizer steps");
  app.add_option("--resume_from", a.resume_from, "Checkpoint directory to resume from, or 'latest'");
  app.add_option("--gradient_accumulation_steps", a.gradient_accumulation_steps, "Micro-batches per optimizer step");
  app.add_option("--data_dir", a.data_dir, "Directory of text files (default: Debian's fortunes)");
  app.add_option("--val_windows", a.val_windows, "Held-out windows scored at the end");
  app.add_option("--dropout", a.dropout, "Attention dropout probability (random: runs then depend on the process count)");
  app.add_option("--freeze", a.freeze, "Comma-separated module paths whose parameters stay fixed (e.g. wpe,attn)");
  app.add_flag("--untied_head", a.untied_head, "An LM head of its own instead of the token embedding's weights");
  app.add_option("--max_grad_norm", a.max_grad_norm, "Clip the gradients' global norm to this (0: no clipping)");
  app.add_flag("--sequence_parallel", a.sequence_parallel,
               "Under parallelism_config_tp_size, also split the activations between layers on the sequence (with "
               "--autotp, AutoTP places it at prepare())");
  app.add_flag("--autotp", a.autotp, "Under parallelism_config_tp_size, let AutoTP split the model instead of gpt::tp_plan");
  app.add_option("--log_every", a.log_every, "Print progress every N steps");
  app.add_flag("--pipeline", a.pipeline,
               "Train the GPT as layer specs cut into stages, a step one pipeline_step (implied under "
               "parallelism_config_pp_size; on one process the same micro-batches accumulated)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(a);
  } catch (const xlr8::Error& e) {
    fmt::print(stderr, "gpt: error: {}\n", e.what());
    return 2;
  } catch (const c10::Error& e) {  // LibTorch's own (a shape, a dtype): the message without its backtrace
    fmt::print(stderr, "gpt: error: {}\n", e.what_without_backtrace());
    return 1;
  }
}
