// Layers that share a module, and under pp the exchanges that keep the stages' copies of it one parameter
// (tied_weights.hpp, xlr8/pipeline.hpp).
#include "parallel/pipeline/tied_weights.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8::pp {
namespace {

// Tags far above the schedule's (which count micro-batches and stages) for the exchanges' transfers.
constexpr int kTiedTagBase = 1 << 24;

int tied_tag(size_t key, size_t parameter) { return kTiedTagBase + static_cast<int>(key * 4096 + parameter); }

// The part of `parts` holding layer `index`.
size_t part_holding(const std::vector<std::pair<size_t, size_t>>& parts, size_t index) {
  for (size_t p = 0; p < parts.size(); ++p)
    if (index >= parts[p].first && index < parts[p].second) return p;
  throw Error(fmt::format("pipeline: layer {} is in no stage", index));
}

}  // namespace

TiedLayerImpl::TiedLayerImpl(std::string key, torch::nn::AnyModule module, TiedForward forward, bool owner)
    : key_(std::move(key)), module_(std::move(module)), forward_(std::move(forward)), owner_(owner) {
  if (key_.empty() || key_.find('.') != std::string::npos)
    throw ConfigError(fmt::format("TiedLayer: key {:?} must be a non-empty name without dots", key_));
  if (module_.is_empty()) throw ConfigError(fmt::format("TiedLayer {:?}: the module is empty", key_));
  if (owner_) register_module(key_, module_.ptr());
}

void TiedLayerImpl::train(bool on) {
  torch::nn::Module::train(on);
  if (!owner_) module_.ptr()->train(on);
}

at::Tensor TiedLayerImpl::forward(const at::Tensor& input) {
  return forward_ ? forward_(*module_.ptr(), input) : module_.forward(input);
}

void copy_tied_modules(const torch::nn::Sequential& whole, const torch::nn::Sequential& stage) {
  std::set<std::string> owned;
  std::set<const torch::nn::Module*> on_stage;
  for (const auto& layer : stage->children()) {
    on_stage.insert(layer.get());
    if (const auto* tied = layer->as<TiedLayerImpl>(); tied && tied->owner()) owned.insert(tied->key());
  }
  std::set<const torch::nn::Module*> elsewhere;  // modules that layers of other stages run
  for (const auto& layer : whole->children())
    if (const auto* tied = layer->as<TiedLayerImpl>(); tied && !on_stage.count(layer.get())) elsewhere.insert(&tied->tied());
  std::map<std::string, const TiedLayerImpl*> copied;  // this stage's layers of one key share one copy
  for (const auto& layer : stage->children()) {
    auto* tied = layer->as<TiedLayerImpl>();
    if (!tied || tied->owner() || owned.count(tied->key()) || !elsewhere.count(&tied->tied())) continue;
    if (auto it = copied.find(tied->key()); it != copied.end()) {
      tied->share_module_of(*it->second);
      continue;
    }
    // A clone builds the module again (its reset() runs the initialisers): the program's random stream must not
    // move on this rank alone (a later draw would differ between the stages).
    auto generator = at::detail::getDefaultCPUGenerator();
    const auto program_state = generator.get_state();
    try {
      const auto owner_parameters = tied->tied().parameters();
      tied->take_copy();
      generator.set_state(program_state);
      // A clone copies values, not whether they train: a frozen owner's copy stays frozen.
      const auto copy_parameters = tied->tied().parameters();
      for (size_t i = 0; i < copy_parameters.size() && i < owner_parameters.size(); ++i)
        copy_parameters[i].set_requires_grad(owner_parameters[i].requires_grad());
    } catch (const c10::Error& e) {
      throw ConfigError(fmt::format("TiedLayer {:?}: this stage runs the module a layer of another stage owns, and it "
                                    "cannot be copied ({}); derive it from torch::nn::Cloneable, or give this stage's "
                                    "layer a module of its own with the same values (DeepSpeed's PipelineModule does)",
                                    tied->key(), e.what_without_backtrace()));
    }
    copied.emplace(tied->key(), tied);
  }
}

TiedWeights::TiedWeights(const torch::nn::Sequential& whole, const torch::nn::Sequential& stage,
                         const std::vector<std::pair<size_t, size_t>>& parts, Communicator pipeline,
                         Communicator data_parallel, const at::Device& device)
    : pipeline_(std::move(pipeline)), data_parallel_(std::move(data_parallel)) {
  const int stages = pipeline_.size();
  std::map<std::string, size_t> index;
  const auto layers = whole->children();
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto* tied = layers[i]->as<TiedLayerImpl>();
    if (!tied) continue;
    const int rank = static_cast<int>(part_holding(parts, i) % static_cast<size_t>(stages));
    auto [it, added] = index.emplace(tied->key(), keys_.size());
    if (added) keys_.push_back({tied->key(), rank, {}, nullptr});
    auto& holders = keys_[it->second].holders;
    if (std::find(holders.begin(), holders.end(), rank) == holders.end()) holders.push_back(rank);
  }
  for (auto& key : keys_) std::sort(key.holders.begin(), key.holders.end());
  for (const auto& layer : stage->named_children())
    if (auto* tied = layer.value()->as<TiedLayerImpl>()) {
      auto& key = keys_.at(index.at(tied->key()));
      key.module = &tied->tied();
      if (key.owner != pipeline_.rank()) key.module->to(device);  // a copy: not the strategy's to place
      else if (tied->owner()) key.prefix = layer.key() + "." + key.name + ".";
    }
  // A key on one stage only is an ordinary shared module there: nothing to exchange.
  std::erase_if(keys_, [](const Key& key) { return key.holders.size() < 2; });
}

// Every holder's module must have the owner's parameters (dtype and shape), or the exchanges would read the wrong
// bytes: one line naming the key, checked once over the pp group.
void TiedWeights::check_copies_match() {
  std::string described = "\n";  // one line a key, "<key>:<dtype>[<shape>];...", found by its whole name
  for (const auto& key : keys_) {
    if (!key.module) continue;
    described += key.name + ":";
    for (const auto& p : key.module->named_parameters())
      described += ((owner_pieces_ && key.owner == pipeline_.rank())
                        ? owner_pieces_->describe(key.prefix + p.key())  // the whole parameter's
                        : fmt::format("{}[{}]", c10::toString(p.value().scalar_type()), fmt::join(p.value().sizes(), ","))) +
                   (p.value().requires_grad() ? ";" : " frozen;");
    described += "\n";
  }
  const auto all = pipeline_.all_gather_object(described);
  for (const auto& key : keys_) {
    auto line_of = [&](int rank) {
      const auto& text = all[static_cast<size_t>(rank)];
      const auto at = text.find("\n" + key.name + ":");
      return at == std::string::npos ? std::string() : text.substr(at + 1, text.find('\n', at + 1) - at - 1);
    };
    for (const int holder : key.holders)
      if (line_of(holder) != line_of(key.owner))
        throw ConfigError(fmt::format("TiedLayer {:?}: stage {} runs a module of other parameters than its owner, "
                                      "stage {} ({} against {}); every layer of a key must run one module (the same "
                                      "dtype and shapes)",
                                      key.name, holder, key.owner, line_of(holder), line_of(key.owner)));
  }
}

std::string TiedWeights::describe() const {
  std::vector<std::string> lines;
  for (const auto& key : keys_)
    lines.push_back(fmt::format("{}: stage {} owns it, stages {} run it", key.name, key.owner, fmt::join(key.holders, ", ")));
  return fmt::format("{}", fmt::join(lines, "; "));
}

void TiedWeights::for_each_held(
    const std::function<void(const Key&, int tag, const std::string& name, at::Tensor& parameter)>& fn) {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < keys_.size(); ++k) {
    if (!keys_[k].module) continue;  // this stage runs none of the key's layers
    auto parameters = keys_[k].module->named_parameters();
    for (size_t i = 0; i < parameters.size(); ++i) fn(keys_[k], tied_tag(k, i), parameters[i].key(), parameters[i].value());
  }
}

at::Tensor TiedWeights::owner_values(const Key& key, const std::string& name, const at::Tensor& parameter) const {
  return owner_pieces_ ? owner_pieces_->whole(key.prefix + name) : parameter.detach().contiguous();
}

void TiedWeights::add_to_owner(const Key& key, const std::string& name, at::Tensor& parameter,
                               const at::Tensor& grad) const {
  if (owner_pieces_) return owner_pieces_->add_gradient(key.prefix + name, grad);
  if (parameter.grad().defined()) parameter.mutable_grad().add_(grad);
  else parameter.mutable_grad() = grad;
}

void TiedWeights::share_values() {
  const int rank = pipeline_.rank();
  for_each_held([&](const Key& key, int tag, const std::string& name, at::Tensor& p) {
    if (rank == key.owner) {
      const auto values = owner_values(key, name, p);  // collective over the stage when it holds pieces
      for (const int holder : key.holders)
        if (holder != rank) pipeline_.send(values, holder, tag);
      return;
    }
    auto values = at::empty_like(p);
    pipeline_.recv(values, key.owner, tag);
    p.copy_(values);
  });
}

void TiedWeights::sum_gradients() {
  const int rank = pipeline_.rank();
  for_each_held([&](const Key& key, int tag, const std::string& name, at::Tensor& p) {
    if (!p.requires_grad()) return;  // frozen on every holder alike (check_copies_match): no gradient to join
    if (rank != key.owner) {
      auto g = p.grad().defined() ? p.grad().detach().clone() : at::zeros_like(p);
      if (data_parallel_.size() > 1) {  // as the owner's strategy averages its gradients over the same peers
        data_parallel_.all_reduce(g);
        g.div_(data_parallel_.size());
      }
      pipeline_.send(g, key.owner, tag);
      p.mutable_grad() = at::Tensor();
      return;
    }
    for (const int holder : key.holders) {
      if (holder == rank) continue;
      auto g = owner_pieces_ ? owner_pieces_->empty_whole(key.prefix + name) : at::empty_like(p);
      pipeline_.recv(g, holder, tag);
      add_to_owner(key, name, p, g);
    }
  });
}

}  // namespace xlr8::pp
