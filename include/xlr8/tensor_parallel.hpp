#pragma once
// Tensor parallelism (Megatron's layouts, the styles of PyTorch's parallelize_module): weights split for
// good across a tp group whose ranks all read the same batch. A plan says, by module path, which style
// each layer gets; parallelize() gives the planned layers (xlr8::nn::Linear / Embedding, which are
// LibTorch's own at tp 1) their local slices in place.
#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/placement.hpp"
#include "xlr8/grad_norm.hpp"

namespace xlr8::tp {

enum class Style {
  // Weight and bias split on the output dimension; the input's gradient is all-reduced in backward.
  // The output stays split on its last dimension (what a row-wise layer expects) unless gathered.
  Colwise,
  // Weight split on the input dimension (the input arrives split on its last dimension); the partial
  // outputs are all-reduced in forward, and the bias, whole on every rank, is added once after that.
  Rowwise,
  // Embedding rows (the vocabulary) split; ids outside this rank's rows give zeros, then the outputs
  // are all-reduced.
  VocabParallel,
  // Kept whole on every rank (DeepSpeed's partition_type "skip"): planned, so `strict` accepts it.
  Replicate,
  // Sequence parallelism's norms and dropouts (any module, LibTorch's own included): kept whole, run on
  // this rank's share of the sequence, so their parameters' gradients are partial and summed over the tp
  // group as backward produces them.
  SequenceParallel,
};
std::string to_string(Style style);

struct PlanEntry {
  // A module path with `*` standing for any run of characters within one path component
  // ("blocks.*.attn.qkv"), matched against the whole path.
  std::string pattern;
  Style style;
  bool gather_output = false;  // Colwise only: all-gather the output's last dimension (a column-wise head)
  // Colwise only: the output is `fused` equal parts stacked (a fused q/k/v projection: 3), each split on
  // its own, so every rank holds its share of q, of k and of v rather than all of q.
  int fused = 1;
  // Sequence parallelism (Megatron's, torchtitan's): between layers, activations are split on the
  // sequence dimension (the second to last: [..., T, C]) over the tp group. Colwise then all-gathers its
  // input's sequence (reduce-scatter in backward) instead of copying it; Rowwise and VocabParallel
  // reduce-scatter their output on the sequence instead of all-reducing it (all-gather in backward). The
  // sequence length must be divisible by the tp size.
  bool sequence_parallel = false;
  // Colwise only: the output is unequal parts stacked, their widths in output features in order (a fused
  // q/k/v projection under grouped-query attention: {n_head, n_kv_head, n_kv_head} x head_dim; DeepSpeed's
  // `shape: [[q, kv, kv], -1]`), each split on its own. When given it says the parts instead of `fused`
  // (which must then be 1 or its length), and the widths must add up to out_features.
  std::vector<int64_t> fused_sizes = {};
  // Linear only: the layer carries attention heads of this many features (0: unchecked). Every width it
  // splits (its output, each fused part, or a row-wise layer's input) must be whole heads that the tp
  // ranks share equally, or parallelize() refuses it by name: a rank holding half a head would fail later,
  // in the model's own reshape. AutoTP and the plan file set it from their head size.
  int64_t head_dim = 0;
};
using Plan = std::vector<PlanEntry>;

// Applies `plan` to a built model (before an optimizer holds its parameters): every module a pattern
// matches must be an xlr8::nn layer of a kind the style fits, and is given this rank's slice of its
// parameters. Errors (ConfigError) name the pattern or path and what exists: a pattern that matches
// nothing, a planned plain LibTorch layer (with the xlr8 type to use), a dimension the tp size does not
// divide, and under `strict` a Linear or Embedding no pattern matched.
void parallelize(torch::nn::Module& model, const Communicator& tp_group, const Plan& plan, bool strict = false);

// AutoTP: a plan inferred from the model's layer names (DeepSpeed's and Megatron's conventions). By the
// last path component: q/k/v projections, fused qkv (3 equal parts when out = 3 x in; under grouped-query
// attention, out = in + 2 kv, the parts {in, kv, kv}: queries as wide as the model), fc/fc1/fc_in/c_fc,
// gate/up (w1/w3) are column-wise; attention outputs (o/o_proj/out_proj/proj/c_proj) and fc2/fc_out/
// down/w2 row-wise; head/lm_head/embed_out column-wise with the output gathered; every xlr8::nn::Embedding
// vocabulary-parallel (replicated when it has options that cannot be split). A Linear it cannot place is
// a ConfigError naming it, never left whole in silence. With head_dim > 0 (prepare(): AcceleratorOptions::
// tp_head_dim or parallelism_config_tp_head_dim), the attention projections (q/k/v, fused qkv, o/out_proj
// by name) get PlanEntry::head_dim, and one whose heads tp_size ranks cannot share whole is refused here.
// With `sequence_parallel`, the plan is Megatron's sequence parallelism: every split layer takes the
// sequence-split activations (PlanEntry::sequence_parallel) and every LayerNorm and Dropout outside them
// (LibTorch's, where the residual stream runs) runs on this rank's share of the sequence (SequenceParallel).
Plan auto_plan(const torch::nn::Module& model, int tp_size, int64_t head_dim = 0, bool sequence_parallel = false);
// `plan` turned into sequence parallelism for `model`: its split layers flagged sequence_parallel and the
// model's LayerNorm, GroupNorm and Dropout modules it does not name added as SequenceParallel. A layer the
// plan keeps whole (Replicate) is a ConfigError naming it: it would see the sequence split.
Plan with_sequence_parallel(Plan plan, const torch::nn::Module& model);

// DeepSpeed's `tensor_parallel` JSON section (its `partition_config.layer_specs`: `patterns` as regular
// expressions searched from the start of parameter names, `partition_type` column/row/skip, `shape`
// [k, -1] for k fused equal parts or [[a, b, ...], -1] for unequal ones, `gather_output`; the first matching
// spec wins) turned into a plan for this model's layers. `preset_model` (DeepSpeed's presets: llama, bloom,
// chatglm, mixtral, deepseek_v2, qwen2, phi3) gives the family's specs; the partition_config's specs go
// before them when `use_default_specs` is true (the default) and replace them when false, and a layer no
// spec of a preset matched stays whole. Without a preset, `use_default_specs` (or no partition_config) has
// AutoTP place what no spec matched. Unknown keys, presets and shapes xlr8 cannot split are ConfigErrors
// naming them. The head size, xlr8's key (DeepSpeed reads num_key_value_heads from a Hugging Face model's
// config, which a LibTorch model lacks): `head_dim` in the section (else the argument) gives the attention
// projections AutoTP names PlanEntry::head_dim, and `head_dim` in a layer_spec gives it to the layers that spec
// matches; a layer whose heads tp_size ranks cannot share whole is refused here, as by auto_plan.
Plan plan_from_deepspeed(const nlohmann::json& tensor_parallel, const torch::nn::Module& model, int tp_size,
                         int64_t head_dim = 0);
// The same rules from a plan file: a JSON file holding that section (autotp_size, partition_config, ...),
// or a whole DeepSpeed JSON whose "tensor_parallel" section it reads. Under parallelism_config_tp_size,
// prepare() splits an unsplit model by the file XLR8_TP_PLAN_FILE names instead of by AutoTP. A missing
// file or bad JSON is a ConfigError naming the file.
Plan plan_from_file(const std::string& path, const torch::nn::Module& model, int tp_size, int64_t head_dim = 0);
// A model already split (by the program's own plan): every split attention projection (AutoTP's names)
// must hold whole heads of `head_dim` that its tp ranks share equally; ConfigError naming the layers that
// do not (prepare() checks a program's split against its head size so).
void check_whole_heads(const torch::nn::Module& model, int64_t head_dim);

// The parameters a plan sliced (their gradients are partial norms over the tp group), with that group;
// nullopt group when nothing in the model is sliced.
struct SlicedParameters {
  std::optional<Communicator> group;
  std::set<const c10::TensorImpl*> members;  // looked up once per parameter on every clip
  bool contains(const at::Tensor& p) const { return members.count(p.unsafeGetTensorImpl()) > 0; }
};
SlicedParameters sliced_parameters(const torch::nn::Module& model);

// How one sliced parameter lies in its whole: split on `dim` over the group, in parts stacked on `dim`
// (the widths of a fused layer's parts; one part when not fused) each split on its own. `placement` says
// which boxes of the whole this rank holds (what checkpoints read); the rest is what gathering needs.
struct SliceLayout {
  Communicator group;
  int64_t dim = 0;
  std::vector<int64_t> parts;
  Placement placement;
};
// By parameter name (model.named_parameters()'s), the sliced ones only.
std::map<std::string, SliceLayout> slice_layouts(const torch::nn::Module& model);
// Where every parameter of `model` lies in its whole, by name: a slice's placement, else the whole tensor.
// What each strategy's parameter_pieces() chunks further.
std::map<std::string, Placement> parameter_placements(const torch::nn::Module& model);
// The whole tensor from every rank's slice: collective over the layout's group.
at::Tensor gather_whole(const at::Tensor& local, const SliceLayout& layout);
// This rank's slice of a whole tensor (no communication).
at::Tensor local_slice(const at::Tensor& whole, const SliceLayout& layout);

// clip_grad_norm_ where some gradients are tp slices: the norm of the whole model (slices summed over
// the tp group, replicated parameters counted once), every gradient scaled by the same coefficient.
GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, const SlicedParameters& sliced, double max_norm,
                      double norm_type);

// True when `pattern` (the PlanEntry syntax) matches the whole of `path`.
bool path_matches(const std::string& pattern, const std::string& path);

// The collectives as autograd functions, each the dual of the other in backward (Megatron's regions).
// Identity forward, all-reduce of the gradient backward: where replicated activations enter a column-wise layer.
at::Tensor copy_to_tp_region(const at::Tensor& x, const Communicator& group);
// All-reduce forward, identity backward: the partial outputs of a row-wise layer.
at::Tensor reduce_from_tp_region(const at::Tensor& x, const Communicator& group);
// All-gather along `dim` forward, this rank's chunk of the gradient backward.
at::Tensor gather_from_tp_region(const at::Tensor& x, const Communicator& group, int64_t dim);
// Sequence parallelism's pair, on the sequence dimension (second to last). All-gather forward and
// reduce-scatter backward: a split sequence entering a column-wise layer.
at::Tensor gather_from_sequence_region(const at::Tensor& x, const Communicator& group);
// Reduce-scatter forward and all-gather backward: partial outputs leaving a row-wise layer split on the
// sequence. A sequence length the group does not divide is a ConfigError naming both.
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, const Communicator& group);
// Bytes this process has sent for the functions above, counted as a ring sends them (an all-reduce of
// S bytes over n ranks 2(n-1)/n S; an all-gather or reduce-scatter of a whole of S bytes (n-1)/n S): the
// tensor-parallel communication volume, read as a difference around a phase.
int64_t region_wire_bytes();

}  // namespace xlr8::tp
