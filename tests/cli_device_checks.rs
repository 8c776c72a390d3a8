//! `kiln train mlp --data` on IDX files whose labels no class matches: the
//! device-side checks stop the run with an error naming the op, the label and
//! the range, and a non-zero exit.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::path::Path;

use assert_cmd::Command;
use flate2::write::GzEncoder;
use flate2::Compression;

/// Writes a gzip'd IDX3 image file and IDX1 label file for `labels`, with
/// 4x4 images of pseudo-random pixels.
fn write_split(dir: &Path, prefix: &str, labels: &[u8]) {
    let n = labels.len() as u32;
    let mut images = Vec::new();
    images.extend_from_slice(&0x0803u32.to_be_bytes());
    for d in [n, 4, 4] {
        images.extend_from_slice(&d.to_be_bytes());
    }
    let mut s = 0x2545_f491u32 ^ n;
    for _ in 0..n * 16 {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        images.push((s >> 24) as u8);
    }
    let mut lab = Vec::new();
    lab.extend_from_slice(&0x0801u32.to_be_bytes());
    lab.extend_from_slice(&n.to_be_bytes());
    lab.extend_from_slice(labels);
    for (name, bytes) in
        [(format!("{prefix}-images-idx3-ubyte.gz"), images), (format!("{prefix}-labels-idx1-ubyte.gz"), lab)]
    {
        let mut gz = GzEncoder::new(std::fs::File::create(dir.join(name)).unwrap(), Compression::fast());
        gz.write_all(&bytes).unwrap();
        gz.finish().unwrap();
    }
}

fn train(dir: &Path) -> std::process::Output {
    Command::cargo_bin("kiln")
        .unwrap()
        .env("KILN_CACHE", "off")
        .args(["train", "mlp", "--epochs", "1", "--batch", "8", "--hidden", "8", "--json", "--data"])
        .arg(dir)
        .output()
        .unwrap()
}

fn labels(n: usize, bad_at: Option<(usize, u8)>) -> Vec<u8> {
    let mut l: Vec<u8> = (0..n).map(|i| (i * 7 % 10) as u8).collect();
    if let Some((i, v)) = bad_at {
        l[i] = v;
    }
    l
}

#[test]
fn train_labels_of_10_and_more_stop_the_run_naming_op_label_and_range() {
    let dir = tempfile::tempdir().unwrap();
    write_split(dir.path(), "train", &labels(64, Some((13, 12))));
    write_split(dir.path(), "t10k", &labels(16, None));
    let out = train(dir.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit 0 with a label of 12: {err}");
    assert!(err.contains("cross_entropy: label 12 is out of range [0, 10)"), "{err}");
}

#[test]
fn test_labels_of_255_stop_the_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    write_split(dir.path(), "train", &labels(64, None));
    write_split(dir.path(), "t10k", &labels(16, Some((3, 255))));
    let out = train(dir.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit 0 with a test label of 255: {err}");
    assert!(err.contains("evaluate: label 255 is out of range [0, 10)"), "{err}");
}

#[test]
fn labels_in_range_train_to_the_end() {
    let dir = tempfile::tempdir().unwrap();
    write_split(dir.path(), "train", &labels(64, None));
    write_split(dir.path(), "t10k", &labels(16, None));
    let out = train(dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["steps"], 8);
    assert_eq!(v["compiles"], 2, "{stdout}");
}
