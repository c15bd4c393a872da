//! Every op at f32, f16 and bf16 against an f64 reference, with per-precision tolerances.
//!
//! Each check rounds random inputs into the precision under test, runs the op there, and runs
//! the same op in f64 on the same (already rounded) values, so the difference is the op's own
//! error. The tolerance is counted in unit roundoffs of the precision (see `ONCE`, `TWICE`...):
//! an op that computes in f32 and rounds once must be within one unit roundoff of every
//! element, so an f16/bf16 intermediate or accumulator inside a kernel shows up as a failure.
//! One generic body per op family runs at each precision (`for_each_precision!`).
//!
//! Then the properties mixed precision depends on: f16/bf16 reductions and matmul accumulate
//! in f32 (a naive f16 sum of 4096 ones sticks at 2048), overflow gives inf rather than a
//! clamp, and NaN propagates.

use crate::common;
use amp_core::{CrossEntropyOptions, DType, Indices, Mask, Precision, Rng, Tensor, bf16, f16};
use common::{assert_close_ulps, randn};

/// Runs `$body` (an expression over the input slice `$t`) at `$E` and in f64 on the same
/// rounded inputs and compares the outputs within `$tol` (relative, absolute) unit roundoffs.
macro_rules! check {
    ($E:ty, $name:expr, $tol:expr, [$($input:expr),* $(,)?], |$t:ident| $body:expr) => {{
        let inputs: Vec<Tensor<f64>> = vec![$($input),*];
        let low: Vec<Tensor<$E>> = inputs.iter().map(|x| x.cast::<$E>()).collect();
        let exact: Vec<Tensor<f64>> = low.iter().map(|x| x.cast::<f64>()).collect();
        let got = {
            let $t: &[Tensor<$E>] = &low;
            $body
        };
        let want = {
            let $t: &[Tensor<f64>] = &exact;
            $body
        };
        assert_close_ulps(&got, &want, $tol, $name);
    }};
}

/// Like `check!` for the gradients of every input of `sum($body * w)` (fixed random `w`,
/// rounded into `$E`, so the op's backward is seeded with exactly the same values).
macro_rules! check_grad {
    ($E:ty, $name:expr, $tol:expr, [$($input:expr),* $(,)?], |$t:ident| $body:expr) => {{
        let inputs: Vec<Tensor<f64>> = vec![$($input),*];
        let low: Vec<Tensor<$E>> = inputs.iter().map(|x| x.cast::<$E>().requires_grad_()).collect();
        let exact: Vec<Tensor<f64>> = low.iter().map(|x| x.detach().cast::<f64>().requires_grad_()).collect();
        let out_low = {
            let $t: &[Tensor<$E>] = &low;
            $body
        };
        let out_exact = {
            let $t: &[Tensor<f64>] = &exact;
            $body
        };
        let w = randn(out_low.shape(), 999).cast::<$E>();
        let g_low = out_low.mul(&w).sum_all().backward();
        let g_exact = out_exact.mul(&w.cast::<f64>()).sum_all().backward();
        for (i, (l, e)) in low.iter().zip(&exact).enumerate() {
            match (g_low.get(l), g_exact.get(e)) {
                (Some(gl), Some(ge)) => assert_close_ulps(gl, ge, $tol, &format!("{} d/d(input {i})", $name)),
                (None, None) => {}
                _ => panic!("{}: input {i} has a gradient in one precision only", $name),
            }
        }
    }};
}

/// Computed in f32 (or exactly) and rounded once: within one unit roundoff of every element.
const ONCE: (f64, f64) = (1.0, 0.0);
/// Two roundings in a row (two ops, or a gradient rounded and then summed back over a
/// broadcast dim by a second reduction).
const TWICE: (f64, f64) = (2.0, 0.0);
/// Computed from a rounded intermediate (a rounded output `y` in `1 - y²`, rounded products
/// then summed) where cancellation makes that rounding an error relative to the largest value
/// rather than to each element.
const FROM_ROUNDED: (f64, f64) = (2.0, 2.0);
/// Data movement, or a selection of existing values: bit-exact.
const EXACT: (f64, f64) = (0.0, 0.0);

/// Positive values away from 0 (for log, sqrt, powf, division).
fn pos(shape: &[usize], seed: u64) -> Tensor<f64> {
    randn(shape, seed).square().add_scalar(0.25)
}

/// Uniform values in [0, 1) (sums without cancellation).
fn unif(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::rand(shape, &mut Rng::seed(seed))
}

// ---- elementwise ---------------------------------------------------------------------------

fn elementwise<E: Precision>() {
    let (a, b, c) = (randn(&[4, 37], 1), randn(&[37], 2), pos(&[4, 1], 3));
    check!(E, "add", ONCE, [a.clone(), b.clone()], |t| t[0].add(&t[1]));
    check!(E, "sub", ONCE, [a.clone(), b.clone()], |t| t[0].sub(&t[1]));
    check!(E, "mul", ONCE, [a.clone(), b.clone()], |t| t[0].mul(&t[1]));
    check!(E, "div", ONCE, [a.clone(), c.clone()], |t| t[0].div(&t[1]));
    check!(E, "operators", TWICE, [a.clone(), b.clone()], |t| &(&t[0] + &t[1]) * 3.0);
    check!(E, "scalar operators", TWICE, [a.clone()], |t| (&t[0] - 1.5) / 4.0);
    check!(E, "add_scalar", ONCE, [a.clone()], |t| t[0].add_scalar(0.3));
    check!(E, "sub_scalar", ONCE, [a.clone()], |t| t[0].sub_scalar(0.3));
    check!(E, "mul_scalar", ONCE, [a.clone()], |t| t[0].mul_scalar(0.3));
    check!(E, "div_scalar", ONCE, [a.clone()], |t| t[0].div_scalar(0.3));
    check!(E, "rdiv_scalar", ONCE, [c.clone()], |t| t[0].rdiv_scalar(3.0));
    check!(E, "neg", EXACT, [a.clone()], |t| -&t[0]);
    check!(E, "square", ONCE, [a.clone()], |t| t[0].square());
    check!(E, "relu", EXACT, [a.clone()], |t| t[0].relu());
    check!(E, "gelu", ONCE, [a.clone()], |t| t[0].gelu());
    check!(E, "gelu_tanh", ONCE, [a.clone()], |t| t[0].gelu_tanh());
    check!(E, "tanh", ONCE, [a.clone()], |t| t[0].tanh());
    check!(E, "sigmoid", ONCE, [a.clone()], |t| t[0].sigmoid());
    check!(E, "silu", ONCE, [a.clone()], |t| t[0].silu());
    check!(E, "exp", ONCE, [a.clone()], |t| t[0].exp());
    let p = pos(&[4, 37], 4);
    check!(E, "log", ONCE, [p.clone()], |t| t[0].log());
    check!(E, "sqrt", ONCE, [p.clone()], |t| t[0].sqrt());
    check!(E, "powf", ONCE, [p.clone()], |t| t[0].powf(1.7));
    check!(E, "powf 2 (x * x)", ONCE, [a.clone()], |t| t[0].powf(2.0));
    // Large enough to run on the parallel path.
    check!(E, "add (parallel)", ONCE, [randn(&[300, 300], 5), randn(&[300, 1], 6)], |t| t[0].add(&t[1]));
    check!(E, "gelu (parallel)", ONCE, [randn(&[300, 300], 7)], |t| t[0].gelu());
}

fn elementwise_grads<E: Precision>() {
    let (a, b, c) = (randn(&[4, 37], 11), randn(&[37], 12), pos(&[4, 1], 13));
    // The broadcast operand's gradient is a sum over the broadcast dim (f32 accumulation).
    check_grad!(E, "add", ONCE, [a.clone(), b.clone()], |t| t[0].add(&t[1]));
    check_grad!(E, "sub", ONCE, [a.clone(), b.clone()], |t| t[0].sub(&t[1]));
    check_grad!(E, "mul", FROM_ROUNDED, [a.clone(), b.clone()], |t| t[0].mul(&t[1]));
    // -y/b is computed from the rounded output y: one rounding more.
    check_grad!(E, "div", FROM_ROUNDED, [a.clone(), c.clone()], |t| t[0].div(&t[1]));
    check_grad!(E, "relu", EXACT, [a.clone()], |t| t[0].relu());
    check_grad!(E, "gelu", ONCE, [a.clone()], |t| t[0].gelu());
    check_grad!(E, "gelu_tanh", ONCE, [a.clone()], |t| t[0].gelu_tanh());
    check_grad!(E, "silu", ONCE, [a.clone()], |t| t[0].silu());
    // These derivatives are functions of the rounded output y (1 - y², y(1 - y), y).
    check_grad!(E, "tanh", FROM_ROUNDED, [a.clone()], |t| t[0].tanh());
    check_grad!(E, "sigmoid", FROM_ROUNDED, [a.clone()], |t| t[0].sigmoid());
    check_grad!(E, "exp", FROM_ROUNDED, [a.clone()], |t| t[0].exp());
    let p = pos(&[4, 37], 14);
    check_grad!(E, "log", ONCE, [p.clone()], |t| t[0].log());
    check_grad!(E, "sqrt", FROM_ROUNDED, [p.clone()], |t| t[0].sqrt());
    check_grad!(E, "powf", ONCE, [p.clone()], |t| t[0].powf(1.7));
    check_grad!(E, "powf 2 (x * x)", ONCE, [a.clone()], |t| t[0].powf(2.0));
}

#[test]
fn elementwise_ops_match_f64() {
    for_each_precision!(elementwise);
    for_each_precision!(elementwise_grads);
}

// ---- matmul --------------------------------------------------------------------------------

fn matmuls<E: Precision>() {
    // f32 accumulation inside, one rounding: 2 unit roundoffs of the largest output.
    check!(E, "matmul 2-D", ONCE, [randn(&[5, 37], 20), randn(&[37, 6], 21)], |t| t[0].matmul(&t[1]));
    check!(E, "matmul batched", ONCE, [randn(&[2, 1, 4, 9], 22), randn(&[3, 9, 5], 23)], |t| t[0].matmul(&t[1]));
    check!(E, "matmul transposed", ONCE, [randn(&[9, 4], 24), randn(&[5, 9], 25)], |t| t[0].t().matmul(&t[1].t()));
    check!(E, "matmul vector", ONCE, [randn(&[9], 26), randn(&[9, 3], 27)], |t| t[0].matmul(&t[1]));
    check!(E, "matmul large k", ONCE, [unif(&[3, 4096], 28), unif(&[4096, 2], 29)], |t| t[0].matmul(&t[1]));
    check!(E, "matmul 128^3", ONCE, [randn(&[128, 128], 30), randn(&[128, 128], 31)], |t| t[0].matmul(&t[1]));
    check_grad!(E, "matmul", ONCE, [randn(&[5, 37], 32), randn(&[37, 6], 33)], |t| t[0].matmul(&t[1]));
    check_grad!(E, "matmul broadcast batch", FROM_ROUNDED, [randn(&[2, 4, 9], 34), randn(&[9, 5], 35)], |t| t[0]
        .matmul(&t[1]));
}

#[test]
fn matmul_matches_f64() {
    for_each_precision!(matmuls);
}

// ---- reductions ----------------------------------------------------------------------------

fn reductions<E: Precision>() {
    let x = randn(&[3, 5, 7], 40);
    for d in 0..3 {
        for keep in [false, true] {
            check!(E, "sum", ONCE, [x.clone()], |t| t[0].sum(d, keep));
            check!(E, "mean", ONCE, [x.clone()], |t| t[0].mean(d, keep));
            check!(E, "max", EXACT, [x.clone()], |t| t[0].max(d, keep));
            check!(E, "min", EXACT, [x.clone()], |t| t[0].min(d, keep));
            let low = x.cast::<E>();
            assert_eq!(low.argmax(d, keep), low.cast::<f64>().argmax(d, keep), "argmax ({})", E::DTYPE);
            assert_eq!(low.argmin(d, keep), low.cast::<f64>().argmin(d, keep), "argmin ({})", E::DTYPE);
            check_grad!(E, "sum", EXACT, [x.clone()], |t| t[0].sum(d, keep));
            check_grad!(E, "mean", ONCE, [x.clone()], |t| t[0].mean(d, keep));
            check_grad!(E, "max", EXACT, [x.clone()], |t| t[0].max(d, keep));
            check_grad!(E, "min", EXACT, [x.clone()], |t| t[0].min(d, keep));
        }
    }
    check!(E, "sum_all", ONCE, [unif(&[5000], 41)], |t| t[0].sum_all());
    check!(E, "mean_all", ONCE, [unif(&[5000], 42)], |t| t[0].mean_all());
    // Long rows and the parallel path, without cancellation so the reference is well scaled.
    check!(E, "sum rows (parallel)", ONCE, [unif(&[64, 1100], 43)], |t| t[0].sum(1, false));
    check!(E, "sum cols (parallel)", ONCE, [unif(&[1100, 64], 44)], |t| t[0].sum(0, false));
}

#[test]
fn reductions_match_f64() {
    for_each_precision!(reductions);
}

// ---- views and casts (exact) ----------------------------------------------------------------

fn views_and_casts<E: Precision>() {
    let x = randn(&[2, 3, 4], 50);
    check!(E, "reshape", EXACT, [x.clone()], |t| t[0].reshape(&[6, 4]));
    check!(E, "flatten", EXACT, [x.clone()], |t| t[0].flatten());
    check!(E, "permute", EXACT, [x.clone()], |t| t[0].permute(&[2, 0, 1]).contiguous());
    check!(E, "transpose", EXACT, [x.clone()], |t| t[0].transpose(0, 2));
    check!(E, "t", EXACT, [x.clone()], |t| t[0].t());
    check!(E, "narrow", EXACT, [x.clone()], |t| t[0].narrow(2, 1, 2));
    check!(E, "slice", EXACT, [x.clone()], |t| t[0].slice(1, 1..3));
    check!(E, "unsqueeze/squeeze", EXACT, [x.clone()], |t| t[0].unsqueeze(1).squeeze(1));
    check!(E, "broadcast_to", EXACT, [randn(&[3, 1], 51)], |t| t[0].broadcast_to(&[2, 3, 4]));
    check_grad!(E, "broadcast_to", FROM_ROUNDED, [randn(&[3, 1], 52)], |t| t[0].broadcast_to(&[2, 3, 4]));
    check_grad!(E, "permute", EXACT, [x.clone()], |t| t[0].permute(&[1, 2, 0]));
    check_grad!(E, "narrow", EXACT, [x.clone()], |t| t[0].narrow(1, 1, 2));
    // Casts round once: to f32 and f64 exactly, and between f16 and bf16 as one rounding of
    // the exact value.
    let low = x.cast::<E>();
    assert_eq!(low.cast::<f32>().to_f64_vec(), low.to_f64_vec());
    let once = |v: f64| bf16::from_f64(v).to_f64();
    let via: Vec<f64> = low.cast::<bf16>().to_f64_vec();
    assert_eq!(via, low.to_f64_vec().into_iter().map(once).collect::<Vec<_>>(), "cast to bf16 ({})", E::DTYPE);
    let once = |v: f64| f16::from_f64(v).to_f64();
    let via: Vec<f64> = low.cast::<f16>().to_f64_vec();
    assert_eq!(via, low.to_f64_vec().into_iter().map(once).collect::<Vec<_>>(), "cast to f16 ({})", E::DTYPE);
    check_grad!(E, "cast", EXACT, [x.clone()], |t| through_f32(&t[0]));
}

/// A round trip through f32 (exact for every precision but f64), doubled on the way.
fn through_f32<E: Precision>(t: &Tensor<E>) -> Tensor<E> {
    t.cast::<f32>().mul_scalar(2.0).cast::<E>()
}

#[test]
fn views_and_casts_are_exact() {
    for_each_precision!(views_and_casts);
}

// ---- softmax, norms, losses ------------------------------------------------------------------

fn softmax_family<E: Precision>() {
    let x = randn(&[4, 37], 60).mul_scalar(3.0);
    let y = randn(&[3, 4, 5], 61);
    check!(E, "softmax", ONCE, [x.clone()], |t| t[0].softmax(1));
    check!(E, "log_softmax", ONCE, [x.clone()], |t| t[0].log_softmax(1));
    for d in 0..3 {
        check!(E, "softmax dim", ONCE, [y.clone()], |t| t[0].softmax(d));
        check!(E, "log_softmax dim", ONCE, [y.clone()], |t| t[0].log_softmax(d));
    }
    check!(E, "softmax (parallel)", ONCE, [randn(&[70, 1100], 62)], |t| t[0].softmax(1));
    check!(E, "softmax of large logits", ONCE, [randn(&[4, 37], 63).add_scalar(1e4)], |t| t[0].softmax(1));
    // Backward reads the rounded output y: a couple of roundings more than forward.
    check_grad!(E, "softmax", FROM_ROUNDED, [x.clone()], |t| t[0].softmax(1));
    check_grad!(E, "log_softmax", FROM_ROUNDED, [x.clone()], |t| t[0].log_softmax(1));
    check_grad!(E, "softmax dim 0", FROM_ROUNDED, [y.clone()], |t| t[0].softmax(0));
}

/// `softmax_f32` (PyTorch's `softmax(x, dim, dtype=torch.float32)`) gives the bits of
/// `cast::<f32>()` then the f32 softmax, and its gradient the bits of that composition's
/// gradient (the f32 gradient rounded once into `E`): on the last dim and another, log and
/// not, 0-dim, and rows enough to run in parallel; at every precision, f64 included.
fn softmax_f32_is_the_cast_then_the_softmax<E: Precision>() {
    let cases: Vec<(Tensor<f64>, usize)> =
        vec![(randn(&[4, 37], 64).mul_scalar(3.0), 1), (randn(&[3, 4, 5], 65), 0), (randn(&[70, 1100], 66), 1)];
    for (x, dim) in cases {
        for log in [false, true] {
            let x = x.cast::<E>().requires_grad_();
            let fused = if log { x.log_softmax_f32(dim) } else { x.softmax_f32(dim) };
            let composed = if log { x.cast::<f32>().log_softmax(dim) } else { x.cast::<f32>().softmax(dim) };
            let name = format!("{} {}softmax_f32 {:?} dim {dim}", E::DTYPE, if log { "log_" } else { "" }, x.shape());
            assert_eq!(fused.to_vec(), composed.to_vec(), "{name}");
            let w = randn(x.shape(), 67).cast::<f32>();
            let (gf, gc) = (fused.mul(&w).sum_all().backward(), composed.mul(&w).sum_all().backward());
            assert_eq!(gf.get(&x).unwrap().to_vec(), gc.get(&x).unwrap().to_vec(), "{name}: gradient");
        }
    }
    let scalar = Tensor::<f64>::from_vec(vec![2.5], &[]).cast::<E>();
    assert_eq!(scalar.softmax_f32(0).to_vec(), vec![1.0]);
    assert!(scalar.try_softmax_f32(1).is_err(), "dim 1 of a 0-dim tensor");
}

#[test]
fn softmax_f32_matches_cast_then_softmax_bit_for_bit() {
    for_each_precision!(softmax_f32_is_the_cast_then_the_softmax);
    softmax_f32_is_the_cast_then_the_softmax::<f64>();
}

/// Values as f64 bits, every NaN as one bit pattern (NaN != NaN would fail an equality).
fn bits<E: Precision>(t: &Tensor<E>) -> Vec<u64> {
    t.to_f64_vec().into_iter().map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() }).collect()
}

/// Asserts two tensors hold the same bits (NaN as NaN), naming the first value that differs.
fn assert_same_bits<E: Precision>(a: &Tensor<E>, b: &Tensor<E>, what: &str) {
    let (a, b) = (bits(a), bits(b));
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    assert!(a.len() == b.len() && first.is_none(), "{what}: value {first:?} differs");
}

/// `scaled_masked_softmax` gives the bits of the chain it fuses (`mul_scalar`, `masked_fill`
/// with -inf, `softmax_f32`, the cast back), values and gradients: a causal mask over rows
/// enough to run in parallel, a key-padding mask broadcast over the leading dims, a mask
/// hiding whole rows (NaN, as the chain gives), a strided input, a negative scale (the
/// masked gradients' zeros take its sign) and a large one (probabilities that underflow to
/// subnormals and zero); at every precision, f64 included.
fn scaled_masked_softmax_is_the_chain<E: Precision>() {
    let pad = Mask::from_vec((0..37).map(|i| i % 5 == 3).collect(), &[1, 37]);
    let rows = Mask::from_vec(vec![false, true, false, false], &[4, 1]);
    let cases: Vec<(Tensor<f64>, f64, Mask)> = vec![
        (randn(&[3, 2, 130, 130], 120), 0.125, Mask::causal(130)),
        // A negative scale over masked tails the kernels skip: their gradient is the chain's
        // `0 * scale`, -0.
        (randn(&[2, 3, 40, 40], 127), -0.3, Mask::causal(40)),
        (randn(&[2, 4, 37], 121).mul_scalar(4.0), -0.7, pad),
        (randn(&[2, 4, 37], 122), 1.0, rows),
        (
            randn(&[2, 37, 4], 123).transpose(1, 2),
            30.0,
            Mask::from_vec((0..4 * 37).map(|i| i % 37 > i / 37).collect(), &[4, 37]),
        ),
    ];
    for (x, scale, mask) in cases {
        let x = x.cast::<E>().requires_grad_();
        let fused = x.scaled_masked_softmax(scale, &mask);
        let chain = x.mul_scalar(scale).masked_fill(&mask, f64::NEG_INFINITY).softmax_f32(x.rank() - 1).cast::<E>();
        let name = format!("{} scaled_masked_softmax {:?} scale {scale}", E::DTYPE, x.shape());
        assert_same_bits(&fused, &chain, &name);
        let w = randn(x.shape(), 124).cast::<E>();
        let (gf, gc) = (fused.mul(&w).sum_all().backward(), chain.mul(&w).sum_all().backward());
        assert_same_bits(gf.get(&x).unwrap(), gc.get(&x).unwrap(), &format!("{name}: gradient"));
    }
    // Rows whose masked tail the kernels skip, with infinities: in row 0 an infinite gradient
    // on a masked probability (the chain's softmax backward multiplies it by the probability's
    // 0: NaN for the row), in row 1 an infinite score (NaN probabilities, masked ones too).
    let mut xv = randn(&[2, 40], 126).to_f64_vec();
    xv[40] = f64::INFINITY; // row 1, unmasked
    let x = Tensor::<f64>::from_vec(xv, &[2, 40]).cast::<E>().requires_grad_();
    let mut w = vec![1.0; 80];
    w[35] = f64::INFINITY; // row 0, masked
    let w = Tensor::<f64>::from_vec(w, &[2, 40]).cast::<E>();
    let mask = Mask::from_vec(Mask::causal(40).to_vec()[..80].to_vec(), &[2, 40]); // its first 2 rows
    let fused = x.scaled_masked_softmax(0.5, &mask);
    let chain = x.mul_scalar(0.5).masked_fill(&mask, f64::NEG_INFINITY).softmax_f32(1).cast::<E>();
    assert_same_bits(&fused, &chain, &format!("{}: an infinite score", E::DTYPE));
    assert!(chain.to_f64_vec()[79].is_nan(), "the chain's row 1 is NaN, masked values too");
    let (gf, gc) = (fused.mul(&w).sum_all().backward(), chain.mul(&w).sum_all().backward());
    let (gf, gc) = (gf.get(&x).unwrap(), gc.get(&x).unwrap());
    assert_same_bits(gf, gc, &format!("{}: an infinite gradient where masked", E::DTYPE));
    assert!(gc.to_f64_vec()[0].is_nan(), "the chain's row 0 gradient is NaN");

    for shape in [[2, 0], [0, 3]] {
        let x = Tensor::<f64>::zeros(&shape).cast::<E>().requires_grad_();
        let y = x.scaled_masked_softmax(0.5, &Mask::full(&shape, false));
        assert_eq!(y.shape(), shape, "empty scores");
        assert_eq!(y.sum_all().backward().get(&x).unwrap().shape(), shape, "empty scores' gradient");
    }
    let x = randn(&[2, 3], 125).cast::<E>();
    assert!(x.try_scaled_masked_softmax(1.0, &Mask::causal(2)).is_err(), "a [2, 2] mask over [2, 3] scores");
    assert!(x.try_scaled_masked_softmax(1.0, &Mask::full(&[4, 2, 3], false)).is_err(), "a mask wider than the scores");
    assert!(
        x.reshape(&[6]).narrow(0, 0, 1).reshape(&[]).try_scaled_masked_softmax(1.0, &Mask::full(&[], false)).is_err()
    );
}

#[test]
fn scaled_masked_softmax_matches_its_chain_bit_for_bit() {
    for_each_precision!(scaled_masked_softmax_is_the_chain);
    scaled_masked_softmax_is_the_chain::<f64>();
}

/// `layer_norm_to::<O>` gives the bits of `layer_norm` then `cast::<O>()`, values and the
/// gradients of the input, weight and bias: with and without the affine parameters, rows
/// enough to run in parallel, and for input/output pairs the CPU fuses (f32 to f16 and bf16)
/// and those it runs as the norm and a cast.
fn layer_norm_to_is_the_norm_then_the_cast<E: Precision, O: Precision>() {
    for (shape, seed) in [([6, 37], 130), ([80, 1000], 131)] {
        let d = shape[1];
        let x = randn(&shape, seed).mul_scalar(2.0).add_scalar(1.0).cast::<E>().requires_grad_();
        let (w, b) =
            (randn(&[d], seed + 1).cast::<E>().requires_grad_(), randn(&[d], seed + 2).cast::<E>().requires_grad_());
        for affine in [true, false] {
            let (wo, bo) = if affine { (Some(&w), Some(&b)) } else { (None, None) };
            let fused: Tensor<O> = x.layer_norm_to(wo, bo, 1e-5);
            let chain = x.layer_norm(wo, bo, 1e-5).cast::<O>();
            let name = format!("layer_norm_to {} -> {} {shape:?} affine {affine}", E::DTYPE, O::DTYPE);
            assert_same_bits(&fused, &chain, &name);
            let g = randn(&shape, seed + 3).cast::<O>();
            let (gf, gc) = (fused.mul(&g).sum_all().backward(), chain.mul(&g).sum_all().backward());
            let leaves = if affine { vec![&x, &w, &b] } else { vec![&x] };
            for (i, leaf) in leaves.into_iter().enumerate() {
                assert_same_bits(gf.get(leaf).unwrap(), gc.get(leaf).unwrap(), &format!("{name}: gradient {i}"));
            }
            // A residual stream, `x + f(norm(x))`: the skip connection's gradient reaches `x`
            // first and the norm's backward adds into it. Once with that gradient's buffer
            // owned alone, once shared (`x` added twice: one buffer for both contributions).
            for twice in [false, true] {
                let skip = if twice { x.add(&x) } else { x.clone() };
                let fused = skip.add_cast(&x.layer_norm_to::<O>(wo, bo, 1e-5).mul(&g));
                let chain = skip.add(&x.layer_norm(wo, bo, 1e-5).cast::<O>().mul(&g).cast::<E>());
                assert_same_bits(&fused, &chain, &format!("{name} residual {twice}"));
                let h = randn(&shape, seed + 4).cast::<E>();
                let (gf, gc) = (fused.mul(&h).sum_all().backward(), chain.mul(&h).sum_all().backward());
                let leaves = if affine { vec![&x, &w, &b] } else { vec![&x] };
                for (i, leaf) in leaves.into_iter().enumerate() {
                    let what = format!("{name} residual {twice}: gradient {i}");
                    assert_same_bits(gf.get(leaf).unwrap(), gc.get(leaf).unwrap(), &what);
                }
            }
        }
    }
}

#[test]
fn layer_norm_to_matches_the_norm_then_the_cast_bit_for_bit() {
    layer_norm_to_is_the_norm_then_the_cast::<f32, bf16>();
    layer_norm_to_is_the_norm_then_the_cast::<f32, f16>();
    layer_norm_to_is_the_norm_then_the_cast::<f32, f32>();
    layer_norm_to_is_the_norm_then_the_cast::<f16, f32>();
    layer_norm_to_is_the_norm_then_the_cast::<f64, bf16>();
    let x = randn(&[2, 3], 132).cast::<f32>();
    assert!(x.try_layer_norm_to::<bf16>(Some(&randn(&[2], 133).cast::<f32>()), None, 1e-5).is_err(), "weight shape");
    // A 1-D input that is also the norm's weight: its gradient gets the skip's, the norm's
    // input gradient (added in the kernel) and the weight's (added by the engine after).
    let x = randn(&[37], 134).cast::<f32>().requires_grad_();
    let fused = x.add_cast(&x.layer_norm_to::<bf16>(Some(&x), None, 1e-5));
    let chain = x.add(&x.layer_norm(Some(&x), None, 1e-5).cast::<bf16>().cast::<f32>());
    assert_same_bits(&fused, &chain, "input as weight");
    let h = randn(&[37], 135).cast::<f32>();
    let (gf, gc) = (fused.mul(&h).sum_all().backward(), chain.mul(&h).sum_all().backward());
    assert_same_bits(gf.get(&x).unwrap(), gc.get(&x).unwrap(), "input as weight: gradient");
}

/// `add_cast` gives the bits of `cast` then `add`, values and both gradients: same shapes
/// (enough values to run in parallel), the argument broadcast (its gradient summed back),
/// the receiver broadcast, a strided argument, values past the narrower type's range and
/// NaN, for the pairs the CPU fuses (f16 and bf16 into f32) and those it runs as the cast and
/// the add (f32 into bf16, rounding; f64 into f32; the same precision).
fn add_cast_is_the_cast_then_the_add<E: Precision, O: Precision>() {
    let mut wide = randn(&[5, 7], 142).mul_scalar(1e5).to_f64_vec();
    wide[3] = f64::NAN;
    let cases: Vec<(Tensor<f64>, Tensor<f64>)> = vec![
        (randn(&[300, 257], 140), randn(&[300, 257], 141)),
        (randn(&[5, 7], 143), randn(&[7], 144)),
        (randn(&[1, 7], 145), randn(&[5, 7], 146)),
        (randn(&[5, 7], 147), randn(&[7, 5], 148).t()),
        (randn(&[5, 7], 149), Tensor::from_vec(wide, &[5, 7])),
    ];
    for (a, b) in cases {
        let (a, b) = (a.cast::<E>().requires_grad_(), b.cast::<O>().requires_grad_());
        let (fused, chain) = (a.add_cast(&b), a.add(&b.cast::<E>()));
        let name = format!("add_cast {} + {} {:?} + {:?}", E::DTYPE, O::DTYPE, a.shape(), b.shape());
        assert_same_bits(&fused, &chain, &name);
        let g = randn(fused.shape(), 150).cast::<E>();
        let (gf, gc) = (fused.mul(&g).sum_all().backward(), chain.mul(&g).sum_all().backward());
        assert_same_bits(gf.get(&a).unwrap(), gc.get(&a).unwrap(), &format!("{name}: receiver's gradient"));
        assert_same_bits(gf.get(&b).unwrap(), gc.get(&b).unwrap(), &format!("{name}: argument's gradient"));
    }
    let (a, b) = (randn(&[2, 3], 151).cast::<E>(), randn(&[3, 2], 152).cast::<O>());
    assert!(a.try_add_cast(&b).is_err(), "[2, 3] + [3, 2] does not broadcast");
}

#[test]
fn add_cast_matches_the_cast_then_the_add_bit_for_bit() {
    add_cast_is_the_cast_then_the_add::<f32, bf16>();
    add_cast_is_the_cast_then_the_add::<f32, f16>();
    add_cast_is_the_cast_then_the_add::<bf16, f32>();
    add_cast_is_the_cast_then_the_add::<f32, f64>();
    add_cast_is_the_cast_then_the_add::<f16, f16>();
}

fn norms<E: Precision>() {
    let x = randn(&[6, 37], 70).mul_scalar(2.0).add_scalar(1.0);
    let (w, b) = (randn(&[37], 71), randn(&[37], 72));
    check!(E, "layer_norm", ONCE, [x.clone()], |t| t[0].layer_norm(None, None, 1e-5));
    check!(E, "layer_norm affine", ONCE, [x.clone(), w.clone(), b.clone()], |t| t[0].layer_norm(
        Some(&t[1]),
        Some(&t[2]),
        1e-5
    ));
    check!(E, "layer_norm (parallel)", ONCE, [randn(&[80, 1000], 73)], |t| t[0].layer_norm(None, None, 1e-5));
    // An odd number of rows: the forward normalises rows two at a time.
    check!(E, "layer_norm odd rows", ONCE, [randn(&[7, 37], 77).mul_scalar(3.0)], |t| t[0]
        .layer_norm(None, None, 1e-5));
    check!(E, "rms_norm odd rows", ONCE, [randn(&[7, 37], 78)], |t| t[0].rms_norm(None, 1e-6));
    check!(E, "rms_norm", ONCE, [x.clone()], |t| t[0].rms_norm(None, 1e-6));
    check!(E, "rms_norm weight", ONCE, [x.clone(), w.clone()], |t| t[0].rms_norm(Some(&t[1]), 1e-6));
    check_grad!(E, "layer_norm", ONCE, [x.clone(), w.clone(), b.clone()], |t| t[0].layer_norm(
        Some(&t[1]),
        Some(&t[2]),
        1e-5
    ));
    check_grad!(E, "layer_norm no affine", ONCE, [x.clone()], |t| t[0].layer_norm(None, None, 1e-5));
    check_grad!(E, "rms_norm", ONCE, [x.clone(), w.clone()], |t| t[0].rms_norm(Some(&t[1]), 1e-6));
    check_grad!(
        E,
        "layer_norm (parallel)",
        ONCE,
        [randn(&[80, 1000], 74), randn(&[1000], 75), randn(&[1000], 76)],
        |t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5)
    );
}

fn losses<E: Precision>() {
    let x = randn(&[9, 37], 80).mul_scalar(2.0);
    let t = Indices::from_vec(vec![0, 5, 36, -100, 7, 7, 1, 20, 3], &[9]);
    let smooth = CrossEntropyOptions { label_smoothing: 0.1, ..Default::default() };
    check!(E, "cross_entropy", ONCE, [x.clone()], |l| l[0].cross_entropy(&t));
    check!(E, "cross_entropy smoothing", ONCE, [x.clone()], |l| l[0].cross_entropy_with(&t, smooth));
    check_grad!(E, "cross_entropy", ONCE, [x.clone()], |l| l[0].cross_entropy(&t));
    check_grad!(E, "cross_entropy smoothing", ONCE, [x.clone()], |l| l[0].cross_entropy_with(&t, smooth));
    let big = Indices::from_vec((0..2000).map(|i| (i * 7) % 50).collect(), &[2000]);
    check!(E, "cross_entropy (parallel)", ONCE, [randn(&[2000, 50], 81)], |l| l[0].cross_entropy(&big));
    let (a, b) = (randn(&[5, 37], 82), randn(&[5, 37], 83));
    check!(E, "mse_loss", ONCE, [a.clone(), b.clone()], |l| l[0].mse_loss(&l[1]));
    check_grad!(E, "mse_loss", ONCE, [a.clone(), b.clone()], |l| l[0].mse_loss(&l[1]));
}

fn attention<E: Precision>() {
    // 70 positions: two of the CPU kernel's key blocks.
    let (q, k, v) = (randn(&[2, 2, 70, 16], 110), randn(&[2, 2, 70, 16], 111), randn(&[2, 2, 70, 16], 112));
    check!(E, "causal_attention", FROM_ROUNDED, [q.clone(), k.clone(), v.clone()], |t| t[0]
        .causal_attention(&t[1], &t[2]));
    check_grad!(E, "causal_attention", FROM_ROUNDED, [q, k, v], |t| t[0].causal_attention(&t[1], &t[2]));
}

#[test]
fn softmax_norms_and_losses_match_f64() {
    for_each_precision!(attention);
    for_each_precision!(softmax_family);
    for_each_precision!(norms);
    for_each_precision!(losses);
}

// ---- dropout, embedding, selection, joining --------------------------------------------------

fn selection<E: Precision>() {
    let x = randn(&[4, 37], 90);
    // The mask depends only on the seed and the length, never on the precision.
    check!(E, "dropout", ONCE, [x.clone()], |t| t[0].dropout(0.3, true, &mut Rng::seed(5)));
    check_grad!(E, "dropout", ONCE, [x.clone()], |t| t[0].dropout(0.3, true, &mut Rng::seed(5)));
    let ids = Indices::from_vec(vec![3, 0, 3, 9, 3, 1], &[2, 3]);
    check!(E, "embedding", EXACT, [randn(&[10, 37], 91)], |t| t[0].embedding(&ids));
    check_grad!(E, "embedding", ONCE, [randn(&[10, 37], 91)], |t| t[0].embedding(&ids));
    let m = Mask::from_vec((0..37).map(|i| i % 3 == 0).collect(), &[37]);
    check!(E, "masked_fill", EXACT, [x.clone()], |t| t[0].masked_fill(&m, -2.5));
    check_grad!(E, "masked_fill", EXACT, [x.clone()], |t| t[0].masked_fill(&m, -2.5));
    let causal = Mask::causal(37).reshape(&[1, 37, 37]);
    check!(E, "masked_fill causal", EXACT, [randn(&[2, 37, 37], 92)], |t| t[0].masked_fill(&causal, f64::NEG_INFINITY));
    check!(E, "where_cond", EXACT, [x.clone(), randn(&[37], 93)], |t| Tensor::where_cond(&m, &t[0], &t[1]));
    check_grad!(E, "where_cond", ONCE, [x.clone(), randn(&[37], 93)], |t| Tensor::where_cond(&m, &t[0], &t[1]));
    check!(E, "cat", EXACT, [x.clone(), randn(&[4, 5], 94)], |t| Tensor::cat(&[&t[0], &t[1]], 1));
    check_grad!(E, "cat", EXACT, [x.clone(), randn(&[4, 5], 94)], |t| Tensor::cat(&[&t[0], &t[1]], 1));
    check!(E, "stack", EXACT, [x.clone(), randn(&[4, 37], 95)], |t| Tensor::stack(&[&t[0], &t[1]], 2));
    check_grad!(E, "stack", EXACT, [x.clone(), randn(&[4, 37], 95)], |t| Tensor::stack(&[&t[0], &t[1]], 0));
}

#[test]
fn dropout_embedding_selection_match_f64() {
    for_each_precision!(selection);
}

// ---- accumulation in f32 ---------------------------------------------------------------------

fn accumulates_in_f32<E: Precision>() {
    let ones = Tensor::<E>::ones(&[4096]);
    assert_eq!(ones.sum_all().item().to_f64(), 4096.0, "sum of 4096 ones ({})", E::DTYPE);
    assert_eq!(ones.reshape(&[1, 4096]).sum(1, false).to_f64_vec(), vec![4096.0]);
    assert_eq!(ones.reshape(&[4096, 1]).broadcast_to(&[4096, 3]).sum(0, false).to_f64_vec(), vec![4096.0; 3]);
    assert_eq!(ones.mean_all().item().to_f64(), 1.0, "mean of 4096 ones ({})", E::DTYPE);
    // Sum of 4096 values of 0.1: a naive f16 sum drifts by tens; f32 accumulation then one
    // rounding is within one f16/bf16 rounding of 409.6 (rounded input 0.1 times 4096).
    let tenth = Tensor::<E>::full(&[4096], 0.1);
    let exact = E::from_f64(0.1).to_f64() * 4096.0;
    let got = tenth.sum_all().item().to_f64();
    assert!(
        (got - exact).abs() <= exact * (common::unit_roundoff::<E>() + 1e-5), // + f32's own error
        "sum of 0.1s ({}): {got} vs {exact}",
        E::DTYPE
    );
    // matmul with k = 4096 of ones: every output is exactly 4096.
    let a = Tensor::<E>::ones(&[2, 4096]);
    let b = Tensor::<E>::ones(&[4096, 3]);
    assert_eq!(a.matmul(&b).to_f64_vec(), vec![4096.0; 6], "matmul k=4096 ({})", E::DTYPE);
    // Softmax over 4096 equal logits is exactly 2^-12 (a sum stuck at 2048 would give 2^-11).
    let p = Tensor::<E>::zeros(&[1, 4096]).softmax(1).to_f64_vec();
    assert!(p.iter().all(|&v| v == 1.0 / 4096.0), "softmax of 4096 ({}): {}", E::DTYPE, p[0]);
    // Cross-entropy over 4096 equal logits is ln(4096).
    let ce = Tensor::<E>::zeros(&[2, 4096]).cross_entropy(&Indices::from_vec(vec![0, 4095], &[2]));
    let want = 4096f64.ln();
    assert!((ce.item().to_f64() - want).abs() <= 2.0 * want * common::unit_roundoff::<E>(), "ce ({})", E::DTYPE);
    // Layer norm over 4096 elements: mean and variance in f32.
    let ramp: Vec<f64> = (0..4096).map(|i| (i % 64) as f64).collect();
    let ln = Tensor::<E>::from_f64s(&ramp, &[1, 4096]).layer_norm(None, None, 0.0);
    let want = Tensor::<f64>::from_f64s(&ramp, &[1, 4096]).layer_norm(None, None, 0.0);
    assert_close_ulps(&ln, &want, ONCE, "layer_norm of 4096");
    // The embedding gradient of one id used 4096 times is 4096, not 2048.
    let w = Tensor::<E>::zeros(&[3, 2]).requires_grad_();
    let ids = Indices::from_vec(vec![1; 4096], &[4096]);
    let g = w.embedding(&ids).sum_all().backward();
    assert_eq!(g.get(&w).unwrap().to_f64_vec(), vec![0.0, 0.0, 4096.0, 4096.0, 0.0, 0.0], "{}", E::DTYPE);
    // So is the gradient of a broadcast operand (summed back over 4096 rows).
    let bias = Tensor::<E>::zeros(&[2]).requires_grad_();
    let g = Tensor::<E>::zeros(&[4096, 2]).add(&bias).sum_all().backward();
    assert_eq!(g.get(&bias).unwrap().to_f64_vec(), vec![4096.0, 4096.0], "{}", E::DTYPE);
    // And the layer-norm bias gradient (a sum over rows).
    let (x, bias) = (Tensor::<E>::randn(&[4096, 2], &mut Rng::seed(1)), Tensor::<E>::zeros(&[2]).requires_grad_());
    let g = x.layer_norm(None, Some(&bias), 1e-5).sum_all().backward();
    assert_eq!(g.get(&bias).unwrap().to_f64_vec(), vec![4096.0, 4096.0], "{}", E::DTYPE);
}

#[test]
fn low_precision_accumulates_in_f32() {
    for_each_precision!(accumulates_in_f32);
}

// ---- overflow and NaN ------------------------------------------------------------------------

#[test]
fn casts_above_max_finite_give_inf() {
    let x = Tensor::<f32>::from_vec(vec![65504.0, 65520.0, 1e5, -1e5, 3.0e38, f32::MAX, -f32::MAX], &[7]);
    let h = x.cast::<f16>().to_f64_vec();
    assert_eq!(h[0], 65504.0, "f16 max finite stays");
    assert!(h[1..4].iter().all(|v| v.is_infinite()), "{h:?}");
    assert!(h[3] < 0.0);
    let b = x.cast::<bf16>().to_f64_vec();
    assert!((b[4] - 3.0e38).abs() < 3.0e38 / 256.0, "3e38 is finite in bf16: {}", b[4]);
    assert!(b[5].is_infinite() && b[5] > 0.0, "f32::MAX rounds past bf16's max finite: {}", b[5]);
    assert!(b[6].is_infinite() && b[6] < 0.0);
    // From f64 and between the half types.
    assert!(Tensor::<f64>::from_vec(vec![1e300], &[1]).cast::<f32>().to_vec()[0].is_infinite());
    assert!(Tensor::<f64>::from_vec(vec![1e300], &[1]).cast::<bf16>().to_vec()[0].is_infinite());
    assert!(Tensor::<bf16>::from_f64s(&[1e6], &[1]).cast::<f16>().to_vec()[0].is_infinite());
}

fn overflow_gives_inf<E: Precision>() {
    let big = E::MAX_FINITE;
    let x = Tensor::<E>::from_f64s(&[big, big / 2.0], &[2]);
    assert_eq!(x.mul_scalar(2.0).to_f64_vec(), vec![f64::INFINITY, big], "mul ({})", E::DTYPE);
    assert!(x.add(&x).to_f64_vec()[0].is_infinite(), "add ({})", E::DTYPE);
    assert!(x.sum_all().item().to_f64().is_infinite(), "sum ({})", E::DTYPE);
    assert!(x.square().to_f64_vec()[1].is_infinite(), "square ({})", E::DTYPE);
    let e = Tensor::<E>::from_f64s(&[100.0], &[1]).exp().to_f64_vec()[0];
    assert_eq!(e, f64::INFINITY, "exp(100) ({})", E::DTYPE);
    if E::DTYPE == DType::F16 {
        // 300 * 300 * 256 = 23M: far past f16's 65504, and inf rather than a clamp.
        let a = Tensor::<E>::full(&[1, 256], 300.0);
        let b = Tensor::<E>::full(&[256, 1], 300.0);
        assert!(a.matmul(&b).item().to_f64().is_infinite());
        assert!(Tensor::<E>::full(&[4096], 20.0).sum_all().item().to_f64().is_infinite());
    }
}

fn nan_propagates<E: Precision>() {
    let v = [1.0, f64::NAN, -2.0, 0.5];
    let x = Tensor::<E>::from_f64s(&v, &[1, 4]);
    let y = Tensor::<E>::from_f64s(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[2, 4]);
    let all_nan = |t: &Tensor<E>| t.to_f64_vec().iter().all(|v| v.is_nan());
    let nan_at = |t: &Tensor<E>, i: usize| t.to_f64_vec()[i].is_nan();
    for (name, t) in [
        ("add", x.add(&y)),
        ("mul", x.mul(&y)),
        ("div", x.div(&y.add_scalar(1.0))),
        ("relu", x.relu()),
        ("gelu", x.gelu()),
        ("exp", x.exp()),
        ("tanh", x.tanh()),
        ("masked_fill elsewhere", x.masked_fill(&Mask::from_vec(vec![true, false, false, false], &[4]), 0.0)),
        ("dropout", x.dropout(0.5, true, &mut Rng::seed(1))),
    ] {
        assert!(nan_at(&t, 1), "{name} ({}): {t:?}", E::DTYPE);
    }
    fn second_is_nan<P: Precision>(t: Tensor<P>) -> bool {
        t.to_f64_vec()[1].is_nan()
    }
    assert!(second_is_nan(x.cast::<bf16>()) && second_is_nan(x.cast::<f16>()) && second_is_nan(x.cast::<f32>()));
    for (name, t) in [
        ("sum", x.sum(1, false)),
        ("mean", x.mean_all()),
        ("max", x.max(1, false)),
        ("min", x.min(1, false)),
        ("softmax", x.softmax(1)),
        ("log_softmax", x.log_softmax(1)),
        ("layer_norm", x.layer_norm(None, None, 1e-5)),
        ("rms_norm", x.rms_norm(None, 1e-5)),
        ("matmul", x.matmul(&y.t())),
        ("cross_entropy", x.cross_entropy(&Indices::from_vec(vec![0], &[1]))),
        ("mse_loss", x.mse_loss(&x.detach())),
    ] {
        assert!(all_nan(&t), "{name} ({}): {t:?}", E::DTYPE);
    }
    // A NaN row does not leak into other rows.
    let rows = Tensor::cat(&[&x, &y], 0);
    let s = rows.softmax(1).to_f64_vec();
    assert!(s[..4].iter().all(|v| v.is_nan()) && s[4..].iter().all(|v| v.is_finite()), "{}", E::DTYPE);
    let n = rows.layer_norm(None, None, 1e-5).to_f64_vec();
    assert!(n[..4].iter().all(|v| v.is_nan()) && n[4..].iter().all(|v| v.is_finite()), "{}", E::DTYPE);
    // NaN gradients propagate too.
    let leaf = x.detach().requires_grad_();
    let g = leaf.softmax(1).mul(&y.narrow(0, 0, 1)).sum_all().backward();
    assert!(all_nan(g.get(&leaf).unwrap()), "softmax backward ({})", E::DTYPE);
}

#[test]
fn overflow_gives_inf_and_nan_propagates() {
    for_each_precision!(overflow_gives_inf);
    for_each_precision!(nan_propagates);
}

// ---- convolution, pooling, batch norm ----------------------------------------------------------

fn convolutions<E: Precision>() {
    use amp_core::Conv2dOptions;
    let (x, w, b) = (randn(&[2, 4, 9, 8], 200), randn(&[6, 2, 3, 3], 201), randn(&[6], 202));
    let opts = Conv2dOptions { stride: (2, 1), padding: (1, 1), dilation: (1, 2), groups: 2 };
    // f32 accumulation and the bias inside the GEMM: one rounding.
    check!(E, "conv2d", ONCE, [x.clone(), w.clone(), b.clone()], |t| t[0].conv2d(&t[1], Some(&t[2]), opts));
    check!(E, "conv2d no bias", ONCE, [x.clone(), w.clone()], |t| t[0].conv2d(&t[1], None, opts));
    // k = 256·3·3 = 2304 taps: a 16-bit accumulator would drift far past one rounding.
    let one = Conv2dOptions::default();
    check!(E, "conv2d large k", ONCE, [unif(&[1, 256, 5, 5], 203), unif(&[2, 256, 3, 3], 204), unif(&[2], 205)], |t| t
        [0]
    .conv2d(&t[1], Some(&t[2]), one));
    let same = Conv2dOptions { padding: (1, 1), ..Default::default() };
    check!(E, "conv2d (parallel)", ONCE, [randn(&[4, 16, 16, 16], 206), randn(&[16, 16, 3, 3], 207)], |t| t[0]
        .conv2d(&t[1], None, same));
    // Each gradient is a sum of f32 products rounded once (col2im sums the input gradient's
    // products in f32 too).
    check_grad!(E, "conv2d", ONCE, [x.clone(), w.clone(), b.clone()], |t| t[0].conv2d(&t[1], Some(&t[2]), opts));
    check_grad!(E, "conv2d (parallel)", ONCE, [randn(&[4, 16, 16, 16], 208), randn(&[16, 16, 3, 3], 209)], |t| t[0]
        .conv2d(&t[1], None, same));
}

fn pooling<E: Precision>() {
    let x = randn(&[2, 3, 9, 8], 210);
    check!(E, "max_pool2d", EXACT, [x.clone()], |t| t[0].max_pool2d((3, 3), (2, 2), (1, 1)));
    check!(E, "avg_pool2d", ONCE, [x.clone()], |t| t[0].avg_pool2d((3, 2), (2, 2), (1, 1)));
    check!(E, "adaptive_avg_pool2d", ONCE, [x.clone()], |t| t[0].adaptive_avg_pool2d((4, 3)));
    check!(E, "max_pool2d (parallel)", EXACT, [randn(&[8, 16, 32, 32], 211)], |t| t[0].max_pool2d(
        (2, 2),
        (2, 2),
        (0, 0)
    ));
    check!(E, "avg_pool2d (parallel)", ONCE, [randn(&[8, 16, 32, 32], 212)], |t| t[0].avg_pool2d(
        (3, 3),
        (1, 1),
        (1, 1)
    ));
    // Disjoint windows route each gradient to one input (exact); overlapping ones sum in f32.
    check_grad!(E, "max_pool2d disjoint", EXACT, [x.clone()], |t| t[0].max_pool2d((2, 2), (2, 2), (0, 0)));
    check_grad!(E, "max_pool2d overlapping", ONCE, [x.clone()], |t| t[0].max_pool2d((3, 3), (1, 1), (1, 1)));
    check_grad!(E, "avg_pool2d", ONCE, [x.clone()], |t| t[0].avg_pool2d((3, 2), (2, 2), (1, 1)));
    check_grad!(E, "adaptive_avg_pool2d", ONCE, [x.clone()], |t| t[0].adaptive_avg_pool2d((4, 3)));
}

/// Batch norm of `t[0]` with the weight `t[1]` and bias `t[2]` taken in `P::Acc`, the
/// parameters' precision (a widening cast: the f64 reference sees the same values), and the
/// running statistics when given.
fn affine_batch_norm<P: Precision>(
    t: &[Tensor<P>],
    running: Option<(&Tensor<f32>, &Tensor<f32>)>,
    opts: amp_core::BatchNormOptions,
) -> Tensor<P> {
    let (w, b) = (t[1].cast::<P::Acc>(), t[2].cast::<P::Acc>());
    let (mut m, mut v) = running.map(|(m, v)| (m.clone(), v.clone())).unzip();
    t[0].batch_norm(m.as_mut(), v.as_mut(), Some(&w), Some(&b), opts)
}

fn batch_norms<E: Precision>() {
    use amp_core::BatchNormOptions;
    let x = randn(&[4, 5, 6, 7], 220).mul_scalar(2.0).add_scalar(1.0);
    let (w, b) = (randn(&[5], 221), randn(&[5], 222));
    let train = BatchNormOptions { training: true, ..Default::default() };
    let (mean, var) = (Tensor::<f32>::from_f64s(&[0.5, -1.0, 1.0, 0.0, 2.0], &[5]), Tensor::<f32>::full(&[5], 3.0));
    let running = Some((&mean, &var));
    // Statistics in f32, one rounding of the output, in both modes.
    macro_rules! both {
        ($check:ident, $name:expr, $opts:expr) => {{
            let inputs = [x.clone(), w.clone(), b.clone()];
            let low: Vec<Tensor<E>> = inputs.iter().map(|t| t.cast::<E>()).collect();
            let exact: Vec<Tensor<f64>> = low.iter().map(|t| t.cast::<f64>()).collect();
            $check(&affine_batch_norm(&low, running, $opts), &affine_batch_norm(&exact, running, $opts), ONCE, $name);
        }};
    }
    both!(assert_close_ulps, "batch_norm training", train);
    both!(assert_close_ulps, "batch_norm eval", BatchNormOptions::default());
    check!(E, "batch_norm no affine", ONCE, [x.clone()], |t| t[0].batch_norm(None, None, None, None, train));
    check!(E, "batch_norm (parallel)", ONCE, [randn(&[16, 8, 32, 32], 223)], |t| t[0]
        .batch_norm(None, None, None, None, train));
    // The parameters' gradients come back in f32 and are rounded once, by the cast into E.
    check_grad!(E, "batch_norm training", ONCE, [x.clone(), w.clone(), b.clone()], |t| affine_batch_norm(
        t, None, train
    ));
    check_grad!(E, "batch_norm eval", ONCE, [x.clone(), w.clone(), b.clone()], |t| affine_batch_norm(
        t,
        running,
        BatchNormOptions::default()
    ));
}

#[test]
fn convolution_pooling_and_batch_norm_match_f64() {
    for_each_precision!(convolutions);
    for_each_precision!(pooling);
    for_each_precision!(batch_norms);
}

/// Direct loops in f64, written from PyTorch's definitions, for the pooling ops and batch norm
/// (the checks above compare an op with itself in f64; these check what it computes).
#[test]
fn pooling_and_batch_norm_follow_pytorch_definitions() {
    use amp_core::BatchNormOptions;
    let (n, c, h, w) = (2, 3, 7, 6);
    let x = randn(&[n, c, h, w], 230);
    let xv = x.to_vec();
    let at = |p: usize, i: isize, j: isize| -> Option<f64> {
        (i >= 0 && j >= 0 && i < h as isize && j < w as isize).then(|| xv[(p * h + i as usize) * w + j as usize])
    };
    // max_pool2d / avg_pool2d: kernel (3, 2), stride (2, 1), padding (1, 1).
    let (k, s, pd) = ((3usize, 2usize), (2usize, 1usize), (1usize, 1usize));
    let (oh, ow) = ((h + 2 * pd.0 - k.0) / s.0 + 1, (w + 2 * pd.1 - k.1) / s.1 + 1);
    let (mut max, mut avg) = (Vec::new(), Vec::new());
    for p in 0..n * c {
        for i in 0..oh {
            for j in 0..ow {
                let taps: Vec<Option<f64>> = (0..k.0)
                    .flat_map(|a| (0..k.1).map(move |b| (a, b)))
                    .map(|(a, b)| at(p, (i * s.0 + a) as isize - pd.0 as isize, (j * s.1 + b) as isize - pd.1 as isize))
                    .collect();
                max.push(taps.iter().flatten().fold(f64::NEG_INFINITY, |m, v| m.max(*v)));
                // count_include_pad: padding counts in the divisor.
                avg.push(taps.iter().flatten().sum::<f64>() / (k.0 * k.1) as f64);
            }
        }
    }
    let close = |got: Vec<f64>, want: &[f64], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-12 * (1.0 + w.abs()), "{what}: {g} vs {w}");
        }
    };
    close(x.max_pool2d(k, s, pd).to_vec(), &max, "max_pool2d");
    close(x.avg_pool2d(k, s, pd).to_vec(), &avg, "avg_pool2d");
    // adaptive_avg_pool2d to (3, 4): windows [floor(i H / o), ceil((i + 1) H / o)).
    let (o0, o1) = (3usize, 4usize);
    let mut adaptive = Vec::new();
    for p in 0..n * c {
        for i in 0..o0 {
            let (h0, h1) = (i * h / o0, ((i + 1) * h).div_ceil(o0));
            for j in 0..o1 {
                let (w0, w1) = (j * w / o1, ((j + 1) * w).div_ceil(o1));
                let sum: f64 =
                    (h0..h1).flat_map(|a| (w0..w1).map(move |b| (a, b))).map(|(a, b)| xv[(p * h + a) * w + b]).sum();
                adaptive.push(sum / ((h1 - h0) * (w1 - w0)) as f64);
            }
        }
    }
    close(x.adaptive_avg_pool2d((o0, o1)).to_vec(), &adaptive, "adaptive_avg_pool2d");
    // batch_norm in training: per channel, the batch mean and the biased variance.
    let (wt, bs) = (randn(&[c], 231), randn(&[c], 232));
    let m = (n * h * w) as f64;
    let mut want = vec![0.0; xv.len()];
    for ch in 0..c {
        let idx: Vec<usize> = (0..n).flat_map(|s| (0..h * w).map(move |e| (s * c + ch) * h * w + e)).collect();
        let mean = idx.iter().map(|&i| xv[i]).sum::<f64>() / m;
        let var = idx.iter().map(|&i| (xv[i] - mean).powi(2)).sum::<f64>() / m;
        for &i in &idx {
            want[i] = (xv[i] - mean) / (var + 1e-5).sqrt() * wt.to_vec()[ch] + bs.to_vec()[ch];
        }
    }
    let train = BatchNormOptions { training: true, ..Default::default() };
    close(x.batch_norm(None, None, Some(&wt), Some(&bs), train).to_vec(), &want, "batch_norm");
}

/// Eval leaves the running buffers bit for bit as they were, however often it runs; training
/// moves them by exactly PyTorch's rule, `(1 - momentum) * running + momentum * stat` with
/// the unbiased variance, computed here independently in f64 and rounded once into f32.
#[test]
fn batch_norm_running_statistics() {
    use amp_core::BatchNormOptions;
    let (n, c, hw) = (3, 4, 10);
    let x = randn(&[n, c, 2, 5], 240).mul_scalar(3.0).add_scalar(0.5);
    let mut mean = Tensor::<f32>::from_f64s(&[0.1, -0.7, 2.5, 0.0], &[c]);
    let mut var = Tensor::<f32>::from_f64s(&[1.0, 0.3, 4.0, 0.9], &[c]);
    let bits = |t: &Tensor<f32>| t.to_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let (mean0, var0) = (bits(&mean), bits(&var));
    let eval = BatchNormOptions::default();
    let first = x.batch_norm(Some(&mut mean), Some(&mut var), None, None, eval).to_vec();
    for _ in 0..100 {
        let y = x.batch_norm(Some(&mut mean), Some(&mut var), None, None, eval).to_vec();
        assert_eq!(y, first, "eval is a function of the running statistics alone");
    }
    assert_eq!((bits(&mean), bits(&var)), (mean0.clone(), var0.clone()), "eval changed the running statistics");
    // A clone shares the buffers: training must not write through it.
    let (mean_seen, var_seen) = (mean.clone(), var.clone());
    // Training, three steps with different momenta, checked against f64 arithmetic.
    let xv = x.to_vec();
    let m = (n * hw) as f64;
    let (mut want_mean, mut want_var) = (mean.to_f64_vec(), var.to_f64_vec());
    for momentum in [0.1, 0.25, 1.0] {
        let train = BatchNormOptions { training: true, momentum, ..Default::default() };
        x.batch_norm(Some(&mut mean), Some(&mut var), None, None, train);
        for ch in 0..c {
            let vals: Vec<f64> =
                (0..n).flat_map(|s| (0..hw).map(move |e| (s * c + ch) * hw + e)).map(|i| xv[i]).collect();
            let mu = vals.iter().sum::<f64>() / m;
            let unbiased = vals.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / (m - 1.0);
            want_mean[ch] = ((1.0 - momentum) * want_mean[ch] + momentum * mu) as f32 as f64;
            want_var[ch] = ((1.0 - momentum) * want_var[ch] + momentum * unbiased) as f32 as f64;
        }
        assert_eq!(mean.to_f64_vec(), want_mean, "running mean after momentum {momentum}");
        assert_eq!(var.to_f64_vec(), want_var, "running var after momentum {momentum}");
    }
    assert_eq!((bits(&mean_seen), bits(&var_seen)), (mean0, var0), "a clone of the buffers saw the update");
    // Low-precision input: the statistics are f32 (E::Acc), the buffers f32; values exact in
    // every precision (integers, M - 1 = 8) give an exact expectation.
    fn low<E: Precision>() {
        let vals = [3.0, 0.0, 8.0, 1.0, 6.0, 2.0, 7.0, 5.0, 4.0]; // one channel, M = 9, mean 4
        let x = Tensor::<E>::from_f64s(&vals, &[1, 1, 3, 3]);
        let (mut mean, mut var) = (Tensor::<f32>::zeros(&[1]), Tensor::<f32>::ones(&[1]));
        let train = BatchNormOptions { training: true, momentum: 0.5, ..Default::default() };
        let _ = x.batch_norm(Some(&mut mean), Some(&mut var), None, None, train);
        let mu = vals.iter().sum::<f64>() / 9.0;
        let unbiased = vals.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / 8.0; // 60 / 8
        assert_eq!(mean.to_f64_vec(), vec![(0.5 * mu) as f32 as f64], "{}", E::DTYPE);
        assert_eq!(var.to_f64_vec(), vec![(0.5 + 0.5 * unbiased) as f32 as f64], "{}", E::DTYPE);
    }
    for_each_precision!(low);
}
