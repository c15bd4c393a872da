//! The CUDA backend's kernels against the GPU's own limits: GEMM throughput at 4096³ and
//! 8192³ in f16 and bf16 (cuBLAS, f32 compute), and the bandwidth of the elementwise and
//! fused-row kernels (GELU, layer norm, softmax, cross-entropy) over 256 MiB of bf16 against
//! a device-to-device copy of the same bytes measured in the same run, and causal attention
//! at GPT-2 small's shape (PyTorch's side: `scaled_dot_product_attention(is_causal=True)`).
//!
//! ```text
//! cargo run --release --features cuda --example gpu_bench
//! python3 tests/python/gpu_bench.py      # the same lines from PyTorch on the same GPU
//! ```
//!
//! Every line starts with `BENCH` and has the same fields as `tests/python/gpu_bench.py`'s,
//! so the GPU bundle's `run.sh` can put the two side by side:
//! `BENCH <what> <dtype> <shape> ms <median> <unit> <value>`. Times are the median of 7
//! rounds, each a queue of several calls ended by one stream synchronisation; bandwidth counts
//! the bytes the op must read and write at least once (input read, output written).

#[cfg(feature = "cuda")]
mod bench {
    use std::time::Instant;

    use amp::cuda::Cuda;
    use amp::{Indices, Precision, Rng, Tensor, bf16, f16};

    /// Median seconds per call of `f`: 7 rounds of `calls` queued calls, each round timed
    /// from a synchronised stream to a synchronised stream.
    fn time(gpu: &Cuda, calls: usize, mut f: impl FnMut()) -> f64 {
        f(); // compiles the kernels and fills the allocator's cache
        gpu.synchronize();
        let mut rounds: Vec<f64> = (0..7)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..calls {
                    f();
                }
                gpu.synchronize();
                t.elapsed().as_secs_f64() / calls as f64
            })
            .collect();
        rounds.sort_by(f64::total_cmp);
        rounds[3]
    }

    /// `[rows, cols]` of standard normal values in `E` on the GPU: one random `[16, cols]`
    /// block made on the host, repeated on the device (the values do not change the speed).
    fn tiled<E: Precision>(gpu: &Cuda, rows: usize, cols: usize) -> Tensor<E, Cuda> {
        assert_eq!(rows % 16, 0);
        Tensor::<f32>::randn(&[1, 16, cols], &mut Rng::seed(rows as u64 ^ cols as u64))
            .to_device(gpu)
            .broadcast_to(&[rows / 16, 16, cols])
            .contiguous()
            .reshape(&[rows, cols])
            .cast::<E>()
    }

    fn gemm<E: Precision>(gpu: &Cuda, n: usize) {
        let a = tiled::<E>(gpu, n, n);
        let b = tiled::<E>(gpu, n, n);
        let calls = if n >= 8192 { 10 } else { 40 };
        let s = time(gpu, calls, || drop(a.matmul(&b)));
        let tflops = 2.0 * (n as f64).powi(3) / s / 1e12;
        println!("BENCH matmul {} {n}x{n}x{n} ms {:.4} TFLOP/s {tflops:.1}", E::DTYPE, s * 1e3);
    }

    /// Bandwidth in GB/s for `bytes` moved per call taking `s` seconds.
    fn gbs(bytes: usize, s: f64) -> f64 {
        bytes as f64 / s / 1e9
    }

    pub fn run(gpu: &Cuda) {
        println!("GPU 0: {}", gpu.device_name());
        for n in [4096, 8192] {
            gemm::<f16>(gpu, n);
            gemm::<bf16>(gpu, n);
        }
        // 256 MiB of bf16: 2^27 values.
        let (rows, cols) = (1usize << 17, 1024);
        let bytes = rows * cols * 2;
        let x = tiled::<bf16>(gpu, rows, cols);
        let shape = format!("{rows}x{cols}");
        let mut dst = tiled::<bf16>(gpu, rows, cols);
        let copy = time(gpu, 20, || x.cast_into(&mut dst)); // bf16 -> bf16: one cuMemcpyDtoD
        println!("BENCH copy bf16 {shape} ms {:.4} GB/s {:.0}", copy * 1e3, gbs(2 * bytes, copy));
        let report = |what: &str, shape: &str, moved: usize, s: f64| {
            let bw = gbs(moved, s);
            println!(
                "BENCH {what} bf16 {shape} ms {:.4} GB/s {bw:.0} of_copy {:.2}",
                s * 1e3,
                bw / gbs(2 * bytes, copy)
            );
        };
        report("gelu", &shape, 2 * bytes, time(gpu, 20, || drop(x.gelu())));
        let w = Tensor::<f32>::ones(&[cols]).to_device(gpu).cast::<bf16>();
        let b = Tensor::<f32>::zeros(&[cols]).to_device(gpu).cast::<bf16>();
        report("layer_norm", &shape, 2 * bytes, time(gpu, 20, || drop(x.layer_norm(Some(&w), Some(&b), 1e-5))));
        report("softmax", &shape, 2 * bytes, time(gpu, 20, || drop(x.softmax(1))));
        // Cross-entropy over a GPT-2 vocabulary: the logits are read, one value per row written.
        let vocab = 50304;
        let ce_rows = (bytes / (vocab * 2)).div_ceil(16) * 16;
        let logits = tiled::<bf16>(gpu, ce_rows, vocab);
        let targets = Indices::from_vec((0..ce_rows as i64).map(|i| (i * 7919) % vocab as i64).collect(), &[ce_rows]);
        let ce_shape = format!("{ce_rows}x{vocab}");
        report("cross_entropy", &ce_shape, ce_rows * vocab * 2, time(gpu, 20, || drop(logits.cross_entropy(&targets))));
        attention(gpu);
    }

    /// Causal attention at GPT-2 small's shape and batch 16 (`[16, 12, 1024, 64]` bf16),
    /// forward alone and forward + backward (through the sum of the output, as PyTorch's side
    /// does), in TFLOP/s of causal attention: `2 n t² d` for the forward's two products over
    /// the causal half, 2.5 times that for the backward's five. First on the fused tensor-core
    /// kernels (the default), then on the cuBLAS path (`attention_blocked_*`), for the ratio.
    fn attention(gpu: &Cuda) {
        let (b, h, t, d) = (16, 12, 1024, 64);
        let qkv = || tiled::<bf16>(gpu, b * h * t, d).reshape(&[b, h, t, d]);
        let (q, k, v) = (qkv().requires_grad_(), qkv().requires_grad_(), qkv().requires_grad_());
        let shape = format!("{b}x{h}x{t}x{d}");
        let fwd_flops = 2.0 * (b * h) as f64 * (t * t * d) as f64;
        for (flash, name) in [(true, "attention"), (false, "attention_blocked")] {
            gpu.set_flash_attention(flash);
            let s = amp::no_grad(|| time(gpu, 10, || drop(q.causal_attention(&k, &v))));
            println!("BENCH {name}_fwd bf16 {shape} ms {:.4} TFLOP/s {:.1}", s * 1e3, fwd_flops / s / 1e12);
            let s = time(gpu, 10, || drop(q.causal_attention(&k, &v).sum_all().backward()));
            let tflops = 3.5 * fwd_flops / s / 1e12;
            println!("BENCH {name}_fwd_bwd bf16 {shape} ms {:.4} TFLOP/s {tflops:.1}", s * 1e3);
        }
        gpu.set_flash_attention(true);
    }
}

fn main() -> std::process::ExitCode {
    #[cfg(feature = "cuda")]
    {
        match amp::cuda::Cuda::new(0) {
            Ok(gpu) => {
                bench::run(&gpu);
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::ExitCode::from(1)
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        eprintln!("error: this build has no CUDA backend: `cargo run --release --features cuda --example gpu_bench`");
        std::process::ExitCode::from(1)
    }
}
