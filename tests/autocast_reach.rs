//! How far `#[autocast]` reaches: a forward written once for any low type (`#[autocast(P)]`,
//! `#[autocast(f32)]`), f64 left alone, `amp::nn` modules' `forward` and `loss` without a
//! turbofish (`Block::forward` and `Gpt::loss` too, whose values do not show their precision),
//! user types' own `forward` through every kind of receiver, the weight cast cache bounded in a
//! long loop, and a bare `#[autocast]` helper called from a region of another precision.

use amp::__private::{cache_entries, cast_stats, reset_cast_stats};
use amp::nn::{Block, CausalSelfAttention, Dropout, Embedding, Gpt, GptConfig, LayerNorm, Linear, Mlp};
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
    /// A fallible form with its precision written: kept, as `forward`'s is.
    fn try_forward(&self, x: &Tensor<f32>) -> Result<Tensor<f32>, String> {
        Ok(self.forward(x))
    }
    /// A `try_forward` that returns no `Result`: whatever it returns, untouched.
    fn try_loss(&self, x: &Tensor<f32>) -> Option<f32> {
        Some(self.forward(x).sum(0, false).sum(0, false).item())
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
    let t = Inherent(2.0).try_forward(x).unwrap(); // a `Result` of f32: kept
    assert_eq!(Inherent(2.0).try_loss(x), Some(8.0));
    assert_eq!(t.dtype(), DType::F32);
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

/// A model of user modules, reached through `&mut self`.
struct Owner {
    state: Stateful,
    layers: Vec<Stateful>,
    dynamic: Box<dyn Layer>,
}

impl Owner {
    #[autocast(bf16)]
    fn run(&mut self, x: &Tensor<f32>) -> (usize, DType) {
        self.state.forward(x); // `&mut self`'s field: borrowed mutably
        for layer in self.layers.iter_mut() {
            layer.forward(x); // a `&mut Stateful` binding: reborrowed
            layer.forward(x);
        }
        let (rank, t) = self.dynamic.forward(x); // a trait object's method
        (rank, t.dtype())
    }
}

/// A user module taken through a generic parameter.
#[autocast(P)]
fn generic_layer<P: Precision, M: Layer>(m: &M, x: &Tensor<f32>) -> usize {
    m.forward(x).0
}

#[autocast(bf16)]
fn more_user_forwards(x: &Tensor<f32>, outer: &mut (Stateful, f32)) -> (Vec<f32>, usize) {
    let c = Consumed(vec![1.0, 2.0]);
    let v = { c }.forward(2.0); // `self` on a variable, moved by a block
    outer.0.forward(x); // a field under a `&mut` parameter: borrowed mutably
    let mut pair = (Stateful { calls: 0 }, 0);
    let (ref mut s, _) = pair;
    s.forward(x); // `ref mut`
    (v, pair.0.calls)
}

#[test]
fn user_forwards_through_more_receivers() {
    let x = Tensor::<f32>::ones(&[2, 2]);
    let mut owner = Owner {
        state: Stateful { calls: 0 },
        layers: vec![Stateful { calls: 0 }, Stateful { calls: 0 }],
        dynamic: Box::new(ByTrait),
    };
    assert_eq!(owner.run(&x), (2, DType::F32));
    assert_eq!((owner.state.calls, owner.layers[0].calls, owner.layers[1].calls), (1, 2, 2));
    assert_eq!(generic_layer::<f16, _>(&ByTrait, &x), 2);
    let mut outer = (Stateful { calls: 0 }, 1.0);
    assert_eq!(more_user_forwards(&x, &mut outer), (vec![2.0, 4.0], 1));
    assert_eq!(outer.0.calls, 1);
}

// ---- amp::nn modules whose precision shows in no argument and no value ----------------------

fn tiny() -> GptConfig {
    GptConfig { vocab_size: 11, block_size: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.1 }
}

fn token_ids(b: usize, t: usize, rng: &mut Rng) -> Indices {
    Indices::from_vec((0..b * t).map(|_| rng.below(11) as i64).collect(), &[b, t])
}

/// The bits of a tensor's values (f16 and bf16 widen to f32 exactly, so equal bits here are
/// equal bits there).
fn bits<E: Precision>(t: &Tensor<E>) -> Vec<u32> {
    t.to_f32_vec().into_iter().map(f32::to_bits).collect()
}

/// A model of `amp::nn` decoder blocks and a whole `Gpt`, held in every way a module is held.
struct Stack {
    blocks: Vec<Block>,
    boxed: Box<Block>,
    gpt: Gpt,
}

impl Stack {
    fn new(rng: &mut Rng) -> Self {
        let d = tiny().d_model;
        Stack {
            blocks: (0..2).map(|_| Block::new(d, 2, 0.1, rng)).collect(),
            boxed: Box::new(Block::new(d, 2, 0.1, rng)),
            gpt: Gpt::new(tiny(), rng),
        }
    }

    /// No turbofish anywhere: each module runs in `P`.
    #[autocast(P)]
    fn run<P: Precision>(&self, x: &Tensor<f32>, ids: &Indices, rng: &mut Rng) -> [Tensor<f32>; 3] {
        let mut h = self.blocks[0].forward(x, rng); // a place under `&self`
        for block in &self.blocks[1..] {
            h = block.forward(&h, rng); // a `&Block`
        }
        h = self.boxed.forward(&h, rng); // a `Box<Block>`
        h = self.blocks.last().unwrap().forward(&h, rng); // a temporary `&Block`
        let loss = self.gpt.loss(ids, ids, rng);
        let logits = self.gpt.forward(ids, rng); // `Tensor<P>`
        [h, loss, logits.cast::<f32>()]
    }

    /// The same with the precision written out (as written, under the region).
    #[autocast(P)]
    fn run_explicit<P: Precision>(&self, x: &Tensor<f32>, ids: &Indices, rng: &mut Rng) -> [Tensor<f32>; 3] {
        let mut h = self.blocks[0].forward::<P>(x, rng);
        for block in &self.blocks[1..] {
            h = block.forward::<P>(&h, rng);
        }
        h = self.boxed.forward::<P>(&h, rng);
        h = self.blocks.last().unwrap().forward::<P>(&h, rng);
        let loss = self.gpt.loss::<P>(ids, ids, rng);
        let logits = self.gpt.forward::<P>(ids, rng);
        [h, loss, logits.cast::<f32>()]
    }

    /// The same without autocast: plain f32.
    fn run_plain(&self, x: &Tensor<f32>, ids: &Indices, rng: &mut Rng) -> [Tensor<f32>; 3] {
        let mut h = self.blocks[0].forward::<f32>(x, rng);
        for block in &self.blocks[1..] {
            h = block.forward::<f32>(&h, rng);
        }
        h = self.boxed.forward::<f32>(&h, rng);
        h = self.blocks.last().unwrap().forward::<f32>(&h, rng);
        let loss = self.gpt.loss::<f32>(ids, ids, rng);
        let logits = self.gpt.forward::<f32>(ids, rng);
        [h, loss, logits]
    }

    /// Through `&mut self` (places under it are borrowed mutably) and the precision each
    /// value comes out in.
    #[autocast(P)]
    fn run_mut<P: Precision>(&mut self, x: &Tensor<f32>, ids: &Indices, rng: &mut Rng) -> (Tensor<f32>, DType) {
        let h = self.blocks[0].forward(x, rng);
        let h = self.boxed.forward(&h, rng);
        (h, self.gpt.forward(ids, rng).dtype())
    }
}

/// A `&mut Gpt` (reborrowed: used twice) and a `mut` local one.
#[autocast(P)]
fn gpt_receivers<P: Precision>(gpt: &mut Gpt, ids: &Indices, rng: &mut Rng) -> (Tensor<f32>, Tensor<f32>, DType) {
    let a = gpt.loss(ids, ids, rng);
    let logits = gpt.forward(ids, rng);
    let mut local = gpt.clone();
    let b = local.loss(ids, ids, rng);
    (a.add(&b), logits.cast::<f32>(), logits.dtype())
}

fn run_at<P: Precision>(stack: &Stack, x: &Tensor<f32>, ids: &Indices) -> ([Vec<u32>; 3], [Vec<u32>; 3]) {
    let implicit = stack.run::<P>(x, ids, &mut Rng::seed(9));
    let explicit = stack.run_explicit::<P>(x, ids, &mut Rng::seed(9));
    (implicit.each_ref().map(bits), explicit.each_ref().map(bits))
}

#[test]
fn block_forward_and_gpt_loss_follow_the_region_without_a_turbofish() {
    let mut rng = Rng::seed(10);
    let mut stack = Stack::new(&mut rng);
    let x = Tensor::<f32>::randn(&[2, 8, 16], &mut rng);
    let ids = token_ids(2, 8, &mut rng);
    // Each precision: bit for bit the call with `::<P>` written (dropout on: the same random
    // stream is drawn in the same order).
    let (i16, e16) = run_at::<f16>(&stack, &x, &ids);
    let (ib, eb) = run_at::<bf16>(&stack, &x, &ids);
    let (i32, e32) = run_at::<f32>(&stack, &x, &ids);
    assert_eq!(i16, e16);
    assert_eq!(ib, eb);
    assert_eq!(i32, e32);
    // At f32, bit for bit the model without autocast.
    let plain = stack.run_plain(&x, &ids, &mut Rng::seed(9));
    assert_eq!(i32, plain.each_ref().map(bits));
    // And the low precisions really ran: every value differs from f32's.
    for k in 0..3 {
        assert_ne!(i16[k], i32[k], "f16, value {k}");
        assert_ne!(ib[k], i32[k], "bf16, value {k}");
        assert_ne!(i16[k], ib[k], "f16 vs bf16, value {k}");
    }
    // `&mut self`, a `&mut Gpt` and a `mut` local: the same values.
    let (h, logits) = stack.run_mut::<bf16>(&x, &ids, &mut Rng::seed(9));
    let mut r = Rng::seed(9);
    let want = stack.boxed.forward::<bf16>(&stack.blocks[0].forward::<bf16>(&x, &mut r), &mut r);
    assert_eq!((bits(&h), logits), (bits(&want), DType::BF16));
    let gpt = &mut stack.gpt;
    let (sum, logits, dtype) = gpt_receivers::<f16>(gpt, &ids, &mut Rng::seed(9));
    let mut r = Rng::seed(9);
    let a = gpt.loss::<f16>(&ids, &ids, &mut r);
    let l = gpt.forward::<f16>(&ids, &mut r);
    let b = gpt.clone().loss::<f16>(&ids, &ids, &mut r);
    assert_eq!((bits(&sum), bits(&logits), dtype), (bits(&a.add(&b)), bits(&l), DType::F16));
}

/// Every `amp::nn` module's `forward` and `loss` inside a region, none with a turbofish.
struct AllModules {
    fc: Linear,
    ln: LayerNorm,
    emb: Embedding,
    drop: Dropout,
    mlp: Mlp,
    attn: CausalSelfAttention,
    block: Block,
    gpt: Gpt,
}

impl AllModules {
    #[autocast(P)]
    fn dtypes<P: Precision>(&self, x: &Tensor<f32>, ids: &Indices, rng: &mut Rng) -> [DType; 9] {
        let e = self.emb.forward(ids); // f32 (rows gathered as they are)
        let n = self.ln.forward(x); // f32 (an fp32 op)
        let d = self.drop.forward(&e, rng); // as its input
        let l = self.fc.forward(x);
        let m = self.mlp.forward(x, rng);
        let a = self.attn.forward(x, rng);
        let b = self.block.forward(x, rng); // f32 residual, computed in P
        let g = self.gpt.forward(ids, rng);
        let loss = self.gpt.loss(ids, ids, rng); // f32
        [e.dtype(), n.dtype(), d.dtype(), l.dtype(), m.dtype(), a.dtype(), b.dtype(), g.dtype(), loss.dtype()]
    }

    /// The same through the fallible forms, errors passed on with `?`.
    #[autocast(P)]
    fn try_dtypes<P: Precision>(&self, x: &Tensor<f32>, ids: &Indices, rng: &mut Rng) -> amp::Result<[DType; 9]> {
        let e = self.emb.try_forward(ids)?;
        let n = self.ln.try_forward(x)?;
        let d = self.drop.try_forward(&e, rng)?;
        let l = self.fc.try_forward(x)?;
        let m = self.mlp.try_forward(x, rng)?;
        let a = self.attn.try_forward(x, rng)?;
        let b = self.block.try_forward(x, rng)?;
        let g = self.gpt.try_forward(ids, rng)?;
        let loss = self.gpt.try_loss(ids, ids, rng)?;
        Ok([e.dtype(), n.dtype(), d.dtype(), l.dtype(), m.dtype(), a.dtype(), b.dtype(), g.dtype(), loss.dtype()])
    }

    /// A loss whose targets may not fit: the error comes out of the region as a value.
    #[autocast(P)]
    fn try_loss<P: Precision>(
        &self,
        x: &Tensor<f32>,
        ids: &Indices,
        targets: &Indices,
        rng: &mut Rng,
    ) -> amp::Result<(Tensor<f32>, DType)> {
        let twice = Twice(&self.fc).try_forward(x)?;
        Ok((self.gpt.try_loss(ids, targets, rng)?, twice.dtype()))
    }
}

/// A module of a user's own whose fallible forward leaves its precision to the caller.
struct Twice<'a>(&'a Linear);

impl Twice<'_> {
    fn try_forward<L: Precision>(&self, x: &Tensor<f32>) -> amp::Result<Tensor<L>> {
        self.0.try_forward::<L, L>(&self.0.try_forward::<L, f32>(x)?)
    }
}

#[test]
fn every_nn_method_runs_without_a_turbofish() {
    let mut rng = Rng::seed(11);
    let d = tiny().d_model;
    let m = AllModules {
        fc: Linear::new(d, d, true, &mut rng),
        ln: LayerNorm::new(d),
        emb: Embedding::new(11, d, 0.02, &mut rng),
        drop: Dropout::new(0.1),
        mlp: Mlp::new(d, 4 * d, 0.1, &mut rng),
        attn: CausalSelfAttention::new(d, 2, 0.1, &mut rng),
        block: Block::new(d, 2, 0.1, &mut rng),
        gpt: Gpt::new(tiny(), &mut rng),
    };
    let x = Tensor::<f32>::randn(&[2, 8, d], &mut rng);
    let ids = token_ids(2, 8, &mut rng);
    let f32s = [DType::F32; 3];
    for (low, got) in [
        (DType::F16, m.dtypes::<f16>(&x, &ids, &mut rng)),
        (DType::BF16, m.dtypes::<bf16>(&x, &ids, &mut rng)),
        (DType::F32, m.dtypes::<f32>(&x, &ids, &mut rng)),
    ] {
        assert_eq!(got[..3], f32s, "{low}");
        assert_eq!(got[3..], [low, low, low, DType::F32, low, DType::F32], "{low}");
    }
    // The `try_` forms: the same precisions; a bad input is an `Err` out of the region.
    assert_eq!(m.try_dtypes::<bf16>(&x, &ids, &mut rng).unwrap(), m.dtypes::<bf16>(&x, &ids, &mut rng));
    assert_eq!(m.try_dtypes::<f16>(&x, &ids, &mut rng).unwrap(), m.dtypes::<f16>(&x, &ids, &mut rng));
    let wide = Tensor::<f32>::randn(&[2, 8, d + 1], &mut rng);
    let err = m.try_dtypes::<bf16>(&wide, &ids, &mut rng).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "layer_norm_to: weight must have shape [{}] (the input's last dim) (shapes [[2, 8, {}], [{d}], [{d}]])",
            d + 1,
            d + 1
        )
    );
    // A user's `try_forward::<L>` runs in the region's type; the loss is bit for bit the
    // plain form's.
    let (loss, twice) = m.try_loss::<bf16>(&x, &ids, &ids, &mut Rng::seed(1)).unwrap();
    assert_eq!(twice, DType::BF16);
    assert_eq!(bits(&loss), bits(&m.gpt.loss::<bf16>(&ids, &ids, &mut Rng::seed(1))));
    let flat = ids.reshape(&[16, 1]);
    assert_eq!(
        m.try_loss::<bf16>(&x, &ids, &flat, &mut Rng::seed(1)).unwrap_err().to_string(),
        "Gpt::loss: targets must have the shape of the token ids [B, T] (shapes [[2, 8], [16, 1]])"
    );
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
