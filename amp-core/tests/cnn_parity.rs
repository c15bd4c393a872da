//! A fixed-weight CNN (conv with bias and padding, batch norm in training mode, max pooling,
//! a strided grouped conv, batch norm, average and adaptive pooling, linear, cross-entropy)
//! against PyTorch's f32 results recorded by `tests/python/cnn_reference.py`: the loss, the
//! logits, every gradient and the running statistics within 1e-5.

use amp_core::{BatchNormOptions, Conv2dOptions, Indices, Tensor};
use serde_json::Value;

/// The same closed-form values as the script's `fill`: `sin(0.37 i + offset) * scale` in
/// f64, rounded once to f32.
fn fill(shape: &[usize], offset: f64, scale: f64) -> Tensor<f32> {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| (0.37 * i as f64 + offset).sin() * scale).collect();
    Tensor::from_f64s(&v, shape)
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().expect("an array").iter().map(|x| x.as_f64().expect("a number")).collect()
}

#[track_caller]
fn close(name: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 * w.abs().max(1.0);
        assert!((*g as f64 - w).abs() <= tol, "{name}[{i}]: {g} vs PyTorch {w}");
    }
}

#[test]
fn a_fixed_weight_cnn_matches_pytorch_in_f32() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/cnn_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();

    let x = fill(&[2, 3, 9, 9], 0.1, 1.0);
    let w1 = fill(&[8, 3, 3, 3], 0.2, 0.3).requires_grad_();
    let b1 = fill(&[8], 0.3, 0.1).requires_grad_();
    let g1 = fill(&[8], 0.4, 0.2).add_scalar(1.0).requires_grad_();
    let be1 = fill(&[8], 0.5, 0.1).requires_grad_();
    let w2 = fill(&[8, 4, 3, 3], 0.6, 0.3).requires_grad_();
    let g2 = fill(&[8], 0.7, 0.2).add_scalar(1.0).requires_grad_();
    let be2 = fill(&[8], 0.8, 0.1).requires_grad_();
    let wl = fill(&[5, 8], 0.9, 0.4).requires_grad_();
    let bl = fill(&[5], 1.0, 0.1).requires_grad_();
    let (mut rm1, mut rv1) = (Tensor::<f32>::zeros(&[8]), Tensor::<f32>::ones(&[8]));
    let (mut rm2, mut rv2) = (Tensor::<f32>::zeros(&[8]), Tensor::<f32>::ones(&[8]));
    let targets = Indices::from_vec(vec![1, 4], &[2]);
    let bn = BatchNormOptions { training: true, momentum: 0.1, eps: 1e-5 };

    let h = x.conv2d(&w1, Some(&b1), Conv2dOptions { padding: (1, 1), ..Default::default() });
    let h = h.batch_norm(Some(&mut rm1), Some(&mut rv1), Some(&g1), Some(&be1), bn).relu();
    let h = h.max_pool2d((3, 3), (2, 2), (1, 1));
    let grouped = Conv2dOptions { stride: (2, 2), padding: (1, 1), groups: 2, ..Default::default() };
    let h = h.conv2d(&w2, None, grouped);
    let h = h.batch_norm(Some(&mut rm2), Some(&mut rv2), Some(&g2), Some(&be2), bn).relu();
    let h = h.avg_pool2d((2, 2), (1, 1), (0, 0));
    let h = h.adaptive_avg_pool2d((1, 1)).reshape(&[2, 8]);
    let logits = h.linear(&wl, Some(&bl));
    let loss = logits.cross_entropy(&targets);
    let grads = loss.backward();

    close("loss", &[loss.item()], &[reference["loss"].as_f64().unwrap()]);
    close("logits", &logits.to_vec(), &floats(&reference["logits"]));
    for (name, t) in [
        ("w1", &w1),
        ("b1", &b1),
        ("g1", &g1),
        ("be1", &be1),
        ("w2", &w2),
        ("g2", &g2),
        ("be2", &be2),
        ("wl", &wl),
        ("bl", &bl),
    ] {
        close(name, &grads.get(t).expect("a gradient").to_vec(), &floats(&reference["grads"][name]));
    }
    for (name, t) in [("rm1", &rm1), ("rv1", &rv1), ("rm2", &rm2), ("rv2", &rv2)] {
        close(name, &t.to_vec(), &floats(&reference["running"][name]));
    }
}
