//! Fuzzing of the readers that take untrusted bytes: the IDX image and label
//! readers and the safetensors checkpoint reader. A proptest-driven corpus
//! run: valid seeds, then random mutations (bit flips, byte edits, splices,
//! truncations, hostile header integers). Every input must give a value or
//! a typed error: no panic, no abort (allocation included), no hang. Bounded
//! (a fixed number of cases per target, a few seconds in release) so it runs
//! in the normal suite; `--nocapture` prints the executions.

use std::io::Cursor;
use std::path::Path;

use kiln_frontend::checkpoint;
use kiln_frontend::data::{parse_idx_images, parse_idx_labels};
use kiln_frontend::Tensor;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// One edit of a byte string.
#[derive(Clone, Debug)]
enum Edit {
    Flip {
        at: usize,
        bit: u8,
    },
    Set {
        at: usize,
        byte: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Remove {
        at: usize,
        len: usize,
    },
    Truncate {
        at: usize,
    },
    /// A big-endian u32 (IDX header fields) or little-endian u64
    /// (safetensors' header length) written over the input.
    Word {
        at: usize,
        value: u64,
        be32: bool,
    },
}

fn edit() -> impl Strategy<Value = Edit> {
    let hostile = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::from(u32::MAX)),
        Just(u64::MAX),
        Just(1 << 31),
        Just(1 << 40),
        any::<u64>()
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Edit::Flip { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Set { at, byte }),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Edit::Remove { at, len }),
        any::<usize>().prop_map(|at| Edit::Truncate { at }),
        (0usize..24, hostile, any::<bool>()).prop_map(|(at, value, be32)| Edit::Word { at, value, be32 }),
    ]
}

fn apply(mut b: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let n = b.len().max(1);
        match e {
            Edit::Flip { at, bit } => {
                if let Some(x) = b.get_mut(at % n) {
                    *x ^= 1 << bit;
                }
            }
            Edit::Set { at, byte } => {
                if let Some(x) = b.get_mut(at % n) {
                    *x = *byte;
                }
            }
            Edit::Insert { at, bytes } => {
                let at = at % (b.len() + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Edit::Remove { at, len } => {
                let at = at % n;
                let end = (at + len).min(b.len());
                if at < end {
                    b.drain(at..end);
                }
            }
            Edit::Truncate { at } => b.truncate(at % n),
            Edit::Word { at, value, be32 } => {
                let bytes: Vec<u8> =
                    if *be32 { (*value as u32).to_be_bytes().to_vec() } else { value.to_le_bytes().to_vec() };
                for (i, x) in bytes.into_iter().enumerate() {
                    if let Some(slot) = b.get_mut(at + i) {
                        *slot = x;
                    }
                }
            }
        }
    }
    b
}

fn idx3(n: u32, rows: u32, cols: u32) -> Vec<u8> {
    let mut b = Vec::new();
    for v in [0x0803, n, rows, cols] {
        b.extend(v.to_be_bytes());
    }
    b.extend((0..(n * rows * cols) as usize).map(|i| (i * 31 % 256) as u8));
    b
}

fn idx1(n: u32) -> Vec<u8> {
    let mut b = Vec::new();
    for v in [0x0801, n] {
        b.extend(v.to_be_bytes());
    }
    b.extend((0..n).map(|i| (i % 10) as u8));
    b
}

/// Runs `cases` mutated inputs of `seeds` through `target`; returns the
/// executions and how many were accepted (the rest were typed errors).
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, cases: u32, target: impl Fn(&[u8]) -> bool) -> (u64, u64) {
    let runs = std::cell::Cell::new(0u64);
    let accepted = std::cell::Cell::new(0u64);
    // Seeds unmutated first: each must be accepted (the harness reaches
    // the readers' deep paths, not only their magic checks).
    for s in &seeds {
        assert!(target(s), "{name}: a valid seed was refused");
    }
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let strategy = (0..seeds.len(), proptest::collection::vec(edit(), 1..6));
    runner
        .run(&strategy, |(seed, edits)| {
            let input = apply(seeds[seed].clone(), &edits);
            runs.set(runs.get() + 1);
            if target(&input) {
                accepted.set(accepted.get() + 1);
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    println!(
        "fuzz {name}: {} executions, {} accepted, {} typed errors, 0 panics",
        runs.get(),
        accepted.get(),
        runs.get() - accepted.get()
    );
    (runs.get(), accepted.get())
}

#[test]
fn idx_image_reader_never_panics_or_overallocates() {
    let path = Path::new("fuzz-images-idx3-ubyte");
    let seeds = vec![idx3(3, 4, 5), idx3(1, 1, 1), idx3(2, 28, 28)];
    let (runs, _) = fuzz("idx3", seeds, 20000, |b| parse_idx_images(&mut Cursor::new(b), path).is_ok());
    assert_eq!(runs, 20000);
}

#[test]
fn idx_label_reader_never_panics_or_overallocates() {
    let path = Path::new("fuzz-labels-idx1-ubyte");
    let seeds = vec![idx1(10), idx1(1), idx1(300)];
    let (runs, _) = fuzz("idx1", seeds, 20000, |b| parse_idx_labels(&mut Cursor::new(b), path).is_ok());
    assert_eq!(runs, 20000);
}

#[test]
fn checkpoint_reader_never_panics() {
    kiln_frontend::set_backend(kiln_frontend::Backend::Reference);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seed.safetensors");
    let w = Tensor::from_vec(vec![1.5f32, -2.0, 3.25, 0.0, 7.0, -0.5], [2, 3]).unwrap();
    let b = Tensor::from_vec(vec![1i32, 2, 3], [3]).unwrap();
    let s = Tensor::from_vec(vec![7u64, 0], [2]).unwrap();
    checkpoint::save(&path, 42, &[("param.w".into(), w), ("param.b".into(), b), ("rng.state".into(), s)]).unwrap();
    let seed = std::fs::read(&path).unwrap();
    let (runs, _) = fuzz("checkpoint", vec![seed], 20000, |bytes| checkpoint::load_bytes(bytes, &path).is_ok());
    assert_eq!(runs, 20000);
}
