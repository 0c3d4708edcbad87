#pragma once
// Context parallelism's communication: the sequence all-gather and its reduce-scatter dual, and ring
// attention (keys and values passed round the cp group while each block is computed).
#include <ATen/core/Tensor.h>

#include <utility>

#include "xlr8/communicator.hpp"

namespace xlr8::cp::detail {

// [..., T_local, C] from every rank, in rank order on the sequence dimension (the second to last).
at::Tensor gather_sequence(const at::Tensor& x, const Communicator& group);
// The sum over ranks of [..., n·T_local, C], this rank's T_local rows of it.
at::Tensor reduce_scatter_sequence(const at::Tensor& x, const Communicator& group);
// Causal or full attention of this rank's head-tail share of the queries against every rank's keys and
// values, passed round the ring; partial results merge by log-sum-exp; chunk pairs wholly above the
// diagonal are skipped. Each chunk pair goes through LibTorch's CPU flash kernel where it is the faster (its
// backward given the merged output and log-sum-exp), else in query tiles of our own (and on CUDA, for now).
// Backward sends each rank's key/value gradients back round the ring.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          const Communicator& group);
// LibTorch's CPU flash kernel in bfloat16 or float16 takes 1.5-2.9x as long as plain attention's two GEMMs
// up to 512 keys, forward and backward, and is faster from 768 (1.3-1.5x; 2.6x at 1024); in float32, and on
// CUDA, it is the faster at every length (bench/attention_cpu.py, bench/RESULTS.md, issue 44).
bool plain_attention_is_faster(const at::Tensor& q, int64_t keys);
int64_t cp_wire_bytes();
void count_wire(int64_t bytes);  // bytes sent by this process's sequence communication elsewhere (Ulysses)
// The chunk pairs (of 2n chunks, head-tail) whose scores `rank` computes against every rank's keys: the
// ring's skipping rule, which allgather's mask leaves open alike.
int64_t chunk_pairs(int rank, int n, bool causal);
// Chunk pairs computed (see cp::attention_blocks), counted where the work is done.
void count_blocks(int64_t n);
int64_t blocks_counted();
std::pair<double, double> ring_seconds();  // computing, waiting
// How many times attention() ran under a context of more than one rank (the Accelerator checks that a
// model's forward went through it at all).
int64_t attention_calls();
// How many times attention() ran at all, a context or none (xlr8 advise: can the model take cp or sp?).
int64_t entry_calls();

}  // namespace xlr8::cp::detail
