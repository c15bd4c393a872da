//! What `#[autocast]` rewrites, and what it leaves alone: forward functions of every shape
//! (free, methods, generic, `?`, closures, loops, nested blocks, calls to other `#[autocast]`
//! functions), user categories, regions switched off, declared return types, and code that
//! only shares a name with an op.

use std::ops::{Add, Mul};

use amp::prelude::*;
use amp::{Promote, Promoted, Tensor};

fn data(shape: &[usize], seed: u64) -> Tensor<f32> {
    Tensor::randn(shape, &mut Rng::seed(seed))
}

fn param(shape: &[usize], seed: u64) -> Param {
    Param::new(data(shape, seed))
}

// ---- code that only shares a name with an op ---------------------------------------------

#[derive(Debug, PartialEq)]
struct Counter(f32);

// A user type whose methods share names and argument counts with table ops.
impl Counter {
    fn softmax(&self, dim: usize) -> f32 {
        self.0 * dim as f32
    }
    fn sum(&self, dim: usize, keepdim: bool) -> f32 {
        self.0 + dim as f32 + f32::from(u8::from(keepdim))
    }
    fn matmul(&self, other: &Counter) -> Counter {
        Counter(self.0 * other.0)
    }
}

/// The same body with and without the attribute.
macro_rules! look_alikes {
    ($name:ident $(#[$attr:meta])?) => {
        $(#[$attr])?
        #[allow(clippy::all)]
        fn $name(v: &[f32], x: f32, n: usize) -> (Vec<f32>, usize, String, Counter) {
            let s: f32 = v.iter().sum(); // Iterator::sum: wrong argument count for the op
            let total = v.iter().copied().sum::<f32>(); // a turbofish: never an op
            let m = v.iter().copied().fold(f32::MIN, f32::max); // a path, not a call
            let e = x.exp(); // f32::exp: same name and argument count as the op
            let r = x.sqrt().powf(2.0) + x.log(2.0) + x.max(1.0); // f32 methods
            let y = 1.5f32;
            let a = x.add(y) + x.mul(y) + x.add(1.5); // std::ops traits by method name: promote candidates
            let f = |p, q| p * q + p; // untyped closure parameters
            let c = f(1.5f32, 2.0);
            let g = v.iter().fold(0.0, |acc, y| acc + y * 2.0);
            let idx = n * 2 + n / 2 - 1; // integer operators
            let words = String::from("a") + "b" + &format!("{}", x.exp());
            let z = vec![x.exp(); 2]; // macros are not entered
            let arr = [0u8; 2 * 3]; // a const context
            let k = Counter(x);
            let u = k.softmax(2) + k.sum(1, true) + Counter(2.0).sum(0, false); // user methods
            let w = k.matmul(&Counter(3.0)).matmul(&k);
            (vec![s, total, m, e, r, a, c, g, z[1], u, arr.len() as f32], idx, words, w)
        }
    };
}

look_alikes!(plain);
look_alikes!(rewritten #[autocast]);

#[test]
fn non_tensor_code_behaves_as_without_the_attribute() {
    let v = [1.0f32, -2.5, 4.0];
    assert_eq!(rewritten(&v, 0.75, 5), plain(&v, 0.75, 5));
}

#[autocast(bf16)]
fn generic_numbers<T: Copy + Add<Output = T> + Mul<Output = T>>(a: T, b: T) -> T {
    a * b + a
}

#[test]
fn generic_non_tensor_code_is_left_to_its_own_types() {
    assert_eq!(generic_numbers(3, 4), 15);
    assert_eq!(generic_numbers(0.5f32, 4.0), 2.5);
}

// ---- the rewrite ----------------------------------------------------------------------------

#[autocast]
fn mlp(x: &Tensor<f32>, w1: &Param, b1: &Param, w2: &Param) -> (DType, DType, DType, Tensor<f32>) {
    let h = x.matmul(w1); // f16 × f16
    let hb = h.add(b1); // f16 + f32 bias: promoted to f32
    let a = hb.relu(); // as its input
    let logits = a.matmul(&w2.t()); // back to f16
    (h.dtype(), hb.dtype(), logits.dtype(), logits.log_softmax(1)) // log_softmax in f32
}

#[test]
fn ops_run_in_their_category_precision() {
    let (x, w1, b1, w2) = (data(&[4, 6], 1), param(&[6, 8], 2), param(&[8], 3), param(&[5, 8], 4));
    let (h, hb, logits, out) = mlp(&x, &w1, &b1, &w2);
    assert_eq!((h, hb, logits, out.dtype()), (DType::F16, DType::F32, DType::F16, DType::F32));
}

#[autocast]
fn operators(a: &Tensor<f16>, b: &Tensor<f32>, c: Tensor<bf16>) -> (DType, DType, DType, DType) {
    let s = a + b; // f16 + f32: f32
    let d = &c * &c; // bf16 stays bf16
    let m = a - &c; // f16 and bf16 meet in f32
    let q = c / 2.0; // a scalar: the tensor's own precision
    (s.dtype(), d.dtype(), m.dtype(), q.dtype())
}

#[test]
fn operators_promote() {
    let a = data(&[2, 3], 1).cast::<f16>();
    let c = data(&[2, 3], 3).cast::<bf16>();
    assert_eq!(operators(&a, &data(&[2, 3], 2), c), (DType::F32, DType::BF16, DType::F32, DType::BF16));
}

#[autocast(bf16)]
fn declared_f32(x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
    x.matmul(w) // bf16 inside; the declared type asks for f32
}

#[autocast]
fn declared_in_wrappers(x: &Tensor<f32>, w: &Param, pick: u8) -> Option<(Tensor<f32>, Tensor<bf16>, usize)> {
    if pick == 0 {
        return None;
    }
    let h = x.matmul(w);
    match pick {
        1 => Some((h.clone(), h, 1)),
        _ => {
            let y = h.relu();
            Some((y.clone(), y, 2))
        }
    }
}

#[autocast]
fn declared_locals(x: &Tensor<f32>, empty: bool) -> Tensor<f32> {
    let h: Tensor<f32> = x.matmul(x); // an f16 product, as the annotation asks: f32
    let s: Tensor<bf16> = h.softmax(1); // f32 softmax, to the annotated bf16
    assert_eq!(s.dtype(), DType::BF16);
    if empty {
        return Tensor::zeros(&[0]); // a constructor takes its precision from the return type
    }
    h
}

#[test]
fn declared_return_types_are_honoured() {
    assert_eq!(declared_locals(&data(&[2, 2], 1), false).dtype(), DType::F32);
    assert_eq!(declared_locals(&data(&[2, 2], 1), true).shape(), &[0]);
    let (x, w) = (data(&[2, 3], 1), param(&[3, 4], 2));
    let y = declared_f32(&x, &w);
    assert_eq!(y.dtype(), DType::F32);
    let by_hand = x.cast::<bf16>().matmul(&w.cast::<bf16>()).cast::<f32>();
    assert_eq!(y.to_vec(), by_hand.to_vec());
    assert!(declared_in_wrappers(&x, &w, 0).is_none());
    let (a, b, n) = declared_in_wrappers(&x, &w, 1).unwrap();
    assert_eq!((a.dtype(), b.dtype(), n), (DType::F32, DType::BF16, 1));
    let (a, b, n) = declared_in_wrappers(&x, &w, 2).unwrap();
    assert_eq!((a.dtype(), b.dtype(), n), (DType::F32, DType::BF16, 2));
}

// Generic forwards: the bound `E: Precision` is enough for the casts to be found.
#[autocast]
fn generic_forward<E: Precision>(x: &Tensor<E>, w: &Param) -> Tensor<E> {
    let h = x.matmul(w); // f16 whatever E is
    assert_eq!(h.dtype(), DType::F16);
    h.softmax(1) // f32, then the declared Tensor<E>
}

// Promotion with a generic precision needs the bound that computes it.
#[autocast]
fn generic_promote<E: Precision + Promote<f32>>(x: &Tensor<E>, b: &Param) -> Tensor<Promoted<E, f32>> {
    x.add(b)
}

#[test]
fn generic_forwards() {
    let w = param(&[3, 4], 2);
    let x = data(&[2, 3], 1);
    assert_eq!(generic_forward(&x, &w).dtype(), DType::F32);
    assert_eq!(generic_forward(&x.cast::<bf16>(), &w).dtype(), DType::BF16);
    assert_eq!(generic_forward(&x.cast::<f16>(), &w).dtype(), DType::F16);
    let b = param(&[3], 3);
    assert_eq!(generic_promote(&x.cast::<f16>(), &b).dtype(), DType::F32);
}

struct Block {
    w: Param,
    u: Param,
}

impl Block {
    // A method, a `?` body, and a call to another `#[autocast]` function.
    #[autocast]
    fn forward(&self, x: &Tensor<f32>) -> amp::Result<Tensor<f32>> {
        let h = x.try_matmul(&self.w)?;
        assert_eq!(h.dtype(), DType::F16);
        let h = self.cell(&h);
        Ok(h.try_softmax(1)?)
    }

    #[autocast]
    fn cell(&self, h: &Tensor<f16>) -> Tensor<f16> {
        h.matmul(&self.u).tanh()
    }

    // Closures, loops and nested blocks.
    #[autocast]
    fn unrolled(&self, xs: &[Tensor<f32>]) -> Tensor<f32> {
        let step = |h: &Tensor<f16>, x: &Tensor<f32>| x.matmul(&self.w).add(&h.matmul(&self.u)).tanh();
        let mut h = Tensor::<f16>::zeros(&[xs[0].shape()[0], 4]);
        for x in xs {
            h = {
                let next = step(&h, x);
                assert_eq!(next.dtype(), DType::F16);
                next
            };
        }
        let mut i = 0;
        while i < 2 {
            h = h.matmul(&self.u);
            i += 1;
        }
        h
    }
}

#[test]
fn methods_question_marks_closures_and_loops() {
    let b = Block { w: param(&[3, 4], 1), u: param(&[4, 4], 2) };
    let y = b.forward(&data(&[2, 3], 3)).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let err = b.forward(&data(&[2, 5], 3)).unwrap_err();
    assert!(err.to_string().contains("matmul"), "{err}");
    let xs = [data(&[2, 3], 4), data(&[2, 3], 5)];
    assert_eq!(b.unrolled(&xs).dtype(), DType::F32);
}

#[autocast]
fn switched_off(x: &Tensor<f32>) -> [DType; 4] {
    let h = x.matmul(x); // f16
    autocast_off! {
        let e = h.exp(); // as written: stays f16
    }
    #[autocast(off)]
    let s = h.softmax(1); // as written
    #[autocast(off)]
    {
        let inner = h.exp(); // a block as written
        assert_eq!(inner.dtype(), DType::F16);
    }
    let on = h.exp(); // autocast again: f32
    let m = autocast_off!(x.matmul(x)); // f32 × f32
    [e.dtype(), s.dtype(), on.dtype(), m.dtype()]
}

#[test]
fn regions_switched_off() {
    assert_eq!(switched_off(&data(&[3, 3], 1)), [DType::F16, DType::F16, DType::F32, DType::F32]);
}

// ---- user categories -------------------------------------------------------------------------

/// Needs f32 input: fp32 = [..] provides it.
fn my_norm(x: &Tensor<f32>, eps: f64) -> Tensor<f32> {
    x.rms_norm(None, eps)
}

/// Needs f16 inputs: lower = [..] provides them.
fn my_proj(x: &Tensor<f16>, w: &Tensor<f16>) -> Tensor<f16> {
    x.matmul(w)
}

trait Rescale {
    fn rescale(&self, k: f64) -> Tensor<f32>;
}

impl Rescale for Tensor<f32> {
    fn rescale(&self, k: f64) -> Tensor<f32> {
        self.mul_scalar(k)
    }
}

struct Net {
    w: Param,
}

impl Net {
    fn helper(x: &Tensor<f32>) -> Tensor<f32> {
        x.square()
    }

    #[autocast(fp32 = [my_norm, rescale, Self::helper], lower = [my_proj], passthrough = [softmax])]
    fn forward(&self, x: &Tensor<f32>) -> (Tensor<f16>, Tensor<f32>) {
        let h = x.matmul(&self.w); // f16
        let n = my_norm(&h, 1e-5); // h cast to f32 for the user's fp32 function
        let r = n.rescale(0.5); // a method put in fp32
        let q = Self::helper(&h); // a path
        let p = my_proj(&r, &self.w.t()); // both cast to f16
        let s = p.softmax(1); // passthrough here: stays f16
        (s, q.add(&r))
    }
}

#[test]
fn user_functions_in_categories() {
    let net = Net { w: param(&[4, 4], 1) };
    let (s, q) = net.forward(&data(&[2, 4], 2));
    assert_eq!((s.dtype(), q.dtype()), (DType::F16, DType::F32));
}

// ---- the user's parentheses ----------------------------------------------------------------

/// Parenthesised receivers of every kind of rewritten call (lower precision, f32, promote, an
/// nn module's method): the rewrite hands them on without the user's parentheses, so the
/// user's crate sees no `unused_parens` warning (denied here).
#[deny(unused_parens)]
mod parenthesised {
    use super::*;
    use amp::nn::Linear;

    #[autocast(f16)]
    pub fn receivers(x: &Tensor<f32>, w: &Param, b: &Param, lin: &Linear) -> (DType, DType, DType, DType) {
        let low = (x.add(x)).matmul(w); // lower precision
        let sum = (&low * &low).sum_all(); // f32
        let promoted = (low.relu()).add(b); // promote
        let moved = ({ lin }).forward(&low); // a module: a block keeps its parentheses
        let via = (lin).forward(&low);
        (low.dtype(), sum.dtype(), promoted.dtype(), moved.add(&via).dtype())
    }
}

#[test]
fn parenthesised_receivers_are_rewritten_without_lint() {
    let (x, w, b) = (data(&[2, 3], 40), param(&[3, 4], 41), param(&[4], 42));
    let lin = amp::nn::Linear::new(4, 4, true, &mut Rng::seed(43));
    assert_eq!(parenthesised::receivers(&x, &w, &b, &lin), (DType::F16, DType::F32, DType::F32, DType::F16));
}

// ---- a table op called by its path ----------------------------------------------------------

#[autocast]
fn by_path(x: &Tensor<f32>, w: &Param) -> (DType, DType, Tensor<f32>, [DType; 2]) {
    let h = Tensor::matmul(x, w); // as `x.matmul(w)`: f16
    let p = Tensor::<f16>::softmax(&h, 1); // f32, as `h.softmax(1)`
    // Qualified-self paths, as `<Tensor<f32>>::matmul` reads in generic code: f16 too.
    let q = [<Tensor<f32>>::matmul(x, w).dtype(), <Tensor<f32, amp::Cpu>>::matmul(x, w).dtype()];
    (h.dtype(), p.dtype(), Tensor::log_softmax(&h, 1), q)
}

#[test]
fn a_table_op_called_by_its_path_is_rewritten_as_its_method_call() {
    let (x, w) = (data(&[4, 6], 1), param(&[6, 8], 2));
    let (h, p, out, qualified) = by_path(&x, &w);
    assert_eq!((h, p, out.dtype()), (DType::F16, DType::F32, DType::F32));
    assert_eq!(qualified, [DType::F16, DType::F16]);
    assert_eq!(out.to_vec(), x.cast::<f16>().matmul(&w.cast::<f16>()).log_softmax_f32(1).to_vec());
}

// ---- nested module calls on fields of `self` -------------------------------------------------

struct ConvBlock {
    conv: amp::nn::Conv2d,
    bn0: amp::nn::BatchNorm2d,
    bn1: amp::nn::BatchNorm2d,
}

impl ConvBlock {
    /// PyTorch's `self.bn1(self.bn0(self.conv(x)))`: each module's `forward` borrows its own
    /// field (batch norm mutably, for its running statistics) while its argument reads others.
    #[autocast]
    fn forward(&mut self, x: &Tensor<f32>) -> Tensor<f32> {
        self.bn1.forward(&self.bn0.forward(&self.conv.forward(x))).relu().cast::<f32>()
    }

    /// The same through the `try_` forms, errors passed on with `?`.
    #[autocast]
    fn try_forward(&mut self, x: &Tensor<f32>) -> amp::Result<Tensor<f32>> {
        Ok(self.bn1.try_forward(&self.bn0.try_forward(&self.conv.try_forward(x)?)?)?.relu().cast::<f32>())
    }
}

#[test]
fn nested_module_calls_on_disjoint_fields_borrow_each_field_mutably() {
    let mut rng = Rng::seed(50);
    let mut block = ConvBlock {
        conv: amp::nn::Conv2d::new(
            2,
            3,
            3,
            amp::Conv2dOptions { padding: (1, 1), ..Default::default() },
            true,
            &mut rng,
        ),
        bn0: amp::nn::BatchNorm2d::new(3),
        bn1: amp::nn::BatchNorm2d::new(3),
    };
    let x = data(&[2, 2, 5, 5], 51);
    let y = block.forward(&x);
    assert_eq!(y.shape(), &[2, 3, 5, 5]);
    // Both batch norms saw a batch in training mode: their running means moved off 0.
    for bn in [&block.bn0, &block.bn1] {
        assert!(bn.running_mean.to_vec().iter().any(|&m| m != 0.0));
    }
    // The `try_` forms: the same values and buffers from the same state; a wrong channel count
    // is an error out of the region, with the running statistics as they were.
    let mut twin = ConvBlock { conv: block.conv.clone(), bn0: block.bn0.clone(), bn1: block.bn1.clone() };
    let (a, b) = (block.forward(&x), twin.try_forward(&x).unwrap());
    assert_eq!((a.dtype(), a.to_vec()), (b.dtype(), b.to_vec()));
    assert_eq!(block.bn1.running_var.to_vec(), twin.bn1.running_var.to_vec());
    let before = twin.bn0.running_mean.to_vec();
    let err = twin.try_forward(&data(&[2, 4, 5, 5], 52)).unwrap_err();
    assert!(err.to_string().starts_with("conv2d: the weight's dim 1 must be the input channels per group"), "{err}");
    assert_eq!(twin.bn0.running_mean.to_vec(), before);
}

// ---- empty values in declared return positions ----------------------------------------------

#[autocast]
fn maybe(x: &Tensor<f32>, w: &Param, skip: bool) -> Option<Tensor<f32>> {
    if skip {
        return None;
    }
    let h = x.matmul(w);
    if h.shape()[0] == 0 { None } else { Some(h) }
}

#[autocast]
fn layers(x: &Tensor<f32>, w: &Param, n: usize) -> Vec<Tensor<f32>> {
    if n == 0 {
        return Vec::new();
    }
    if n == 1 {
        return vec![];
    }
    (0..n).map(|_| x.matmul(w).cast::<f32>()).collect()
}

#[test]
fn none_and_empty_vecs_return_from_autocast_functions() {
    let (x, w) = (data(&[2, 3], 60), param(&[3, 4], 61));
    assert!(maybe(&x, &w, true).is_none());
    assert_eq!(maybe(&x, &w, false).map(|t| t.dtype()), Some(DType::F32));
    assert!(layers(&x, &w, 0).is_empty() && layers(&x, &w, 1).is_empty());
    assert_eq!(layers(&x, &w, 2).len(), 2);
}
