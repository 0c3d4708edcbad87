#pragma once
// Fashion-MNIST from the IDX files Debian's dataset-fashion-mnist installs (gzip-compressed), and a
// small CNN for it.
#include <torch/torch.h>

#include <string>

namespace fashion {

// Images as float [N, 1, 28, 28] normalised with the dataset's mean/std; labels as int64 [N].
class Dataset : public torch::data::datasets::Dataset<Dataset> {
 public:
  // split: "train" or "t10k". Throws xlr8::Error naming the missing or malformed file.
  Dataset(const std::string& data_dir, const std::string& split, int64_t limit = 0);
  torch::data::Example<> get(size_t index) override;
  torch::optional<size_t> size() const override;

 private:
  torch::Tensor images_, labels_;
};

struct NetImpl : torch::nn::Module {
  NetImpl();
  torch::Tensor forward(torch::Tensor x);  // log-probabilities [N, 10]
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

}  // namespace fashion
