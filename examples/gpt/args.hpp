#pragma once
// The GPT example's command line (main.cpp), which both of its training paths read.
#include <cstdint>
#include <string>

namespace xlr8 {
class Accelerator;
}

namespace gpt {

struct Args {
  int64_t max_steps = 300;
  int64_t batch_size = 16;
  int64_t seq_len = 128;
  int64_t n_layer = 4;
  int64_t d_model = 128;
  int64_t n_head = 4;
  int64_t n_kv_head = 0;  // grouped-query attention (0: n_head)
  uint64_t seed = 1234;
  double lr = 3e-4;  // 1e-3 stalls at the unigram loss (~3.3) for hundreds of steps
  double weight_decay = 0.01;  // AdamW's default
  int64_t warmup_steps = 0;    // a DeepSpeed config's scheduler warms up over these (DummyScheduler)
  std::string output_dir = "gpt_output";
  int64_t checkpoint_every = 0;
  std::string resume_from;
  std::string init_from;  // weights save_model wrote (another run's output_dir/model)
  int gradient_accumulation_steps = 1;
  std::string data_dir = "/usr/share/games/fortunes";
  int64_t val_windows = 256;  // held-out windows scored at the end
  bool untied_head = false;
  int64_t log_every = 25;
  std::string freeze;  // module paths to fine-tune around (gpt::freeze)
  double dropout = 0.0;  // attention dropout; 0 keeps runs on any number of processes comparable
  bool autotp = false;   // under parallelism_config_tp_size: let prepare()'s AutoTP split the model
  bool sequence_parallel = false;  // under parallelism_config_tp_size: split activations on the sequence too
  double max_grad_norm = 0;  // > 0: clip the global gradient norm to this before each optimizer step
  bool pipeline = false;     // the GPT as a PipelineModule, a step one pipeline_step (train_pipeline.cpp)
};

// --pipeline, or a launch with parallelism_config_pp_size above 1 (train_pipeline.cpp): trains and prints the
// result line; returns the exit code.
int train_pipeline(xlr8::Accelerator& acc, const Args& args);

}  // namespace gpt
