//! `#[autocast]` on an MLP: the matmuls run in f16 (f32 accumulation), the bias adds meet the
//! f32 biases in f32 (promote), the loss is f32, and the gradients come back in f32 for the
//! f32 master weights. Prints the precision of every intermediate, then trains a few steps.
//!
//! Run: `cargo run --example autocast_mlp` (`-- --bf16` for bf16, `-- --policy` to print the
//! whole op policy table).

use amp::__private::{cast_stats, reset_cast_stats};
use amp::policy;
use amp::prelude::*;

/// What the forward saw: a label and a precision per intermediate.
type Trace = Vec<(&'static str, DType)>;

/// One MLP loss under `#[autocast($low)]`, recording each intermediate's precision.
macro_rules! forward {
    ($name:ident, $low:ident) => {
        #[autocast($low)]
        fn $name(&self, x: &Tensor<f32>, targets: &Indices, trace: &mut Trace) -> Tensor<f32> {
            let h = x.matmul(&self.w1);
            trace.push(("x @ w1                 lower precision", h.dtype()));
            let h = h.add(&self.b1);
            trace.push(("  + b1 (f32 param)     promote", h.dtype()));
            let a = h.gelu();
            trace.push(("gelu                   passthrough", a.dtype()));
            let logits = a.matmul(&self.w2);
            trace.push(("a @ w2                 lower precision", logits.dtype()));
            let logits = logits.add(&self.b2);
            trace.push(("  + b2 (f32 param)     promote", logits.dtype()));
            let loss = logits.cross_entropy(targets);
            trace.push(("cross_entropy          fp32", loss.dtype()));
            loss
        }
    };
}

struct Mlp {
    w1: Param,
    b1: Param,
    w2: Param,
    b2: Param,
}

impl Mlp {
    fn new(d_in: usize, d_hidden: usize, classes: usize, rng: &mut Rng) -> Mlp {
        let mut p = |shape: &[usize], scale: f64| Param::new(Tensor::<f32>::randn(shape, rng).mul_scalar(scale));
        Mlp {
            w1: p(&[d_in, d_hidden], (1.0 / d_in as f64).sqrt()),
            b1: p(&[d_hidden], 0.0),
            w2: p(&[d_hidden, classes], (1.0 / d_hidden as f64).sqrt()),
            b2: p(&[classes], 0.0),
        }
    }

    fn params_mut(&mut self) -> [&mut Param; 4] {
        [&mut self.w1, &mut self.b1, &mut self.w2, &mut self.b2]
    }

    // The same forward under f16 and under bf16 (the autocast type is part of the attribute).
    forward!(loss_f16, f16);
    forward!(loss_bf16, bf16);

    fn loss(&self, bf16: bool, x: &Tensor<f32>, targets: &Indices, trace: &mut Trace) -> Tensor<f32> {
        if bf16 { self.loss_bf16(x, targets, trace) } else { self.loss_f16(x, targets, trace) }
    }
}

/// A toy task: the class is the index of the largest of the first `classes` features.
fn batch(n: usize, d: usize, classes: usize, rng: &mut Rng) -> (Tensor<f32>, Indices) {
    let x = Tensor::<f32>::randn(&[n, d], rng);
    let v = x.to_vec();
    let labels = (0..n)
        .map(|i| {
            let row = &v[i * d..i * d + classes];
            (0..classes).max_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap() as i64
        })
        .collect();
    (x, Indices::from_vec(labels, &[n]))
}

/// The precision of every intermediate of an `#[autocast]` MLP, its gradients and a few steps.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Autocast to bf16 instead of f16.
    #[arg(long)]
    bf16: bool,
    /// Print the op policy table and exit.
    #[arg(long)]
    policy: bool,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    if args.policy {
        policy::print_policy();
        return;
    }
    let bf16 = args.bf16;
    let mut rng = Rng::seed(7);
    let (d, hidden, classes) = (16, 64, 4);
    let mut mlp = Mlp::new(d, hidden, classes, &mut rng);

    let (x, y) = batch(64, d, classes, &mut rng);
    let mut trace = Trace::new();
    reset_cast_stats();
    let loss = mlp.loss(bf16, &x, &y, &mut trace);
    let stats = cast_stats();
    let grads = loss.backward();

    println!("#[autocast({})] MLP {d} -> {hidden} -> {classes}, batch 64\n", if bf16 { "bf16" } else { "f16" });
    println!("{:<40} precision", "intermediate");
    for (what, dt) in &trace {
        println!("{what:<40} {dt}");
    }
    for (name, p) in [("w1", &mlp.w1), ("b1", &mlp.b1), ("w2", &mlp.w2), ("b2", &mlp.b2)] {
        let g = grads.get(p).expect("every parameter gets a gradient");
        println!("{:<40} {}", format!("grad {name} (f32 master weight)"), g.dtype());
    }
    // x, w1, w2 down to the low type; the two products up to f32 to meet the f32 biases.
    println!("\ncasts run: {} (cache hits: {})", stats.casts, stats.cache_hits);

    // A few plain SGD steps on the f32 master weights.
    let lr = 0.5;
    println!("\nstep  loss (f32)");
    for step in 0..=60 {
        let (x, y) = batch(64, d, classes, &mut rng);
        let loss = mlp.loss(bf16, &x, &y, &mut Trace::new());
        let grads = loss.backward();
        if step % 10 == 0 {
            println!("{step:>4}  {:.4}", loss.item());
        }
        for p in mlp.params_mut() {
            let g = grads.get(p).expect("gradient").to_vec();
            for (w, g) in p.data_mut().iter_mut().zip(g) {
                *w -= lr * g;
            }
        }
    }
}
