#!/usr/bin/env python3
"""PyTorch's own (Python) training loop on the bench specs, single process or DDP under torchrun
(--zero: DDP with torch.distributed.optim.ZeroRedundancyOptimizer, PyTorch's ZeRO-1).

Prints the same JSON line as xlr8-bench so bench/run compares them directly. Runs on the project's .venv torch (bench/run).
"""
import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def make_model(name):
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0)
    return nn.Sequential(nn.TransformerEncoder(layer, 2), nn.Linear(256, 10))


def make_batch(name, batch):
    if name == "mlp":
        return torch.randn(batch, 784), torch.randint(10, (batch,))
    return torch.randn(128, batch, 256), torch.randint(10, (128 * batch,))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--zero", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    model = make_model(a.model)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    if a.zero and distributed:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(a.model, a.batch)
    times = []
    for i in range(a.warmup + a.steps):
        start = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        if a.model == "transformer":
            out = out.reshape(-1, 10)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1000)
    median = statistics.median(times)
    # Parameters, gradients and this rank's optimizer state (ZeroRedundancyOptimizer: its shard only).
    local = opt.optim if hasattr(opt, "optim") else opt
    state = sum(p.numel() * p.element_size() * 2 for p in model.parameters())
    state += sum(t.numel() * t.element_size() for s in local.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    nproc = dist.get_world_size() if distributed else 1
    if distributed:
        figures = torch.tensor([median, rss, state], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        median, rss, state = figures.tolist()
    if not distributed or dist.get_rank() == 0:
        impl = ("pytorch_zero1" if a.zero else "pytorch_ddp") if distributed else "pytorch"
        print(json.dumps({"impl": impl, "model": a.model, "nproc": nproc, "batch_per_rank": a.batch,
                          "step_ms_median": median, "samples_per_s": a.batch * nproc * 1000 / median,
                          "peak_rss_mb": rss, "state_bytes_per_rank": int(state)}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
