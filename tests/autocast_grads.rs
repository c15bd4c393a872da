//! `#[autocast]` is the casts a careful person would write, nothing more: outputs and
//! gradients bit-identical to the same forward with the casts written by hand, gradients
//! through every inserted cast in each parameter's own precision, and the weight cast cache
//! converting each parameter once per call.

use amp::__private::{CastStats, cast_stats, reset_cast_stats};
use amp::prelude::*;
use amp::{Indices, Tensor};

struct Model {
    emb: Param,
    ln_w: Param,
    ln_b: Param,
    w1: Param,
    b1: Param,
    w2: Param,
    /// A parameter kept in f16 (not a master weight): its gradient comes back in f16.
    b2: Param<f16>,
}

impl Model {
    fn new(seed: u64) -> Model {
        let mut rng = Rng::seed(seed);
        let mut p = |shape: &[usize], scale: f64| Param::new(Tensor::<f32>::randn(shape, &mut rng).mul_scalar(scale));
        let (v, d, f) = (11, 8, 16);
        let b2 = Param::new(Tensor::<f32>::randn(&[d], &mut Rng::seed(seed + 1)).cast::<f16>());
        Model {
            emb: p(&[v, d], 0.5),
            ln_w: p(&[d], 1.0),
            ln_b: p(&[d], 0.1),
            w1: p(&[d, f], 0.4),
            b1: p(&[f], 0.1),
            w2: p(&[f, d], 0.3),
            b2,
        }
    }
    fn named(&self) -> Vec<(&str, AnyGrad<'_>)> {
        vec![
            ("emb", AnyGrad::F32(&self.emb)),
            ("ln_w", AnyGrad::F32(&self.ln_w)),
            ("ln_b", AnyGrad::F32(&self.ln_b)),
            ("w1", AnyGrad::F32(&self.w1)),
            ("b1", AnyGrad::F32(&self.b1)),
            ("w2", AnyGrad::F32(&self.w2)),
            ("b2", AnyGrad::F16(&self.b2)),
        ]
    }
}

enum AnyGrad<'a> {
    F32(&'a Param),
    F16(&'a Param<f16>),
}

/// A gradient's dtype and bits.
fn grad_bits(g: &Grads, p: &AnyGrad<'_>) -> (DType, Vec<u64>) {
    match p {
        AnyGrad::F32(p) => {
            let t = g.get(p).expect("gradient for an f32 parameter");
            (t.dtype(), t.to_vec().iter().map(|v| u64::from(v.to_bits())).collect())
        }
        AnyGrad::F16(p) => {
            let t = g.get(p).expect("gradient for an f16 parameter");
            (t.dtype(), t.to_vec().iter().map(|v| u64::from(v.to_bits())).collect())
        }
    }
}

/// The forward under `#[autocast($low)]`, and the same forward with the casts by hand.
macro_rules! forwards {
    ($auto:ident, $hand:ident, $low:ident) => {
        #[autocast($low)]
        fn $auto(m: &Model, ids: &Indices, targets: &Indices) -> Tensor<f32> {
            let x = m.emb.embedding(ids); // passthrough: f32 rows
            let h = x.layer_norm(Some(&m.ln_w), Some(&m.ln_b), 1e-5); // fp32
            let a = h.matmul(&m.w1).add(&m.b1).gelu(); // low matmul, f32 bias add (promote)
            let y = a.matmul(&m.w2); // low
            let r = &x + &y; // promote: f32
            let r = r.add(&m.b2); // promote: the f16 bias is cast up
            let logits = r.matmul(&m.emb.t()); // low, tied to the embedding
            logits.cross_entropy(targets) // fp32
        }

        fn $hand(m: &Model, ids: &Indices, targets: &Indices) -> Tensor<f32> {
            let x = m.emb.embedding(ids);
            let h = x.layer_norm(Some(&m.ln_w), Some(&m.ln_b), 1e-5);
            let a = h.cast::<$low>().matmul(&m.w1.cast::<$low>()).cast::<f32>().add(&m.b1).gelu();
            let y = a.cast::<$low>().matmul(&m.w2.cast::<$low>());
            let r = x.add(&y.cast::<f32>());
            let r = r.add(&m.b2.cast::<f32>());
            let logits = r.cast::<$low>().matmul(&m.emb.t().cast::<$low>());
            logits.cast::<f32>().cross_entropy(targets)
        }
    };
}

forwards!(auto_f16, hand_f16, f16);
forwards!(auto_bf16, hand_bf16, bf16);

fn batch() -> (Indices, Indices) {
    (Indices::from_vec(vec![1, 4, 4, 9, 0, 7], &[6]), Indices::from_vec(vec![4, 4, 9, 0, 7, 2], &[6]))
}

macro_rules! compare {
    ($auto:ident, $hand:ident) => {{
        let m = Model::new(3);
        let (ids, targets) = batch();
        let (la, lh) = ($auto(&m, &ids, &targets), $hand(&m, &ids, &targets));
        assert_eq!(la.dtype(), DType::F32, "the loss is f32");
        assert_eq!(la.item().to_bits(), lh.item().to_bits(), "loss {} vs {}", la.item(), lh.item());
        let (ga, gh) = (la.backward(), lh.backward());
        for (name, p) in m.named() {
            let (a, h) = (grad_bits(&ga, &p), grad_bits(&gh, &p));
            assert_eq!(a, h, "gradient of {name}");
            assert!(a.1.iter().any(|b| *b != 0), "a gradient reached {name}");
        }
        // f32 master gradients for f32 parameters, f16 for the f16 one.
        assert_eq!(grad_bits(&ga, &AnyGrad::F32(&m.w1)).0, DType::F32);
        assert_eq!(grad_bits(&ga, &AnyGrad::F16(&m.b2)).0, DType::F16);
    }};
}

#[test]
fn bit_identical_to_hand_written_casts_f16() {
    compare!(auto_f16, hand_f16);
}

#[test]
fn bit_identical_to_hand_written_casts_bf16() {
    compare!(auto_bf16, hand_bf16);
}

/// The model in f32 throughout (the reference the mixed-precision gradients approximate).
fn plain_f32(m: &Model, ids: &Indices, targets: &Indices) -> Tensor<f32> {
    let x = m.emb.embedding(ids);
    let h = x.layer_norm(Some(&m.ln_w), Some(&m.ln_b), 1e-5);
    let a = h.matmul(&m.w1).add(&m.b1).gelu();
    let r = x.add(&a.matmul(&m.w2)).add(&m.b2.cast::<f32>());
    r.matmul(&m.emb.t()).cross_entropy(targets)
}

#[test]
fn master_gradients_approximate_the_f32_model() {
    // Every parameter's gradient through the inserted casts agrees with the all-f32 model's
    // to within 16-bit rounding: nothing is dropped or scaled on the way through a cast.
    let m = Model::new(5);
    let (ids, targets) = batch();
    let (ga, g32) = (auto_bf16(&m, &ids, &targets).backward(), plain_f32(&m, &ids, &targets).backward());
    for (name, p) in [("emb", &m.emb), ("ln_w", &m.ln_w), ("w1", &m.w1), ("b1", &m.b1), ("w2", &m.w2)] {
        let (a, r) = (ga.get(p).unwrap().to_vec(), g32.get(p).unwrap().to_vec());
        let diff: f32 = a.iter().zip(&r).map(|(x, y)| (x - y).powi(2)).sum::<f32>().sqrt();
        let norm: f32 = r.iter().map(|y| y * y).sum::<f32>().sqrt();
        assert!(diff <= 0.02 * norm, "{name}: |autocast - f32| = {diff}, |f32| = {norm}");
    }
}

// ---- the weight cast cache ---------------------------------------------------------------------

#[autocast]
fn reuse(x: &Tensor<f32>, w: &Param, steps: usize) -> Tensor<f32> {
    let mut h = x.matmul(w);
    for _ in 0..steps {
        h = h.matmul(w).tanh(); // the same weight every step
    }
    h.matmul(&w.t()) // and a view of it
}

#[autocast(cache = false)]
fn reuse_uncached(x: &Tensor<f32>, w: &Param, steps: usize) -> Tensor<f32> {
    let mut h = x.matmul(w);
    for _ in 0..steps {
        h = h.matmul(w).tanh();
    }
    h.matmul(&w.t())
}

#[autocast]
fn two_layers_sharing(x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
    // Each call below is its own `#[autocast]` function: the cache spans the outermost one.
    let h = reuse(x, w, 1);
    reuse(&h, w, 1)
}

#[test]
fn each_parameter_is_converted_once_per_call() {
    let mut rng = Rng::seed(2);
    let x = Tensor::<f32>::randn(&[3, 5], &mut rng);
    let w = Param::new(Tensor::<f32>::randn(&[5, 5], &mut rng).mul_scalar(0.3));
    let steps = 6;
    reset_cast_stats();
    let cached = reuse(&x, &w, steps);
    // x (an input, not a parameter) once, w once, the f16 result to the declared f32 once;
    // the other `steps + 1` uses of w (the loop and `w.t()`) are served by the cache.
    assert_eq!(cast_stats(), CastStats { casts: 3, cache_hits: steps as u64 + 1 });
    reset_cast_stats();
    let uncached = reuse_uncached(&x, &w, steps);
    assert_eq!(cast_stats(), CastStats { casts: steps as u64 + 4, cache_hits: 0 });
    // Same values, same gradients.
    assert_eq!(cached.to_vec(), uncached.to_vec());
    let (g1, g2) = (cached.sum_all().backward(), uncached.sum_all().backward());
    assert_eq!(g1.get(&w).unwrap().to_vec(), g2.get(&w).unwrap().to_vec());
    // Nested regions share the outermost one's cache; the next call starts afresh.
    reset_cast_stats();
    two_layers_sharing(&x, &w);
    // x, w once, the first call's f16 result to its declared f32 and back to f16 for the
    // second call, the second result to f32; w's other 5 uses are hits.
    assert_eq!(cast_stats(), CastStats { casts: 5, cache_hits: 5 });
    reset_cast_stats();
    reuse(&x, &w, 0);
    assert_eq!(cast_stats(), CastStats { casts: 3, cache_hits: 1 }, "a new call converts again");
}

#[test]
fn an_update_between_calls_is_seen() {
    let x = Tensor::<f32>::ones(&[1, 2]);
    let mut w = Param::new(Tensor::<f32>::from_vec(vec![1.0, 0.0, 0.0, 1.0], &[2, 2]));
    let a = reuse(&x, &w, 0).to_vec();
    w.data_mut()[0] = 3.0;
    let b = reuse(&x, &w, 0).to_vec();
    assert_ne!(a, b);
    let by_hand = x.cast::<f16>().matmul(&w.cast::<f16>()).matmul(&w.t().cast::<f16>()).cast::<f32>();
    assert_eq!(b, by_hand.to_vec());
}
