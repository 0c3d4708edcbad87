// The GPT example's model trained through xlr8 on one process, timed for bench/gpt_throughput.sh against
// the same model in plain PyTorch (bench/gpt_torch.py): the same shapes, random tokens made on the device,
// AdamW, bf16 autocast; warm-up steps excluded, the clock read after the device finishes. Prints one
// JSON line: tokens/s over the timed steps, the peak of allocated device memory, the last loss. --trace PATH:
// three more steps (untimed) under LibTorch's Kineto profiler, written as a Chrome trace (bench/trace_kernels.py
// sums its device kernels by name, to set beside gpt_torch.py --trace's).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <chrono>

#include "diagnostics/memory_meter.hpp"
#include "gpt.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"

namespace {

namespace F = torch::nn::functional;

struct Args {
  int64_t n_layer = 2, d_model = 64, n_head = 2, seq_len = 64, batch_size = 4;
  int64_t warmup = 3, steps = 10;
  std::string precision = "bf16";
  uint64_t seed = 1234;
  bool cpu = false;
  std::string trace;
};

void wait_for_device(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Runs `steps` under the Kineto profiler (CPU operators and, on CUDA, device kernels) and saves the trace.
template <class Steps>
void save_trace(const c10::Device& device, const std::string& path, Steps&& steps) {
  namespace profiler = torch::profiler::impl;
  const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO);
  std::set<profiler::ActivityType> activities{profiler::ActivityType::CPU};
  if (device.is_cuda()) activities.insert(profiler::ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  steps();
  wait_for_device(device);
  torch::autograd::profiler::disableProfiler()->save(path);
}

int run(const Args& args) {
  xlr8::AcceleratorOptions options;
  options.cpu = args.cpu;
  options.mixed_precision = xlr8::parse_mixed_precision(args.precision, "--precision");
  xlr8::Accelerator acc(options);
  acc.set_seed(args.seed);
  const gpt::Config config{.seq_len = args.seq_len, .n_layer = args.n_layer, .d_model = args.d_model,
                           .n_head = args.n_head};
  auto model = acc.prepare(gpt::Gpt(config));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  // AdamW as PyTorch's defaults have it (betas 0.9, 0.999; eps 1e-8), weight decay 0.01 on every parameter.
  auto opt = acc.prepare(xlr8::optim::FusedAdamW(model->parameters(),
                                                 torch::optim::AdamWOptions(3e-4).weight_decay(0.01)));
  const auto device = acc.device();
  const auto long_on_device = torch::TensorOptions().dtype(torch::kLong).device(device);
  torch::Tensor loss;
  auto train_step = [&] {
    auto tokens = torch::randint(0, config.vocab_size, {args.batch_size, args.seq_len + 1}, long_on_device);
    auto step = acc.accumulate(model);
    auto logits = model->forward(tokens.narrow(1, 0, args.seq_len));
    loss = F::cross_entropy(logits.flatten(0, 1), tokens.narrow(1, 1, args.seq_len).flatten());
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
  };
  auto started = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < args.warmup + args.steps; ++i) {
    train_step();
    if (i + 1 == args.warmup) {
      wait_for_device(device);
      xlr8::diagnostics::memory_meter::reset_peak(device);
      started = std::chrono::steady_clock::now();
    }
  }
  wait_for_device(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const double tokens = static_cast<double>(args.steps * args.batch_size * args.seq_len);
  const nlohmann::json result{{"impl", "xlr8"},
                              {"device", device.str()},
                              {"parameters", params},
                              {"tokens_per_s", tokens / seconds},
                              {"step_ms", 1e3 * seconds / static_cast<double>(args.steps)},
                              // The caching allocator's peak of allocated bytes, as torch.cuda.max_memory_allocated.
                              {"peak_device_bytes", device.is_cuda() ? nlohmann::json(xlr8::diagnostics::memory_meter::read(device).peak)
                                                                     : nlohmann::json()},
                              {"loss", loss.item<double>()}};
  fmt::print("{}\n", result.dump());
  if (!args.trace.empty())
    save_trace(device, args.trace, [&] {
      for (int i = 0; i < 3; ++i) train_step();
    });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpt_throughput: the GPT example's training step through xlr8, timed"};
  Args a;
  app.add_option("--n_layer", a.n_layer);
  app.add_option("--d_model", a.d_model);
  app.add_option("--n_head", a.n_head);
  app.add_option("--seq_len", a.seq_len);
  app.add_option("--batch_size", a.batch_size);
  app.add_option("--warmup", a.warmup, "Steps before the clock starts");
  app.add_option("--steps", a.steps, "Timed steps");
  app.add_option("--precision", a.precision, "no, bf16 or fp16 (mixed precision: autocast)");
  app.add_option("--seed", a.seed);
  app.add_flag("--cpu", a.cpu, "Stay on the CPU even with a GPU");
  app.add_option("--trace", a.trace, "Then profile three more steps into this Chrome trace (JSON)");
  CLI11_PARSE(app, argc, argv);
  if (a.warmup < 1 || a.steps < 1) {
    fmt::print(stderr, "gpt_throughput: --warmup and --steps must be at least 1\n");
    return 2;
  }
  try {
    return run(a);
  } catch (const xlr8::Error& e) {
    fmt::print(stderr, "gpt_throughput: error: {}\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "gpt_throughput: error: {}\n", e.what_without_backtrace());
    return 1;
  }
}
