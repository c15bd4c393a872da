//! Buffers (`#[param(buffer)]`): state saved and moved with a module, never trained.

use std::path::PathBuf;

use amp_core::checkpoint::{LoadOptions, TensorFile, load_weights, load_weights_with, save_tensors, save_weights};
use amp_core::nn::Linear;
use amp_core::optim::{Optimizer, Sgd};
use amp_core::param::ToDevice;
use amp_core::{Cpu, Device, Indices, Param, Params, Rng, Tensor};

/// A norm-like module with two running statistics and a counter.
#[derive(Params, Debug, Clone)]
struct Stats<D: Device = Cpu> {
    weight: Param<f32, D>,
    #[param(buffer)]
    running_mean: Tensor<f32, D>,
    #[param(buffer, rename = "count")]
    num_batches_tracked: Tensor<f32, D>,
    #[param(skip)]
    momentum: f64,
}

#[derive(Params, Debug, Clone)]
struct Net<D: Device = Cpu> {
    stats: Stats<D>,
    fc: Linear<f32, D>,
    layers: Vec<Stats<D>>,
}

fn stats(n: usize, seed: u64) -> Stats {
    let mut rng = Rng::seed(seed);
    Stats {
        weight: Param::new(Tensor::randn(&[n], &mut rng)),
        running_mean: Tensor::randn(&[n], &mut rng),
        num_batches_tracked: Tensor::scalar(3.0),
        momentum: 0.1,
    }
}

fn net() -> Net {
    Net { stats: stats(4, 1), fc: Linear::new(4, 4, true, &mut Rng::seed(2)), layers: vec![stats(4, 3), stats(4, 4)] }
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("buffers").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn buffers_are_listed_with_pytorch_names_and_are_not_parameters() {
    let m = net();
    let buffers: Vec<String> = m.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        buffers,
        [
            "stats.running_mean",
            "stats.count",
            "layers.0.running_mean",
            "layers.0.count",
            "layers.1.running_mean",
            "layers.1.count"
        ]
    );
    let params: Vec<String> = m.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(params, ["stats.weight", "fc.weight", "fc.bias", "layers.0.weight", "layers.1.weight"]);
    assert_eq!(m.num_params(), 4 + 16 + 4 + 4 + 4, "buffers are not counted as parameters");
}

#[test]
fn buffers_get_no_gradient_and_an_optimizer_step_leaves_them_alone() {
    let mut m = net();
    let x = Tensor::<f32>::randn(&[2, 4], &mut Rng::seed(9));
    // The buffer takes part in the forward pass, as batch norm's running mean does in eval.
    let y = m.fc.forward::<f32, f32>(&x.sub(&m.stats.running_mean)).mul(&m.stats.weight);
    let grads = y.square().mean_all().backward();
    assert_eq!(grads.len(), 3, "weight, fc.weight and fc.bias only");
    let before: Vec<Vec<f32>> = m.named_buffers().into_iter().map(|(_, b)| b.to_vec()).collect();
    let mut opt = Sgd::new(0.5).build().unwrap();
    opt.step(&mut m, &grads).unwrap();
    let after: Vec<Vec<f32>> = m.named_buffers().into_iter().map(|(_, b)| b.to_vec()).collect();
    assert_eq!(before, after);
}

#[test]
fn buffers_are_saved_loaded_and_moved() {
    let dir = fresh_dir("round_trip");
    let file = dir.join("model.safetensors");
    let m = net();
    save_weights(&file, &m).unwrap();
    let mut other = net();
    for (_, b) in other.named_buffers_mut() {
        *b = b.mul_scalar(0.0);
    }
    load_weights(&file, &mut other).unwrap();
    let values = |m: &Net| m.named_buffers().into_iter().map(|(n, b)| (n, b.to_vec())).collect::<Vec<_>>();
    assert_eq!(values(&other), values(&m));
    // Moving the module moves its buffers with their values.
    let moved: Net<Cpu> = m.to_device(&Cpu);
    assert_eq!(values(&moved), values(&m));
    assert_eq!(moved.stats.momentum, 0.1, "skipped fields are cloned");
}

#[test]
fn a_strict_load_names_a_missing_buffer_and_an_integer_counter_loads() {
    let dir = fresh_dir("strict");
    let file = dir.join("partial.safetensors");
    // PyTorch's layout for the first module only, with the counter as I64 (as PyTorch stores
    // `num_batches_tracked`).
    let mut tf = TensorFile::new();
    tf.insert("weight", Tensor::<f32>::ones(&[4]));
    tf.insert("running_mean", Tensor::<f32>::full(&[4], 0.25));
    tf.insert("count", Indices::from_vec(vec![7], &[]));
    save_tensors(&file, &tf).unwrap();
    let mut s = stats(4, 5);
    load_weights(&file, &mut s).unwrap();
    assert_eq!(s.running_mean.to_vec(), vec![0.25; 4]);
    assert_eq!(s.num_batches_tracked.item(), 7.0);

    let mut tf = TensorFile::new();
    tf.insert("weight", Tensor::<f32>::ones(&[4]));
    save_tensors(&file, &tf).unwrap();
    let err = load_weights(&file, &mut stats(4, 6)).unwrap_err().to_string();
    assert!(err.contains("tensor `running_mean` is missing: the model has this buffer"), "{err}");
    let report = load_weights_with(&file, &mut stats(4, 6), &LoadOptions::new().strict(false)).unwrap();
    assert_eq!(report.missing, ["running_mean", "count"]);
}
