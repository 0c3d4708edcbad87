// The smallest complete xlr8 program: a model of its own, ready for every strategy (FULL_SHARD included).
// Sharded, each Block a unit: xlr8 launch --num_processes 2 --use_fsdp
//   --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Block build/bin/minimal
#include <torch/torch.h>
#include <xlr8/xlr8.hpp>

struct BlockImpl : torch::nn::Module {  // a unit FULL_SHARD can shard: its forward opens the guard
  torch::nn::LayerNorm norm{register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})))};
  torch::nn::Linear fc{register_module("fc", torch::nn::Linear(32, 32))};
  torch::Tensor forward(torch::Tensor x) {
    auto unit = xlr8::unshard(*this);               // gathers this unit's parameters (when sharded)
    return unit.done(x + torch::relu(fc(norm(x))));  // frees them; gathers them again for backward
  }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  torch::nn::Linear in{register_module("in", torch::nn::Linear(8, 32))};
  Block block1{register_module("block1", Block())}, block2{register_module("block2", Block())};
  torch::nn::Linear out{register_module("out", torch::nn::Linear(32, 1))};
  torch::Tensor forward(torch::Tensor x) {
    auto unit = xlr8::unshard(*this);  // the root unit: the parameters no Block holds
    return unit.done(out(block2(block1(in(x)))));
  }
};
TORCH_MODULE(Net);

struct Sums {  // y = x1 + ... + x8 for 512 random x; each rank reads its share of the batches
  torch::Tensor x = torch::randn({512, 8});
  size_t size() const { return 512; }
  torch::data::Example<> get(size_t i) const { return {x[i], x[i].sum(0, true)}; }
};

int main() {
  xlr8::Accelerator acc;  // processes, strategy and precision come from `xlr8 launch` or its config file
  acc.set_seed(0);         // the same seed on every rank: the same data, the same initial model
  auto data = acc.prepare_data_loader(Sums{}, {.batch_size = 32, .shuffle = true});
  auto model = acc.prepare(Net());
  auto opt = acc.prepare(torch::optim::AdamW(model->parameters(), 1e-2));
  for (int epoch = 0; epoch < 8; ++epoch) {
    torch::Tensor loss;
    for (auto& batch : *data) {
      loss = torch::mse_loss(model->forward(batch.data), batch.target);
      acc.backward(loss);
      opt.step();
      opt.zero_grad();
    }
    acc.print("epoch {} loss {:.4f}", epoch, acc.reduce(loss.detach(), xlr8::ReduceOp::AVG).item<double>());
  }
}
