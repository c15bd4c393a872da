//! Character-level text dataset: vocabulary from the file, windows and next-character
//! targets, a validation split, and errors that name the file.

use std::path::PathBuf;

use amp_core::data::{CharTextDataset, CharVocab, DataLoader, Dataset};

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("data_text");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn windows_and_vocab_from_a_file() {
    let path = temp_file("hello.txt", "hello world\nhello rust\n".as_bytes());
    let ds = CharTextDataset::from_file(&path, 4).unwrap();
    assert_eq!(ds.vocab().chars(), &['\n', ' ', 'd', 'e', 'h', 'l', 'o', 'r', 's', 't', 'u', 'w']);
    assert_eq!(ds.len(), 23 - 4);
    let s = ds.get(6);
    assert_eq!(ds.vocab().decode(&s.input), "worl");
    assert_eq!(ds.vocab().decode(&s.target), "orld");
    assert_eq!(ds.vocab().encode("hello").unwrap(), [4, 3, 5, 5, 6]);
    assert!(ds.vocab().encode("hi").unwrap_err().to_string().contains("'i' at position 1"));

    let mut loader = DataLoader::new(ds.clone(), 3, 0).unwrap();
    let batch = loader.next_token_batch().unwrap();
    assert_eq!(batch.inputs.shape(), &[3, 4]);
    assert_eq!(batch.num_targets(), 12);
}

#[test]
fn split_keeps_the_vocabulary_and_the_order() {
    let text: String = (0..100).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    let ds = CharTextDataset::from_text("alphabet", &text, 8).unwrap();
    let (train, val) = ds.split(0.2).unwrap();
    assert_eq!((train.tokens().len(), val.tokens().len()), (80, 20));
    assert_eq!((train.len(), val.len()), (72, 12));
    assert_eq!(train.vocab(), val.vocab());
    assert_eq!(val.vocab().decode(&val.get(0).input), "cdefghij"); // text[80..88]
    let err = ds.split(0.05).unwrap_err().to_string();
    assert!(err.starts_with("alphabet: is too short (validation part of the split): 5 characters"), "{err}");
    assert!(ds.split(1.0).is_err());
}

#[test]
fn errors_name_the_file() {
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("no_such_dir/corpus.txt");
    let err = CharTextDataset::from_file(&missing, 8).unwrap_err().to_string();
    assert!(err.contains("no_such_dir/corpus.txt") && err.contains("cannot read the training text"), "{err}");

    let empty = temp_file("empty.txt", b"");
    let err = CharTextDataset::from_file(&empty, 8).unwrap_err().to_string();
    assert!(err.contains("empty.txt: is empty"), "{err}");

    let short = temp_file("short.txt", b"abcdefgh");
    let err = CharTextDataset::from_file(&short, 8).unwrap_err().to_string();
    assert!(err.contains("short.txt: is too short: 8 characters") && err.contains("at least 9"), "{err}");
    assert!(CharTextDataset::from_file(&short, 7).is_ok());

    let binary = temp_file("binary.bin", &[b'a', b'b', 0xff, 0xfe, b'c']);
    let err = CharTextDataset::from_file(&binary, 2).unwrap_err().to_string();
    assert!(err.contains("binary.bin: is not UTF-8 text (invalid byte at offset 2)"), "{err}");

    let vocab = CharVocab::from_text("ba");
    assert_eq!(vocab.decode(&[1, 0, 7]), "ba\u{FFFD}"); // ids follow sorted order: a=0, b=1
}
