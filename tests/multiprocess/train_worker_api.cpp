// train_worker's modes for the everyday API on real ranks:
//   nested          gather / gather_for_metrics / reduce / pad_across_processes over nested values
//   nested-mismatch rank 2 (or the last) passes another shape to gather
//   nested-undefined rank 1 passes an undefined tensor to gather
//   free-memory     train, free_memory(), measure the resident memory that came back, train again
//   free-control    the same, but only the caller's handles are dropped (no free_memory)
#include "train_worker_api.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <torch/torch.h>

#include <fstream>
#include <map>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "xlr8/error.hpp"

namespace {

// A user's batch type: tensors beside a plain field, made traversable with map_tensors.
struct Batch {
  at::Tensor input;
  std::vector<at::Tensor> extras;
  int64_t tag = 0;
  Batch map_tensors(const xlr8::TensorFn& fn) const { return {fn(input), xlr8::map_tensors(extras, fn), tag}; }
};

struct Ids {  // sample i is i: gather_for_metrics must give back each exactly once
  int64_t n;
  size_t size() const { return static_cast<size_t>(n); }
  torch::data::Example<> get(size_t i) const {
    auto id = at::full({}, static_cast<int64_t>(i), at::kLong);
    return {id, id * 10};
  }
};

double resident_mb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

}  // namespace

int run_nested_mode(xlr8::Accelerator& acc, const std::string& mode) {
  const int r = acc.process_index();
  const double d = r;
  if (mode == "nested-undefined") {  // an optional mask left undefined on rank 1 only
    acc.gather(std::vector<at::Tensor>{r == 1 ? at::Tensor() : at::zeros({1})});
    return 0;
  }
  if (mode == "nested-mismatch") {
    const int64_t rows = r == acc.num_processes() - 1 ? 2 : 1;
    acc.gather(std::vector<at::Tensor>{at::zeros({1}), at::zeros({rows, 3})});
    return 0;
  }
  std::vector<at::Tensor> list{at::full({1}, d), at::full({2}, 10 + d)};
  std::map<std::string, std::tuple<at::Tensor, at::Tensor>> by_name{
      {"b", {at::full({1, 2}, d), at::arange(2, at::kLong) + 2 * r}}, {"a", {at::full({1}, -d), at::full({1}, r % 2 == 0)}}};
  // Inserted in another order on each rank: the traversal must still agree (by key).
  std::unordered_map<int, at::Tensor> by_id;
  if (r % 2 == 0) by_id = {{3, at::full({1}, 300 + d)}, {1, at::full({1}, 100 + d)}, {2, at::full({1}, 200 + d)}};
  else by_id = {{1, at::full({1}, 100 + d)}, {2, at::full({1}, 200 + d)}, {3, at::full({1}, 300 + d)}};
  std::pair<at::Tensor, Batch> user{at::full({1}, d * d), Batch{at::full({1, 2}, d), {at::full({1}, 5 + d)}, 42}};

  auto g_list = acc.gather(list);
  auto g_by_name = acc.gather(by_name);
  auto g_by_id = acc.gather(by_id);
  auto g_user = acc.gather(user);
  auto reduced = acc.reduce(std::map<std::string, at::Tensor>{{"sum", at::full({2}, d)}});
  auto padded = acc.pad_across_processes(std::vector<at::Tensor>{at::full({r + 1}, d)}, 0, -1.0);

  // gather_for_metrics over an Example: the even_batches padding leaves both the data and the target.
  auto loader = acc.prepare_data_loader(Ids{10}, {.batch_size = 2});
  std::vector<int64_t> ids, targets;
  for (auto& batch : *loader) {
    auto all = acc.gather_for_metrics(batch);
    for (int64_t i = 0; i < all.data.size(0); ++i) ids.push_back(all.data[i].item<int64_t>());
    for (int64_t i = 0; i < all.target.size(0); ++i) targets.push_back(all.target[i].item<int64_t>());
  }
  nlohmann::json by_id_json;
  for (const auto& [key, value] : g_by_id) by_id_json[std::to_string(key)] = value;
  nlohmann::json report{{"list", g_list},
                        {"b0", std::get<0>(g_by_name["b"])},
                        {"b1", std::get<1>(g_by_name["b"])},
                        {"a0", std::get<0>(g_by_name["a"])},
                        {"a1", std::get<1>(g_by_name["a"])},
                        {"by_id", by_id_json},
                        {"user_first", g_user.first},
                        {"user_input", g_user.second.input},
                        {"user_extras", g_user.second.extras},
                        {"user_tag", g_user.second.tag},
                        {"reduced", reduced["sum"]},
                        {"padded", padded[0]},
                        {"ids", ids},
                        {"targets", targets},
                        {"text", fmt::format("{:.1f} {} {}", g_list[1], g_list[1].sizes(), g_list[1].device())}};
  auto all = acc.gather_object(report.dump());
  if (acc.is_main_process()) fmt::print("{}\n", nlohmann::json{{"ranks", all}}.dump());
  return 0;
}

int run_free_memory_mode(xlr8::Accelerator& acc, const std::string& mode) {
  // ~4.2 M parameters (17 MB): AdamW's state (34 MB) and the strategy's buffers dwarf noise.
  auto model = acc.prepare(torch::nn::Sequential(torch::nn::Linear(8, 2048), torch::nn::Tanh(),
                                                 torch::nn::Linear(2048, 2048), torch::nn::Tanh(),
                                                 torch::nn::Linear(2048, 4)));
  auto opt = acc.prepare(torch::optim::AdamW(model->parameters(), torch::optim::AdamWOptions(1e-3)));
  auto x = at::randn({16, 8}), y = at::randint(0, 4, {16}, at::kLong);
  auto train_step = [&](xlr8::PreparedOptimizer& o) {
    auto scope = acc.accumulate(model);
    acc.backward(torch::cross_entropy_loss(model->forward(x), y));
    o.step();
    o.zero_grad();
  };
  for (int i = 0; i < 3 * acc.gradient_accumulation_steps(); ++i) train_step(opt);
  std::vector<at::Tensor> expected;  // the whole current parameters, as summon_full_params shows them
  {
    auto full = acc.summon_full_params(model, /*writeback=*/false);
    for (const auto& p : model->parameters()) expected.push_back(p.detach().clone());
  }
  auto kept = opt;  // a second handle, to check it refuses to step afterwards
  const double before = resident_mb();
  opt = {};
  if (mode == "free-memory") acc.free_memory();
  const double after = resident_mb();
  double max_difference = 0;
  bool grads_dropped = true, float32 = true;
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    max_difference = std::max(max_difference, (params[i].detach() - expected[i]).abs().max().item<double>());
    grads_dropped = grads_dropped && !params[i].grad().defined();
    float32 = float32 && params[i].scalar_type() == at::kFloat;
  }
  std::string refused, refused_zero_grad, refused_in_scope;
  if (mode == "free-memory") {
    try {
      kept.step();
    } catch (const xlr8::Error& e) {
      refused = e.what();
    }
    try {
      kept.zero_grad();
    } catch (const xlr8::Error& e) {
      refused_zero_grad = e.what();
    }
    // Usable again: the same model prepared anew trains, with the same accumulation setting.
    model = acc.prepare(model);
    auto again = acc.prepare(torch::optim::AdamW(model->parameters(), torch::optim::AdamWOptions(1e-3)));
    for (int i = 0; i < acc.gradient_accumulation_steps(); ++i) train_step(again);
    try {
      auto scope = acc.accumulate(model);
      acc.free_memory();
    } catch (const xlr8::Error& e) {
      refused_in_scope = e.what();
    }
  }
  nlohmann::json report{{"rank", acc.process_index()}, {"rss_before_mb", before},  {"rss_after_mb", after},
                        {"max_difference", max_difference}, {"grads_dropped", grads_dropped}, {"float32", float32},
                        {"refused", refused},               {"step_after", acc.step()},
                        {"refused_zero_grad", refused_zero_grad}, {"refused_in_scope", refused_in_scope},
                        {"accumulation_after", acc.gradient_accumulation_steps()}};
  auto all = acc.gather_object(report.dump());
  if (acc.is_main_process()) fmt::print("{}\n", nlohmann::json{{"ranks", all}}.dump());
  return 0;
}
