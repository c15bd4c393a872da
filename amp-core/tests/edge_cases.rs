//! Edge cases (empty tensors, size-1 broadcasting, 0-dim tensors) and the semantics of the
//! new ops against hand-computed values: cross-entropy with ignore_index and label smoothing
//! (PyTorch's formula, evaluated here in f64), dropout's statistics and reproducibility, the
//! causal mask.

use crate::common;
use amp_core::{CrossEntropyOptions, Indices, Mask, Rng, Tensor, bf16, f16};
use common::randn;

fn z(shape: &[usize]) -> Tensor<f64> {
    Tensor::zeros(shape)
}

// ---- empty tensors ---------------------------------------------------------------------------

#[test]
fn empty_tensors_flow_through_elementwise_reductions_and_matmul() {
    let e = z(&[0, 3]).requires_grad_();
    let b = randn(&[3], 1).requires_grad_();
    let s = e.add(&b);
    assert_eq!(s.shape(), &[0, 3]);
    assert_eq!(e.mul(&z(&[0, 3])).shape(), &[0, 3]);
    assert_eq!(e.relu().shape(), &[0, 3]);
    assert_eq!(e.sum(0, false).to_vec(), vec![0.0; 3]);
    assert_eq!(e.sum(1, false).shape(), &[0]);
    assert_eq!(e.sum_all().item(), 0.0);
    assert!(e.mean_all().item().is_nan(), "mean of nothing is NaN, as in PyTorch");
    // Gradients through empties: zeros of the right shapes.
    let g = s.sum_all().backward();
    assert_eq!(g.get(&b).unwrap().to_vec(), vec![0.0; 3]);
    assert_eq!(g.get(&e).unwrap().shape(), &[0, 3]);

    // k = 0: the product is all zeros (an empty sum), not garbage.
    let k0 = Tensor::<f64>::ones(&[2, 0]).matmul(&Tensor::ones(&[0, 3]));
    assert_eq!(k0.to_vec(), vec![0.0; 6]);
    let k0 = Tensor::<f16>::ones(&[2, 0]).matmul(&Tensor::ones(&[0, 3]));
    assert_eq!(k0.to_f64_vec(), vec![0.0; 6]);
    let k0 = Tensor::<bf16>::ones(&[4, 2, 0]).matmul(&Tensor::ones(&[0, 3]));
    assert_eq!(k0.to_f64_vec(), vec![0.0; 24]);
    assert_eq!(z(&[0, 4]).matmul(&z(&[4, 3])).shape(), &[0, 3]);
    assert_eq!(z(&[2, 4]).matmul(&z(&[4, 0])).shape(), &[2, 0]);
    // Gradients of a k = 0 product are empty too.
    let (a, w) = (z(&[2, 0]).requires_grad_(), z(&[0, 3]).requires_grad_());
    let g = a.matmul(&w).sum_all().backward();
    assert_eq!(g.get(&a).unwrap().shape(), &[2, 0]);
    assert_eq!(g.get(&w).unwrap().shape(), &[0, 3]);
}

#[test]
fn empty_tensors_through_the_new_ops() {
    // Softmax over an empty batch, and over an empty dim.
    let x = z(&[0, 5]).requires_grad_();
    let y = x.softmax(1);
    assert_eq!(y.shape(), &[0, 5]);
    assert_eq!(x.log_softmax(1).shape(), &[0, 5]);
    assert_eq!(y.sum_all().backward().get(&x).unwrap().shape(), &[0, 5]);
    assert_eq!(z(&[3, 0]).softmax(1).shape(), &[3, 0]);
    assert_eq!(z(&[3, 0]).softmax(0).shape(), &[3, 0]);
    // Norms over an empty batch still give the parameters (zero) gradients.
    let w = Tensor::<f64>::ones(&[4]).requires_grad_();
    let b = z(&[4]).requires_grad_();
    let n = z(&[0, 4]).layer_norm(Some(&w), Some(&b), 1e-5);
    assert_eq!(n.shape(), &[0, 4]);
    let g = n.sum_all().backward();
    assert_eq!(g.get(&w).unwrap().to_vec(), vec![0.0; 4]);
    assert_eq!(g.get(&b).unwrap().to_vec(), vec![0.0; 4]);
    assert_eq!(z(&[2, 0]).rms_norm(None, 1e-6).shape(), &[2, 0]);
    // Losses over nothing are NaN (0/0), as PyTorch's mean reduction gives.
    assert!(z(&[0, 4]).cross_entropy(&Indices::from_vec(vec![], &[0])).item().is_nan());
    assert!(z(&[0]).mse_loss(&z(&[0])).item().is_nan());
    // Embedding of no ids, cat with an empty piece, stack of empties, masked_fill, dropout.
    let emb = randn(&[5, 3], 2).requires_grad_();
    let out = emb.embedding(&Indices::from_vec(vec![], &[0]));
    assert_eq!(out.shape(), &[0, 3]);
    assert_eq!(out.sum_all().backward().get(&emb).unwrap().to_vec(), vec![0.0; 15]);
    let a = randn(&[2, 3], 3);
    let c = Tensor::cat(&[&a, &z(&[0, 3])], 0);
    assert_eq!(c.to_vec(), a.to_vec());
    assert_eq!(Tensor::stack(&[&z(&[0]), &z(&[0])], 1).shape(), &[0, 2]);
    assert_eq!(z(&[0, 3]).masked_fill(&Mask::full(&[3], true), 1.0).shape(), &[0, 3]);
    assert_eq!(Tensor::where_cond(&Mask::full(&[0, 1], true), &z(&[3]), &z(&[1])).shape(), &[0, 3]);
    assert_eq!(z(&[0, 3]).dropout(0.5, true, &mut Rng::seed(0)).shape(), &[0, 3]);
}

// ---- size-1 broadcasting ---------------------------------------------------------------------

#[test]
fn size_one_dims_broadcast() {
    let col = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0], &[3, 1]);
    let row = Tensor::<f64>::from_vec(vec![10.0, 20.0], &[1, 2]);
    assert_eq!(col.add(&row).to_vec(), vec![11.0, 21.0, 12.0, 22.0, 13.0, 23.0]);
    assert_eq!(Tensor::<f64>::ones(&[1]).add(&z(&[2, 3])).to_vec(), vec![1.0; 6]);
    // Batch dims of size 1 broadcast in matmul.
    let m = Tensor::<f64>::ones(&[1, 2, 3]).matmul(&Tensor::ones(&[4, 3, 2]));
    assert_eq!(m.shape(), &[4, 2, 2]);
    assert!(m.to_vec().iter().all(|&v| v == 3.0));
    assert_eq!(Tensor::<f64>::full(&[1, 1], 2.0).matmul(&Tensor::full(&[1, 1], 3.0)).to_vec(), vec![6.0]);
    // A size-1 mask broadcasts, in masked_fill and where.
    let x = randn(&[2, 3], 4);
    assert_eq!(x.masked_fill(&Mask::full(&[1, 1], true), 7.0).to_vec(), vec![7.0; 6]);
    assert_eq!(x.masked_fill(&Mask::full(&[1], false), 7.0).to_vec(), x.to_vec());
    let picked = Tensor::where_cond(&Mask::from_vec(vec![true, false], &[2, 1]), &x, &z(&[1]));
    assert_eq!(picked.to_vec(), [&x.to_vec()[..3], &[0.0; 3]].concat());
    // Ops over a size-1 dim.
    assert_eq!(randn(&[4, 1], 5).softmax(1).to_vec(), vec![1.0; 4]);
    assert_eq!(randn(&[4, 1], 5).log_softmax(1).to_vec(), vec![0.0; 4]);
    let bias = Tensor::<f64>::from_vec(vec![0.5], &[1]);
    assert_eq!(randn(&[3, 1], 6).layer_norm(None, Some(&bias), 1e-5).to_vec(), vec![0.5; 3]);
    let ce = randn(&[3, 1], 7).cross_entropy(&Indices::from_vec(vec![0, 0, 0], &[3]));
    assert_eq!(ce.item(), 0.0, "one class: probability 1, loss 0");
}

// ---- 0-dim tensors ---------------------------------------------------------------------------

#[test]
fn zero_dim_tensors() {
    let s = Tensor::<f64>::scalar(2.0).requires_grad_();
    let v = randn(&[3], 8);
    assert_eq!(s.add(&v).shape(), &[3]);
    assert_eq!(s.sum_all().item(), 2.0);
    assert_eq!(s.softmax(0).item(), 1.0);
    assert_eq!(s.log_softmax(0).item(), 0.0);
    assert_eq!(s.softmax(0).shape(), &[] as &[usize]);
    assert_eq!(s.mse_loss(&Tensor::scalar(5.0)).item(), 9.0);
    let st = Tensor::stack(&[&s, &Tensor::scalar(3.0), &s], 0);
    assert_eq!(st.to_vec(), vec![2.0, 3.0, 2.0]);
    let g = st.mul(&Tensor::from_vec(vec![1.0, 10.0, 100.0], &[3])).sum_all().backward();
    assert_eq!(g.get(&s).unwrap().item(), 101.0);
    assert_eq!(s.masked_fill(&Mask::full(&[], true), -1.0).item(), -1.0);
    assert_eq!(Tensor::where_cond(&Mask::full(&[], false), &s, &v).to_vec(), v.to_vec());
    let w = randn(&[4, 2], 9);
    let e = w.embedding(&Indices::from_vec(vec![3], &[]));
    assert_eq!(e.shape(), &[2]);
    assert_eq!(e.to_vec(), w.narrow(0, 3, 1).flatten().to_vec());
    // 1-D logits with a 0-dim target.
    let logits = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0], &[3]);
    let want = -(3f64 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln());
    assert!((logits.cross_entropy(&Indices::from_vec(vec![2], &[])).item() - want).abs() < 1e-12);
    // A 0-dim loss is what backward starts from.
    let x = randn(&[2, 2], 10).requires_grad_();
    let loss = x.cross_entropy(&Indices::from_vec(vec![0, 1], &[2]));
    assert_eq!(loss.shape(), &[] as &[usize]);
    assert_eq!(loss.backward().get(&x).unwrap().shape(), &[2, 2]);
}

/// 1-D operands of matmul, as in `torch.matmul`: vector @ vector is a 0-dim dot product,
/// vector @ matrix and matrix @ vector drop the vector's dim; gradients flow to both sides.
#[test]
fn matmul_of_vectors_follows_torch() {
    let a = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0], &[3]).requires_grad_();
    let b = Tensor::<f64>::from_vec(vec![4.0, 5.0, 6.0], &[3]).requires_grad_();
    let dot = a.matmul(&b);
    assert_eq!(dot.shape(), &[] as &[usize]);
    assert_eq!(dot.item(), 32.0);
    let g = dot.backward();
    assert_eq!(g.get(&a).unwrap().to_vec(), vec![4.0, 5.0, 6.0]);
    assert_eq!(g.get(&b).unwrap().to_vec(), vec![1.0, 2.0, 3.0]);
    // In the low precisions too (f32 accumulation, one rounding).
    let h = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3]).cast::<f16>();
    assert_eq!(h.matmul(&h).item().to_f32(), 14.0);
    let m = Tensor::<f64>::from_vec((0..6).map(f64::from).collect(), &[3, 2]);
    assert_eq!(a.matmul(&m).shape(), &[2]);
    assert_eq!(a.matmul(&m).to_vec(), vec![16.0, 22.0]);
    assert_eq!(m.t().matmul(&a).to_vec(), vec![16.0, 22.0]);
    // Batched matrix @ vector: [2, 2, 3] @ [3] -> [2, 2].
    let bm = Tensor::<f64>::ones(&[2, 2, 3]);
    assert_eq!(bm.matmul(&a).shape(), &[2, 2]);
    // A length mismatch is an error naming both shapes, not a panic.
    let err = a.try_matmul(&Tensor::ones(&[4])).unwrap_err().to_string();
    assert!(err.contains("[3]") && err.contains("[4]"), "{err}");
}

// ---- known values ----------------------------------------------------------------------------

/// PyTorch's cross-entropy (mean reduction) computed directly in f64 from its definition:
/// `(1 - s) * nll_mean + (s / C) * sum_i(-sum_c logp[i, c]) / n_valid`.
fn reference_cross_entropy(x: &[f64], c: usize, targets: &[i64], ignore: Option<i64>, s: f64) -> f64 {
    let (mut nll, mut smooth, mut n) = (0.0, 0.0, 0usize);
    for (i, &t) in targets.iter().enumerate() {
        if Some(t) == ignore {
            continue;
        }
        let row = &x[i * c..(i + 1) * c];
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        nll += -(row[t as usize] - lse);
        smooth += -row.iter().map(|v| v - lse).sum::<f64>();
        n += 1;
    }
    (1.0 - s) * nll / n as f64 + (s / c as f64) * smooth / n as f64
}

#[test]
fn cross_entropy_matches_the_formula_by_hand() {
    // Two rows by hand: logits [0, ln 3] and [ln 2, 0], targets 1 and 0.
    // Row 0: p = [1/4, 3/4], -log p[1] = ln(4/3). Row 1: p = [2/3, 1/3], -log p[0] = ln(3/2).
    let x = Tensor::<f64>::from_vec(vec![0.0, 3f64.ln(), 2f64.ln(), 0.0], &[2, 2]);
    let t = Indices::from_vec(vec![1, 0], &[2]);
    let want = ((4.0f64 / 3.0).ln() + 1.5f64.ln()) / 2.0;
    assert!((x.cross_entropy(&t).item() - want).abs() < 1e-15);
    // With label smoothing 0.2 over C = 2: each row adds (0.2/2)·(-sum log p) and keeps 0.8 of
    // its nll. Row 0: -sum log p = ln 4 + ln(4/3); row 1: ln(3/2) + ln 3.
    let smooth = CrossEntropyOptions { label_smoothing: 0.2, ..Default::default() };
    let want_s = 0.8 * want + 0.1 * ((4f64.ln() + (4.0f64 / 3.0).ln()) + (1.5f64.ln() + 3f64.ln())) / 2.0;
    assert!((x.cross_entropy_with(&t, smooth).item() - want_s).abs() < 1e-15);

    // Random logits against the f64 reference, every option combination.
    let (n, c) = (7, 5);
    let xs = randn(&[n, c], 11).mul_scalar(3.0);
    let v = xs.to_vec();
    let targets = [4, -100, 0, 2, -100, 1, 4];
    for (ignore, s) in [(Some(-100), 0.0), (Some(-100), 0.3), (Some(4), 0.1), (Some(-100), 1.0)] {
        let tg: Vec<i64> = targets.iter().map(|&t| if t == -100 { ignore.unwrap() } else { t }).collect();
        let opts = CrossEntropyOptions { ignore_index: ignore, label_smoothing: s };
        let got = xs.cross_entropy_with(&Indices::from_vec(tg.clone(), &[n]), opts).item();
        let want = reference_cross_entropy(&v, c, &tg, ignore, s);
        assert!((got - want).abs() < 1e-12 * want.abs().max(1.0), "{ignore:?} {s}: {got} vs {want}");
    }
    // In f32 with large logits (max subtraction keeps it finite).
    let big = Tensor::<f32>::from_vec(vec![1000.0, 0.0, -1000.0, 1000.0], &[2, 2]);
    let l = big.cross_entropy(&Indices::from_vec(vec![0, 0], &[2])).item();
    assert!((l - 1000.0).abs() < 1e-3, "{l}"); // row 0: 0, row 1: 2000, mean 1000
}

#[test]
fn cross_entropy_ignores_rows_like_pytorch() {
    let x = randn(&[3, 4], 12).requires_grad_();
    // An ignored row changes neither the loss nor its own gradient (which is zero).
    let l_all = x.cross_entropy(&Indices::from_vec(vec![1, 2, 3], &[3]));
    let l_ign = x.cross_entropy(&Indices::from_vec(vec![1, -100, 3], &[3]));
    let two = x.narrow(0, 0, 1).cross_entropy(&Indices::from_vec(vec![1], &[1])).item()
        + x.narrow(0, 2, 1).cross_entropy(&Indices::from_vec(vec![3], &[1])).item();
    assert!((l_ign.item() - two / 2.0).abs() < 1e-14, "the mean is over the counted rows only");
    assert_ne!(l_all.item(), l_ign.item());
    let g = l_ign.backward();
    let gx = g.get(&x).unwrap().to_vec();
    assert_eq!(&gx[4..8], &[0.0; 4]);
    // Each counted row's gradient is (softmax - onehot) / 2.
    let p = x.narrow(0, 0, 1).softmax(1).to_vec();
    for j in 0..4 {
        let want = (p[j] - if j == 1 { 1.0 } else { 0.0 }) / 2.0;
        assert!((gx[j] - want).abs() < 1e-15);
    }
    // Every row ignored: NaN loss (0/0) and zero gradients, as PyTorch gives.
    let all = x.cross_entropy(&Indices::from_vec(vec![-100; 3], &[3]));
    assert!(all.item().is_nan());
    assert_eq!(all.backward().get(&x).unwrap().to_vec(), vec![0.0; 12]);
    // A custom ignore_index that is a real class.
    let opts = CrossEntropyOptions { ignore_index: Some(2), label_smoothing: 0.0 };
    let l2 = x.cross_entropy_with(&Indices::from_vec(vec![1, 2, 3], &[3]), opts).item();
    assert!((l2 - two / 2.0).abs() < 1e-14);
}

#[test]
fn mse_and_norms_by_hand() {
    let a = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = Tensor::<f64>::from_vec(vec![1.0, 0.0, 5.0, 4.0], &[2, 2]);
    assert_eq!(a.mse_loss(&b).item(), 2.0); // (0 + 4 + 4 + 0) / 4
    // Layer norm of [1, 2, 3, 4]: mean 2.5, biased variance 1.25.
    let x = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 4]);
    let y = x.layer_norm(None, None, 0.0).to_vec();
    let r = 1.25f64.sqrt();
    for (got, want) in y.iter().zip([-1.5 / r, -0.5 / r, 0.5 / r, 1.5 / r]) {
        assert!((got - want).abs() < 1e-15);
    }
    let w = Tensor::<f64>::from_vec(vec![2.0, 2.0, 2.0, 2.0], &[4]);
    let bias = Tensor::<f64>::from_vec(vec![1.0, 1.0, 1.0, 1.0], &[4]);
    let y2 = x.layer_norm(Some(&w), Some(&bias), 0.0).to_vec();
    assert!(y2.iter().zip(&y).all(|(a, b)| (a - (2.0 * b + 1.0)).abs() < 1e-15));
    // RMS norm of [3, 4]: rms = sqrt(12.5).
    let y = Tensor::<f64>::from_vec(vec![3.0, 4.0], &[2]).rms_norm(None, 0.0).to_vec();
    assert!((y[0] - 3.0 / 12.5f64.sqrt()).abs() < 1e-15 && (y[1] - 4.0 / 12.5f64.sqrt()).abs() < 1e-15);
    // eps enters under the root.
    let y = Tensor::<f64>::from_vec(vec![1.0, -1.0], &[2]).layer_norm(None, None, 3.0).to_vec();
    assert_eq!(y, vec![0.5, -0.5]);
}

// ---- dropout ---------------------------------------------------------------------------------

#[test]
fn dropout_statistics_scaling_and_reproducibility() {
    let n = 200_000;
    let x = Tensor::<f32>::ones(&[n]);
    let p = 0.3;
    let y = x.dropout(p, true, &mut Rng::seed(42)).to_vec();
    let kept = y.iter().filter(|&&v| v != 0.0).count();
    let frac = 1.0 - kept as f64 / n as f64;
    assert!((frac - p).abs() < 0.005, "dropped fraction {frac}");
    let scale = (1.0 / (1.0 - p)) as f32;
    assert!(y.iter().all(|&v| v == 0.0 || v == scale), "kept values are scaled by 1/(1-p)");
    // Same seed, same mask; another seed, another mask; the generator advances one draw.
    assert_eq!(x.dropout(p, true, &mut Rng::seed(42)).to_vec(), y);
    assert_ne!(x.dropout(p, true, &mut Rng::seed(43)).to_vec(), y);
    let mut rng = Rng::seed(42);
    let first = x.dropout(p, true, &mut rng).to_vec();
    let second = x.dropout(p, true, &mut rng).to_vec();
    assert_eq!(first, y);
    assert_ne!(first, second);
    let mut probe = Rng::seed(42);
    probe.next_u64();
    probe.next_u64();
    assert_eq!(rng, probe, "two calls draw exactly two numbers");
    // Eval mode and p = 0 are the identity and draw nothing.
    let mut r = Rng::seed(1);
    assert_eq!(x.dropout(p, false, &mut r).to_vec(), x.to_vec());
    assert_eq!(x.dropout(0.0, true, &mut r).to_vec(), x.to_vec());
    assert_eq!(r, Rng::seed(1));
    // The mask is the same in every precision (it depends on the seed and position only).
    let h = x.cast::<bf16>().dropout(p, true, &mut Rng::seed(42)).to_f32_vec();
    assert!(h.iter().zip(&y).all(|(a, b)| (*a == 0.0) == (*b == 0.0)));
    // The gradient goes through the same mask, with the same scale.
    let leaf = Tensor::<f32>::ones(&[1000]).requires_grad_();
    let out = leaf.dropout(0.5, true, &mut Rng::seed(3));
    let g = out.sum_all().backward();
    assert_eq!(g.get(&leaf).unwrap().to_vec(), out.to_vec());
}

#[test]
fn causal_mask_hides_the_future() {
    let m = Mask::causal(3);
    assert_eq!(m.shape(), &[3, 3]);
    #[rustfmt::skip]
    assert_eq!(m.to_vec(), vec![
        false, true, true,
        false, false, true,
        false, false, false,
    ]);
    assert_eq!(m.count(), 3);
    assert_eq!((!&m).count(), 6);
    assert_eq!(!m.clone(), !&m);
    // Masked attention rows: each query attends to itself and the past only.
    let scores = Tensor::<f32>::zeros(&[2, 3, 3]);
    let p = scores.masked_fill(&m, f64::NEG_INFINITY).softmax(2).to_vec();
    let want = [1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0];
    for (i, (got, w)) in p.iter().zip(want.iter().cycle()).enumerate() {
        assert!((got - w).abs() < 1e-7, "{i}: {got} vs {w}");
    }
    // masked_fill's gradient is zero where it filled.
    let x = Tensor::<f64>::ones(&[3, 3]).requires_grad_();
    let g = x.masked_fill(&m, 0.0).sum_all().backward();
    assert_eq!(g.get(&x).unwrap().to_vec(), (!&m).as_slice().iter().map(|&k| k as u8 as f64).collect::<Vec<_>>());
    assert_eq!(Mask::causal(0).numel(), 0);
    assert_eq!(Mask::causal(1).to_vec(), vec![false]);
}

/// `cat` reads strided parts (permuted, transposed, narrowed, broadcast) in place: the same
/// values as concatenating their contiguous copies, small and large enough to run in parallel.
#[test]
fn cat_of_strided_views_matches_cat_of_their_copies() {
    let mut rng = Rng::seed(7);
    let check = |parts: &[&Tensor<f32>], dim: usize| {
        let copies: Vec<Tensor<f32>> = parts.iter().map(|p| p.contiguous()).collect();
        let copies: Vec<&Tensor<f32>> = copies.iter().collect();
        assert_eq!(Tensor::cat(parts, dim).to_vec(), Tensor::cat(&copies, dim).to_vec(), "dim {dim}");
    };
    let a = Tensor::<f32>::randn(&[4, 6, 5, 7], &mut rng).permute(&[0, 2, 1, 3]); // [4, 5, 6, 7]
    let b = Tensor::<f32>::randn(&[4, 5, 3, 7], &mut rng);
    let c = Tensor::<f32>::randn(&[4, 5, 7, 2], &mut rng).transpose(2, 3); // [4, 5, 2, 7]
    let d = Tensor::<f32>::randn(&[1, 5, 1, 7], &mut rng).broadcast_to(&[4, 5, 4, 7]);
    let e = Tensor::<f32>::randn(&[4, 5, 9, 7], &mut rng).narrow(2, 3, 5);
    check(&[&a, &b, &c, &d, &e], 2);
    let f = Tensor::<f32>::randn(&[1, 1, 6, 7], &mut rng).broadcast_to(&[4, 2, 6, 7]);
    check(&[&a.narrow(1, 1, 3), &a.narrow(1, 0, 2), &f], 1);
    // A part whose memory runs span several output rows (broadcast over the outermost dim).
    let g = Tensor::<f32>::randn(&[1, 3, 2, 5], &mut rng).broadcast_to(&[4, 3, 2, 5]);
    check(&[&g, &Tensor::<f32>::randn(&[4, 3, 1, 5], &mut rng)], 2);
    check(&[&a.transpose(0, 3), &c.transpose(0, 3)], 2);
    // W2's q, k and v gradients seen in qkv's memory order ([B, T, 1, H, hd] each, concatenated
    // along the 1), k's transposed: the case autograd's narrow backward builds.
    let qkv = |rng: &mut Rng| Tensor::<f32>::randn(&[16, 4, 128, 64], rng).reshape(&[1, 16, 4, 128, 64]);
    let (q, v) = (qkv(&mut rng), qkv(&mut rng));
    let k = Tensor::<f32>::randn(&[16, 4, 64, 128], &mut rng).transpose(2, 3).reshape(&[1, 16, 4, 128, 64]);
    let mem = |t: &Tensor<f32>| t.permute(&[1, 3, 0, 2, 4]);
    check(&[&mem(&q), &mem(&k), &mem(&v)], 2);
}

/// `reshape` returns views where strides allow; writing into such a view (`cast_into`) must
/// not write through to the tensor it views, as no in-place write does on shared storage.
#[test]
fn writing_into_a_reshaped_view_leaves_the_viewed_tensor_alone() {
    let mut rng = Rng::seed(9);
    let x = Tensor::<f32>::randn(&[3, 2, 4], &mut rng).permute(&[1, 0, 2]); // [2, 3, 4]
    let before = x.to_vec();
    // Drops the size-1 dim of a narrow of a permuted tensor: a view of x's storage.
    let mut v = x.narrow(0, 1, 1).reshape(&[3, 4]);
    let ones = Tensor::<f64>::ones(&[3, 4]);
    ones.cast_into(&mut v);
    assert_eq!(v.to_vec(), vec![1.0; 12]);
    assert_eq!(x.to_vec(), before);
    // A view of a whole contiguous tensor, still shared with it.
    let y = Tensor::<f32>::randn(&[2, 6], &mut rng);
    let mut w = y.reshape(&[3, 4]);
    ones.cast_into(&mut w);
    assert_ne!(y.to_vec(), vec![1.0; 12]);
}

#[test]
fn cat_stack_and_embedding_values() {
    let a = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = Tensor::<f64>::from_vec(vec![5.0, 6.0], &[2, 1]);
    assert_eq!(Tensor::cat(&[&a, &b], 1).to_vec(), vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
    assert_eq!(Tensor::cat(&[&a.t(), &b.t()], 0).to_vec(), vec![1.0, 3.0, 2.0, 4.0, 5.0, 6.0]);
    let s = Tensor::stack(&[&a, &a.mul_scalar(10.0)], 1);
    assert_eq!(s.shape(), &[2, 2, 2]);
    assert_eq!(s.to_vec(), vec![1.0, 2.0, 10.0, 20.0, 3.0, 4.0, 30.0, 40.0]);
    // The embedding gradient adds repeated ids' rows.
    let w = Tensor::<f64>::zeros(&[3, 2]).requires_grad_();
    let ids = Indices::from_vec(vec![2, 0, 2], &[3]);
    let seed = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    let g = w.embedding(&ids).mul(&seed).sum_all().backward();
    assert_eq!(g.get(&w).unwrap().to_vec(), vec![3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);
    // A big vocabulary runs the parallel scatter: same answer as a plain loop.
    let (v, d, n) = (5000, 16, 3000);
    let ids: Vec<i64> = (0..n).map(|i| ((i * 7919) % 97) as i64 * 13 % v as i64).collect();
    let w = Tensor::<f32>::zeros(&[v, d]).requires_grad_();
    let up = Tensor::<f32>::randn(&[n, d], &mut Rng::seed(13));
    let g = w.embedding(&Indices::from_vec(ids.clone(), &[n])).mul(&up).sum_all().backward();
    let mut want = vec![0f32; v * d];
    let upv = up.to_vec();
    for (r, &id) in ids.iter().enumerate() {
        for j in 0..d {
            want[id as usize * d + j] += upv[r * d + j];
        }
    }
    assert_eq!(g.get(&w).unwrap().to_vec(), want, "ascending-position accumulation in f32");
}

/// The gradient of a transposed operand comes back in the operand's own memory order (as
/// PyTorch's `mm` backward returns it): `k` of `q @ k.t()` gets a contiguous gradient, which the
/// `qkv` gradient's concatenation copies in runs (a transposed one it gathered element by
/// element).
#[test]
fn a_transposed_operand_gets_its_gradient_in_its_own_memory_order() {
    let (q, k) = (randn(&[2, 3, 5, 4], 1).requires_grad_(), randn(&[2, 3, 6, 4], 2).requires_grad_());
    let g = q.matmul(&k.t()).square().sum_all().backward();
    let (gq, gk) = (g.get(&q).unwrap(), g.get(&k).unwrap());
    assert_eq!(gk.shape(), &[2, 3, 6, 4]);
    assert!(gk.layout().is_contiguous(), "k's gradient: {:?}", gk.layout());
    // The values of the product taken the other way round: through a contiguous copy of k's
    // transpose (the same sums in another order of the f64 kernel's blocks).
    let g2 = q.matmul(&k.t().contiguous()).square().sum_all().backward();
    for (got, want) in [(gk, g2.get(&k).unwrap()), (gq, g2.get(&q).unwrap())] {
        for (a, b) in got.to_vec().iter().zip(want.to_vec()) {
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}
