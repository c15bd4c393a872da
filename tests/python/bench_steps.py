# PyTorch's side of `bench_steps`: the fixed workloads W1 (MLP) and W2 (GPT) of
# shared/reference/performance.md, one full AMP step each (forward under autocast, scaled
# backward, unscale, clip_grad_norm 1.0, AdamW step, scaler update), on the CPU with the
# threads `bench_steps` uses. Prints one JSON object: {"torch": version, "threads": n,
# "w1": {"f32": s, "bf16": s, "f16": s}, "w2": {...}} with the median step time of each cell
# asked for (others are left out). `bench_steps --torch <python>` runs this and puts the
# figures in its table, so both sides are measured in the same run.
#
# Usage: bench_steps.py --steps N [--only w1|w2] [--precision f32|bf16|f16] [--threads T]
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--only", choices=["w1", "w2"])
p.add_argument("--precision", choices=["f32", "bf16", "f16"])
p.add_argument("--threads", type=int)
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)


class Mlp(nn.Module):
    """W1: 1024 -> 4096 -> 4096 -> 1024 -> 10, GELU between layers."""

    def __init__(self):
        super().__init__()
        dims = [1024, 4096, 4096, 1024, 10]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        h = self.layers[0](x)
        for layer in self.layers[1:]:
            h = layer(F.gelu(h))
        return h


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    """W2: vocab 128, d 256, 4 layers, 4 heads, seq 128, pre-LayerNorm, learned positions."""

    def __init__(self, vocab=128, d=256, layers=4, heads=4, block=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def time_steps(model, batch, precision, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "f16")
    dtype = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}[precision]
    x, y = batch
    times = []
    for i in range(steps + 1):  # one warm-up step
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(x)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if i > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


torch.manual_seed(0)
result = {"torch": torch.__version__, "threads": torch.get_num_threads()}
for w in ["w1", "w2"]:
    if args.only and args.only != w:
        continue
    cells = {}
    for precision in ["f32", "bf16", "f16"]:
        if args.precision and args.precision != precision:
            continue
        if w == "w1":
            model, batch = Mlp(), (torch.randn(256, 1024), torch.randint(0, 10, (256,)))
        else:
            model, batch = Gpt(), (torch.randint(0, 128, (16, 128)), torch.randint(0, 128, (16, 128)))
        cells[precision] = time_steps(model, batch, precision, args.steps)
    result[w] = cells
print(json.dumps(result))
