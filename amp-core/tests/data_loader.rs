//! DataLoader: every sample once per epoch, seeded reshuffling, drop_last, and a position that
//! resumes the exact order (through JSON, as a checkpoint stores it).

use amp_core::data::{DataLoader, Dataset, LoaderPosition};

/// Sample `i` is `i`: the batches show the order directly.
struct Range(usize);

impl Dataset for Range {
    type Sample = usize;
    fn len(&self) -> usize {
        self.0
    }
    fn get(&self, index: usize) -> usize {
        assert!(index < self.0);
        index
    }
}

fn epoch_of(loader: &mut DataLoader<Range>) -> Vec<Vec<usize>> {
    (0..loader.batches_per_epoch()).map(|_| loader.next_batch()).collect()
}

#[test]
fn each_epoch_is_a_permutation_in_batches() {
    let mut loader = DataLoader::new(Range(103), 10, 7).unwrap();
    assert_eq!(loader.batches_per_epoch(), 11);
    let mut previous: Option<Vec<usize>> = None;
    for epoch in 0..3 {
        let batches = epoch_of(&mut loader);
        assert_eq!(loader.epoch(), epoch);
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(sizes, [10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 3]);
        let order: Vec<usize> = batches.concat();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..103).collect::<Vec<_>>(), "epoch {epoch} is not a permutation");
        assert_ne!(order, (0..103).collect::<Vec<_>>(), "epoch {epoch} was not shuffled");
        if let Some(prev) = &previous {
            assert_ne!(prev, &order, "epoch {epoch} repeats the previous order");
        }
        previous = Some(order);
    }
}

#[test]
fn same_seed_same_order_other_seed_other_order() {
    let take = |seed| {
        let mut l = DataLoader::new(Range(50), 8, seed).unwrap();
        (0..20).flat_map(|_| l.next_indices()).collect::<Vec<_>>()
    };
    assert_eq!(take(1), take(1));
    assert_ne!(take(1), take(2));
}

#[test]
fn drop_last_skips_the_short_batch_and_unshuffled_is_in_order() {
    let mut loader = DataLoader::new(Range(23), 5, 0).unwrap().drop_last(true).unwrap().shuffle(false);
    assert_eq!(loader.batches_per_epoch(), 4);
    let first = epoch_of(&mut loader);
    assert_eq!(first, [vec![0, 1, 2, 3, 4], vec![5, 6, 7, 8, 9], vec![10, 11, 12, 13, 14], vec![15, 16, 17, 18, 19]]);
    // The next batch starts epoch 1 rather than serving the 3 left over.
    assert_eq!(loader.next_batch(), [0, 1, 2, 3, 4]);
    assert_eq!(loader.epoch(), 1);

    let err = DataLoader::new(Range(3), 5, 0).unwrap().drop_last(true).unwrap_err().to_string();
    assert!(err.contains("batch size 5 exceeds the dataset's 3 samples"), "{err}");
    assert!(DataLoader::new(Range(3), 0, 0).unwrap_err().to_string().contains("batch_size"));
    assert!(DataLoader::new(Range(0), 2, 0).unwrap_err().to_string().contains("empty"));
}

#[test]
fn restored_position_continues_the_exact_order_across_epochs() {
    for drop_last in [false, true] {
        let mut original = DataLoader::new(Range(37), 6, 42).unwrap().drop_last(drop_last).unwrap();
        for _ in 0..9 {
            original.next_indices(); // mid-epoch 1
        }
        let json = serde_json::to_string(&original.position()).unwrap();
        let position: LoaderPosition = serde_json::from_str(&json).unwrap();
        assert_eq!(position, original.position());

        let mut resumed = DataLoader::new(Range(37), 6, 42).unwrap().drop_last(drop_last).unwrap();
        resumed.restore(&position).unwrap();
        for step in 0..40 {
            assert_eq!(resumed.next_batch(), original.next_batch(), "drop_last {drop_last}, step {step}");
        }
        assert_eq!(resumed.position(), original.position());
    }
}

#[test]
fn restore_refuses_a_position_for_another_stream() {
    let position = DataLoader::new(Range(37), 6, 42).unwrap().position();
    let check = |mut loader: DataLoader<Range>, expect: &str| {
        let err = loader.restore(&position).unwrap_err().to_string();
        assert!(err.contains(expect), "{err}");
    };
    check(DataLoader::new(Range(38), 6, 42).unwrap(), "dataset of length 37, but this loader has 38");
    check(DataLoader::new(Range(37), 5, 42).unwrap(), "batch size 6, but this loader has 5");
    check(DataLoader::new(Range(37), 6, 42).unwrap().drop_last(true).unwrap(), "drop_last = false");
    check(DataLoader::new(Range(37), 6, 42).unwrap().shuffle(false), "shuffle = true");
    // A different seed is not a mismatch: the stored seed wins, so the order is the stored one.
    let mut other_seed = DataLoader::new(Range(37), 6, 1).unwrap();
    other_seed.restore(&position).unwrap();
    assert_eq!(other_seed.next_indices(), DataLoader::new(Range(37), 6, 42).unwrap().next_indices());
}
