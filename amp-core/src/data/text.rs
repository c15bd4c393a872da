//! A character-level language-model dataset from a user's text file: the vocabulary is the
//! file's distinct characters, a sample is a window of `T` characters and the `T` characters
//! after each (next-character targets). With a shuffling [`super::DataLoader`] the windows come
//! in random order.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use super::{Dataset, TokenSample};
use crate::error::{Error, Result};

/// The characters of a text, sorted, each one a token id (its position).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CharVocab {
    chars: Vec<char>,
}

impl CharVocab {
    /// The distinct characters of `text`, sorted.
    pub fn from_text(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharVocab { chars }
    }
    /// Number of token ids.
    pub fn len(&self) -> usize {
        self.chars.len()
    }
    /// Whether the vocabulary has no characters.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }
    /// The characters, in id order.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }
    /// The id of `c`, if it is in the vocabulary.
    pub fn id_of(&self, c: char) -> Option<i64> {
        self.chars.binary_search(&c).ok().map(|i| i as i64)
    }
    /// Token ids of `text`; fails on the first character outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                self.id_of(c).ok_or_else(|| Error::InvalidArgument {
                    op: "CharVocab::encode",
                    name: "text",
                    detail: format!("character {c:?} at position {i} is not in the vocabulary"),
                })
            })
            .collect()
    }
    /// Text of token ids (`\u{FFFD}` for an id outside the vocabulary).
    pub fn decode(&self, ids: &[i64]) -> String {
        ids.iter()
            .map(|&i| usize::try_from(i).ok().and_then(|i| self.chars.get(i)).copied().unwrap_or('\u{FFFD}'))
            .collect()
    }
}

/// Windows of `block_size` characters from one text, as a [`Dataset`] of [`TokenSample`]s.
#[derive(Clone, Debug)]
pub struct CharTextDataset {
    /// Where the text came from, for messages.
    source: String,
    vocab: Arc<CharVocab>,
    tokens: Arc<Vec<i64>>,
    /// The part of `tokens` this dataset serves (all, or one side of a split).
    range: Range<usize>,
    block_size: usize,
}

impl CharTextDataset {
    /// Reads `path` (UTF-8 text) and serves windows of `block_size` characters. Errors name the
    /// file: missing or unreadable, not UTF-8, empty, or too short for one window.
    pub fn from_file(path: impl AsRef<Path>, block_size: usize) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let bytes = std::fs::read(path)
            .map_err(|e| Error::Io { path: name.clone(), detail: format!("cannot read the training text: {e}") })?;
        let text = String::from_utf8(bytes).map_err(|e| Error::Io {
            path: name.clone(),
            detail: format!("is not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
        })?;
        Self::from_text(&name, &text, block_size)
    }
    /// Serves windows of `block_size` characters of `text`; `source` names it in messages.
    pub fn from_text(source: &str, text: &str, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::InvalidArgument {
                op: "CharTextDataset",
                name: "block_size",
                detail: "must be at least 1".into(),
            });
        }
        if text.is_empty() {
            return Err(Error::Io {
                path: source.to_string(),
                detail: "is empty: a character-level dataset needs some text".into(),
            });
        }
        let vocab = CharVocab::from_text(text);
        let tokens = vocab.encode(text)?;
        check_length(source, tokens.len(), block_size, "")?;
        Ok(CharTextDataset {
            source: source.to_string(),
            vocab: Arc::new(vocab),
            range: 0..tokens.len(),
            tokens: Arc::new(tokens),
            block_size,
        })
    }
    /// Splits off the last `val_fraction` of the text (in `(0, 1)`) as a validation set with the
    /// same vocabulary; both sides must hold at least one window.
    pub fn split(&self, val_fraction: f64) -> Result<(CharTextDataset, CharTextDataset)> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(Error::InvalidArgument {
                op: "CharTextDataset::split",
                name: "val_fraction",
                detail: format!("{val_fraction} is not in (0, 1)"),
            });
        }
        let n = self.range.len();
        let cut = self.range.start + n - ((n as f64 * val_fraction).round() as usize);
        let (train, val) = (self.range.start..cut, cut..self.range.end);
        check_length(&self.source, train.len(), self.block_size, " (training part of the split)")?;
        check_length(&self.source, val.len(), self.block_size, " (validation part of the split)")?;
        let part = |range| CharTextDataset { range, ..self.clone() };
        Ok((part(train), part(val)))
    }
    /// The vocabulary.
    pub fn vocab(&self) -> &CharVocab {
        &self.vocab
    }
    /// Window length `T`.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// The token ids this dataset covers.
    pub fn tokens(&self) -> &[i64] {
        &self.tokens[self.range.clone()]
    }
    /// Where the text came from.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// A window needs `block_size + 1` characters (inputs and their next characters).
fn check_length(source: &str, len: usize, block_size: usize, part: &str) -> Result<()> {
    if len < block_size + 1 {
        return Err(Error::Io {
            path: source.to_string(),
            detail: format!(
                "is too short{part}: {len} characters, but a window of {block_size} characters and its next-character targets need at least {}",
                block_size + 1
            ),
        });
    }
    Ok(())
}

impl Dataset for CharTextDataset {
    type Sample = TokenSample;
    /// Number of window start positions.
    fn len(&self) -> usize {
        self.range.len() - self.block_size
    }
    fn get(&self, index: usize) -> TokenSample {
        assert!(index < self.len(), "CharTextDataset::get: index {index} out of range 0..{}", self.len());
        let start = self.range.start + index;
        let t = self.block_size;
        TokenSample {
            input: self.tokens[start..start + t].to_vec(),
            target: self.tokens[start + 1..start + t + 1].to_vec(),
        }
    }
}
