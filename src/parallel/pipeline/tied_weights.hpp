#pragma once
// Under pp, the modules TiedLayers share across stages (xlr8/pipeline.hpp): which stage owns each key, and the two
// exchanges a step makes over the pp group: the owner's values into the other stages' copies before the schedule,
// and their gradients into the owner's after it.
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/pipeline/owner_pieces.hpp"
#include "xlr8/communicator.hpp"

namespace xlr8::pp {

// Before a cut releases the other stages' layers: each of `stage`'s TiedLayers whose key has no owner on this stage
// and whose module a layer of another stage of `whole` runs too takes its own copy of it (that layer's memory is
// about to be given back).
void copy_tied_modules(const torch::nn::Sequential& whole, const torch::nn::Sequential& stage);

class TiedWeights {
 public:
  // `whole`: the model as the program built it; `stage`: this rank's layers of it; `parts`: parts_of(whole).
  // `data_parallel`: the ranks holding the same stage, which average its gradients. Moves the copies to `device`.
  TiedWeights(const torch::nn::Sequential& whole, const torch::nn::Sequential& stage,
              const std::vector<std::pair<size_t, size_t>>& parts, Communicator pipeline, Communicator data_parallel,
              const at::Device& device);
  // No module is run by two stages (a key of one stage is an ordinary shared module there).
  bool empty() const { return keys_.empty(); }
  // The keys' names, owner stages and holders, for errors and logs ("embed: stage 0 owns it, stages 0, 3 run it").
  std::string describe() const;
  // When the owner stages' strategies shard or tensor-split their parameters (before check_copies_match): the
  // owner's values and gradients are their pieces on the stage's ranks (none: the parameters themselves).
  void use_owner_pieces(std::shared_ptr<const OwnerPieces> pieces) { owner_pieces_ = std::move(pieces); }
  // Collective over the pp group, once before the first exchange: each key's copies have its owner's parameters
  // (dtypes and shapes), or one line names the key.
  void check_copies_match();
  // Collective over the pp group: every copy takes its owner's values (before a step's schedule).
  void share_values();
  // Collective over the pp group: every copy's gradient, averaged over its data-parallel peers as the owner's is,
  // is added to the owner's, and the copy's cleared (after the step's last backward).
  void sum_gradients();

 private:
  struct Key {
    std::string name;
    int owner = 0;             // the pp rank of the key's first layer in the whole model
    std::vector<int> holders;  // every pp rank running one of its layers, ascending
    torch::nn::Module* module = nullptr;  // this rank's instance (owner's or copy), when it holds the key
    std::string prefix;        // on the owner: its parameters' names in the stage ("<layer>.<key>.")
  };
  // fn(key, its parameter's transfer tag, its name in the module, the parameter) for each parameter of each key
  // this stage runs, in one order on every rank (the exchanges match by it), without recording gradients.
  void for_each_held(const std::function<void(const Key&, int tag, const std::string& name, at::Tensor& parameter)>& fn);
  // The owner's parameter `name` (of key's module) as the copies take it, and where a copy's gradient goes.
  at::Tensor owner_values(const Key& key, const std::string& name, const at::Tensor& parameter) const;
  void add_to_owner(const Key& key, const std::string& name, at::Tensor& parameter, const at::Tensor& grad) const;

  std::vector<Key> keys_;
  std::shared_ptr<const OwnerPieces> owner_pieces_;
  Communicator pipeline_, data_parallel_;
};

}  // namespace xlr8::pp
