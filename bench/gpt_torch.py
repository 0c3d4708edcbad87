#!/usr/bin/env python3
"""The GPT of examples/gpt in plain PyTorch, timed as bench/gpt_throughput.cpp times it through xlr8.

The same model (byte vocabulary, learned positions, pre-norm blocks with a fused qkv projection, exact GELU,
an LM head tied to the token embedding, GPT-2's N(0, 0.02) initialisation), the same step (random tokens made
on the device, cross entropy, AdamW(lr 3e-4, weight_decay 0.01) with fused=True, bf16 autocast) and the same
kernels a Python user would pick (F.scaled_dot_product_attention with is_causal). --compile runs the model
under torch.compile. Warm-up steps are excluded and the clock is read after the device finishes. Prints one
JSON line with the fields gpt_throughput prints; --trace PATH profiles three more steps as gpt_throughput does.
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, seq_len, n_layer, d_model, n_head):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the head tied to the token embedding


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("n_layer", 2), ("d_model", 64), ("n_head", 2), ("seq_len", 64), ("batch_size", 4),
                          ("warmup", 3), ("steps", 10), ("seed", 1234)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--precision", default="bf16", choices=["no", "bf16", "fp16"])
    ap.add_argument("--compile", action="store_true", help="the model under torch.compile")
    ap.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    ap.add_argument("--trace", help="then profile three more steps into this Chrome trace (JSON)")
    a = ap.parse_args()
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    torch.manual_seed(a.seed)
    model = Gpt(256, a.seq_len, a.n_layer, a.d_model, a.n_head).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    step_model = torch.compile(model) if a.compile else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step():
        tokens = torch.randint(0, 256, (a.batch_size, a.seq_len + 1), device=device)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = step_model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    started = time.perf_counter()
    for i in range(a.warmup + a.steps):
        loss = train_step()
        if i + 1 == a.warmup:
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
    sync()
    seconds = time.perf_counter() - started
    print(json.dumps({
        "impl": "torch_compile" if a.compile else "torch_eager",
        "device": str(device),
        "parameters": params,
        "tokens_per_s": a.steps * a.batch_size * a.seq_len / seconds,
        "step_ms": 1e3 * seconds / a.steps,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "loss": loss.item(),
    }))
    if a.trace:
        activities = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                train_step()
            sync()
        prof.export_chrome_trace(a.trace)


if __name__ == "__main__":
    main()
