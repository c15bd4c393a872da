//! Every op's gradient against central finite differences in f64, including broadcasting.

mod common;
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
