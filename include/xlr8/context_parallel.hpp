#pragma once
// Context parallelism: one sequence split over a cp group, every rank holding a share of each sample's
// tokens, attention exchanging keys and values so that each query still sees every earlier token
// (reference/004 "Context Parallelism"; PyTorch's context_parallel). The split is load-balanced for
// causal attention ("head-tail"): the sequence is cut into 2·cp chunks and rank r keeps chunks r and
// 2·cp−1−r, so every rank has the same amount of attention work.
//
// Ulysses sequence parallelism (parallelism_config_sp_size; DeepSpeed's ALST) is the other way to split a
// sequence, and shares this entry point: each rank holds a contiguous share of the sequence, and attention
// trades it by an all-to-all for a share of the heads over the whole sequence, then trades back.
//
// A model needs two calls and no cp branch: xlr8::attention(q, k, v, ...) for its attention, and
// xlr8::cp::local_positions(...) for the positions of the tokens it holds. With no context installed
// (cp 1) they are plain scaled-dot-product attention and arange(T). The Accelerator installs the
// context when parallelism_config_cp_size or _sp_size is above 1, and shards each batch with
// Accelerator::shard_sequence().
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "xlr8/communicator.hpp"

namespace xlr8::cp {

// Accelerate's parallelism_config_cp_comm_strategy.
enum class CommStrategy {
  AllGather,  // "allgather": every rank all-gathers the keys and values, its queries attend to them
  AllToAll,   // "alltoall": a ring; key/value blocks pass to the next rank while this block is computed
  Ulysses,    // "ulysses": parallelism_config_sp_size (not a cp_comm_strategy value): heads all-to-all
};
std::string to_string(CommStrategy strategy);
// "allgather" or "alltoall"; anything else is a ConfigError naming the key and the allowed values.
CommStrategy parse_comm_strategy(const std::string& value);

// How a sequence is split over the group. Context parallelism splits head-tail (each rank's causal work
// equal); Ulysses contiguously, as DeepSpeed's data loader adapter does (every rank attends over the whole
// sequence for its heads, so the work is equal anyway).
enum class Split { HeadTail, Contiguous };
Split split_of(CommStrategy strategy);

struct Context {
  Communicator group;
  CommStrategy strategy = CommStrategy::AllGather;
};

// Installs `context` for this thread (attention() and the sequence helpers follow it) until the scope
// ends; the previous one comes back. Scopes nest.
class Scope {
 public:
  explicit Scope(Context context);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  std::optional<Context> previous_;
};
// The context this thread follows, or nullopt (cp 1). A context installed for the process
// (set_process_context, which the Accelerator uses) applies to threads that installed none.
std::optional<Context> current();
void set_process_context(std::optional<Context> context);

// Positions in the whole sequence of the `local_length` tokens a rank of `cp_size` holds; arange(local_length)
// when cp_size is 1.
at::Tensor positions(int64_t local_length, int cp_size, int cp_rank, const at::Device& device,
                     Split split = Split::HeadTail);
// The same for the current context (arange without one): what a model adds position embeddings for.
at::Tensor local_positions(int64_t local_length, const at::Device& device);

// This rank's share of `x` along `dim`. The length must be divisible by 2·cp (head-tail) or by sp
// (contiguous): otherwise a ConfigError naming both. No communication.
at::Tensor shard_sequence(const at::Tensor& x, const Communicator& group, int64_t dim, Split split = Split::HeadTail);
// The whole sequence from every rank's share (collective over the group): the inverse of shard_sequence.
at::Tensor unshard_sequence(const at::Tensor& local, const Communicator& group, int64_t dim,
                            Split split = Split::HeadTail);

struct AttentionOptions {
  bool causal = true;
  double dropout = 0.0;  // on the attention weights (only while training; not with the ring)
  std::optional<double> scale;  // 1/sqrt(head_dim) when unset
};
// Scaled dot-product attention over q, k, v shaped [..., T, head_dim]: softmax(q·kᵀ·scale, masked
// causally) · v. Without a context that is all; under one, q, k and v hold this rank's share of the
// sequence, keys and values are exchanged over the group by the context's strategy, the causal mask
// follows global positions, and the result is this rank's share of the whole attention's output
// (gradients exact). Grouped-query attention: k and v ([..., kv_heads, T, head_dim]) may have fewer heads
// than q when kv_heads divides q's, each serving consecutive query heads (Llama's repeat_kv); context
// parallelism exchanges them repeated to q's heads, Ulysses as they are when sp divides kv_heads. Ulysses
// needs q's heads divisible by sp: otherwise a ConfigError naming both.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& options = {});

// Bytes this process has sent for context-parallel or Ulysses attention (forward and backward), as a ring
// sends them: read as a difference around a phase.
int64_t wire_bytes();
// Query-key chunk pairs (of the 2·cp chunks) this process's context-parallel attention has computed
// with any unmasked score: its share of the attention work, equal on every rank under head-tail
// balancing (2·cp+1 per call when causal); Ulysses counts none. Read as a difference around a phase.
int64_t attention_blocks();
// The ring's time (alltoall), summed over its steps, forward and backward: computing blocks, and waiting
// for the next block after its own were computed (what the overlap did not hide). Seconds, as differences.
struct RingTime {
  double compute_s = 0, wait_s = 0;
};
RingTime ring_time();

}  // namespace xlr8::cp

namespace xlr8 {
using cp::attention;
}
