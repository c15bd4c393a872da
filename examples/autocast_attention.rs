//! `#[autocast]` on a small causal self-attention block (pre-norm, one head, residual):
//! the projections and both attention matmuls in f16, layer norm, the masked softmax and the
//! loss in f32, the residual stream in f32, and f32 master gradients. Prints the precision of
//! every intermediate and the casts the region ran.
//!
//! Run: `cargo run --example autocast_attention` (`-- --bf16` for bf16).

use amp::__private::{cast_stats, reset_cast_stats};
use amp::prelude::*;

type Trace = Vec<(&'static str, DType)>;

struct Attention {
    ln_w: Param,
    ln_b: Param,
    wq: Param,
    wk: Param,
    wv: Param,
    wo: Param,
}

impl Attention {
    fn new(d: usize, rng: &mut Rng) -> Attention {
        let s = (1.0 / d as f64).sqrt();
        let mut p = |scale: f64| Param::new(Tensor::<f32>::randn(&[d, d], rng).mul_scalar(scale));
        let (wq, wk, wv, wo) = (p(s), p(s), p(s), p(s));
        Attention { ln_w: Param::new(Tensor::ones(&[d])), ln_b: Param::new(Tensor::zeros(&[d])), wq, wk, wv, wo }
    }
}

/// The block's forward and a loss under `#[autocast($low)]`.
macro_rules! block {
    ($name:ident, $low:ident) => {
        #[autocast($low)]
        fn $name(m: &Attention, x: &Tensor<f32>, target: &Tensor<f32>, trace: &mut Trace) -> Tensor<f32> {
            let (t, d) = (x.shape()[1], x.shape()[2]);
            let h = x.layer_norm(Some(&m.ln_w), Some(&m.ln_b), 1e-5);
            trace.push(("layer_norm                    fp32", h.dtype()));
            let (q, k, v) = (h.matmul(&m.wq), h.matmul(&m.wk), h.matmul(&m.wv));
            trace.push(("q, k, v = h @ w               lower precision", q.dtype()));
            let scores = q.matmul(&k.t()).mul_scalar(1.0 / (d as f64).sqrt());
            trace.push(("q @ kᵀ / √d                   lower precision", scores.dtype()));
            let masked = scores.masked_fill(&Mask::causal(t), f64::NEG_INFINITY);
            trace.push(("masked_fill (causal)          passthrough", masked.dtype()));
            let probs = masked.softmax(2);
            trace.push(("softmax                       fp32 accumulate", probs.dtype()));
            let ctx = probs.matmul(&v);
            trace.push(("probs @ v                     lower precision", ctx.dtype()));
            let out = ctx.matmul(&m.wo);
            trace.push(("ctx @ wo                      lower precision", out.dtype()));
            let y = x + &out;
            trace.push(("x + out (residual)            promote", y.dtype()));
            let loss = y.mse_loss(target);
            trace.push(("mse_loss                      fp32", loss.dtype()));
            loss
        }
    };
}

block!(loss_f16, f16);
block!(loss_bf16, bf16);

/// The precision of every intermediate of an `#[autocast]` causal self-attention block.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Autocast to bf16 instead of f16.
    #[arg(long)]
    bf16: bool,
}

fn main() {
    let bf16 = <Args as clap::Parser>::parse().bf16;
    let mut rng = Rng::seed(11);
    let (b, t, d) = (2, 6, 16);
    let m = Attention::new(d, &mut rng);
    let x = Tensor::<f32>::randn(&[b, t, d], &mut rng);
    let target = Tensor::<f32>::randn(&[b, t, d], &mut rng);

    let mut trace = Trace::new();
    reset_cast_stats();
    let loss = if bf16 { loss_bf16(&m, &x, &target, &mut trace) } else { loss_f16(&m, &x, &target, &mut trace) };
    let stats = cast_stats();
    let grads = loss.backward();

    println!("#[autocast({})] causal self-attention, x: [{b}, {t}, {d}]\n", if bf16 { "bf16" } else { "f16" });
    println!("{:<46} precision", "intermediate");
    for (what, dt) in &trace {
        println!("{what:<46} {dt}");
    }
    for (name, p) in [("ln_w", &m.ln_w), ("wq", &m.wq), ("wk", &m.wk), ("wv", &m.wv), ("wo", &m.wo)] {
        let g = grads.get(p).expect("every parameter gets a gradient");
        let norm = g.to_vec().iter().map(|v| v * v).sum::<f32>().sqrt();
        println!("{:<46} {}   |g| = {norm:.4}", format!("grad {name} (f32 master weight)"), g.dtype());
    }
    println!("\nloss {:.5} ({})", loss.item(), loss.dtype());
    println!("casts run: {} ({} served by the weight cast cache)", stats.casts, stats.cache_hits);
}
