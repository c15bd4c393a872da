//! The embedded default task: a tiny GPT learns to add `n`-digit numbers, as characters.
//!
//! A sequence is `a+b=c$` with `a` and `b` zero-padded to `n` digits and the sum to `n + 1`
//! (written least-significant digit first by default, which is how a left-to-right model
//! can carry). Inputs are the sequence without its last token, targets the sequence shifted
//! by one, with [`IGNORE_INDEX`] on the prompt so the loss covers only the answer and `$`.
//!
//! Design notes: the pairs `(a, b)` are never stored. Every pair is a number
//! `k = a * 10^n + b` in `0..10^(2n)`; a seeded draw picks the held-out pairs (with each
//! `(a, b)` its mirror `(b, a)`, so the test measures addition, not recall of a commuted
//! training pair), and the training set is every other `k`, found by skipping the sorted
//! held-out list. Memory is the held-out list alone, for any `n`.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::{Dataset, IGNORE_INDEX, TokenSample};
use crate::error::{Error, Result};
use crate::indices::Indices;
use crate::rng::Rng;

/// Settings of the addition task.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdditionConfig {
    /// Digits per operand, 1 to 9.
    pub digits: usize,
    /// How many `(a, b)` pairs to hold out for testing (mirrored pairs included; at most half
    /// of all pairs).
    pub test_size: usize,
    /// Write the sum least-significant digit first (easier to learn: each digit depends only
    /// on the ones already written).
    pub reverse_answer: bool,
    /// Seed of the held-out draw.
    pub seed: u64,
}

impl Default for AdditionConfig {
    /// Two digits, 500 held-out pairs, reversed answers, seed 0.
    fn default() -> Self {
        AdditionConfig { digits: 2, test_size: 500, reverse_answer: true, seed: 0 }
    }
}

/// The task's tokens: digits `0`-`9` are ids 0-9, then `+`, `=`, the end marker `$` and the
/// padding `_` (unused by fixed-width sequences, there for models that batch other lengths).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdditionVocab;

impl AdditionVocab {
    /// `+`.
    pub const PLUS: i64 = 10;
    /// `=`.
    pub const EQUALS: i64 = 11;
    /// End of the answer, `$`.
    pub const END: i64 = 12;
    /// Padding, `_`.
    pub const PAD: i64 = 13;
    /// Number of token ids.
    pub const SIZE: usize = 14;

    /// The character of a token id (`?` for an id outside the vocabulary).
    pub fn char_of(id: i64) -> char {
        match id {
            0..=9 => char::from(b'0' + id as u8),
            Self::PLUS => '+',
            Self::EQUALS => '=',
            Self::END => '$',
            Self::PAD => '_',
            _ => '?',
        }
    }
    /// The token id of a character.
    pub fn id_of(c: char) -> Option<i64> {
        match c {
            '0'..='9' => Some(c as i64 - '0' as i64),
            '+' => Some(Self::PLUS),
            '=' => Some(Self::EQUALS),
            '$' => Some(Self::END),
            '_' => Some(Self::PAD),
            _ => None,
        }
    }
    /// Token ids as text.
    pub fn decode(ids: &[i64]) -> String {
        ids.iter().map(|&i| Self::char_of(i)).collect()
    }
}

#[derive(Debug)]
struct Inner {
    config: AdditionConfig,
    /// `10^digits`.
    base: u64,
    /// Held-out pair numbers, sorted.
    held_out: Vec<u64>,
}

/// The addition task: its held-out split, sequence layout, and exact-match scoring.
#[derive(Clone, Debug)]
pub struct AdditionTask {
    inner: Arc<Inner>,
}

/// Which pairs a dataset serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    Train,
    Test,
}

/// One split of an [`AdditionTask`] as a [`Dataset`] of [`TokenSample`]s.
#[derive(Clone, Debug)]
pub struct AdditionDataset {
    inner: Arc<Inner>,
    split: Split,
}

impl AdditionTask {
    /// The task for `config`: draws the held-out pairs.
    pub fn new(config: AdditionConfig) -> Result<Self> {
        if !(1..=9).contains(&config.digits) {
            return Err(Error::InvalidArgument {
                op: "AdditionTask::new",
                name: "digits",
                detail: format!("{} digits: use 1 to 9", config.digits),
            });
        }
        let base = 10u64.pow(config.digits as u32);
        let pairs = base * base;
        if config.test_size == 0 || config.test_size as u64 > pairs / 2 {
            return Err(Error::InvalidArgument {
                op: "AdditionTask::new",
                name: "test_size",
                detail: format!(
                    "{} held-out pairs: use 1 to {} (half of the {pairs} pairs of {}-digit numbers)",
                    config.test_size,
                    pairs / 2,
                    config.digits
                ),
            });
        }
        let mut rng = Rng::seed(config.seed);
        let mut held = BTreeSet::new();
        while held.len() < config.test_size {
            let k = rng.below(pairs);
            let (a, b) = (k / base, k % base);
            held.insert(k);
            held.insert(b * base + a);
        }
        let held_out = held.into_iter().collect();
        Ok(AdditionTask { inner: Arc::new(Inner { config, base, held_out }) })
    }
    /// The settings.
    pub fn config(&self) -> &AdditionConfig {
        &self.inner.config
    }
    /// Every pair not held out.
    pub fn train_set(&self) -> AdditionDataset {
        AdditionDataset { inner: self.inner.clone(), split: Split::Train }
    }
    /// The held-out pairs (never in the training set, nor their mirrors).
    pub fn test_set(&self) -> AdditionDataset {
        AdditionDataset { inner: self.inner.clone(), split: Split::Test }
    }
    /// Number of token ids ([`AdditionVocab::SIZE`]).
    pub fn vocab_size(&self) -> usize {
        AdditionVocab::SIZE
    }
    /// Tokens of the prompt `a+b=`: `2n + 2`.
    pub fn prompt_len(&self) -> usize {
        2 * self.inner.config.digits + 2
    }
    /// Digits of the answer, `n + 1` (the end marker follows them).
    pub fn answer_len(&self) -> usize {
        self.inner.config.digits + 1
    }
    /// Model sequence length `T`: the full `a+b=c$` minus its last token, `3n + 3`.
    pub fn seq_len(&self) -> usize {
        self.prompt_len() + self.answer_len()
    }
    /// The full token sequence `a+b=c$`.
    pub fn encode(&self, a: u64, b: u64) -> Vec<i64> {
        let n = self.inner.config.digits;
        let mut seq = Vec::with_capacity(3 * n + 4);
        push_digits(&mut seq, a, n, false);
        seq.push(AdditionVocab::PLUS);
        push_digits(&mut seq, b, n, false);
        seq.push(AdditionVocab::EQUALS);
        push_digits(&mut seq, a + b, n + 1, self.inner.config.reverse_answer);
        seq.push(AdditionVocab::END);
        seq
    }
    /// The prompt `a+b=` alone.
    pub fn encode_prompt(&self, a: u64, b: u64) -> Vec<i64> {
        let mut seq = self.encode(a, b);
        seq.truncate(self.prompt_len());
        seq
    }
    /// The number an answer's digit tokens spell (in the task's digit order); `None` if a
    /// token is not a digit or the count is not [`AdditionTask::answer_len`].
    pub fn decode_answer(&self, tokens: &[i64]) -> Option<u64> {
        if tokens.len() != self.answer_len() || tokens.iter().any(|t| !(0..=9).contains(t)) {
            return None;
        }
        let digits: Vec<u64> = if self.inner.config.reverse_answer {
            tokens.iter().rev().map(|&t| t as u64).collect()
        } else {
            tokens.iter().map(|&t| t as u64).collect()
        };
        Some(digits.iter().fold(0, |acc, d| acc * 10 + d))
    }
    /// A sequence as text, e.g. `"12+34=640$"` (answer reversed: 46).
    pub fn render(&self, tokens: &[i64]) -> String {
        AdditionVocab::decode(tokens)
    }
    /// Exact-match accuracy over `dataset` (usually [`AdditionTask::test_set`]), at most
    /// `limit` examples. `generate(prompts, n)` gets `[B, prompt_len]` prompts and returns
    /// `[B, m]` (`m >= n`) greedily decoded tokens; an example counts when its first
    /// `n = answer_len()` tokens spell `a + b`.
    pub fn exact_match_accuracy<F>(
        &self,
        dataset: &AdditionDataset,
        batch_size: usize,
        limit: Option<usize>,
        mut generate: F,
    ) -> Result<Accuracy>
    where
        F: FnMut(&Indices, usize) -> Result<Indices>,
    {
        if batch_size == 0 {
            return Err(Error::InvalidArgument {
                op: "AdditionTask::exact_match_accuracy",
                name: "batch_size",
                detail: "must be at least 1".into(),
            });
        }
        let total = limit.map_or(dataset.len(), |l| l.min(dataset.len()));
        let (p, n) = (self.prompt_len(), self.answer_len());
        let mut correct = 0;
        for start in (0..total).step_by(batch_size) {
            let end = (start + batch_size).min(total);
            let pairs: Vec<(u64, u64)> = (start..end).map(|i| dataset.pair(i)).collect();
            let prompts: Vec<i64> = pairs.iter().flat_map(|&(a, b)| self.encode_prompt(a, b)).collect();
            let prompts = Indices::try_from_vec(prompts, &[pairs.len(), p])?;
            let out = generate(&prompts, n)?;
            let shape = out.shape();
            if shape.len() != 2 || shape[0] != pairs.len() || shape[1] < n {
                return Err(Error::Shape {
                    op: "AdditionTask::exact_match_accuracy",
                    detail: format!("the decoder must return [{}, >= {n}] tokens", pairs.len()),
                    shapes: vec![shape.to_vec()],
                });
            }
            let m = shape[1];
            for (row, &(a, b)) in pairs.iter().enumerate() {
                let got = &out.as_slice()[row * m..row * m + n];
                if self.decode_answer(got) == Some(a + b) {
                    correct += 1;
                }
            }
        }
        Ok(Accuracy { correct, total })
    }
}

/// Result of [`AdditionTask::exact_match_accuracy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accuracy {
    /// Examples whose answer was exactly right.
    pub correct: usize,
    /// Examples scored.
    pub total: usize,
}

impl Accuracy {
    /// `correct / total` (0 when nothing was scored).
    pub fn fraction(&self) -> f64 {
        if self.total == 0 { 0.0 } else { self.correct as f64 / self.total as f64 }
    }
}

impl std::fmt::Display for Accuracy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({:.1}%)", self.correct, self.total, 100.0 * self.fraction())
    }
}

/// `value` as `width` digit tokens, most significant first unless `reverse`.
fn push_digits(seq: &mut Vec<i64>, value: u64, width: usize, reverse: bool) {
    let mut digits: Vec<i64> = (0..width)
        .scan(value, |v, _| {
            let d = (*v % 10) as i64;
            *v /= 10;
            Some(d)
        })
        .collect(); // least significant first
    if !reverse {
        digits.reverse();
    }
    seq.extend(digits);
}

impl AdditionDataset {
    /// The `(a, b)` pair of sample `index`.
    pub fn pair(&self, index: usize) -> (u64, u64) {
        let inner = &self.inner;
        let k = match self.split {
            Split::Test => inner.held_out[index],
            Split::Train => {
                assert!(index < self.len(), "AdditionDataset::get: index {index} out of range 0..{}", self.len());
                // The index-th number not in the sorted held-out list: every held-out number at
                // or below the candidate pushes it one further.
                let mut k = index as u64;
                for &h in &inner.held_out {
                    if h <= k {
                        k += 1;
                    } else {
                        break;
                    }
                }
                k
            }
        };
        (k / inner.base, k % inner.base)
    }
    /// The task this split belongs to.
    pub fn task(&self) -> AdditionTask {
        AdditionTask { inner: self.inner.clone() }
    }
}

impl Dataset for AdditionDataset {
    type Sample = TokenSample;
    fn len(&self) -> usize {
        match self.split {
            Split::Test => self.inner.held_out.len(),
            Split::Train => (self.inner.base * self.inner.base - self.inner.held_out.len() as u64) as usize,
        }
    }
    fn get(&self, index: usize) -> TokenSample {
        let (a, b) = self.pair(index);
        let task = self.task();
        let seq = task.encode(a, b);
        let input = seq[..seq.len() - 1].to_vec();
        let mut target = seq[1..].to_vec();
        // Position t predicts token t + 1: positions before the last prompt token predict
        // prompt tokens, which are given, not learned.
        let first_answer_pos = task.prompt_len() - 1;
        target[..first_answer_pos].fill(IGNORE_INDEX);
        TokenSample { input, target }
    }
}
