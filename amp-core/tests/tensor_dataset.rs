//! TensorDataset + DataLoader: batched tensors straight from in-memory inputs and labels. Every
//! sample once per epoch, rows kept paired through the shuffle, seeded orders, resume from a
//! stored position, shape errors, `[N, C, L]` inputs, and no autograd history on batches.

use amp_core::data::{DataLoader, Dataset, LoaderPosition, TensorDataset};
use amp_core::{Error, Indices, Tensor, f16};

/// `n` samples whose input row `i` is `[i, 1000 + i, 2000 + i]` and whose label is `i`, so a
/// batch shows which samples it holds and whether inputs and labels stayed together.
fn numbered(n: usize) -> TensorDataset<Tensor<f32>, Indices> {
    let x: Vec<f32> = (0..n).flat_map(|i| [i as f32, 1000.0 + i as f32, 2000.0 + i as f32]).collect();
    let y: Vec<i64> = (0..n as i64).collect();
    TensorDataset::new(Tensor::from_vec(x, &[n, 3]), Indices::from_vec(y, &[n])).unwrap()
}

/// The labels of a batch, after checking each input row is the one its label names.
fn checked_labels(x: &Tensor<f32>, y: &Indices) -> Vec<i64> {
    let b = y.shape()[0];
    assert_eq!(x.shape(), &[b, 3]);
    let xs = x.to_vec();
    for (k, &label) in y.as_slice().iter().enumerate() {
        let l = label as f32;
        assert_eq!(xs[3 * k..3 * k + 3], [l, 1000.0 + l, 2000.0 + l], "row {k} of the batch is not sample {label}");
    }
    y.to_vec()
}

/// One epoch through `epoch_batches`: the labels of each batch.
fn epoch_labels(loader: &mut DataLoader<TensorDataset<Tensor<f32>, Indices>>) -> Vec<Vec<i64>> {
    loader
        .epoch_batches()
        .map(|batch| {
            let (x, y) = batch.unwrap();
            checked_labels(&x, &y)
        })
        .collect()
}

#[test]
fn every_sample_appears_once_per_epoch_with_and_without_drop_last() {
    let all: Vec<i64> = (0..23).collect();
    // Keeping the short last batch: 4 full batches and one of 3, every sample exactly once.
    let mut loader = DataLoader::new(numbered(23), 5, 3).unwrap();
    let mut previous = None;
    for epoch in 0..3 {
        let batches = epoch_labels(&mut loader);
        assert_eq!(loader.epoch(), epoch);
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [5, 5, 5, 5, 3], "epoch {epoch}");
        let order = batches.concat();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, all, "epoch {epoch} is not a permutation of the samples");
        assert_ne!(order, all, "epoch {epoch} was not shuffled");
        assert_ne!(previous.as_ref(), Some(&order), "epoch {epoch} repeats the previous order");
        previous = Some(order);
    }

    // Dropping it: 4 full batches of distinct samples, the 3 left over differ between epochs.
    let mut loader = DataLoader::new(numbered(23), 5, 3).unwrap().drop_last(true).unwrap();
    let mut dropped = Vec::new();
    for epoch in 0..4 {
        let batches = epoch_labels(&mut loader);
        assert_eq!(loader.epoch(), epoch);
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [5, 5, 5, 5], "epoch {epoch}");
        let mut seen = batches.concat();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 20, "epoch {epoch} served a sample twice");
        dropped.push(all.iter().copied().filter(|l| !seen.contains(l)).collect::<Vec<_>>());
    }
    assert!(dropped.windows(2).any(|w| w[0] != w[1]), "the same samples were dropped every epoch: {dropped:?}");
}

#[test]
fn next_tensor_batch_follows_the_loader_order_and_keeps_rows_paired() {
    // Unshuffled: the batches are the rows in order, the last one short.
    let mut loader = DataLoader::new(numbered(7), 3, 0).unwrap().shuffle(false);
    let mut labels = Vec::new();
    for _ in 0..3 {
        let (x, y) = loader.next_tensor_batch().unwrap();
        labels.push(checked_labels(&x, &y));
    }
    assert_eq!(labels, [vec![0, 1, 2], vec![3, 4, 5], vec![6]]);

    // Shuffled: each batch holds exactly the samples `next_indices` of an equal loader names,
    // in that order, across epoch boundaries.
    let mut batches = DataLoader::new(numbered(7), 3, 9).unwrap();
    let mut indices = DataLoader::new(numbered(7), 3, 9).unwrap();
    for step in 0..10 {
        let (x, y) = batches.next_tensor_batch().unwrap();
        let expected: Vec<i64> = indices.next_indices().into_iter().map(|i| i as i64).collect();
        assert_eq!(checked_labels(&x, &y), expected, "step {step}");
    }

    // Regression targets as a second f32 tensor: target row i is `[-i]`.
    let n = 9;
    let x = Tensor::<f32>::from_vec((0..n).map(|i| i as f32).collect(), &[n, 1]);
    let t = Tensor::<f32>::from_vec((0..n).map(|i| -(i as f32)).collect(), &[n, 1]);
    let mut loader = DataLoader::new(TensorDataset::new(x, t).unwrap(), 4, 1).unwrap();
    for (x, t) in loader.epoch_batches().map(Result::unwrap) {
        assert_eq!(t.shape(), x.shape());
        assert_eq!(t.to_vec(), x.to_vec().iter().map(|v| -v).collect::<Vec<_>>());
    }
}

#[test]
fn equal_seeds_give_equal_orders_and_other_seeds_other_orders() {
    let two_epochs = |seed| {
        let mut loader = DataLoader::new(numbered(40), 8, seed).unwrap();
        [epoch_labels(&mut loader), epoch_labels(&mut loader)].concat()
    };
    assert_eq!(two_epochs(11), two_epochs(11));
    assert_ne!(two_epochs(11), two_epochs(12));
}

#[test]
fn a_restored_position_continues_with_identical_batches() {
    for drop_last in [false, true] {
        let loader = || DataLoader::new(numbered(37), 6, 42).unwrap().drop_last(drop_last).unwrap();
        let mut original = loader();
        for _ in 0..9 {
            original.next_tensor_batch().unwrap(); // mid-epoch 1
        }
        assert_eq!(original.epoch(), 1);
        let json = serde_json::to_string(&original.position()).unwrap();
        let position: LoaderPosition = serde_json::from_str(&json).unwrap();

        let mut resumed = loader();
        resumed.restore(&position).unwrap();
        // Epoch 0 took 6 batches with drop_last, 7 without (a short one of 1), so 3 (or 2) of
        // epoch 1 are served: 3 of 6 full batches are left, or 5 of 7 (4 full, 1 short).
        let left = if drop_last { 3 } else { 5 };
        assert_eq!(resumed.epoch_batches().len(), left, "drop_last {drop_last}");
        let rest: Vec<_> = resumed.epoch_batches().map(Result::unwrap).collect();
        assert_eq!(rest.len(), left);
        for (step, (x, y)) in rest.iter().enumerate() {
            let (xo, yo) = original.next_tensor_batch().unwrap();
            assert_eq!((x.to_vec(), y), (xo.to_vec(), &yo), "drop_last {drop_last}, rest of epoch, batch {step}");
        }
        for step in 0..20 {
            let (x, y) = resumed.next_tensor_batch().unwrap();
            let (xo, yo) = original.next_tensor_batch().unwrap();
            assert_eq!((x.to_vec(), y), (xo.to_vec(), yo), "drop_last {drop_last}, step {step}");
        }
        assert_eq!(resumed.position(), original.position());
    }
}

#[test]
fn a_position_taken_inside_the_epoch_loop_resumes_the_rest_of_the_epoch() {
    let mut original = DataLoader::new(numbered(30), 4, 8).unwrap();
    let mut first_part = Vec::new();
    let mut batches = original.epoch_batches();
    assert_eq!(batches.len(), 8);
    for _ in 0..3 {
        let (x, y) = batches.next().unwrap().unwrap();
        first_part.push(checked_labels(&x, &y));
    }
    let position = batches.position(); // what a checkpoint in the loop body would store
    let rest: Vec<Vec<i64>> = batches.map(|b| b.unwrap().1.to_vec()).collect();
    assert_eq!(rest.len(), 5);

    let mut resumed = DataLoader::new(numbered(30), 4, 8).unwrap();
    resumed.restore(&position).unwrap();
    assert_eq!(resumed.position().index, 12);
    assert_eq!(epoch_labels(&mut resumed), rest);
    let mut whole = [first_part, rest].concat().concat();
    whole.sort();
    assert_eq!(whole, (0..30).collect::<Vec<_>>());
}

#[test]
fn new_refuses_mismatched_empty_and_0_dim_tensors() {
    let message = |r: Result<TensorDataset<Tensor<f32>, Indices>, Error>| match r {
        Err(e @ Error::Shape { .. }) => e.to_string(),
        Err(other) => panic!("expected a shape error, got {other}"),
        Ok(_) => panic!("expected a shape error, got a dataset"),
    };
    let err = message(TensorDataset::new(Tensor::zeros(&[5, 3]), Indices::from_vec(vec![0; 4], &[4])));
    assert_eq!(
        err,
        "TensorDataset::new: inputs have 5 rows (first dim) but labels have 4; both must count the same samples \
         (shapes [[5, 3], [4]])"
    );
    let err = message(TensorDataset::new(Tensor::scalar(1.0), Indices::from_vec(vec![0], &[1])));
    assert!(err.contains("inputs are 0-dim"), "{err}");
    let err = message(TensorDataset::new(Tensor::zeros(&[2]), Indices::from_vec(vec![7], &[])));
    assert!(err.contains("labels are 0-dim"), "{err}");
    let err = message(TensorDataset::new(Tensor::zeros(&[0, 3]), Indices::from_vec(vec![], &[0])));
    assert!(err.contains("inputs have no rows (first dim 0)"), "{err}");
}

#[test]
fn a_3d_input_batches_to_b_c_l_in_any_precision() {
    let (n, c, l) = (6, 2, 4);
    // Input element (i, ch, t) is 100 i + 10 ch + t, exact in f16.
    let values: Vec<f32> =
        (0..n).flat_map(|i| (0..c).flat_map(move |ch| (0..l).map(move |t| (100 * i + 10 * ch + t) as f32))).collect();
    let x = Tensor::<f16>::from_f32s(&values, &[n, c, l]);
    let y = Indices::from_vec((0..n as i64).collect(), &[n]);
    let data = TensorDataset::new(x, y).unwrap();
    assert_eq!(data.len(), n);
    let (row, label) = data.get(4);
    assert_eq!((row.shape(), label.shape()), (&[c, l][..], &[][..]));
    assert_eq!(row.to_f32_vec(), values[4 * c * l..5 * c * l]);
    assert_eq!(label.as_slice(), [4]);

    let mut loader = DataLoader::new(data, 4, 5).unwrap();
    let sizes: Vec<usize> = loader
        .epoch_batches()
        .map(|batch| {
            let (xb, yb) = batch.unwrap();
            assert_eq!(xb.shape()[1..], [c, l]);
            let xs = xb.to_f32_vec();
            for (k, &i) in yb.as_slice().iter().enumerate() {
                let i = i as usize;
                assert_eq!(xs[k * c * l..(k + 1) * c * l], values[i * c * l..(i + 1) * c * l], "batch row {k}");
            }
            xb.shape()[0]
        })
        .collect();
    assert_eq!(sizes, [4, 2]);
}

#[test]
fn batches_are_leaves_without_history_even_from_a_grad_tensor() {
    let x = Tensor::<f32>::ones(&[5, 2]).requires_grad_();
    let t = Tensor::<f32>::zeros(&[5]).requires_grad_();
    let mut loader = DataLoader::new(TensorDataset::new(x, t).unwrap(), 2, 0).unwrap();
    let (xb, tb) = loader.next_tensor_batch().unwrap();
    assert!(!xb.requires_grad() && !tb.requires_grad());
    assert!(xb.id().is_none());
    let (xs, ts) = loader.dataset().get(0);
    assert!(!xs.requires_grad() && !ts.requires_grad());
    // A batch is an input: a graph built on it has nothing to differentiate.
    assert!(xb.sum_all().try_backward().is_err());
}
