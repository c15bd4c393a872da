"""PyTorch's side of examples/gpu_gpt.rs: the same GPT (GPT-2 small's shape, pre-LN blocks,
one qkv projection, exact GELU, learned positions, a biased head, GPT-2's initialisation from
its own random numbers), the same synthetic batches
and the same step, in PyTorch eager: torch.autocast + GradScaler (f16) or autocast alone
(bf16), scaled_dot_product_attention(is_causal=True), clip_grad_norm_(1.0) after unscale_,
AdamW(fused=False). Prints one line per precision in the example's format, with the
synchronisations per step counted by torch.cuda.set_sync_debug_mode (each synchronising call
warns once).

    python tests/python/gpu_gpt.py [--device cuda|cpu] [--precision bf16|f16|both]
                                   [--batch N] [--steps 20] [--warmup 3] [--tiny] [--profile N]
"""

import argparse
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


def config(tiny):
    if tiny:
        return dict(vocab=512, block=128, d=128, layers=2, heads=4)
    return dict(vocab=50304, block=1024, d=768, layers=12, heads=12)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c["vocab"], c["d"])
        self.pos = nn.Embedding(c["block"], c["d"])
        self.blocks = nn.ModuleList(Block(c["d"], c["heads"]) for _ in range(c["layers"]))
        self.ln_f = nn.LayerNorm(c["d"])
        self.head = nn.Linear(c["d"], c["vocab"])
        # GPT-2's initialisation, as amp's `Gpt::new`: every weight matrix and embedding
        # normal with standard deviation 0.02, biases zero (layer norms keep ones and zeros).
        # PyTorch's defaults (embeddings N(0, 1), linears uniform) start from another loss.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, ids, targets):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def batch(c, b, step, device):
    i = torch.arange(c["block"] + 1)
    rows = torch.arange(b).unsqueeze(1)
    tokens = (rows * 31 + step * 7 + 13 * i) % c["vocab"]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def run(c, b, dtype, args):
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = Gpt(c).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=False)
    scaler = torch.amp.GradScaler(args.device, enabled=dtype == torch.float16)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(i):
        ids, targets = batch(c, b, i, dev)
        with torch.autocast(args.device, dtype=dtype):
            loss = model(ids, targets)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    first = None
    for i in range(args.warmup):
        loss = step(i)
        if first is None:
            first = loss.item()
    if cuda:
        torch.cuda.synchronize()
    syncs = None
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        for i in range(args.steps):
            loss = step(args.warmup + i)
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught) / args.steps
    last = loss.item()
    elapsed = time.perf_counter() - t0
    tokens = b * c["block"] * args.steps
    n = sum(p.numel() for p in model.parameters()) - c["block"] * c["d"]
    flops = 6 * n + 12 * c["layers"] * c["block"] * c["d"]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    name = "bf16" if dtype == torch.bfloat16 else "f16+GradScaler"
    blocking = "n/a" if syncs is None else f"{syncs:.2f}"
    print(
        f"torch-{args.device} {name:<14} batch {b:>3}: {tokens / elapsed:>9.0f} tokens/s  "
        f"{tokens * flops / elapsed / 1e12:>7.3f} TFLOP/s  peak {peak / 2**30:>6.2f} GiB  "
        f"syncs/step {blocking}  loss {first:.3f} -> {last:.3f}",
        flush=True,
    )
    if args.profile:
        # The same steps under torch.profiler, for a kernel-by-kernel comparison with
        # `gpu_gpt --profile`: self time per op, device time on a GPU.
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for i in range(args.profile):
                step(args.warmup + args.steps + i)
            if cuda:
                torch.cuda.synchronize()
        print(f"torch.profiler, {name}, {args.profile} steps:", flush=True)
        keys = ["self_device_time_total", "self_cuda_time_total"] if cuda else ["self_cpu_time_total"]
        for key in keys:  # the device columns' name changed across releases
            try:
                print(prof.key_averages().table(sort_by=key, row_limit=30), flush=True)
                break
            except (AttributeError, KeyError, ValueError) as e:
                print(f"(sorting by {key} failed: {e})", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", default="both", choices=["bf16", "f16", "both"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--profile", type=int, default=0, help="steps to run under torch.profiler after the timed ones")
    args = p.parse_args()
    c = config(args.tiny)
    if args.precision in ("bf16", "both"):
        run(c, args.batch, torch.bfloat16, args)
    if args.precision in ("f16", "both"):
        run(c, args.batch, torch.float16, args)


if __name__ == "__main__":
    main()
