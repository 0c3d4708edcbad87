// A model that is a sequence of layers, trained as a pipeline (issue 46, first part): with
//   xlr8 launch --num_processes 4 --parallelism_config_pp_size 4 build/bin/pipeline
// each of the 4 ranks runs a stage of the layers, and one step's batch flows through them in micro-batches
// (--parallelism_config_pp_schedule GPipe | 1F1B, --parallelism_config_pp_microbatches M). On one process it is
// the same training, step for step. Prints one JSON line: every step's loss (and gradient norm with clipping).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <xlr8/xlr8.hpp>

namespace {

// 9 layers of uneven widths: cut by parameters, the stages hold different numbers of them.
torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Tanh(), torch::nn::Linear(64, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, 48), torch::nn::Tanh(),
                               torch::nn::Linear(48, 4));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pipeline: a Sequential trained by xlr8's pipeline schedules (or on one process)"};
  int steps = 8, batch = 24;
  double lr = 0.05;
  app.add_option("--steps", steps);
  app.add_option("--batch_size", batch, "Samples a step (the micro-batches split it)");
  app.add_option("--lr", lr, "SGD's learning rate");
  double max_grad_norm = 0;
  app.add_option("--max_grad_norm", max_grad_norm, "Clip the gradients' global norm to this (0: no clipping)");
  std::string save_dir;
  app.add_option("--save_state", save_dir, "Save the training state there at the end (refused under pp for now)");
  CLI11_PARSE(app, argc, argv);
  xlr8::Accelerator acc;
  acc.set_seed(0);  // the same model on every rank; each keeps its stage's layers
  auto model = acc.prepare(mlp());
  auto optimizer = acc.prepare(torch::optim::SGD(model->parameters(), lr));
  const auto teacher = torch::randn({16, 4});  // the function to learn: tanh(x @ teacher)
  const bool pipelined = acc.plan().mesh.pp > 1;
  auto mse = [](const torch::Tensor& y, const torch::Tensor& target) { return torch::mse_loss(y, target); };
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  for (int step = 0; step < steps; ++step) {
    auto x = torch::randn({batch, 16});
    auto target = torch::tanh(x.matmul(teacher));
    double loss = 0;
    if (pipelined) {
      loss = acc.pipeline_step(x, target, mse);
    } else {
      auto value = mse(model->forward(x.to(acc.device())), target.to(acc.device()));
      acc.backward(value);
      loss = value.item<double>();
    }
    if (max_grad_norm > 0) norms.push_back(acc.clip_grad_norm(model->parameters(), max_grad_norm).value());
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(loss);
  }
  if (!save_dir.empty()) acc.save_state(save_dir);
  if (acc.is_main_process())
    std::cout << nlohmann::json{{"losses", losses}, {"grad_norms", norms}, {"num_processes", acc.num_processes()}, {"pp", acc.plan().mesh.pp}}
              << std::endl;
}
