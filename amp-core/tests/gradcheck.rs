//! Every op's gradient against central finite differences in f64, including broadcasting.

use crate::common;
use amp_core::Tensor;
use common::{gradcheck, randn};

#[test]
fn binary_ops_with_broadcasting() {
    let a = randn(&[2, 3], 1);
    let b = randn(&[3], 2);
    let c = randn(&[2, 1], 3).add_scalar(3.0); // away from 0 for div
    gradcheck(&[a.clone(), b.clone()], |t| t[0].add(&t[1]).square().sum_all());
    gradcheck(&[a.clone(), b.clone()], |t| t[0].sub(&t[1]).square().sum_all());
    gradcheck(&[a.clone(), b.clone()], |t| t[0].mul(&t[1]).sum_all());
    gradcheck(&[a.clone(), c.clone()], |t| t[0].div(&t[1]).square().sum_all());
    gradcheck(&[b, c], |t| (&t[0] * &t[1] - &t[1] / 2.0).square().sum_all());
}

#[test]
fn unary_ops() {
    let x = randn(&[7], 4);
    let pos = x.square().add_scalar(0.5);
    type F = fn(&Tensor<f64>) -> Tensor<f64>;
    let ops: [(&str, F); 8] = [
        ("neg", |t| t.neg()),
        ("relu", |t| t.relu()),
        ("gelu", |t| t.gelu()),
        ("gelu_tanh", |t| t.gelu_tanh()),
        ("tanh", |t| t.tanh()),
        ("sigmoid", |t| t.sigmoid()),
        ("silu", |t| t.silu()),
        ("exp", |t| t.exp()),
    ];
    for (name, op) in ops {
        eprintln!("{name}");
        gradcheck(std::slice::from_ref(&x), |t| op(&t[0]).square().sum_all());
    }
    gradcheck(std::slice::from_ref(&pos), |t| t[0].log().sum_all());
    gradcheck(std::slice::from_ref(&pos), |t| t[0].sqrt().sum_all());
    gradcheck(std::slice::from_ref(&pos), |t| t[0].powf(1.7).sum_all());
    gradcheck(std::slice::from_ref(&pos), |t| t[0].rdiv_scalar(2.0).sum_all());
}

#[test]
fn matmul_2d_batched_and_broadcast() {
    gradcheck(&[randn(&[3, 4], 5), randn(&[4, 2], 6)], |t| t[0].matmul(&t[1]).square().sum_all());
    gradcheck(&[randn(&[2, 3, 4], 7), randn(&[4, 5], 8)], |t| t[0].matmul(&t[1]).square().sum_all());
    gradcheck(&[randn(&[2, 1, 3, 4], 9), randn(&[3, 4, 2], 10)], |t| t[0].matmul(&t[1]).square().sum_all());
    gradcheck(&[randn(&[4], 11), randn(&[4, 3], 12)], |t| t[0].matmul(&t[1]).square().sum_all());
    gradcheck(&[randn(&[3, 4], 13), randn(&[3, 5], 14)], |t| t[0].t().matmul(&t[1]).square().sum_all());
    // Transposed (column-major) operands get their gradients as transposed products: the right
    // one (attention's `q @ k.t()`), both, batched, square, and broadcast over a batch.
    gradcheck(&[randn(&[3, 4], 15), randn(&[5, 4], 16)], |t| t[0].matmul(&t[1].t()).square().sum_all());
    gradcheck(&[randn(&[4, 3], 17), randn(&[5, 4], 18)], |t| t[0].t().matmul(&t[1].t()).square().sum_all());
    gradcheck(&[randn(&[2, 3, 4], 19), randn(&[2, 3, 4], 20)], |t| t[0].matmul(&t[1].t()).square().sum_all());
    gradcheck(&[randn(&[4, 4], 21), randn(&[4, 4], 22)], |t| t[0].t().matmul(&t[1].t()).square().sum_all());
    gradcheck(&[randn(&[2, 3, 4], 23), randn(&[5, 4], 24)], |t| t[0].matmul(&t[1].t()).square().sum_all());
    gradcheck(&[randn(&[4, 2, 3], 25), randn(&[4, 5], 26)], |t| t[0].transpose(0, 2).matmul(&t[1]).square().sum_all());
}

#[test]
fn reductions_and_views() {
    let x = randn(&[2, 3, 4], 15);
    for d in 0..3 {
        for keep in [false, true] {
            gradcheck(std::slice::from_ref(&x), |t| t[0].sum(d, keep).square().sum_all());
            gradcheck(std::slice::from_ref(&x), |t| t[0].mean(d, keep).square().sum_all());
            gradcheck(std::slice::from_ref(&x), |t| t[0].max(d, keep).square().sum_all());
            gradcheck(std::slice::from_ref(&x), |t| t[0].min(d, keep).square().sum_all());
        }
    }
    let w = randn(&[2, 3, 4], 16);
    gradcheck(&[x.clone(), w.clone()], |t| t[0].permute(&[2, 0, 1]).mul(&t[1].permute(&[2, 0, 1])).sum_all());
    gradcheck(&[x.clone(), w.clone()], |t| {
        t[0].transpose(0, 2).contiguous().reshape(&[4, 6]).mul(&t[1].reshape(&[4, 6])).sum_all()
    });
    gradcheck(std::slice::from_ref(&x), |t| t[0].narrow(1, 1, 2).square().sum_all());
    gradcheck(&[randn(&[3, 1], 17)], |t| t[0].broadcast_to(&[2, 3, 4]).mul(&x).sum_all());
}

#[test]
fn cast_backward_casts_the_gradient_back() {
    use amp_core::{Param, f16};
    let w = Param::new(Tensor::<f32>::from_vec(vec![1.0, -2.0, 3.0], &[3]));
    let y = w.cast::<f16>().mul_scalar(3.0).cast::<f32>().square().sum_all();
    let g = y.backward();
    let gw: &Tensor<f32> = g.get(&w).expect("a gradient for the f32 parameter");
    // d/dw (3w)^2 = 18 w, exact in f16 for these values.
    assert_eq!(gw.to_vec(), vec![18.0, -36.0, 54.0]);
}

/// `sum(t * w)` with fixed random weights `w`: a scalar whose gradient is `w`, so ops whose
/// outputs sum to a constant (softmax) still get a non-trivial check.
fn weighted(t: &Tensor<f64>, seed: u64) -> Tensor<f64> {
    t.mul(&randn(t.shape(), seed)).sum_all()
}

#[test]
fn softmax_and_log_softmax_over_every_dim() {
    let x = randn(&[2, 3, 4], 20).mul_scalar(2.0);
    for d in 0..3 {
        gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].softmax(d), 21));
        gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].log_softmax(d), 22));
    }
    // A strided (transposed) input, and a 0-dim input.
    gradcheck(&[randn(&[4, 3], 23)], |t| weighted(&t[0].t().softmax(1), 24));
    gradcheck(&[randn(&[], 25)], |t| t[0].softmax(0).mul_scalar(3.0).add(&t[0]).sum_all());
    gradcheck(&[randn(&[], 25)], |t| t[0].log_softmax(0).add(&t[0].square()).sum_all());
    // Large logits: the max subtraction keeps both passes finite.
    let big = randn(&[3, 5], 26).mul_scalar(300.0);
    gradcheck(std::slice::from_ref(&big), |t| weighted(&t[0].div_scalar(100.0).log_softmax(1), 27));
}

#[test]
fn layer_norm_with_and_without_affine() {
    let x = randn(&[2, 3, 5], 30);
    let w = randn(&[5], 31);
    let b = randn(&[5], 32);
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].layer_norm(None, None, 1e-5), 33));
    gradcheck(&[x.clone(), w.clone()], |t| weighted(&t[0].layer_norm(Some(&t[1]), None, 1e-5), 34));
    gradcheck(&[x.clone(), b.clone()], |t| weighted(&t[0].layer_norm(None, Some(&t[1]), 1e-5), 35));
    gradcheck(&[x.clone(), w.clone(), b.clone()], |t| weighted(&t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5), 36));
    // Only the parameters require gradients (a frozen input), and a transposed input.
    gradcheck(&[w.clone(), b.clone()], |t| weighted(&x.layer_norm(Some(&t[0]), Some(&t[1]), 0.1), 37));
    gradcheck(&[randn(&[5, 4], 38)], |t| weighted(&t[0].t().layer_norm(None, None, 1e-5), 39));
    // Large offset: the two-pass variance does not cancel.
    gradcheck(&[randn(&[2, 6], 40).add_scalar(1000.0)], |t| weighted(&t[0].layer_norm(None, None, 1e-5), 41));
}

#[test]
fn rms_norm_with_and_without_weight() {
    let x = randn(&[3, 2, 6], 42);
    let w = randn(&[6], 43);
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].rms_norm(None, 1e-6), 44));
    gradcheck(&[x.clone(), w.clone()], |t| weighted(&t[0].rms_norm(Some(&t[1]), 1e-6), 45));
    gradcheck(std::slice::from_ref(&w), |t| weighted(&x.rms_norm(Some(&t[0]), 0.5), 46));
}

#[test]
fn cross_entropy_with_ignore_index_and_label_smoothing() {
    use amp_core::{CrossEntropyOptions, Indices};
    let x = randn(&[5, 4], 50).mul_scalar(2.0);
    let t = Indices::from_vec(vec![3, 0, -100, 2, 0], &[5]);
    gradcheck(std::slice::from_ref(&x), |l| l[0].cross_entropy(&t));
    for (ignore, smoothing) in [(Some(-100), 0.0), (Some(-100), 0.1), (Some(0), 0.25), (None, 0.0), (Some(2), 1.0)] {
        // Row 2 is ignored (or, with no ignore_index, an ordinary row of class 1).
        let t = Indices::from_vec(vec![3, 0, ignore.unwrap_or(1), 2, 0], &[5]);
        let opts = CrossEntropyOptions { ignore_index: ignore, label_smoothing: smoothing };
        gradcheck(std::slice::from_ref(&x), |l| l[0].cross_entropy_with(&t, opts).mul_scalar(1.7));
    }
    // 1-D logits with a 0-dim target, and logits that are a strided view.
    gradcheck(&[randn(&[6], 51)], |l| l[0].cross_entropy(&Indices::from_vec(vec![4], &[])));
    gradcheck(&[randn(&[4, 5], 52)], |l| l[0].t().cross_entropy(&t));
}

#[test]
fn mse_loss_for_input_and_target() {
    gradcheck(&[randn(&[3, 4], 53), randn(&[3, 4], 54)], |t| t[0].mse_loss(&t[1]));
    gradcheck(&[randn(&[4, 3], 55), randn(&[3, 4], 56)], |t| t[0].t().mse_loss(&t[1]).mul_scalar(-2.0));
}

#[test]
fn dropout_routes_the_gradient_through_the_same_mask() {
    use amp_core::Rng;
    let x = randn(&[4, 50], 57);
    // The closure reseeds, so every evaluation draws the same mask.
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].dropout(0.3, true, &mut Rng::seed(9)), 58));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].dropout(0.3, false, &mut Rng::seed(9)), 59));
}

#[test]
fn embedding_with_repeated_ids() {
    use amp_core::Indices;
    let w = randn(&[5, 3], 60);
    let ids = Indices::from_vec(vec![0, 2, 2, 4, 0, 2], &[2, 3]); // row 1 and 3 unused
    gradcheck(std::slice::from_ref(&w), |t| weighted(&t[0].embedding(&ids), 61));
    gradcheck(std::slice::from_ref(&w), |t| weighted(&t[0].embedding(&Indices::from_vec(vec![3], &[])), 62));
    // A transposed weight (a tied output projection looked up as an embedding).
    gradcheck(&[randn(&[3, 5], 63)], |t| weighted(&t[0].t().embedding(&ids), 64));
}

#[test]
fn masked_fill_with_broadcast_masks() {
    use amp_core::Mask;
    let x = randn(&[2, 3, 4], 70);
    let bits = |n: usize, seed: u64| {
        let mut r = amp_core::Rng::seed(seed);
        (0..n).map(|_| r.uniform() < 0.4).collect::<Vec<_>>()
    };
    for shape in [vec![2, 3, 4], vec![3, 4], vec![4], vec![2, 1, 4], vec![1, 3, 1], vec![]] {
        let m = Mask::from_vec(bits(shape.iter().product(), 71), &shape);
        gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].masked_fill(&m, -3.0), 72));
    }
    // The mask is larger than the input: the output broadcasts, the gradient sums back.
    let m = Mask::from_vec(bits(24, 73), &[2, 3, 4]);
    gradcheck(&[randn(&[3, 1], 74)], |t| weighted(&t[0].masked_fill(&m, 5.0), 75));
    let causal = Mask::causal(4);
    gradcheck(&[randn(&[2, 4, 4], 76)], |t| t[0].masked_fill(&causal, f64::NEG_INFINITY).softmax(2).square().sum_all());
}

#[test]
fn where_cond_with_broadcasting() {
    use amp_core::Mask;
    let m = Mask::from_vec(vec![true, false, false, true, true, false], &[2, 3]);
    let cases: [(Vec<usize>, Vec<usize>, &Mask); 4] = [
        (vec![2, 3], vec![2, 3], &m),
        (vec![3], vec![2, 1], &m),
        (vec![1, 3], vec![], &m),
        (vec![4, 2, 3], vec![3], &m),
    ];
    for (i, (sa, sb, m)) in cases.into_iter().enumerate() {
        let (a, b) = (randn(&sa, 80 + i as u64), randn(&sb, 90 + i as u64));
        gradcheck(&[a, b], |t| weighted(&Tensor::where_cond(m, &t[0], &t[1]), 99));
    }
    // Only one side requires a gradient.
    let b = randn(&[2, 3], 100);
    gradcheck(&[randn(&[2, 3], 101)], |t| weighted(&Tensor::where_cond(&m, &t[0], &b), 102));
    gradcheck(&[randn(&[2, 3], 103)], |t| weighted(&Tensor::where_cond(&m, &b, &t[0]), 104));
    // A broadcast mask: [2, 1] against [2, 3] operands.
    let col = Mask::from_vec(vec![false, true], &[2, 1]);
    gradcheck(&[randn(&[2, 3], 105), randn(&[2, 3], 106)], |t| weighted(&Tensor::where_cond(&col, &t[0], &t[1]), 107));
}

#[test]
fn cat_and_stack_along_several_dims() {
    for dim in 0..3 {
        let mut s = [2, 3, 4];
        let a = randn(&s, 110);
        s[dim] = 1;
        let b = randn(&s, 111);
        s[dim] = 3;
        let c = randn(&s, 112);
        gradcheck(&[a, b, c], |t| weighted(&Tensor::cat(&[&t[0], &t[1], &t[2]], dim), 113));
    }
    // One input twice, a strided input, and a constant input that needs no gradient.
    let k = randn(&[3, 2], 114);
    gradcheck(&[randn(&[2, 3], 115)], |t| weighted(&Tensor::cat(&[&t[0], &t[0].t().t(), &k.t()], 1), 116));
    for dim in 0..=2 {
        gradcheck(&[randn(&[3, 2], 117), randn(&[3, 2], 118)], |t| {
            weighted(&Tensor::stack(&[&t[0], &t[1], &t[0]], dim), 119)
        });
    }
    gradcheck(&[randn(&[], 120), randn(&[], 121)], |t| weighted(&Tensor::stack(&[&t[0], &t[1]], 0), 122));
}

#[test]
fn linear_with_and_without_bias() {
    let x = randn(&[2, 3, 4], 40);
    let w = randn(&[5, 4], 41);
    let b = randn(&[5], 42);
    gradcheck(&[x.clone(), w.clone(), b], |t| t[0].linear(&t[1], Some(&t[2])).square().sum_all());
    gradcheck(&[x, w], |t| t[0].linear(&t[1], None).square().sum_all());
    // A strided (transposed) weight view.
    gradcheck(&[randn(&[3, 4], 43), randn(&[4, 5], 44)], |t| t[0].linear(&t[1].t(), None).square().sum_all());
}

/// Narrows of one tensor share one gradient buffer (each window added in place, or windows
/// that tile the tensor concatenated): splits into chunks (arriving in reverse order, so the
/// concatenation must sort them), overlapping windows, windows of a middle dim, narrows mixed with dense uses of the
/// same tensor in either order, and a running gradient that another tensor still shares (it
/// must be copied, not written into).
#[test]
fn narrow_windows_accumulate_into_one_buffer() {
    let x = randn(&[6, 4], 80);
    // Three chunks (a `split`), weighted differently so a misplaced window shows.
    gradcheck(std::slice::from_ref(&x), |t| {
        (0..3).map(|i| weighted(&t[0].narrow(0, 2 * i, 2), 81 + i as u64)).fold(Tensor::scalar(0.0), |a, b| a.add(&b))
    });
    // Overlapping windows, and windows of the inner dim (many runs per window).
    gradcheck(std::slice::from_ref(&x), |t| {
        weighted(&t[0].narrow(0, 1, 4), 84)
            .add(&weighted(&t[0].narrow(0, 3, 3), 85))
            .add(&weighted(&t[0].narrow(1, 1, 2), 86))
    });
    let y = randn(&[2, 3, 4], 87);
    gradcheck(std::slice::from_ref(&y), |t| {
        weighted(&t[0].narrow(1, 0, 1), 88).add(&weighted(&t[0].narrow(1, 1, 2).exp(), 89))
    });
    // Dense uses before and after the narrows in the graph.
    gradcheck(std::slice::from_ref(&x), |t| {
        let p = t[0].mul_scalar(1.5);
        weighted(&p.square(), 90).add(&weighted(&p.narrow(0, 2, 3), 91)).add(&weighted(&p.tanh(), 92))
    });
    // `p + w` hands one gradient to both `p` and the leaf `w`, which keeps it: the windows
    // and dense gradients added into `p`'s gradient must not leak into `w`'s.
    let w = randn(&[6, 4], 93);
    // Each in both orders: the engine meets `p`'s uses in the reverse of the order its
    // depth-first walk first reached them.
    for add_first in [false, true] {
        gradcheck(&[x.clone(), w.clone()], |t| {
            let p = t[0].mul_scalar(2.0);
            let a = weighted(&p.add(&t[1]), 94);
            let n = weighted(&p.narrow(1, 0, 3), 95).add(&weighted(&p.narrow(0, 4, 2), 96));
            if add_first { n.add(&a) } else { a.add(&n) }
        });
        gradcheck(&[x.clone(), w.clone()], |t| {
            let p = t[0].mul_scalar(2.0);
            let (a, s) = (weighted(&p.add(&t[1]), 97), weighted(&p.square(), 98));
            if add_first { s.add(&a) } else { a.add(&s) }
        });
    }
    // Chunks of a permuted view, as attention cuts q, k and v out of one qkv tensor.
    let z = randn(&[2, 3, 6], 96);
    gradcheck(std::slice::from_ref(&z), |t| {
        let v = t[0].reshape(&[2, 3, 3, 2]).permute(&[2, 0, 1, 3]);
        let part = |i: usize| v.narrow(0, i, 1).reshape(&[2, 3, 2]);
        weighted(&part(0).matmul(&part(1).t()).matmul(&part(2)), 97)
    });
}

/// Attention's `q`, `k` and `v`, narrows of one permuted `qkv`, each the operand of one
/// product: the products write their gradients straight into `qkv`'s gradient buffer (the
/// profile test sees no concatenation), with the values the concatenation gives (forced here by
/// a copy between each narrow and its product), in every precision. Also the parts that cannot
/// be written in place: one read twice, one read by another op (each comes the usual way and is
/// copied in), one not read at all (zeros).
#[test]
fn narrowed_operands_get_their_gradients_written_in_place() {
    use amp_core::{Precision, Rng, bf16, f16};
    fn grads<E: Precision>(variant: usize, copy: bool) -> Vec<f64> {
        let (b, t, h, hd) = (2, 8, 2, 4);
        let mut rng = Rng::seed(7);
        let x = Tensor::<f32>::randn(&[b, t, 3 * h * hd], &mut rng).cast::<E>().requires_grad_();
        let weights = Tensor::<f32>::randn(&[b, h, t, hd], &mut rng);
        let qkv = x.reshape(&[b, t, 3, h, hd]).permute(&[2, 0, 3, 1, 4]);
        let part = |i: usize| {
            let p = qkv.narrow(0, i, 1).reshape(&[b, h, t, hd]);
            if copy { p.contiguous() } else { p }
        };
        let (q, k, v) = (part(0), part(1), part(2));
        let y = match variant {
            0 => q.matmul(&k.t()).mul_scalar(0.5).matmul(&v),
            // `q` read twice, `v` through tanh.
            1 => q.matmul(&k.t()).add(&q.matmul(&q.t())).mul_scalar(0.5).matmul(&v.tanh()),
            // `v` not read: its window of the gradient is zero.
            _ => q.matmul(&k.t()).mul_scalar(0.5).matmul(&k),
        };
        let g = y.cast::<f32>().mul(&weights).sum_all().backward();
        g.get(&x).unwrap().to_vec().into_iter().map(|v| v.to_f64()).collect()
    }
    fn check<E: Precision>() {
        for variant in 0..3 {
            // Equal values (a zero's sign aside: with a window missing, the usual path adds the
            // later windows into zeros).
            assert_eq!(grads::<E>(variant, false), grads::<E>(variant, true), "{} variant {variant}", E::DTYPE);
        }
    }
    check::<f32>();
    check::<bf16>();
    check::<f16>();
    check::<f64>();
}

#[test]
fn split_gradients_are_exact_and_leave_shared_gradients_alone() {
    use amp_core::Grads;
    // Each element's gradient comes from exactly one window: exact values, no rounding.
    let x = Tensor::<f32>::from_vec((0..12).map(|v| v as f32).collect(), &[3, 4]).requires_grad_();
    let loss = (0..3)
        .map(|i| x.narrow(0, i, 1).mul_scalar((i + 1) as f64).sum_all())
        .fold(Tensor::scalar(0.0), |a, b| a.add(&b));
    let g = loss.backward();
    let want: Vec<f32> = (0..12).map(|j| (j / 4 + 1) as f32).collect();
    assert_eq!(g.get(&x).unwrap().to_vec(), want);
    // A leaf whose values are a transposed view: its split gradient is still handed back
    // row-major (the memory-order concatenation is only for views inside the graph).
    let xt = Tensor::<f32>::from_vec((0..12).map(|v| v as f32).collect(), &[4, 3]).t().requires_grad_();
    let loss = (0..3)
        .map(|i| xt.narrow(0, i, 1).mul_scalar((i + 1) as f64).sum_all())
        .fold(Tensor::scalar(0.0), |a, b| a.add(&b));
    let gt = loss.backward();
    let gt = gt.get(&xt).unwrap();
    assert!(gt.layout().is_contiguous());
    assert_eq!(gt.to_vec(), want);
    // Accumulating into a copy of a `Grads` leaves the original untouched (shared buffers are
    // never written in place).
    let mut acc: Grads = g.clone();
    acc.accumulate(x.square().sum_all().backward());
    assert_eq!(g.get(&x).unwrap().to_vec(), want);
    let doubled: Vec<f32> = (0..12).map(|j| (j / 4 + 1) as f32 + 2.0 * j as f32).collect();
    assert_eq!(acc.get(&x).unwrap().to_vec(), doubled);
}

#[test]
fn conv2d_with_stride_padding_dilation_groups_and_bias() {
    use amp_core::Conv2dOptions;
    let x = randn(&[2, 4, 7, 6], 130);
    let w = randn(&[6, 2, 3, 2], 131); // groups 2: 4 / 2 input channels per group
    let b = randn(&[6], 132);
    let opts = Conv2dOptions { stride: (2, 2), padding: (1, 1), dilation: (2, 2), groups: 2 };
    gradcheck(&[x.clone(), w.clone(), b.clone()], |t| weighted(&t[0].conv2d(&t[1], Some(&t[2]), opts), 133));
    gradcheck(&[x.clone(), w.clone()], |t| weighted(&t[0].conv2d(&t[1], None, opts), 134));
    // Defaults; mixed per-dim options; only the weight, or only the bias, needing gradients.
    gradcheck(&[randn(&[1, 3, 5, 5], 135), randn(&[2, 3, 3, 3], 136)], |t| {
        weighted(&t[0].conv2d(&t[1], None, Conv2dOptions::default()), 137)
    });
    let mixed = Conv2dOptions { stride: (1, 3), padding: (2, 0), dilation: (1, 2), groups: 1 };
    gradcheck(&[x.clone(), randn(&[3, 4, 2, 2], 138), b.narrow(0, 0, 3)], |t| {
        weighted(&t[0].conv2d(&t[1], Some(&t[2]), mixed), 139)
    });
    gradcheck(std::slice::from_ref(&w), |t| weighted(&x.conv2d(&t[0], Some(&b), opts), 140));
    gradcheck(std::slice::from_ref(&b), |t| weighted(&x.conv2d(&w, Some(&t[0]), opts), 141));
    // A strided (permuted) input and a depthwise convolution (groups = channels).
    let depthwise = Conv2dOptions { padding: (1, 1), groups: 4, ..Default::default() };
    gradcheck(&[randn(&[2, 6, 7, 4], 142), randn(&[4, 1, 3, 3], 143)], |t| {
        weighted(&t[0].permute(&[0, 3, 2, 1]).conv2d(&t[1], None, depthwise), 144)
    });
}

#[test]
fn pooling_max_average_and_adaptive() {
    let x = randn(&[2, 3, 7, 6], 150);
    // Overlapping windows (kernel 3, stride 2) with padding, and disjoint ones.
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].max_pool2d((3, 2), (2, 2), (1, 1)), 151));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].max_pool2d((2, 2), (2, 2), (0, 0)), 152));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].avg_pool2d((3, 3), (2, 1), (1, 1)), 153));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].avg_pool2d((2, 3), (2, 3), (0, 0)), 154));
    // Adaptive windows that overlap (7 -> 3, 6 -> 4), one window, more outputs than inputs.
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].adaptive_avg_pool2d((3, 4)), 155));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].adaptive_avg_pool2d((1, 1)), 156));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].adaptive_avg_pool2d((9, 8)), 157));
    // A 3-D input and a transposed one.
    gradcheck(&[randn(&[3, 5, 5], 158)], |t| weighted(&t[0].max_pool2d((3, 3), (1, 1), (1, 1)), 159));
    gradcheck(&[randn(&[2, 3, 6, 7], 160)], |t| {
        weighted(&t[0].transpose(2, 3).avg_pool2d((2, 2), (1, 1), (1, 0)), 161)
    });
}

#[test]
fn batch_norm_in_training_and_in_eval() {
    use amp_core::BatchNormOptions;
    let x = randn(&[3, 4, 2, 3], 170);
    let (w, b) = (randn(&[4], 171), randn(&[4], 172));
    let train = BatchNormOptions { training: true, ..Default::default() };
    let eval = BatchNormOptions::default();
    // Running buffers (f32), fresh in every evaluation: training updates them.
    let mean = Tensor::<f32>::from_f64s(&[0.3, -0.2, 1.0, 0.0], &[4]);
    let var = Tensor::<f32>::from_f64s(&[0.5, 2.0, 1.25, 0.75], &[4]);
    let run = |t: &Tensor<f64>, w: Option<&Tensor<f64>>, b: Option<&Tensor<f64>>, opts| {
        let (mut m, mut v) = (mean.clone(), var.clone());
        t.batch_norm(Some(&mut m), Some(&mut v), w, b, opts)
    };
    // Training: through the batch statistics, with and without affine and buffers.
    gradcheck(&[x.clone(), w.clone(), b.clone()], |t| weighted(&run(&t[0], Some(&t[1]), Some(&t[2]), train), 173));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].batch_norm(None, None, None, None, train), 174));
    gradcheck(&[x.clone(), w.clone()], |t| weighted(&t[0].batch_norm(None, None, Some(&t[1]), None, train), 175));
    // Eval: a fixed affine map of the input.
    gradcheck(&[x.clone(), w.clone(), b.clone()], |t| weighted(&run(&t[0], Some(&t[1]), Some(&t[2]), eval), 176));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&run(&t[0], None, None, eval), 177));
    // [N, C] input, a large offset (two-pass variance), and a strided input.
    gradcheck(&[randn(&[5, 4], 178)], |t| weighted(&run(&t[0], Some(&w), None, train), 179));
    gradcheck(&[randn(&[4, 4, 3], 180).add_scalar(1000.0)], |t| weighted(&run(&t[0], None, Some(&b), train), 181));
    gradcheck(&[randn(&[3, 2, 4], 182)], |t| weighted(&run(&t[0].transpose(1, 2), None, None, train), 183));
}

#[test]
fn flatten_dims_is_a_reshape() {
    let x = randn(&[2, 3, 4, 2], 190);
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].flatten_dims(1, 2), 191));
    gradcheck(std::slice::from_ref(&x), |t| weighted(&t[0].permute(&[3, 1, 0, 2]).flatten_dims(0, 3), 192));
}

/// Causal attention as separate ops: scores, mask, softmax, values.
fn attention_unfused(q: &Tensor<f64>, k: &Tensor<f64>, v: &Tensor<f64>) -> Tensor<f64> {
    let (r, t) = (q.rank(), q.shape()[q.rank() - 2]);
    let d = q.shape()[r - 1] as f64;
    let scores = q.matmul(&k.transpose(r - 2, r - 1)).mul_scalar(1.0 / d.sqrt());
    scores.masked_fill(&amp_core::Mask::causal(t), f64::NEG_INFINITY).softmax(r - 1).matmul(v)
}

#[test]
fn causal_attention_equals_the_unfused_ops_and_finite_differences() {
    // t = 150 spans three of the CPU kernel's key blocks (64); t = 1 sees only itself; a
    // rank-3 input has no head dim; strided (transposed) inputs go through the same kernel.
    for (i, shape) in [[2usize, 3, 150, 8].as_slice(), &[1, 1, 1, 4], &[3, 7, 5]].into_iter().enumerate() {
        let s = 10 * i as u64;
        let (q, k, v) = (randn(shape, 200 + s), randn(shape, 201 + s).mul_scalar(2.0), randn(shape, 202 + s));
        let w = randn(shape, 203 + s); // weights of the output in the loss: every gradient row differs
        type Attention = fn(&Tensor<f64>, &Tensor<f64>, &Tensor<f64>) -> Tensor<f64>;
        let run = |f: Attention| {
            let (q, k, v) = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_());
            let y = f(&q, &k, &v);
            let g = y.mul(&w).sum_all().backward();
            let mut out = vec![y.to_vec()];
            out.extend([&q, &k, &v].map(|x| g.get(x).unwrap().to_vec()));
            out
        };
        let fused = run(|q, k, v| q.causal_attention(k, v));
        let unfused = run(attention_unfused);
        for (what, (a, b)) in ["output", "dq", "dk", "dv"].iter().zip(fused.iter().zip(&unfused)) {
            for (j, (a, b)) in a.iter().zip(b).enumerate() {
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{shape:?} {what}[{j}]: fused {a}, unfused {b}");
            }
        }
    }
    let t = |s| randn(&[1, 2, 5, 3], s);
    gradcheck(&[t(210), t(211), t(212)], |x| x[0].causal_attention(&x[1], &x[2]).square().sum_all());
    // Transposed views ([.., d, t] read as [.., t, d]) are gathered first.
    let (q, k, v) = (randn(&[2, 4, 6], 220), randn(&[2, 4, 6], 221), randn(&[2, 4, 6], 222));
    let strided = q.transpose(1, 2).causal_attention(&k.transpose(1, 2), &v.transpose(1, 2)).to_vec();
    let contiguous = q
        .transpose(1, 2)
        .contiguous()
        .causal_attention(&k.transpose(1, 2).contiguous(), &v.transpose(1, 2).contiguous());
    assert_eq!(strided, contiguous.to_vec());
}
