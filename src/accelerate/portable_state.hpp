#pragma once
// The parts of save_state/load_state that make a checkpoint independent of the strategy and the number
// of processes: each rank writes the element ranges of parameters and optimizer state it holds, by
// parameter name (checkpoint/sharded_pieces.hpp), and on load reads back exactly the ranges it holds
// now, whatever wrote them. Reading and checking finish on every rank before anything changes.
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "checkpoint/optimizer_state.hpp"
#include "checkpoint/training_checkpoint.hpp"
#include "accelerate/accelerator_impl.hpp"
#include "parallel/group_in_memory.hpp"

namespace xlr8 {

// Whether save_state writes the models as pieces (FSDP's SHARDED_STATE_DICT, DeepSpeed's layout) rather
// than whole on the main process (FULL_STATE_DICT, and DDP's).
bool models_saved_sharded(const AcceleratorImpl& s);

// Fills `pieces` with this rank's share of the models (when `models_as_pieces`) and of the state of every
// optimizer whose type is portable, and `state` with "optimizer_formats" (kind or "archive") and
// "optimizer_lrs". Returns, per optimizer, whether it is written as pieces (else the caller archives it).
// The pieces' values are read when written, under `held` (release it after the write).
std::vector<bool> collect_portable_state(const AcceleratorImpl& s, bool models_as_pieces,
                                         checkpoints::RankPieces& pieces, nlohmann::json& state,
                                         const std::shared_ptr<GroupInMemory>& held);

// What load_state will copy in, read in full first; under offload's disk tier checked in full first (names, shapes,
// the files' CRC32) and read as it is copied, one tensor at a time, so that a state larger than memory is loaded.
struct PortableLoad {
  struct Copy {
    ParallelStrategy* model = nullptr;  // the strategy whose parameter `target` is; none for a buffer
    at::Tensor target;
    std::function<at::Tensor()> values;
  };
  std::vector<std::vector<Copy>> models;  // per model
  struct Leaf {
    at::Tensor leaf;
    ParallelStrategy* model = nullptr;
    std::function<std::optional<checkpoints::ParameterState>()> state;  // none: the checkpoint holds none for it
  };
  struct OptimizerStates {
    bool portable = false;  // else the optimizer comes from its archive
    std::vector<Leaf> leaves;
    std::vector<double> lrs;
  };
  std::vector<OptimizerStates> optimizers;
};

// Throws (naming the tensor, both shapes, or the file) when the checkpoint does not fit what is prepared. `saved`
// must outlive the returned load.
PortableLoad read_portable_state(const AcceleratorImpl& s, const checkpoints::Verified& saved, const nlohmann::json& state);
// Copies the models' pieces in (not collective: each strategy's parameter_pieces_loaded follows).
void apply_model_state(AcceleratorImpl& s, const PortableLoad& load);
// Optimizer states and learning rates, after the schedulers replayed their steps.
void apply_optimizer_state(AcceleratorImpl& s, const PortableLoad& load);

// Offload's disk tier: the state of `optimizers` that strategies keep on disk, all in memory while this lives (an
// archive, which holds a whole optimizer at once, reads or replaces it) and written out again when it ends, however
// the checkpoint ends.
class OptimizerStateInMemory {
 public:
  OptimizerStateInMemory(AcceleratorImpl& s, std::vector<torch::optim::Optimizer*> optimizers);
  ~OptimizerStateInMemory();
  OptimizerStateInMemory(const OptimizerStateInMemory&) = delete;
  OptimizerStateInMemory& operator=(const OptimizerStateInMemory&) = delete;

 private:
  void each(bool in_memory);
  AcceleratorImpl& s_;
  std::vector<torch::optim::Optimizer*> optimizers_;
};

}  // namespace xlr8
