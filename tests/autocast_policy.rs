//! The macro and the run-time policy table cannot drift: for every row of
//! `amp::policy::POLICY`, an `#[autocast]` function calling that op (under f16 and under bf16)
//! returns the precision the row predicts, and the rows exercised here are exactly the table.

use std::collections::BTreeSet;
use std::sync::Mutex;

use amp::policy::{self, Category, POLICY};
use amp::prelude::*;
use amp::{CrossEntropyOptions, Tensor};

/// The ops each case exercised, to compare with the table.
static SEEN: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

fn t<E: Precision>(shape: &[usize]) -> Tensor<E> {
    let n: usize = shape.iter().product();
    Tensor::from_f64s(&(0..n).map(|i| 0.25 + 0.5 * (i % 7) as f64).collect::<Vec<_>>(), shape)
}

fn ids() -> amp::Indices {
    amp::Indices::from_vec(vec![0, 2], &[2])
}

fn mask() -> amp::Mask {
    amp::Mask::from_vec(vec![true, false, false, true, true, false], &[2, 3])
}

/// Checks one op: the precision the `#[autocast]` call returned against the table's answer.
fn check(op: &'static str, autocast: DType, inputs: &[DType], got: Option<DType>) {
    let row = policy::lookup(op).unwrap_or_else(|| panic!("`{op}` has no row"));
    SEEN.lock().unwrap().insert(row.op);
    if let Some(got) = got {
        let want = row.output_dtype(autocast, inputs);
        assert_eq!(got, want, "`{op}` ({}) under {autocast} with inputs {inputs:?}", row.category);
    }
}

/// One `#[autocast]` function per op and precision: `$x` (and `$y`) are its tensor inputs of
/// precisions `$X` (`$Y`); the body is the op call; the precisions of the tensor operands that
/// the op reads are listed in `[$($in),*]` (the receiver first).
macro_rules! case {
    ($op:literal, $low:ident, |$x:ident: $X:ty $(, $y:ident: $Y:ty)?| [$($in:ty),*] $body:expr) => {{
        #[autocast($low)]
        #[allow(unused_variables)]
        fn run($x: &Tensor<$X> $(, $y: &Tensor<$Y>)?) -> Option<DType> {
            $body
        }
        let low = <$low as Precision>::DTYPE;
        let got = run(&t::<$X>(&[2, 3]) $(, &t::<$Y>(&[2, 3]))?);
        check($op, low, &[$(<$in as Precision>::DTYPE),*], got);
    }};
}

/// Runs every case under one autocast type.
macro_rules! all_cases {
    ($low:ident) => {
        // lower precision
        case!("matmul", $low, |x: f32, y: f16| [f32, f16] Some(x.matmul(&y.t()).dtype()));
        case!("causal_attention", $low, |x: f32, y: f16| [f32, f16, f32] Some(x.causal_attention(&y, &x).dtype()));
        case!("linear", $low, |x: f32, w: f16| [f32, f16] {
            let b = w.narrow(1, 0, 1).reshape(&[2]);
            Some(x.linear(&w, Some(&b)).dtype())
        });
        // The f16 weight and bias are lowered with the f32 input.
        case!("conv2d", $low, |x: f32, w: f16| [f32, f16] {
            let (x, b) = (x.reshape(&[1, 1, 2, 3]), w.reshape(&[6]).narrow(0, 0, 1));
            Some(x.conv2d(&w.reshape(&[1, 1, 2, 3]), Some(&b), amp::Conv2dOptions::default()).dtype())
        });
        // fp32
        case!("exp", $low, |x: f16| [f16] Some(x.exp().dtype()));
        case!("log", $low, |x: bf16| [bf16] Some(x.log().dtype()));
        case!("sqrt", $low, |x: f16| [f16] Some(x.sqrt().dtype()));
        case!("powf", $low, |x: f16| [f16] Some(x.powf(3.0).dtype()));
        // Runs as `square` inside, under `powf`'s row.
        case!("powf", $low, |x: f16| [f16] Some(x.powf(2.0).dtype()));
        // The f16 weight and bias are cast too (else they would not match the f32 input).
        case!("layer_norm", $low, |x: f16, w: f16| [f16] {
            let w = w.narrow(0, 0, 1).reshape(&[3]);
            Some(x.layer_norm(Some(&w), Some(&w), 1e-5).dtype())
        });
        // With its output type named (a turbofish, which `#[autocast]` leaves as written) on
        // the f32 input the region's layer norm would read.
        case!("layer_norm_to", $low, |x: f32, w: f32| [f32] {
            let w = w.narrow(0, 0, 1).reshape(&[3]);
            Some(x.layer_norm_to::<f32>(Some(&w), Some(&w), 1e-5).dtype())
        });
        // The bf16 argument is read into the f32 receiver's precision, as written.
        case!("add_cast", $low, |x: f32, y: bf16| [f32, bf16] Some(x.add_cast(&y).dtype()));
        case!("rms_norm", $low, |x: bf16, w: bf16| [bf16] {
            let w = w.narrow(0, 0, 1).reshape(&[3]);
            Some(x.rms_norm(Some(&w), 1e-6).dtype())
        });
        case!("cross_entropy", $low, |x: f16| [f16] Some(x.cross_entropy(&ids()).dtype()));
        case!("cross_entropy_with", $low, |x: f16| [f16] {
            Some(x.cross_entropy_with(&ids(), CrossEntropyOptions::default()).dtype())
        });
        case!("mse_loss", $low, |x: f16, y: f32| [f16, f32] Some(x.mse_loss(&y).dtype()));
        // fp32 accumulate
        case!("softmax", $low, |x: f16| [f16] Some(x.softmax(1).dtype()));
        case!("log_softmax", $low, |x: bf16| [bf16] Some(x.log_softmax(1).dtype()));
        case!("softmax_f32", $low, |x: bf16| [bf16] Some(x.softmax_f32(1).dtype()));
        case!("log_softmax_f32", $low, |x: f16| [f16] Some(x.log_softmax_f32(1).dtype()));
        case!("scaled_masked_softmax", $low, |x: bf16| [bf16] Some(x.scaled_masked_softmax(0.5, &mask()).dtype()));
        case!("sum", $low, |x: f16| [f16] Some(x.sum(1, false).dtype()));
        case!("mean", $low, |x: f16| [f16] Some(x.mean(0, true).dtype()));
        case!("sum_all", $low, |x: bf16| [bf16] Some(x.sum_all().dtype()));
        case!("mean_all", $low, |x: f16| [f16] Some(x.mean_all().dtype()));
        // promote
        case!("add", $low, |x: f16, y: f32| [f16, f32] Some(x.add(&y).dtype()));
        case!("sub", $low, |x: bf16, y: f16| [bf16, f16] Some(x.sub(&y).dtype()));
        case!("mul", $low, |x: bf16, y: bf16| [bf16, bf16] Some(x.mul(&y).dtype()));
        case!("div", $low, |x: f32, y: f16| [f32, f16] Some(x.div(&y).dtype()));
        case!("where_cond", $low, |x: f16, y: bf16| [f16, bf16] Some(Tensor::where_cond(&mask(), &x, &y).dtype()));
        case!("cat", $low, |x: f16, y: f32| [f16, f32] Some(Tensor::cat(&[&x, &y, &x], 0).dtype()));
        case!("stack", $low, |x: bf16, y: bf16| [bf16, bf16] Some(Tensor::stack(&[&x, &y], 1).dtype()));
        // passthrough
        case!("neg", $low, |x: f16| [f16] Some(x.neg().dtype()));
        case!("relu", $low, |x: bf16| [bf16] Some(x.relu().dtype()));
        case!("gelu", $low, |x: f16| [f16] Some(x.gelu().dtype()));
        case!("gelu_tanh", $low, |x: f16| [f16] Some(x.gelu_tanh().dtype()));
        case!("tanh", $low, |x: f32| [f32] Some(x.tanh().dtype()));
        case!("sigmoid", $low, |x: f16| [f16] Some(x.sigmoid().dtype()));
        case!("silu", $low, |x: bf16| [bf16] Some(x.silu().dtype()));
        case!("square", $low, |x: f16| [f16] Some(x.square().dtype()));
        case!("add_scalar", $low, |x: f16| [f16] Some(x.add_scalar(1.0).dtype()));
        case!("sub_scalar", $low, |x: f16| [f16] Some(x.sub_scalar(1.0).dtype()));
        case!("mul_scalar", $low, |x: bf16| [bf16] Some(x.mul_scalar(2.0).dtype()));
        case!("div_scalar", $low, |x: f16| [f16] Some(x.div_scalar(2.0).dtype()));
        case!("rdiv_scalar", $low, |x: f16| [f16] Some(x.rdiv_scalar(2.0).dtype()));
        case!("dropout", $low, |x: f16| [f16] Some(x.dropout(0.5, true, &mut Rng::seed(0)).dtype()));
        // Batch norm runs in its input's precision (f32 statistics inside; f32 weight, bias and
        // buffers taken as they are).
        case!("batch_norm", $low, |x: f16| [f16] {
            let (mut mean, mut var) = (Tensor::<f32>::zeros(&[3]), Tensor::<f32>::ones(&[3]));
            let (weight, bias) = (Tensor::<f32>::ones(&[3]), Tensor::<f32>::zeros(&[3]));
            let train = amp::BatchNormOptions { training: true, ..Default::default() };
            Some(x.batch_norm(Some(&mut mean), Some(&mut var), Some(&weight), Some(&bias), train).dtype())
        });
        case!("max_pool2d", $low, |x: bf16| [bf16] Some(x.unsqueeze(0).max_pool2d((2, 2), (1, 1), (1, 1)).dtype()));
        case!("avg_pool2d", $low, |x: f16| [f16] Some(x.unsqueeze(0).avg_pool2d((1, 2), (1, 1), (0, 0)).dtype()));
        case!("adaptive_avg_pool2d", $low, |x: bf16| [bf16] Some(x.unsqueeze(0).adaptive_avg_pool2d((1, 1)).dtype()));
        case!("embedding", $low, |x: f16| [f16] Some(x.t().embedding(&ids()).dtype()));
        case!("masked_fill", $low, |x: bf16| [bf16] Some(x.masked_fill(&mask(), -1e4).dtype()));
        case!("max", $low, |x: f16| [f16] Some(x.max(1, false).dtype()));
        case!("min", $low, |x: f16| [f16] Some(x.min(0, true).dtype()));
        case!("argmax", $low, |x: f16| [f16] {
            assert_eq!(x.argmax(1, false).to_vec(), vec![2, 2]);
            None
        });
        case!("argmin", $low, |x: f16| [f16] {
            assert_eq!(x.argmin(1, false).to_vec(), vec![0, 0]);
            None
        });
        case!("reshape", $low, |x: f16| [f16] Some(x.reshape(&[3, 2]).dtype()));
        case!("flatten", $low, |x: f16| [f16] Some(x.flatten().dtype()));
        case!("flatten_dims", $low, |x: bf16| [bf16] Some(x.unsqueeze(0).flatten_dims(1, 2).dtype()));
        case!("permute", $low, |x: bf16| [bf16] Some(x.permute(&[1, 0]).dtype()));
        case!("transpose", $low, |x: f16| [f16] Some(x.transpose(0, 1).dtype()));
        case!("t", $low, |x: f16| [f16] Some(x.t().dtype()));
        case!("narrow", $low, |x: f16| [f16] Some(x.narrow(1, 1, 2).dtype()));
        case!("slice", $low, |x: f16| [f16] Some(x.slice(1, 0..2).dtype()));
        case!("unsqueeze", $low, |x: f16| [f16] Some(x.unsqueeze(0).dtype()));
        case!("squeeze", $low, |x: f16| [f16] Some(x.unsqueeze(2).squeeze(2).dtype()));
        case!("broadcast_to", $low, |x: f16| [f16] Some(x.broadcast_to(&[4, 2, 3]).dtype()));
        case!("contiguous", $low, |x: f16| [f16] Some(x.t().contiguous().dtype()));
    };
}

#[test]
fn every_row_yields_the_precision_the_table_predicts() {
    all_cases!(f16);
    all_cases!(bf16);
    let seen = SEEN.lock().unwrap().clone();
    let table: BTreeSet<&str> = POLICY.iter().map(|r| r.op).collect();
    assert_eq!(seen, table, "every table row has a case here, and every case a row");
}

#[test]
fn the_table_is_printable_and_complete() {
    let text = policy::PolicyTable.to_string();
    for row in POLICY {
        assert!(text.contains(&format!("| `{}` |", row.op)), "{} missing from the printed table", row.op);
    }
    let count = |c| POLICY.iter().filter(|r| r.category == c).count();
    assert_eq!(count(Category::LowerPrecision), 4); // matmul, linear, conv2d, causal_attention
    assert!(count(Category::Fp32) >= 9 && count(Category::Fp32Accumulate) >= 6 && count(Category::Promote) >= 7);
    assert_eq!(policy::lookup("try_softmax").map(|r| r.category), Some(Category::Fp32Accumulate));
    assert_eq!(policy::promote_dtype(DType::F16, DType::BF16), DType::F32);
    assert_eq!(policy::promote_dtype(DType::BF16, DType::BF16), DType::BF16);
}
