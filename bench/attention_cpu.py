#!/usr/bin/env python3
"""Causal attention forward + backward on the CPU: LibTorch's fused kernel (F.scaled_dot_product_attention,
its CPU flash kernel) against plain attention (q·kᵀ, mask, softmax in float32, ·v: what xlr8::attention runs
where the fused kernel is slower), in float32 and bfloat16 over sequence lengths. Medians of --reps timed
calls after two warm-up calls; the threads are torch's default. The rule in
src/parallel/sequence/cp_ring.cpp (plain_attention_is_faster) comes from this table.

  .venv/bin/python3 bench/attention_cpu.py
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def plain(q, k, v):
    T, S = q.size(-2), k.size(-2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def fused(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_ms(fn, dtype, shape, reps):
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    upstream = torch.randn(*shape, dtype=dtype)
    for _ in range(2):
        fn(q, k, v).backward(upstream)
    runs = []
    for _ in range(reps):
        began = time.perf_counter()
        fn(q, k, v).backward(upstream)
        runs.append((time.perf_counter() - began) * 1e3)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | B, heads, T, head_dim | fused ms | plain ms | plain / fused |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(16, 4, 128, 32), (8, 4, 256, 32), (4, 4, 512, 32), (4, 4, 768, 32), (8, 8, 256, 64),
                      (4, 8, 512, 64), (2, 8, 768, 64), (2, 8, 1024, 64)]:
            f, p = time_ms(fused, dtype, shape, a.reps), time_ms(plain, dtype, shape, a.reps)
            print(f"| {str(dtype).replace('torch.', '')} | {', '.join(map(str, shape))} | {f:.1f} | {p:.1f} | {p / f:.2f} |")


if __name__ == "__main__":
    main()
