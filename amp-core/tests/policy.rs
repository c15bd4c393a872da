//! The run-time policy table, and `#[autocast]` used from amp-core directly (generated code
//! reaches `::amp_core::__private`; the facade's tests cover `::amp::__private`).

use amp_core::policy::{self, Category, OpPolicy, POLICY};
use amp_core::{DType, Param, Rng, Tensor, autocast, bf16};

#[test]
fn rows_are_unique_and_lookups_follow_try_forms() {
    let mut names: Vec<&str> = POLICY.iter().map(|r| r.op).collect();
    names.sort_unstable();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "duplicate rows");
    for row in POLICY {
        assert_eq!(policy::lookup(&format!("try_{}", row.op)), Some(row));
        assert!(row.call.contains(row.op));
        assert!(row.call.matches("tensor").count() >= row.tensor_args, "{row:?}");
    }
    assert!(policy::lookup("backward").is_none());
}

#[test]
fn output_precision_per_category() {
    let row = |op| *policy::lookup(op).unwrap();
    let (matmul, exp, sum, add, relu): (OpPolicy, OpPolicy, OpPolicy, OpPolicy, OpPolicy) =
        (row("matmul"), row("exp"), row("sum"), row("add"), row("relu"));
    assert_eq!(matmul.category, Category::LowerPrecision);
    assert_eq!(matmul.output_dtype(DType::BF16, &[DType::F32, DType::F32]), DType::BF16);
    assert_eq!(exp.output_dtype(DType::F16, &[DType::F16]), DType::F32);
    assert_eq!(sum.category, Category::Fp32Accumulate);
    assert_eq!(sum.output_dtype(DType::F16, &[DType::BF16]), DType::F32);
    assert_eq!(add.output_dtype(DType::F16, &[DType::F16, DType::F32]), DType::F32);
    assert_eq!(add.output_dtype(DType::F16, &[DType::F16, DType::BF16]), DType::F32);
    assert_eq!(add.output_dtype(DType::F16, &[DType::BF16, DType::BF16]), DType::BF16);
    assert_eq!(relu.output_dtype(DType::F16, &[DType::BF16]), DType::BF16);
}

#[test]
fn printed_table_is_markdown_with_every_row() {
    let text = policy::PolicyTable.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "| op | call | category | why |");
    assert_eq!(lines.len(), POLICY.len() + 2);
    assert!(text.contains("| `matmul` | `x.matmul(&tensor)` | lower precision |"));
    assert!(text.contains("| `layer_norm` | `x.layer_norm(Some(&tensor), Some(&tensor), _)` | fp32 |"));
    assert!(text.contains("| `cat` | `Tensor::cat(&[&tensor, ..], _)` | promote |"));
}

struct Mlp {
    w1: Param,
    w2: Param,
}

impl Mlp {
    #[autocast(bf16)]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let h = x.matmul(&self.w1).gelu();
        assert_eq!(h.dtype(), DType::BF16);
        let y = h.matmul(&self.w2);
        assert_eq!(y.dtype(), DType::BF16);
        y.log_softmax(1)
    }
}

#[test]
fn autocast_through_amp_core_directly() {
    let mut rng = Rng::seed(1);
    let m = Mlp { w1: Param::new(Tensor::randn(&[4, 8], &mut rng)), w2: Param::new(Tensor::randn(&[8, 3], &mut rng)) };
    let x = Tensor::<f32>::randn(&[2, 4], &mut rng);
    let y = m.forward(&x);
    assert_eq!(y.dtype(), DType::F32);
    let g = y.sum_all().backward();
    assert_eq!(g.get(&m.w1).unwrap().dtype(), DType::F32);
    // Same result as the casts written out.
    let by_hand =
        x.cast::<bf16>().matmul(&m.w1.cast::<bf16>()).gelu().matmul(&m.w2.cast::<bf16>()).cast::<f32>().log_softmax(1);
    assert_eq!(y.to_vec(), by_hand.to_vec());
}

struct ConvBlock {
    w: Param,
    b: Param,
}

impl ConvBlock {
    /// conv2d lowered to bf16 (its bias too); batch norm, pooling and flatten_dims run as
    /// their bf16 input, batch norm with f32 running buffers.
    #[autocast(bf16)]
    fn forward(&self, x: &Tensor<f32>, mean: &mut Tensor<f32>, var: &mut Tensor<f32>) -> Tensor<f32> {
        let y = x.conv2d(&self.w, Some(&self.b), amp_core::Conv2dOptions { padding: (1, 1), ..Default::default() });
        assert_eq!(y.dtype(), DType::BF16);
        let train = amp_core::BatchNormOptions { training: true, ..Default::default() };
        let n = y.batch_norm(Some(mean), Some(var), None, None, train);
        assert_eq!(n.dtype(), DType::BF16, "batch_norm runs as its input");
        let p = n.relu().max_pool2d((2, 2), (2, 2), (0, 0)).avg_pool2d((1, 2), (1, 1), (0, 0));
        let p = p.adaptive_avg_pool2d((1, 1)).flatten_dims(1, 3);
        assert_eq!(p.dtype(), DType::BF16, "pooling and flatten_dims run as their input");
        p.sum(1, false)
    }
}

#[test]
fn autocast_lowers_conv2d_and_passes_batch_norm_and_pooling_through() {
    let mut rng = Rng::seed(2);
    let m = ConvBlock {
        w: Param::new(Tensor::randn(&[3, 2, 3, 3], &mut rng)),
        b: Param::new(Tensor::randn(&[3], &mut rng)),
    };
    let x = Tensor::<f32>::randn(&[2, 2, 4, 4], &mut rng);
    let (mut mean, mut var) = (Tensor::<f32>::zeros(&[3]), Tensor::<f32>::ones(&[3]));
    let y = m.forward(&x, &mut mean, &mut var);
    assert_eq!(y.dtype(), DType::F32);
    assert!(mean.to_vec().iter().any(|v| *v != 0.0), "training updated the f32 running mean");
    let g = y.sum_all().backward();
    assert_eq!(g.get(&m.w).unwrap().dtype(), DType::F32);
    assert_eq!(g.get(&m.b).unwrap().dtype(), DType::F32);
}

/// A helper without the attribute: its conv2d is not rewritten.
fn unreached_conv(x: &Tensor<f32>, w: &Tensor<f32>) -> Tensor<f32> {
    x.conv2d(w, None, amp_core::Conv2dOptions::default())
}

#[autocast(bf16)]
fn calls_unreached_conv(x: &Tensor<f32>, w: &Tensor<f32>) -> Tensor<f32> {
    unreached_conv(x, w)
}

#[test]
#[should_panic(expected = "`conv2d` ran on a f32 tensor inside a `#[autocast]` (bf16) region")]
fn conv2d_unreached_by_autocast_panics_with_the_fix() {
    calls_unreached_conv(&Tensor::zeros(&[1, 1, 3, 3]), &Tensor::zeros(&[1, 1, 2, 2]));
}
