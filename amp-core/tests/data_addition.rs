//! The addition task: sequence layout, targets masked on the prompt, a held-out split
//! disjoint from training (mirrors included), batching, and exact-match scoring.

use std::collections::HashSet;

use amp_core::Indices;
use amp_core::data::{AdditionConfig, AdditionTask, AdditionVocab, DataLoader, Dataset, IGNORE_INDEX, TokenBatch};

fn task(digits: usize, reverse: bool) -> AdditionTask {
    AdditionTask::new(AdditionConfig { digits, test_size: 200, reverse_answer: reverse, seed: 3 }).unwrap()
}

#[test]
fn sequence_layout_and_targets() {
    let t = task(2, true);
    assert_eq!((t.prompt_len(), t.answer_len(), t.seq_len(), t.vocab_size()), (6, 3, 9, 14));
    // 12 + 34 = 046, written reversed.
    assert_eq!(t.render(&t.encode(12, 34)), "12+34=640$");
    assert_eq!(task(2, false).render(&task(2, false).encode(12, 34)), "12+34=046$");
    assert_eq!(t.render(&t.encode(99, 9)), "99+09=801$");
    assert_eq!(t.render(&t.encode_prompt(5, 7)), "05+07=");
    assert_eq!(t.decode_answer(&[6, 4, 0]), Some(46));
    assert_eq!(task(2, false).decode_answer(&[0, 4, 6]), Some(46));
    assert_eq!(t.decode_answer(&[6, 4]), None);
    assert_eq!(t.decode_answer(&[6, AdditionVocab::PLUS, 0]), None);

    let train = t.train_set();
    let sample = train.get(17);
    let (a, b) = train.pair(17);
    let seq = t.encode(a, b);
    assert_eq!(sample.input, seq[..9]);
    // Positions 0..=4 would predict prompt tokens: ignored. Position 5 ('=') predicts the
    // first answer digit, ..., position 8 predicts the end marker.
    assert_eq!(&sample.target[..5], &[IGNORE_INDEX; 5]);
    assert_eq!(&sample.target[5..], &seq[6..]);
    assert_eq!(*sample.target.last().unwrap(), AdditionVocab::END);
}

#[test]
fn held_out_pairs_and_their_mirrors_never_appear_in_training() {
    let t = task(2, true);
    let (train, test) = (t.train_set(), t.test_set());
    assert!(test.len() >= 200 && test.len() <= 400, "{}", test.len());
    assert_eq!(train.len() + test.len(), 10_000);
    let test_pairs: HashSet<(u64, u64)> = (0..test.len()).map(|i| test.pair(i)).collect();
    assert_eq!(test_pairs.len(), test.len());
    for &(a, b) in &test_pairs {
        assert!(test_pairs.contains(&(b, a)), "mirror of ({a}, {b}) is not held out");
    }
    let train_pairs: HashSet<(u64, u64)> = (0..train.len()).map(|i| train.pair(i)).collect();
    assert_eq!(train_pairs.len(), train.len(), "training pairs repeat");
    assert!(train_pairs.is_disjoint(&test_pairs));
    // Same seed, same split; another seed, another split.
    let again = task(2, true).test_set();
    assert_eq!((0..again.len()).map(|i| again.pair(i)).collect::<HashSet<_>>(), test_pairs);
    let other = AdditionTask::new(AdditionConfig { seed: 4, test_size: 200, ..AdditionConfig::default() }).unwrap();
    let other = other.test_set();
    assert_ne!((0..other.len()).map(|i| other.pair(i)).collect::<HashSet<_>>(), test_pairs);
}

#[test]
fn large_digit_counts_do_not_enumerate_pairs() {
    // 10^18 pairs: only the held-out list is stored.
    let t = AdditionTask::new(AdditionConfig { digits: 9, test_size: 100, ..AdditionConfig::default() }).unwrap();
    let train = t.train_set();
    assert!(train.len() > 999_999_999_999_999_000);
    let s = train.get(train.len() - 1);
    assert_eq!(s.input.len(), t.seq_len());
    // The last training pair is the largest pair number that is not held out.
    let test = t.test_set();
    let held: HashSet<(u64, u64)> = (0..test.len()).map(|i| test.pair(i)).collect();
    let base = 1_000_000_000u64;
    let mut k = base * base - 1;
    while held.contains(&(k / base, k % base)) {
        k -= 1;
    }
    assert_eq!(train.pair(train.len() - 1), (k / base, k % base));
    assert!(!held.contains(&train.pair(12_345)));
}

#[test]
fn batches_stack_into_indices() {
    let t = task(3, true);
    let mut loader = DataLoader::new(t.train_set(), 16, 0).unwrap();
    let batch: TokenBatch = loader.next_token_batch().unwrap();
    assert_eq!(batch.inputs.shape(), &[16, 12]);
    assert_eq!(batch.targets.shape(), &[16, 12]);
    assert_eq!((batch.batch_size(), batch.seq_len()), (16, 12));
    assert_eq!(batch.num_targets(), 16 * (t.answer_len() + 1));
    assert!(batch.inputs.as_slice().iter().all(|&x| (0..14).contains(&x)));
}

#[test]
fn exact_match_accuracy_scores_a_decoder() {
    let t = task(2, true);
    let test = t.test_set();
    // An oracle that reads a and b back from the prompt and writes the true sum.
    let oracle = |prompts: &Indices, n: usize, wrong_every: usize| -> Indices {
        let (rows, p) = (prompts.shape()[0], prompts.shape()[1]);
        let mut out = Vec::new();
        for r in 0..rows {
            let row = &prompts.as_slice()[r * p..(r + 1) * p];
            let a = row[0] * 10 + row[1];
            let b = row[3] * 10 + row[4];
            let mut sum = a + b + i64::from(wrong_every > 0 && r % wrong_every == 0);
            for _ in 0..n {
                out.push(sum % 10);
                sum /= 10;
            }
            out.push(AdditionVocab::END);
        }
        Indices::from_vec(out, &[rows, n + 1])
    };
    let acc = t.exact_match_accuracy(&test, 32, None, |p, n| Ok(oracle(p, n, 0))).unwrap();
    assert_eq!((acc.correct, acc.total), (test.len(), test.len()));
    assert_eq!(acc.fraction(), 1.0);
    // Every 4th row of each batch of 8 wrong: exactly a quarter wrong.
    let acc = t.exact_match_accuracy(&test, 8, Some(160), |p, n| Ok(oracle(p, n, 4))).unwrap();
    assert_eq!((acc.correct, acc.total), (120, 160));
    assert_eq!(acc.to_string(), "120/160 (75.0%)");
    // A decoder returning the wrong shape is an error, not a silent score.
    let err = t.exact_match_accuracy(&test, 8, Some(8), |p, _| Ok(Indices::from_vec(vec![0; 8], &[p.shape()[0], 1])));
    assert!(err.unwrap_err().to_string().contains("must return [8, >= 3]"));
}

#[test]
fn bad_settings_are_refused() {
    let err = |c: AdditionConfig| AdditionTask::new(c).unwrap_err().to_string();
    assert!(err(AdditionConfig { digits: 0, ..Default::default() }).contains("use 1 to 9"));
    assert!(err(AdditionConfig { digits: 10, ..Default::default() }).contains("use 1 to 9"));
    assert!(err(AdditionConfig { digits: 1, test_size: 51, ..Default::default() }).contains("use 1 to 50"));
    assert!(err(AdditionConfig { test_size: 0, ..Default::default() }).contains("test_size"));
}
