//! How far `#[autocast]` reaches: a forward written once for any low type (`#[autocast(P)]`,
//! `#[autocast(f32)]`), f64 left alone, `amp::nn` modules' `forward` without a turbofish, the
//! weight cast cache bounded in a long loop, and a bare `#[autocast]` helper called from a
//! region of another precision.

use amp::__private::{cache_entries, cast_stats, reset_cast_stats};
use amp::nn::{Linear, Mlp};
use amp::prelude::*;

// ---- one forward, any low type ----------------------------------------------------------------

#[derive(Params)]
struct Net {
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    fn new(rng: &mut Rng) -> Self {
        Net { fc1: Linear::new(8, 16, true, rng), fc2: Linear::new(16, 3, true, rng) }
    }

    /// The README's forward, generic over its low type.
    #[autocast(P)]
    fn loss<P: Precision>(&self, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
        let h = x.linear(&self.fc1.weight, self.fc1.bias.as_ref()).gelu();
        h.linear(&self.fc2.weight, self.fc2.bias.as_ref()).cross_entropy(y)
    }

    /// The same body without the attribute: plain f32 (`linear` takes the `Param`s as they are).
    fn loss_f32(&self, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
        let h = x.linear(&self.fc1.weight, self.fc1.bias.as_ref()).gelu();
        h.linear(&self.fc2.weight, self.fc2.bias.as_ref()).cross_entropy(y)
    }

    /// The hidden activation's precision, the logits (declared f32), the loss.
    #[autocast(P)]
    fn observe<P: Precision>(&self, x: &Tensor<f32>, y: &Indices) -> (DType, Tensor<f32>, Tensor<f32>) {
        let h = x.linear(&self.fc1.weight, self.fc1.bias.as_ref()).gelu();
        let logits = h.linear(&self.fc2.weight, self.fc2.bias.as_ref());
        let loss = logits.cross_entropy(y);
        (h.dtype(), logits, loss)
    }

    /// A residual add (a promotion of `P` with f32: `#[autocast(P)]` adds the bounds for it).
    #[autocast(P)]
    fn residual<P: Precision>(&self, x: &Tensor<f32>) -> (DType, Tensor<f32>) {
        let h = self.fc1.forward(x).gelu(); // [.., 16] in P
        let back = h.linear(&self.fc1.weight.t(), None); // [.., 8] in P
        let r = x + &back; // f32 + P: f32
        let s = &back + &back; // P + P: P
        (s.dtype(), r)
    }

    /// Every element of a declared `Vec<Tensor<f32>>` is conformed; so is a tuple that is a
    /// call's value, not written out.
    #[autocast(P)]
    fn pieces<P: Precision>(&self, x: &Tensor<f32>) -> (Vec<Tensor<f32>>, (Tensor<f32>, usize)) {
        let h = self.fc1.forward(x);
        let pair = self.pair::<P>(&h);
        (vec![h.clone(), h.relu()], pair)
    }

    fn pair<P: Precision>(&self, h: &Tensor<P>) -> (Tensor<P>, usize) {
        (h.clone(), h.rank())
    }
}

/// A training loop generic over the low type, with no bounds beyond `Precision` (the forward
/// has no promotions, so it needs none).
fn train<P: Precision>(net: &mut Net, x: &Tensor<f32>, y: &Indices, steps: usize) -> (f32, f32) {
    let before = net.loss::<P>(x, y).item();
    for _ in 0..steps {
        let loss = net.loss::<P>(x, y);
        let grads = loss.backward();
        for (_, p) in net.named_params_mut() {
            let g = grads.get(p).unwrap().to_vec();
            for (w, g) in p.data_mut().iter_mut().zip(g) {
                *w -= 0.2 * g;
            }
        }
    }
    (before, net.loss::<P>(x, y).item())
}

fn batch(rng: &mut Rng) -> (Tensor<f32>, Indices) {
    let x = Tensor::<f32>::randn(&[32, 8], rng);
    let y = x.matmul(&Tensor::<f32>::randn(&[8, 3], rng)).argmax(1, false);
    (x, y)
}

#[test]
fn one_generic_forward_runs_at_f32_f16_and_bf16() {
    let mut rng = Rng::seed(7);
    let net = Net::new(&mut rng);
    let (x, y) = batch(&mut rng);
    let (h32, logits32, loss32) = net.observe::<f32>(&x, &y);
    let (h16, logits16, loss16) = net.observe::<f16>(&x, &y);
    let (hb, logitsb, lossb) = net.observe::<bf16>(&x, &y);
    assert_eq!((h32, h16, hb), (DType::F32, DType::F16, DType::BF16));
    for t in [&logits32, &logits16, &logitsb, &loss32, &loss16, &lossb] {
        assert_eq!(t.dtype(), DType::F32);
    }
    // P = f32 is the model as written, bit for bit.
    assert_eq!(net.loss::<f32>(&x, &y).to_vec(), net.loss_f32(&x, &y).to_vec());
    assert_eq!(loss32.to_vec(), net.loss_f32(&x, &y).to_vec());
    // The low types are close to it, and not equal.
    for l in [&loss16, &lossb] {
        assert!((l.item() - loss32.item()).abs() < 0.05, "{} vs {}", l.item(), loss32.item());
    }
    assert_ne!(logits16.to_vec(), logits32.to_vec());
    // Gradients in f32 at every low type.
    let g = net.loss::<bf16>(&x, &y).backward();
    assert_eq!(g.get(&net.fc1.weight).unwrap().dtype(), DType::F32);
}

#[test]
fn a_generic_training_loop_trains_at_each_precision() {
    for p in [DType::F32, DType::F16, DType::BF16] {
        let mut rng = Rng::seed(3);
        let mut net = Net::new(&mut rng);
        let (x, y) = batch(&mut rng);
        let (before, after) = match p {
            DType::F32 => train::<f32>(&mut net, &x, &y, 40),
            DType::F16 => train::<f16>(&mut net, &x, &y, 40),
            _ => train::<bf16>(&mut net, &x, &y, 40),
        };
        assert!(after < 0.7 * before, "{p}: loss {before} -> {after}");
    }
}

#[test]
fn generic_promotions_and_declared_containers() {
    let mut rng = Rng::seed(4);
    let net = Net::new(&mut rng);
    let x = Tensor::<f32>::randn(&[4, 8], &mut rng);
    let (s, r) = net.residual::<bf16>(&x);
    assert_eq!((s, r.dtype()), (DType::BF16, DType::F32));
    let (s, r) = net.residual::<f32>(&x);
    assert_eq!((s, r.dtype()), (DType::F32, DType::F32));
    let (v, (t, rank)) = net.pieces::<f16>(&x);
    assert_eq!(v.iter().map(|t| t.dtype()).collect::<Vec<_>>(), [DType::F32, DType::F32]);
    assert_eq!((t.dtype(), rank), (DType::F32, 2));
}

#[autocast(f32)]
fn all_f32(x: &Tensor<f32>, w: &Param) -> (DType, DType, Tensor<f32>) {
    let h = x.matmul(w); // a lower-precision op, in f32
    let e = h.cast::<f16>().exp(); // an fp32 op: its input is widened to f32
    (h.dtype(), e.dtype(), h)
}

#[test]
fn autocast_f32_runs_every_op_in_f32() {
    let mut rng = Rng::seed(5);
    let x = Tensor::<f32>::randn(&[3, 4], &mut rng);
    let w = Param::new(Tensor::<f32>::randn(&[4, 2], &mut rng));
    let (h, e, out) = all_f32(&x, &w);
    assert_eq!((h, e), (DType::F32, DType::F32));
    assert_eq!(out.to_vec(), x.matmul(&w).to_vec());
}

// ---- f64 is left alone --------------------------------------------------------------------------

#[autocast]
fn in_f64(a: &Tensor<f32>, b: &Tensor<f32>, w: &Param<f64>) -> (Tensor<f64>, DType, DType) {
    let (a, b) = (a.cast::<f64>(), b.cast::<f64>());
    let c = a.matmul(&b); // lower-precision op: f64 stays f64
    let e = c.mul_scalar(1e-5).exp(); // fp32 op: f64 stays f64
    let l = a.linear(w, None); // a Param<f64> too
    (c, e.dtype(), l.dtype())
}

#[test]
fn f64_runs_as_written() {
    // 300·300 + 14·1 = 90,014: exact in f64 (and f32), past f16's largest finite 65,504.
    let a = Tensor::<f32>::from_vec(vec![300.0, 14.0], &[1, 2]);
    let b = Tensor::<f32>::from_vec(vec![300.0, 1.0], &[2, 1]);
    let w = Param::new(Tensor::<f64>::ones(&[3, 2]));
    let (c, e, l) = in_f64(&a, &b, &w);
    assert_eq!((c.dtype(), e, l), (DType::F64, DType::F64, DType::F64));
    assert_eq!(c.to_vec(), vec![90_014.0]);
}

// ---- amp::nn modules ------------------------------------------------------------------------------

#[derive(Params)]
struct WithModules {
    fc1: Linear,
    mlp: Mlp,
}

impl WithModules {
    #[autocast(bf16)]
    fn in_bf16(&self, x: &Tensor<f32>, rng: &mut Rng) -> (DType, DType, Tensor<f32>) {
        let h = self.fc1.forward(x); // no turbofish: bf16
        let m = self.mlp.forward(x, rng); // bf16
        let explicit = self.fc1.forward::<f32, _>(x); // a turbofish is as written
        (h.dtype(), m.dtype(), explicit)
    }

    #[autocast(P)]
    fn generic<P: Precision>(&self, x: &Tensor<f32>) -> DType {
        self.fc1.forward(x).dtype()
    }
}

#[test]
fn nn_forward_follows_the_region() {
    let mut rng = Rng::seed(6);
    let m = WithModules { fc1: Linear::new(4, 4, true, &mut rng), mlp: Mlp::new(4, 8, 0.0, &mut rng) };
    let x = Tensor::<f32>::randn(&[2, 4], &mut rng);
    let (h, mm, explicit) = m.in_bf16(&x, &mut rng);
    assert_eq!((h, mm, explicit.dtype()), (DType::BF16, DType::BF16, DType::F32));
    assert_eq!(
        (m.generic::<f16>(&x), m.generic::<bf16>(&x), m.generic::<f32>(&x)),
        (DType::F16, DType::BF16, DType::F32)
    );
    // Outside autocast the explicit API is unchanged.
    assert_eq!(m.fc1.forward::<bf16, f32>(&x).dtype(), DType::BF16);
}

/// User types whose own `forward` must be found as written.
struct Inherent(f32);
impl Inherent {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.mul_scalar(f64::from(self.0))
    }
}

trait Layer {
    fn forward(&self, x: &Tensor<f32>) -> (usize, Tensor<f32>);
}
struct ByTrait;
impl Layer for ByTrait {
    fn forward(&self, x: &Tensor<f32>) -> (usize, Tensor<f32>) {
        (x.rank(), x.clone())
    }
}

struct Stateful {
    calls: usize,
}
impl Stateful {
    fn forward(&mut self, x: &Tensor<f32>) -> Tensor<f32> {
        self.calls += 1;
        x.clone()
    }
}

struct Consumed(Vec<f32>);
impl Consumed {
    fn forward(self, k: f32) -> Vec<f32> {
        self.0.into_iter().map(|v| v * k).collect()
    }
}

/// A user type generic over its output precision, like the nn modules: it follows the region.
struct GenericOut;
impl GenericOut {
    fn forward<L: Precision>(&self, x: &Tensor<f32>) -> Tensor<L> {
        x.cast::<L>()
    }
}

#[autocast(bf16)]
fn user_forwards(x: &Tensor<f32>, s: &mut Stateful) -> ([DType; 4], usize, Vec<f32>) {
    let a = Inherent(2.0).forward(x); // inherent, `&self`
    let (rank, b) = ByTrait.forward(x); // a trait's
    s.forward(x); // `&mut self`, through a `&mut` parameter
    let mut local = Stateful { calls: 0 };
    local.forward(x); // `&mut self`, on a `mut` local
    let c = s.forward(x);
    let v = Consumed(vec![1.0, 2.0]).forward(3.0); // `self`
    let g = GenericOut.forward(x); // its open precision follows the region
    ([a.dtype(), b.dtype(), c.dtype(), g.dtype()], rank + local.calls, v)
}

#[test]
fn user_types_keep_their_own_forward() {
    let x = Tensor::<f32>::ones(&[2, 2]);
    let mut s = Stateful { calls: 0 };
    let (dtypes, rank_plus_calls, v) = user_forwards(&x, &mut s);
    assert_eq!(dtypes, [DType::F32, DType::F32, DType::F32, DType::BF16]);
    assert_eq!((rank_plus_calls, s.calls), (3, 2));
    assert_eq!(v, vec![3.0, 6.0]);
}

// ---- the weight cast cache in a long loop -------------------------------------------------------

#[autocast]
fn step_loss(net: &Net, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
    // fc1.weight twice: one conversion, one hit.
    let h = x.linear(&net.fc1.weight, net.fc1.bias.as_ref()).gelu();
    let h2 = x.linear(&net.fc1.weight, net.fc1.bias.as_ref());
    h.add(&h2).linear(&net.fc2.weight, net.fc2.bias.as_ref()).cross_entropy(y)
}

/// A whole training loop inside one `#[autocast]` region: the forward is a nested region.
#[autocast]
fn train_inside_a_region(net: &mut Net, x: &Tensor<f32>, y: &Indices, steps: usize) -> usize {
    let params = net.named_params().len();
    let mut most = 0;
    for _ in 0..steps {
        let loss = step_loss(net, x, y);
        let grads = loss.backward();
        for (_, p) in net.named_params_mut() {
            let g = grads.get(p).unwrap().to_vec();
            for (w, g) in p.data_mut().iter_mut().zip(g) {
                *w -= 0.01 * g; // in place: copies on write while the cache shares the storage
            }
        }
        most = most.max(cache_entries());
        assert!(cache_entries() <= 2 * params, "{} cache entries for {params} parameters", cache_entries());
    }
    most
}

#[test]
fn the_cache_stays_bounded_in_a_long_loop() {
    let mut rng = Rng::seed(8);
    let mut net = Net::new(&mut rng);
    let (x, y) = batch(&mut rng);
    reset_cast_stats();
    let most = train_inside_a_region(&mut net, &x, &y, 1_000);
    assert!(most >= 1, "the cache was used");
    assert_eq!(cache_entries(), 0, "emptied when the outermost region exits");
    // Its benefit is kept: each forward converted fc1.weight once and used it twice.
    assert!(cast_stats().cache_hits >= 1_000, "{:?}", cast_stats());
}

// ---- a bare `#[autocast]` helper under another precision ------------------------------------------

#[autocast]
fn helper(x: &Tensor<f32>) -> Tensor<f32> {
    x.matmul(x)
}

#[autocast(f16)]
fn helper_f16(x: &Tensor<f32>) -> DType {
    x.matmul(x).dtype()
}

#[autocast(P)]
fn helper_generic<P: Precision>(x: &Tensor<f32>) -> DType {
    x.matmul(x).dtype()
}

#[autocast(bf16)]
fn bf16_caller(x: &Tensor<f32>) -> Tensor<f32> {
    helper(x)
}

#[autocast(bf16)]
fn bf16_caller_ok(x: &Tensor<f32>) -> (DType, DType) {
    (helper_f16(x), helper_generic::<bf16>(x))
}

#[test]
#[should_panic(
    expected = "`helper` is `#[autocast]` (f16) but was called from a bf16 autocast region: make it generic, \
                `#[autocast(P)] fn helper<P: Precision>(..)`, and call it as `helper::<P>(..)`, or give it \
                `#[autocast(bf16)]`"
)]
fn a_bare_helper_under_bf16_panics_with_the_fix() {
    bf16_caller(&Tensor::<f32>::ones(&[2, 2]));
}

#[test]
fn chosen_precisions_are_kept_under_another_region() {
    let x = Tensor::<f32>::ones(&[2, 2]);
    assert_eq!(bf16_caller_ok(&x), (DType::F16, DType::BF16));
    // A bare helper under an f16 region, or outside any, is fine.
    assert_eq!(helper(&x).dtype(), DType::F32);
}
