//! Bad input: every `try_` form returns an error that names the op and the shapes (or dims,
//! or the offending value), and the plain form panics with exactly the same text.

use std::panic::{AssertUnwindSafe, catch_unwind};

use amp_core::{CrossEntropyOptions, Error, Indices, Mask, Rng, Tensor};

fn t(shape: &[usize]) -> Tensor<f32> {
    Tensor::zeros(shape)
}

/// Asserts `result` is an error with message `want`, and that `plain` panics with it too.
#[track_caller]
fn same_error<T: std::fmt::Debug, U>(result: Result<T, Error>, plain: impl FnOnce() -> U, want: &str) {
    let err = result.expect_err("the try_ form should fail");
    assert_eq!(err.to_string(), want);
    let payload = catch_unwind(AssertUnwindSafe(plain)).err().expect("the plain form should panic");
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .expect("a string panic payload");
    assert_eq!(msg, want, "the plain form panics with the try_ form's message");
}

#[test]
fn elementwise_matmul_and_reductions() {
    let (a, b) = (t(&[2, 3]), t(&[4]));
    same_error(a.try_add(&b), || a.add(&b), "add: shapes [2, 3] and [4] cannot be broadcast together");
    same_error(a.try_div(&b), || a.div(&b), "div: shapes [2, 3] and [4] cannot be broadcast together");
    let c = t(&[4, 5]);
    same_error(a.try_matmul(&c), || a.matmul(&c), "matmul: inner dims differ: 3 vs 4 (shapes [[2, 3], [4, 5]])");
    same_error(
        a.try_sum(2, false),
        || a.sum(2, false),
        "sum: dim 2 is out of range for a tensor of rank 2 (shape [2, 3])",
    );
    same_error(
        a.try_reshape(&[4]),
        || a.reshape(&[4]),
        "reshape: cannot reshape 6 elements into [4] (shapes [[2, 3], [4]])",
    );
}

#[test]
fn softmax_errors_name_the_dim_and_shape() {
    let x = t(&[2, 3]);
    same_error(
        x.try_softmax(2),
        || x.softmax(2),
        "softmax: dim 2 is out of range for a tensor of rank 2 (shape [2, 3])",
    );
    same_error(
        x.try_log_softmax(5),
        || x.log_softmax(5),
        "log_softmax: dim 5 is out of range for a tensor of rank 2 (shape [2, 3])",
    );
    let s = t(&[]);
    same_error(s.try_softmax(1), || s.softmax(1), "softmax: dim 1 is out of range for a tensor of rank 0 (shape [])");
}

#[test]
fn norm_errors_name_parameter_shapes_and_eps() {
    let (x, w3, w4) = (t(&[2, 4]), t(&[3]), t(&[4]));
    same_error(
        x.try_layer_norm(Some(&w3), None, 1e-5),
        || x.layer_norm(Some(&w3), None, 1e-5),
        "layer_norm: weight must have shape [4] (the input's last dim) (shapes [[2, 4], [3]])",
    );
    same_error(
        x.try_layer_norm(Some(&w4), Some(&w3), 1e-5),
        || x.layer_norm(Some(&w4), Some(&w3), 1e-5),
        "layer_norm: bias must have shape [4] (the input's last dim) (shapes [[2, 4], [4], [3]])",
    );
    same_error(
        x.try_layer_norm(None, None, -1.0),
        || x.layer_norm(None, None, -1.0),
        "layer_norm: invalid argument `eps`: must be finite and >= 0, got -1 (input shape [2, 4])",
    );
    same_error(
        x.try_rms_norm(Some(&t(&[2, 4])), 1e-6),
        || x.rms_norm(Some(&t(&[2, 4])), 1e-6),
        "rms_norm: weight must have shape [4] (the input's last dim) (shapes [[2, 4], [2, 4]])",
    );
    let s = t(&[]);
    same_error(
        s.try_rms_norm(None, 1e-6),
        || s.rms_norm(None, 1e-6),
        "rms_norm: the input needs at least one dim (shapes [[]])",
    );
    same_error(
        x.try_rms_norm(None, f64::NAN),
        || x.rms_norm(None, f64::NAN),
        "rms_norm: invalid argument `eps`: must be finite and >= 0, got NaN (input shape [2, 4])",
    );
}

#[test]
fn cross_entropy_errors() {
    let x = t(&[2, 4]);
    let bad = Indices::from_vec(vec![1, 5], &[2]);
    same_error(
        x.try_cross_entropy(&bad),
        || x.cross_entropy(&bad),
        "cross_entropy: index 5 at position 1 is out of range 0..4",
    );
    assert!(matches!(
        x.try_cross_entropy(&bad),
        Err(Error::IndexOutOfRange { op: "cross_entropy", index: 5, position: 1, bound: 4 })
    ));
    // -100 is ignored by default, but any other negative target is an error; with
    // ignore_index None, -100 is an error too.
    let neg = Indices::from_vec(vec![-1, -100], &[2]);
    same_error(
        x.try_cross_entropy(&neg),
        || x.cross_entropy(&neg),
        "cross_entropy: index -1 at position 0 is out of range 0..4",
    );
    let none = CrossEntropyOptions { ignore_index: None, ..Default::default() };
    let ignored = Indices::from_vec(vec![0, -100], &[2]);
    same_error(
        x.try_cross_entropy_with(&ignored, none),
        || x.cross_entropy_with(&ignored, none),
        "cross_entropy: index -100 at position 1 is out of range 0..4",
    );
    let three = Indices::from_vec(vec![0, 1, 2], &[3]);
    same_error(
        x.try_cross_entropy(&three),
        || x.cross_entropy(&three),
        "cross_entropy: expected logits [N, C] with targets [N] (or logits [C] with a 0-dim target) (shapes [[2, 4], [3]])",
    );
    let x3 = t(&[2, 4, 5]);
    let two = Indices::from_vec(vec![0, 1], &[2]);
    same_error(
        x3.try_cross_entropy(&two),
        || x3.cross_entropy(&two),
        "cross_entropy: expected logits [N, C] with targets [N] (or logits [C] with a 0-dim target) (shapes [[2, 4, 5], [2]])",
    );
    let smooth = CrossEntropyOptions { label_smoothing: 1.5, ..Default::default() };
    same_error(
        x.try_cross_entropy_with(&two, smooth),
        || x.cross_entropy_with(&two, smooth),
        "cross_entropy: invalid argument `label_smoothing`: must be in [0, 1], got 1.5 (logits shape [2, 4])",
    );
}

#[test]
fn mse_dropout_and_embedding_errors() {
    let (a, b) = (t(&[2, 3]), t(&[3, 2]));
    same_error(
        a.try_mse_loss(&b),
        || a.mse_loss(&b),
        "mse_loss: input and target must have the same shape (shapes [[2, 3], [3, 2]])",
    );
    for p in [1.0, -0.1, f64::NAN] {
        same_error(
            a.try_dropout(p, true, &mut Rng::seed(0)),
            || a.dropout(p, true, &mut Rng::seed(0)),
            &format!("dropout: invalid argument `p`: must be in [0, 1), got {p} (input shape [2, 3])"),
        );
    }
    // A bad p is refused in eval mode too, so a config error shows up before training.
    assert!(a.try_dropout(1.0, false, &mut Rng::seed(0)).is_err());
    let w = t(&[10, 4]);
    let ids = Indices::from_vec(vec![0, 9, 10], &[3]);
    same_error(w.try_embedding(&ids), || w.embedding(&ids), "embedding: index 10 at position 2 is out of range 0..10");
    let neg = Indices::from_vec(vec![-1], &[1]);
    same_error(w.try_embedding(&neg), || w.embedding(&neg), "embedding: index -1 at position 0 is out of range 0..10");
    let v = t(&[10]);
    same_error(
        v.try_embedding(&ids),
        || v.embedding(&ids),
        "embedding: the weight must be 2-D [num_embeddings, dim] (shapes [[10], [3]])",
    );
}

#[test]
fn mask_selection_and_joining_errors() {
    let x = t(&[2, 3]);
    let m4 = Mask::full(&[4], true);
    same_error(
        x.try_masked_fill(&m4, 0.0),
        || x.masked_fill(&m4, 0.0),
        "masked_fill: shapes [2, 3] and [4] cannot be broadcast together",
    );
    let (a, b) = (t(&[2, 3]), t(&[4]));
    let m = Mask::full(&[2, 3], false);
    same_error(
        Tensor::try_where_cond(&m, &a, &b),
        || Tensor::where_cond(&m, &a, &b),
        "where_cond: shapes [2, 3] and [4] cannot be broadcast together",
    );
    let m5 = Mask::full(&[5], false);
    let b3 = t(&[3]);
    same_error(
        Tensor::try_where_cond(&m5, &a, &b3),
        || Tensor::where_cond(&m5, &a, &b3),
        "where_cond: mask, a and b cannot be broadcast together (shapes [[5], [2, 3], [3]])",
    );
    let c = t(&[2, 4]);
    same_error(
        Tensor::try_cat(&[&a, &c], 0),
        || Tensor::cat(&[&a, &c], 0),
        "cat: shapes must match except in dim 0 (shapes [[2, 3], [2, 4]])",
    );
    same_error(
        Tensor::try_cat(&[&a, &t(&[2, 3, 1])], 1),
        || Tensor::cat(&[&a, &t(&[2, 3, 1])], 1),
        "cat: shapes must match except in dim 1 (shapes [[2, 3], [2, 3, 1]])",
    );
    same_error(
        Tensor::try_cat(&[&a, &c], 2),
        || Tensor::cat(&[&a, &c], 2),
        "cat: dim 2 is out of range for a tensor of rank 2 (shape [2, 3])",
    );
    same_error(
        Tensor::<f32>::try_cat(&[], 0),
        || Tensor::<f32>::cat(&[], 0),
        "cat: invalid argument `tensors`: needs at least one tensor",
    );
    let s = t(&[]);
    same_error(
        Tensor::try_cat(&[&s, &s], 0),
        || Tensor::cat(&[&s, &s], 0),
        "cat: dim 0 is out of range for a tensor of rank 0 (shape [])",
    );
    let at = t(&[3, 2]);
    same_error(
        Tensor::try_stack(&[&a, &at], 0),
        || Tensor::stack(&[&a, &at], 0),
        "stack: every tensor must have the same shape (shapes [[2, 3], [3, 2]])",
    );
    same_error(
        Tensor::try_stack(&[&a, &a], 3),
        || Tensor::stack(&[&a, &a], 3),
        "stack: dim 3 is out of range 0..=2 for stacking (shapes [[2, 3], [2, 3]])",
    );
    same_error(
        Tensor::<f32>::try_stack(&[], 0),
        || Tensor::<f32>::stack(&[], 0),
        "stack: invalid argument `tensors`: needs at least one tensor",
    );
    same_error(
        Mask::try_from_vec(vec![true; 3], &[2, 2]),
        || Mask::from_vec(vec![true; 3], &[2, 2]),
        "Mask::from_vec: 3 elements cannot fill shape [2, 2] (4 elements)",
    );
    same_error(
        Mask::causal(3).try_reshape(&[4, 2]),
        || Mask::causal(3).reshape(&[4, 2]),
        "Mask::reshape: cannot reshape 9 entries into [4, 2] (shapes [[3, 3], [4, 2]])",
    );
    let ids = Indices::from_vec(vec![1, 2, 3, 4, 5, 6], &[2, 3]);
    same_error(
        ids.try_reshape(&[4]),
        || ids.reshape(&[4]),
        "Indices::reshape: cannot reshape 6 indices into [4] (shapes [[2, 3], [4]])",
    );
}

// The plain forms, through the test harness's own panic check.

#[test]
#[should_panic(expected = "cross_entropy: index 7 at position 0 is out of range 0..4")]
fn plain_cross_entropy_panics_with_the_message() {
    t(&[1, 4]).cross_entropy(&Indices::from_vec(vec![7], &[1]));
}

#[test]
#[should_panic(expected = "layer_norm: weight must have shape [8] (the input's last dim) (shapes [[3, 8], [4]])")]
fn plain_layer_norm_panics_with_the_message() {
    t(&[3, 8]).layer_norm(Some(&t(&[4])), None, 1e-5);
}

#[test]
#[should_panic(expected = "softmax: dim 3 is out of range for a tensor of rank 3 (shape [1, 2, 3])")]
fn plain_softmax_panics_with_the_message() {
    t(&[1, 2, 3]).softmax(3);
}

#[test]
#[should_panic(expected = "cat: shapes must match except in dim 1 (shapes [[2, 3], [3, 3]])")]
fn plain_cat_panics_with_the_message() {
    Tensor::cat(&[&t(&[2, 3]), &t(&[3, 3])], 1);
}

#[test]
#[should_panic(expected = "embedding: index 3 at position 1 is out of range 0..3")]
fn plain_embedding_panics_with_the_message() {
    t(&[3, 2]).embedding(&Indices::from_vec(vec![0, 3], &[2]));
}

#[test]
fn conv2d_errors_name_the_shapes_and_options() {
    use amp_core::Conv2dOptions;
    let one = Conv2dOptions::default();
    let (x, w) = (t(&[2, 3, 5]), t(&[4, 3, 3, 3]));
    same_error(
        x.try_conv2d(&w, None, one),
        || x.conv2d(&w, None, one),
        "conv2d: needs an input [N, C_in, H, W] and a weight [C_out, C_in / groups, kH, kW] (shapes [[2, 3, 5], [4, 3, 3, 3]])",
    );
    let x = t(&[1, 4, 5, 5]);
    let (w, g3) = (t(&[6, 2, 3, 3]), Conv2dOptions { groups: 3, ..one });
    same_error(
        x.try_conv2d(&w, None, g3),
        || x.conv2d(&w, None, g3),
        "conv2d: groups 3 must divide the input's 4 and the weight's 6 channels (shapes [[1, 4, 5, 5], [6, 2, 3, 3]])",
    );
    let (w, g2) = (t(&[6, 3, 3, 3]), Conv2dOptions { groups: 2, ..one });
    same_error(
        x.try_conv2d(&w, None, g2),
        || x.conv2d(&w, None, g2),
        "conv2d: the weight's dim 1 must be the input channels per group, 4 / 2 = 2 (shapes [[1, 4, 5, 5], [6, 3, 3, 3]])",
    );
    let (w, b) = (t(&[6, 4, 3, 3]), t(&[5]));
    same_error(
        x.try_conv2d(&w, Some(&b), one),
        || x.conv2d(&w, Some(&b), one),
        "conv2d: the bias must have shape [6] (shapes [[1, 4, 5, 5], [6, 4, 3, 3], [5]])",
    );
    let zero = Conv2dOptions { stride: (0, 1), ..one };
    same_error(
        x.try_conv2d(&w, None, zero),
        || x.conv2d(&w, None, zero),
        "conv2d: invalid argument `stride`: must be at least 1 in both dims, got (0, 1) (input shape [1, 4, 5, 5])",
    );
    let (small, big) = (t(&[1, 1, 2, 2]), t(&[1, 1, 3, 3]));
    same_error(
        small.try_conv2d(&big, None, one),
        || small.conv2d(&big, None, one),
        "conv2d: the kernel 3x3 with dilation (1, 1) is larger than the input 2x2 padded by (0, 0) (shapes [[1, 1, 2, 2], [1, 1, 3, 3]])",
    );
    // Padding makes it fit.
    let padded = small.conv2d(&big, None, Conv2dOptions { padding: (1, 1), ..one });
    assert_eq!(padded.shape(), &[1, 1, 2, 2]);
}

#[test]
fn pooling_errors_name_the_shapes_and_windows() {
    let m = t(&[4, 4]);
    same_error(
        m.try_max_pool2d((2, 2), (2, 2), (0, 0)),
        || m.max_pool2d((2, 2), (2, 2), (0, 0)),
        "max_pool2d: needs an input [N, C, H, W] or [C, H, W] (shapes [[4, 4]])",
    );
    let x = t(&[1, 1, 4, 4]);
    same_error(
        x.try_max_pool2d((2, 2), (1, 1), (2, 0)),
        || x.max_pool2d((2, 2), (1, 1), (2, 0)),
        "max_pool2d: invalid argument `padding`: must be at most half the kernel (2, 2), got (2, 0) (input shape [1, 1, 4, 4])",
    );
    same_error(
        x.try_avg_pool2d((0, 2), (1, 1), (0, 0)),
        || x.avg_pool2d((0, 2), (1, 1), (0, 0)),
        "avg_pool2d: invalid argument `kernel`: must be at least 1 in both dims, got (0, 2) (input shape [1, 1, 4, 4])",
    );
    let small = t(&[1, 1, 2, 2]);
    same_error(
        small.try_avg_pool2d((3, 3), (1, 1), (0, 0)),
        || small.avg_pool2d((3, 3), (1, 1), (0, 0)),
        "avg_pool2d: the kernel (3, 3) is larger than the input 2x2 padded by (0, 0) (shapes [[1, 1, 2, 2]])",
    );
    same_error(
        x.try_adaptive_avg_pool2d((0, 2)),
        || x.adaptive_avg_pool2d((0, 2)),
        "adaptive_avg_pool2d: invalid argument `output_size`: must be at least 1 in both dims, got (0, 2) (input shape [1, 1, 4, 4])",
    );
    let empty = t(&[1, 1, 0, 4]);
    same_error(
        empty.try_adaptive_avg_pool2d((2, 2)),
        || empty.adaptive_avg_pool2d((2, 2)),
        "adaptive_avg_pool2d: needs a non-empty H and W (shapes [[1, 1, 0, 4]])",
    );
}

#[test]
fn batch_norm_errors_name_the_buffers_and_the_mode() {
    use amp_core::BatchNormOptions;
    let (train, eval) = (BatchNormOptions { training: true, ..Default::default() }, BatchNormOptions::default());
    let v = t(&[4]);
    same_error(
        v.try_batch_norm(None, None, None, None, train),
        || v.batch_norm(None, None, None, None, train),
        "batch_norm: needs an input [N, C, ...] with at least two dims (shapes [[4]])",
    );
    let x = t(&[2, 3, 4]);
    let w = t(&[4]);
    same_error(
        x.try_batch_norm(None, None, Some(&w), None, train),
        || x.batch_norm(None, None, Some(&w), None, train),
        "batch_norm: weight must have shape [3] (the input's channels, dim 1) (shapes [[2, 3, 4], [4]])",
    );
    let buffers = |c: usize, d: usize| (t(&[c]), t(&[d]));
    let ((mut m, mut s), (mut m2, mut s2)) = (buffers(2, 3), buffers(2, 3));
    same_error(
        x.try_batch_norm(Some(&mut m), Some(&mut s), None, None, train),
        || x.batch_norm(Some(&mut m2), Some(&mut s2), None, None, train),
        "batch_norm: running_mean must have shape [3] (the input's channels, dim 1) (shapes [[2, 3, 4], [2], [3]])",
    );
    let (mut m, mut m2) = (t(&[3]), t(&[3]));
    same_error(
        x.try_batch_norm(Some(&mut m), None, None, None, train),
        || x.batch_norm(Some(&mut m2), None, None, None, train),
        "batch_norm: needs both running_mean and running_var, or neither (shapes [[2, 3, 4], [3]])",
    );
    same_error(
        x.try_batch_norm(None, None, None, None, eval),
        || x.batch_norm(None, None, None, None, eval),
        "batch_norm: needs running_mean and running_var in eval (training = false) (shapes [[2, 3, 4]])",
    );
    let row = t(&[1, 3]);
    same_error(
        row.try_batch_norm(None, None, None, None, train),
        || row.batch_norm(None, None, None, None, train),
        "batch_norm: needs more than 1 value per channel in training, got 1 (shapes [[1, 3]])",
    );
    let bad = BatchNormOptions { eps: -1.0, ..train };
    same_error(
        x.try_batch_norm(None, None, None, None, bad),
        || x.batch_norm(None, None, None, None, bad),
        "batch_norm: invalid argument `eps`: must be finite (eps also >= 0), got -1 (input shape [2, 3, 4])",
    );
    // A refused call leaves the buffers alone.
    let (mut m, mut s) = (Tensor::<f32>::full(&[3], 0.5), Tensor::<f32>::full(&[3], 2.0));
    assert!(x.try_batch_norm(Some(&mut m), Some(&mut s), Some(&w), None, train).is_err());
    assert_eq!((m.to_vec(), s.to_vec()), (vec![0.5; 3], vec![2.0; 3]));
}

#[test]
fn flatten_dims_errors() {
    let x = t(&[2, 3, 4]);
    same_error(
        x.try_flatten_dims(1, 3),
        || x.flatten_dims(1, 3),
        "flatten_dims: dim 3 is out of range for a tensor of rank 3 (shape [2, 3, 4])",
    );
    same_error(
        x.try_flatten_dims(2, 1),
        || x.flatten_dims(2, 1),
        "flatten_dims: the start dim 2 comes after the end dim 1 (shapes [[2, 3, 4]])",
    );
    assert_eq!(x.flatten_dims(0, 1).shape(), &[6, 4]);
    assert_eq!(x.flatten_dims(2, 2).shape(), &[2, 3, 4]);
    assert_eq!(Tensor::<f32>::scalar(2.0).flatten_dims(0, 0).shape(), &[1]);
}

#[test]
fn views_and_param_set_have_try_forms() {
    // These panicked through assert!/assert_eq! with no try_ form to catch.
    let (v, m) = (t(&[3]), t(&[2, 1, 3]));
    same_error(v.try_t(), || v.t(), "t: needs at least 2 dims, got 1 (shapes [[3]])");
    same_error(
        m.try_unsqueeze(4),
        || m.unsqueeze(4),
        "unsqueeze: dim 4 is out of range 0..=3 for a tensor of rank 3 (shapes [[2, 1, 3]])",
    );
    same_error(m.try_squeeze(2), || m.squeeze(2), "squeeze: dim 2 has size 3, not 1 (shapes [[2, 1, 3]])");
    same_error(
        m.try_squeeze(3),
        || m.squeeze(3),
        "squeeze: dim 3 is out of range for a tensor of rank 3 (shape [2, 1, 3])",
    );
    assert_eq!(
        (m.t().shape(), m.unsqueeze(3).shape(), m.squeeze(1).shape()),
        (&[2, 3, 1][..], &[2, 1, 3, 1][..], &[2, 3][..])
    );

    // A weight stored transposed (GPT-2's Conv1D `[in, out]` for a Linear's `[out, in]`).
    let mut p = amp_core::Param::new(Tensor::from_vec(vec![1.0f32; 6], &[2, 3]));
    let wrong = Tensor::from_vec(vec![7.0f32; 6], &[3, 2]);
    let err = p.try_set(&wrong).unwrap_err().to_string();
    assert_eq!(err, "Param::set: the new values must have the parameter's shape (shapes [[2, 3], [3, 2]])");
    assert_eq!(p.to_vec(), vec![1.0; 6], "a refused set leaves the values");
    let mut q = p.clone();
    same_error(q.try_set(&wrong), || p.set(&wrong), &err);
    p.set(&wrong.t());
    assert_eq!(p.to_vec(), vec![7.0; 6]);

    // The converting constructors, as `from_vec`.
    let want = "from_vec: 5 elements cannot fill shape [2, 3] (6 elements)";
    same_error(
        Tensor::<amp_core::bf16>::try_from_f32s(&[1.0; 5], &[2, 3]),
        || Tensor::<amp_core::bf16>::from_f32s(&[1.0; 5], &[2, 3]),
        want,
    );
    same_error(Tensor::<f32>::try_from_f64s(&[1.0; 5], &[2, 3]), || Tensor::<f32>::from_f64s(&[1.0; 5], &[2, 3]), want);
    assert_eq!(Tensor::<amp_core::f16>::from_f32s(&[0.1; 6], &[2, 3]).to_vec(), vec![amp_core::f16::from_f32(0.1); 6]);
}

#[test]
fn values_a_user_holds_or_logs_print_with_debug() {
    let guard = amp_core::NoGradGuard::new();
    assert!(format!("{guard:?}").starts_with("NoGradGuard"));
    drop(guard);
    let config = amp_core::data::ShapesConfig { train: 8, test: 4, ..Default::default() };
    let task = amp_core::data::ShapesTask::new(config).unwrap();
    let shown = format!("{task:?}");
    assert!(shown.contains("train: 8") && shown.contains("test: 4"), "{shown}");
    let mut scaler = amp_core::scaler::GradScaler::default();
    let w = amp_core::Param::new(Tensor::<f32>::ones(&[2]));
    let step = scaler.scale(w.sum_all());
    assert_eq!(format!("{step:?}"), r#"TrainStep { stage: "LossScaled", live: true }"#);
    step.abandon();
}

// ---- nn modules ----------------------------------------------------------------------------------

/// Every `amp::nn` module has `try_forward` (and `Gpt` `try_loss`): a bad input is an error that
/// names the module or op and the shapes, and `forward` panics with the same text.
#[test]
fn module_forwards_have_try_forms_with_the_same_messages() {
    use amp_core::Conv2dOptions;
    use amp_core::nn::{
        AdaptiveAvgPool2d, AvgPool2d, Block, CausalSelfAttention, Conv2d, Dropout, Embedding, LayerNorm, Linear,
        MaxPool2d, Mlp,
    };
    let mut rng = Rng::seed(0);
    let lin = Linear::new(5, 6, true, &mut rng);
    let x = t(&[4, 3]);
    same_error(
        lin.try_forward::<f32, f32>(&x),
        || lin.forward::<f32, f32>(&x),
        "linear: the input's last dim must equal the weight's in_features 5 (shapes [[4, 3], [6, 5], [6]])",
    );
    let emb = Embedding::new(10, 4, 0.02, &mut rng);
    let ids = Indices::from_vec(vec![1, 12], &[2]);
    same_error(emb.try_forward(&ids), || emb.forward(&ids), "embedding: index 12 at position 1 is out of range 0..10");
    let ln = LayerNorm::new(4);
    let x = t(&[2, 5]);
    same_error(
        ln.try_forward(&x),
        || ln.forward(&x),
        "layer_norm_to: weight must have shape [5] (the input's last dim) (shapes [[2, 5], [4], [4]])",
    );
    same_error(
        ln.try_forward_to::<amp_core::bf16, f32>(&x),
        || ln.forward_to::<amp_core::bf16, f32>(&x),
        "layer_norm_to: weight must have shape [5] (the input's last dim) (shapes [[2, 5], [4], [4]])",
    );
    let conv = Conv2d::new(3, 8, 3, Conv2dOptions::default(), true, &mut rng);
    let img = t(&[1, 4, 8, 8]);
    same_error(
        conv.try_forward::<f32, f32>(&img),
        || conv.forward::<f32, f32>(&img),
        "conv2d: the weight's dim 1 must be the input channels per group, 4 / 1 = 4 (shapes [[1, 4, 8, 8], [8, 3, 3, 3], [8]])",
    );
    let flat = t(&[2, 8]);
    same_error(
        MaxPool2d::new(2).try_forward(&flat),
        || MaxPool2d::new(2).forward(&flat),
        "max_pool2d: needs an input [N, C, H, W] or [C, H, W] (shapes [[2, 8]])",
    );
    let tiny = t(&[1, 1, 1, 1]);
    same_error(
        AvgPool2d::new(2).try_forward(&tiny),
        || AvgPool2d::new(2).forward(&tiny),
        "avg_pool2d: the kernel (2, 2) is larger than the input 1x1 padded by (0, 0) (shapes [[1, 1, 1, 1]])",
    );
    same_error(
        AdaptiveAvgPool2d::new((0, 1)).try_forward(&tiny),
        || AdaptiveAvgPool2d::new((0, 1)).forward(&tiny),
        "adaptive_avg_pool2d: invalid argument `output_size`: must be at least 1 in both dims, got (0, 1) (input shape [1, 1, 1, 1])",
    );
    let mut drop = Dropout::new(0.5);
    drop.p = 1.5; // a public field set by hand
    let v = t(&[3]);
    assert!(
        drop.try_forward(&v, &mut rng).is_err()
            && catch_unwind(AssertUnwindSafe(|| drop.forward(&v, &mut Rng::seed(0)))).is_err()
    );

    // Attention, the MLP and a block: the input's rank and width.
    let attn = CausalSelfAttention::new(16, 2, 0.0, &mut rng);
    for shape in [&[3, 16][..], &[1, 3, 12]] {
        let x = t(shape);
        same_error(
            attn.try_forward::<f32, f32>(&x, &mut Rng::seed(0)),
            || attn.forward::<f32, f32>(&x, &mut Rng::seed(0)),
            &format!("CausalSelfAttention::forward: expected an input [B, T, d] with d = 16 (shapes [{shape:?}])"),
        );
    }
    let mlp = Mlp::new(16, 64, 0.0, &mut rng);
    let x = t(&[1, 3, 12]);
    same_error(
        mlp.try_forward::<f32, f32>(&x, &mut Rng::seed(0)),
        || mlp.forward::<f32, f32>(&x, &mut Rng::seed(0)),
        "linear: the input's last dim must equal the weight's in_features 16 (shapes [[1, 3, 12], [64, 16], [64]])",
    );
    let block = Block::new(16, 2, 0.0, &mut rng);
    same_error(
        block.try_forward::<f32>(&x, &mut Rng::seed(0)),
        || block.forward::<f32>(&x, &mut Rng::seed(0)),
        "layer_norm_to: weight must have shape [12] (the input's last dim) (shapes [[1, 3, 12], [16], [16]])",
    );
    // On good input the try_ form is the plain one, bit for bit.
    let x = Tensor::<f32>::randn(&[2, 3, 16], &mut rng);
    let bits = |t: Tensor<f32>| t.to_vec().into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(
        bits(block.try_forward::<amp_core::f16>(&x, &mut Rng::seed(1)).unwrap()),
        bits(block.forward::<amp_core::f16>(&x, &mut Rng::seed(1)))
    );
}

/// Batch norm refuses an input before touching its buffers, so a refused call leaves the
/// running statistics and the batch count as they were.
#[test]
fn batch_norm_2d_errors_leave_the_buffers_alone() {
    use amp_core::nn::BatchNorm2d;
    let mut bn = BatchNorm2d::new(8);
    let before = (bn.running_mean.to_vec(), bn.running_var.to_vec(), bn.num_batches_tracked.item());
    for (shape, want) in [
        (&[2, 8][..], "BatchNorm2d::forward: expected a 4-D input [N, C, H, W] (shapes [[2, 8]])"),
        (
            &[2, 4, 3, 3],
            "batch_norm: weight must have shape [4] (the input's channels, dim 1) (shapes [[2, 4, 3, 3], [8], [8], [8], [8]])",
        ),
        (
            &[1, 8, 1, 1],
            "batch_norm: needs more than 1 value per channel in training, got 1 (shapes [[1, 8, 1, 1], [8], [8], [8], [8]])",
        ),
    ] {
        let x = t(shape);
        let mut other = bn.clone();
        same_error(bn.try_forward(&x), || other.forward(&x), want);
        assert_eq!((bn.running_mean.to_vec(), bn.running_var.to_vec(), bn.num_batches_tracked.item()), before);
    }
}

/// The GPT's token ids must be `[B, T]` with `T <= block_size`, and its targets the ids' shape:
/// the same number of targets laid out otherwise (`[T, B]`, flattened) trained silently on the
/// wrong pairs before.
#[test]
fn gpt_refuses_ids_and_targets_of_the_wrong_shape() {
    use amp_core::nn::{Gpt, GptConfig};
    let cfg = GptConfig { vocab_size: 10, block_size: 8, d_model: 16, n_heads: 2, n_layers: 1, dropout: 0.0 };
    let gpt = Gpt::new(cfg, &mut Rng::seed(0));
    let forward = |ids: Indices, want: &str| {
        same_error(
            gpt.try_forward::<f32>(&ids, &mut Rng::seed(0)),
            || gpt.forward::<f32>(&ids, &mut Rng::seed(0)),
            want,
        )
    };
    let shape_err =
        |shape: &str| format!("Gpt::forward: expected token ids [B, T] with 1 <= T <= block_size 8 (shapes [{shape}])");
    forward(Indices::from_vec(vec![1, 2], &[2]), &shape_err("[2]"));
    forward(Indices::from_vec(vec![1; 9], &[1, 9]), &shape_err("[1, 9]"));
    forward(Indices::from_vec(vec![], &[3, 0]), &shape_err("[3, 0]"));
    forward(Indices::from_vec(vec![1, 11], &[1, 2]), "embedding: index 11 at position 1 is out of range 0..10");

    let ids = Indices::from_vec(vec![1, 2, 3, 4, 5, 6], &[2, 3]);
    let loss = |targets: Indices, want: &str| {
        same_error(
            gpt.try_loss::<f32>(&ids, &targets, &mut Rng::seed(0)),
            || gpt.loss::<f32>(&ids, &targets, &mut Rng::seed(0)),
            want,
        )
    };
    for shape in [&[3, 2][..], &[6], &[6, 1]] {
        loss(
            Indices::from_vec(vec![1; 6], shape),
            &format!("Gpt::loss: targets must have the shape of the token ids [B, T] (shapes [[2, 3], {shape:?}])"),
        );
    }
    loss(
        Indices::from_vec(vec![1, 2, 3, 4, 5, 40], &[2, 3]),
        "cross_entropy: index 40 at position 5 is out of range 0..10",
    );
    let good = Indices::from_vec(vec![2, 3, 4, 5, 6, -100], &[2, 3]);
    assert_eq!(
        gpt.try_loss::<f32>(&ids, &good, &mut Rng::seed(0)).unwrap().item().to_bits(),
        gpt.loss::<f32>(&ids, &good, &mut Rng::seed(0)).item().to_bits()
    );
}

/// Constructors that check their arguments have a `try_new` with the panic's message.
#[test]
fn module_constructors_have_try_forms() {
    use amp_core::Conv2dOptions;
    use amp_core::nn::{Block, CausalSelfAttention, Conv2d, Dropout, Linear, Mlp};
    let r = || Rng::seed(0);
    same_error(
        Conv2d::try_new(3, 8, 0, Conv2dOptions::default(), true, &mut r()),
        || Conv2d::new(3, 8, 0, Conv2dOptions::default(), true, &mut r()),
        "Conv2d::new: invalid argument `kernel`: the kernel size must be at least 1, got 0",
    );
    let groups = Conv2dOptions { groups: 2, ..Default::default() };
    same_error(
        Conv2d::try_new(3, 8, 3, groups, true, &mut r()),
        || Conv2d::new(3, 8, 3, groups, true, &mut r()),
        "Conv2d::new: invalid argument `groups`: in_channels 3 and out_channels 8 must be multiples of groups 2",
    );
    let heads =
        "CausalSelfAttention::new: invalid argument `n_heads`: d = 16 must be a positive multiple of n_heads = 3";
    same_error(
        CausalSelfAttention::try_new(16, 3, 0.0, &mut r()),
        || CausalSelfAttention::new(16, 3, 0.0, &mut r()),
        heads,
    );
    same_error(Block::try_new(16, 3, 0.0, &mut r()), || Block::new(16, 3, 0.0, &mut r()), heads);
    let p = "Dropout::new: invalid argument `p`: must be in [0, 1), got 1";
    same_error(Dropout::try_new(1.0), || Dropout::new(1.0), p);
    same_error(Mlp::try_new(16, 64, 1.0, &mut r()), || Mlp::new(16, 64, 1.0, &mut r()), p);
    same_error(
        CausalSelfAttention::try_new(16, 2, 1.0, &mut r()),
        || CausalSelfAttention::new(16, 2, 1.0, &mut r()),
        p,
    );
    // PyTorch's init with no inputs: a zero bias, not NaN (the bound 1/√0).
    let empty = Linear::new(0, 3, true, &mut r());
    assert_eq!(empty.bias.as_ref().unwrap().to_vec(), vec![0.0; 3]);
    let conv = Conv2d::new(0, 2, 3, Conv2dOptions::default(), true, &mut r());
    assert_eq!(conv.bias.as_ref().unwrap().to_vec(), vec![0.0; 2]);
}
