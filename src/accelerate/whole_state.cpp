// A module's whole tensors as save_model and save_state write them: its strategy's full state, tensor-parallel
// slices gathered whole as they come (accelerator_impl.hpp's WholeState).
#include "accelerate/accelerator_impl.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

WholeState whole_state_of(const AcceleratorImpl& s, const torch::nn::Module& module) {
  WholeState out;
  const auto* strategy = s.strategy_for(&module);
  out.layout = strategy ? strategy->full_state_layout() : module_state_dict(module);
  // Tensor-parallel slices are written whole: gathered over their tp group as they come.
  const auto slices = tp::slice_layouts(module);
  for (auto& [name, t] : out.layout)
    if (auto it = slices.find(name); it != slices.end())
      t = at::empty(it->second.placement.whole(), t.options().device(at::kMeta));
  out.visit = [strategy, slices, layout = out.layout](const WholeState::Visitor& fn) {
    auto deliver = [&](size_t i, const at::Tensor& t) {
      auto it = slices.find(layout[i].first);
      fn(i, it == slices.end() ? t : tp::gather_whole(t, it->second));  // collective
    };
    if (strategy) strategy->visit_full_state(deliver);
    else
      for (size_t i = 0; i < layout.size(); ++i) deliver(i, layout[i].second);
  };
  return out;
}

std::vector<SafetensorsSpec> WholeState::specs() const {
  std::vector<SafetensorsSpec> out;
  for (const auto& [name, t] : layout) out.push_back({name, t.scalar_type(), t.sizes().vec()});
  return out;
}

}  // namespace xlr8
