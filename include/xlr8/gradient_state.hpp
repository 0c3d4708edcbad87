#pragma once
// Accelerate's GradientState: whether this step syncs gradients, and where the active data loader is
// (end_of_dataloader and remainder drive the forced sync on an epoch's last batch and gather_for_metrics).
#include <cstddef>
#include <cstdint>
#include <vector>

namespace xlr8 {

struct LoaderProgress {
  bool end_of_dataloader = false;
  int64_t remainder = -1;  // real samples in the last global round; -1 when unknown
};

class GradientState {
 public:
  int num_steps = 1;
  bool sync_gradients = true;
  bool sync_with_dataloader = true;

  // Loaders push themselves while iterating; nested loops (evaluation inside training) stack.
  void push(const LoaderProgress* loader) { active_.push_back(loader); }
  void pop(const LoaderProgress* loader) {
    for (size_t i = active_.size(); i-- > 0;)
      if (active_[i] == loader) {
        active_.erase(active_.begin() + static_cast<long>(i));
        break;
      }
  }
  bool in_dataloader() const { return !active_.empty(); }
  bool end_of_dataloader() const { return !active_.empty() && active_.back()->end_of_dataloader; }
  int64_t remainder() const { return active_.empty() ? -1 : active_.back()->remainder; }

 private:
  std::vector<const LoaderProgress*> active_;
};

}  // namespace xlr8
