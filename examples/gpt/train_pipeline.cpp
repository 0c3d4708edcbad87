// The GPT example under pipeline parallelism through the Accelerator (--pipeline, or a launch with
// parallelism_config_pp_size above 1): the model as gpt::pipeline_layers in a PipelineModule, so each rank builds
// only its own stage's layers, each seeded by its index (every layout starts from one process's values); a step is
// one accelerator.pipeline_step over the batch's parallelism_config_pp_microbatches micro-batches, and the held-out
// loss one pipeline_evaluate a batch. The stage's other axes (DDP, ZeRO, FSDP) come from the launch as usual.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include "args.hpp"
#include "gpt.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/deepspeed_pipeline.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"

namespace gpt {

namespace {

namespace F = torch::nn::functional;

at::Tensor next_byte_loss(const at::Tensor& logits, const at::Tensor& target) {
  return F::cross_entropy(logits.flatten(0, 1), target.flatten());
}

// What the pipeline path does not take: named, not ignored.
void refuse_unsupported(const Args& args) {
  const std::pair<bool, const char*> unsupported[] = {
      {!args.freeze.empty(), "--freeze"},
      {args.autotp, "--autotp"},
      {args.sequence_parallel, "--sequence_parallel"},
      {!args.init_from.empty(), "--init_from"},
      {args.gradient_accumulation_steps > 1,
       "--gradient_accumulation_steps (a pipeline's micro-batches are its accumulation: "
       "--parallelism_config_pp_microbatches)"}};
  for (const auto& [set, flag] : unsupported)
    if (set) throw xlr8::ConfigError(fmt::format("gpt --pipeline: {} is not supported on the pipeline path", flag));
}

// The mean loss over the held-out windows that fill whole batches (pipeline_evaluate splits each into the
// micro-batches), over every data-parallel replica; JSON null, and a line saying so, when no batch is whole.
nlohmann::json held_out_loss(xlr8::Accelerator& acc, const std::shared_ptr<xlr8::DataLoader<TextWindows>>& val,
                             const Args& args) {
  double sum = 0;
  int64_t batches = 0;
  if (val)  // none with --val_windows 0; the reduce below is collective either way
    for (auto& batch : *val) {
      sum += acc.pipeline_evaluate(batch.data, batch.target, next_byte_loss);
      ++batches;
    }
  auto both = acc.reduce(at::tensor({sum, static_cast<double>(batches)}, at::kDouble));
  if (both[1].item<double>() > 0) return both[0].item<double>() / both[1].item<double>();
  acc.print("validation: no held-out batch is whole (--val_windows {} under --batch_size {} a replica), so none was "
            "scored; val_loss is null",
            args.val_windows, args.batch_size);
  return nullptr;
}

}  // namespace

int train_pipeline(xlr8::Accelerator& acc, const Args& args) {
  refuse_unsupported(args);
  const Config config{.seq_len = args.seq_len, .n_layer = args.n_layer, .d_model = args.d_model, .n_head = args.n_head,
                      .n_kv_head = args.n_kv_head, .dropout = args.dropout, .tied_head = !args.untied_head};
  auto model = acc.prepare(xlr8::deepspeed::PipelineModule(
      pipeline_layers(config), xlr8::deepspeed::PipelineModuleOptions{.loss_fn = next_byte_loss, .base_seed = args.seed}));
  int64_t held = 0;  // the parameters this rank's stage holds
  for (const auto& p : model->parameters()) held += p.numel();
  auto opt = acc.prepare(xlr8::optim::FusedAdamW(model->parameters(),
                                                 torch::optim::AdamWOptions(args.lr).weight_decay(args.weight_decay)));
  auto [train_windows, held_out_windows] = split_text(load_text(args.data_dir), args.seq_len, args.val_windows);
  auto train = acc.prepare_data_loader(std::move(train_windows), {.batch_size = args.batch_size, .shuffle = true});
  std::shared_ptr<xlr8::DataLoader<TextWindows>> val;
  if (*held_out_windows.size() > 0)
    val = acc.prepare_data_loader(std::move(held_out_windows), {.batch_size = args.batch_size, .drop_last = true});
  // "latest" on a first start (no automatic checkpoint yet) starts fresh and says so, as the other path does.
  const bool nothing_to_resume = args.resume_from == "latest" && !acc.latest_checkpoint();
  if (nothing_to_resume) acc.print("--resume_from latest: no checkpoint under {}/checkpoints yet; starting fresh", args.output_dir);
  if (!args.resume_from.empty() && !nothing_to_resume) {
    acc.load_state(args.resume_from == "latest" ? "" : args.resume_from);
    acc.print("resumed from {} at step {}", args.resume_from, acc.step());
  }
  const int64_t replicas = acc.state().mesh().size(xlr8::MeshDim::dp);
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> losses;
  int64_t tokens = 0;
  auto bar = acc.progress(args.max_steps, {.description = "train", .unit = "step", .initial = acc.step(),
                                           .line_every = args.log_every});
  while (acc.step() < args.max_steps)
    for (auto& batch : *train) {
      const double loss = acc.pipeline_step(batch.data, batch.target, next_byte_loss);
      if (args.max_grad_norm > 0) acc.clip_grad_norm(model->parameters(), args.max_grad_norm);
      opt.step();
      opt.zero_grad();
      losses.push_back(loss);  // this replica's; averaged over the replicas once, at the end
      tokens += batch.data.numel() * replicas;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      bar.set_postfix({{"loss", loss}, {"tokens/s", std::round(tokens / std::max(seconds, 1e-9))}});
      bar.update();
      if (args.checkpoint_every > 0 && acc.step() % args.checkpoint_every == 0) acc.print("saved {}", acc.save_state());
      if (acc.step() >= args.max_steps) break;
    }
  bar.close();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Every rank of a replica holds its loss: the mean over all ranks is the mean over the replicas.
  if (!losses.empty()) {
    const auto mean = acc.reduce(at::tensor(losses, at::kDouble), xlr8::ReduceOp::AVG);
    losses.assign(mean.data_ptr<double>(), mean.data_ptr<double>() + mean.numel());
  }
  const auto val_loss = held_out_loss(acc, val, args);
  nlohmann::json held_by_rank = nlohmann::json::array();
  for (const auto& count : acc.gather_object(std::to_string(held))) held_by_rank.push_back(std::stoll(count));
  // Zero-bubble schedules: the last step's micro-batches each stage could not split (a backward run whole).
  nlohmann::json whole_backwards = nlohmann::json::array();
  const auto stats = acc.pipeline_stats();
  for (const auto& count : acc.gather_object(std::to_string(stats.is_null() ? 0 : stats.value("whole_backwards", 0))))
    whole_backwards.push_back(std::stoi(count));
  acc.save_model(model, args.output_dir + "/model");
  acc.end_training();
  if (acc.is_main_process())
    fmt::print("{}\n", nlohmann::json{{"pipeline", true},
                                      {"losses", losses},
                                      {"final_train_loss", losses.empty() ? 0.0 : losses.back()},
                                      {"val_loss", val_loss},
                                      {"global_step", acc.step()},
                                      {"num_processes", acc.num_processes()},
                                      {"pp_size", acc.state().mesh().size(xlr8::MeshDim::pp)},
                                      {"stage_starts", model->stage_starts()},
                                      {"parameters_by_rank", held_by_rank},
                                      {"pipeline_stats", stats},
                                      {"whole_backwards_by_rank", whole_backwards},
                                      {"tokens_per_s", static_cast<double>(tokens) / std::max(seconds, 1e-9)}}
                           .dump());
  return 0;
}

}  // namespace gpt
