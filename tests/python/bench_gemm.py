"""PyTorch's CPU GEMM rates at the shapes of `cargo bench -p amp-core --bench gemm` and at
1024³, in f32, bf16 and f16, for a side-by-side comparison run on the same machine.

Run: `python tests/python/bench_gemm.py [--threads 2] [--samples 30]`. Prints one line per
shape and type: GFLOP/s at the median time over the samples and at the fastest one (the
figures divan reports as median and fastest for the Rust side).
"""

import argparse
import statistics
import time

import torch


def shapes():
    """(name, flops, thunk builder) per product, the same operands as the Rust bench."""

    def linear_qkv(dt):
        x, w, b = torch.randn(2048, 256, dtype=dt), torch.randn(768, 256, dtype=dt), torch.randn(768, dtype=dt)
        return lambda: torch.nn.functional.linear(x, w, b)

    def matmul_dx(dt):
        dy, w = torch.randn(2048, 256, dtype=dt), torch.randn(256, 1024, dtype=dt)
        return lambda: dy @ w

    def matmul_dw(dt):
        dy, x = torch.randn(2048, 1024, dtype=dt), torch.randn(2048, 256, dtype=dt)
        return lambda: dy.t() @ x

    def matmul_dx_k1024(dt):
        dy, w = torch.randn(2048, 1024, dtype=dt), torch.randn(1024, 256, dtype=dt)
        return lambda: dy @ w

    def matmul_dw_m256(dt):
        dy, h = torch.randn(2048, 256, dtype=dt), torch.randn(2048, 1024, dtype=dt)
        return lambda: dy.t() @ h

    def attention_scores(dt):
        q, k = torch.randn(64, 128, 64, dtype=dt), torch.randn(64, 128, 64, dtype=dt)
        return lambda: q @ k.transpose(1, 2)

    def square_1024(dt):
        a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
        return lambda: a @ b

    return [
        ("linear_qkv_fwd", 2 * 2048 * 256 * 768, linear_qkv),
        ("matmul_dx", 2 * 2048 * 256 * 1024, matmul_dx),
        ("matmul_dw", 2 * 1024 * 2048 * 256, matmul_dw),
        ("matmul_dx_k1024", 2 * 2048 * 1024 * 256, matmul_dx_k1024),
        ("matmul_dw_m256", 2 * 256 * 2048 * 1024, matmul_dw_m256),
        ("attention_scores", 2 * 64 * 128 * 128 * 64, attention_scores),
        ("matmul_1024", 2 * 1024**3, square_1024),
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--samples", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, oneDNN ISA: {torch.backends.cpu.get_cpu_capability()}")
    for name, flops, build in shapes():
        cells = []
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            f = build(dt)
            for _ in range(3):
                f()
            times = []
            for _ in range(args.samples):
                t = time.perf_counter()
                f()
                times.append(time.perf_counter() - t)
            rate = lambda t: flops / t / 1e9
            cells.append(f"{str(dt).removeprefix('torch.')} {rate(statistics.median(times)):6.1f} ({rate(min(times)):6.1f})")
        print(f"{name:18} GFLOP/s, median (best)  " + "  ".join(cells))


if __name__ == "__main__":
    main()
