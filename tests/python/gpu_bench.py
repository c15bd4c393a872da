"""PyTorch's side of examples/gpu_bench.rs on the same GPU: torch.matmul at 4096^3 and 8192^3
in f16 and bf16, a copy, GELU, layer norm, softmax and cross-entropy over the same 256 MiB
of bf16, and causal attention (SDPA) at GPT-2 small's shape, timed the same way (median of 7 rounds, each a queue of calls ended by one
synchronisation). Prints `BENCH` lines in the example's format with `torch_` before the op.

    python tests/python/gpu_bench.py
"""

import time

import torch
import torch.nn.functional as F


def timed(calls, f):
    f()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / calls)
    return sorted(rounds)[3]


def main():
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU 0: {torch.cuda.get_device_name(0)} (torch {torch.__version__})")
    for n in (4096, 8192):
        for dtype, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            s = timed(10 if n >= 8192 else 40, lambda: torch.matmul(a, b))
            print(f"BENCH torch_matmul {name} {n}x{n}x{n} ms {s * 1e3:.4f} TFLOP/s {2 * n**3 / s / 1e12:.1f}")
            del a, b
    rows, cols = 1 << 17, 1024
    nbytes = rows * cols * 2
    shape = f"{rows}x{cols}"
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy = timed(20, lambda: dst.copy_(x))
    print(f"BENCH torch_copy bf16 {shape} ms {copy * 1e3:.4f} GB/s {2 * nbytes / copy / 1e9:.0f}")

    def report(what, shape, moved, s):
        bw = moved / s / 1e9
        print(f"BENCH torch_{what} bf16 {shape} ms {s * 1e3:.4f} GB/s {bw:.0f} of_copy {bw / (2 * nbytes / copy / 1e9):.2f}")

    report("gelu", shape, 2 * nbytes, timed(20, lambda: F.gelu(x)))
    w = torch.ones(cols, device=dev, dtype=torch.bfloat16)
    b = torch.zeros(cols, device=dev, dtype=torch.bfloat16)
    report("layer_norm", shape, 2 * nbytes, timed(20, lambda: F.layer_norm(x, (cols,), w, b, 1e-5)))
    report("softmax", shape, 2 * nbytes, timed(20, lambda: torch.softmax(x, 1)))
    vocab = 50304
    ce_rows = -(-(nbytes // (vocab * 2)) // 16) * 16
    logits = torch.randn(ce_rows, vocab, device=dev, dtype=torch.bfloat16)
    targets = (torch.arange(ce_rows, device=dev) * 7919) % vocab
    report("cross_entropy", f"{ce_rows}x{vocab}", ce_rows * vocab * 2, timed(20, lambda: F.cross_entropy(logits, targets)))
    del x, dst, logits

    # Causal attention at GPT-2 small's shape, batch 16: forward, and forward + backward through
    # the output's sum; TFLOP/s of causal attention (2 n t^2 d forward, 2.5 times that backward).
    b, h, t, d = 16, 12, 1024, 64
    q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    shape = f"{b}x{h}x{t}x{d}"
    fwd_flops = 2 * b * h * t * t * d
    with torch.no_grad():
        s = timed(10, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    print(f"BENCH torch_attention_fwd bf16 {shape} ms {s * 1e3:.4f} TFLOP/s {fwd_flops / s / 1e12:.1f}")
    def forward_backward():
        q.grad = k.grad = v.grad = None  # as ours: fresh gradients, no accumulation
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    s = timed(10, forward_backward)
    print(f"BENCH torch_attention_fwd_bwd bf16 {shape} ms {s * 1e3:.4f} TFLOP/s {3.5 * fwd_flops / s / 1e12:.1f}")


if __name__ == "__main__":
    main()
