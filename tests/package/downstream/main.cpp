// A user's training loop against the installed xlr8: a linear model on fixed data, a few steps on any
// number of processes. Each rank prints its parameters' checksum; equal checksums on every rank mean
// the ranks trained in lockstep.
#include <torch/torch.h>
#include <xlr8/accelerator.hpp>

#include <cstdio>

int main() {
  xlr8::Accelerator acc;
  torch::manual_seed(0);
  auto model = acc.prepare(torch::nn::Linear(4, 1));
  auto opt = acc.prepare(torch::optim::SGD(model->parameters(), 0.1));
  auto x = torch::arange(32, torch::kFloat32).reshape({8, 4}) / 32.0;
  auto y = x.sum(1, true);
  // Each rank takes its own rows of the global batch.
  auto rows = x.size(0) / acc.num_processes();
  auto mine = x.narrow(0, acc.process_index() * rows, rows), target = y.narrow(0, acc.process_index() * rows, rows);
  double loss_value = 0;
  for (int step = 0; step < 5; ++step) {
    auto loss = torch::mse_loss(model->forward(mine), target);
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
    loss_value = acc.reduce(loss.detach(), xlr8::ReduceOp::AVG).item<double>();
  }
  double checksum = 0;
  for (const auto& p : model->parameters()) checksum += p.sum().item<double>();
  std::printf("downstream rank %d of %d: loss %.6f checksum %.9f\n", acc.process_index(), acc.num_processes(),
              loss_value, checksum);
  return 0;
}
