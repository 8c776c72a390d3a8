//! Fingerprints the compiler's own sources, so a persistent compile cache never
//! serves a program that an older lowering produced under the same version
//! number (see `kiln_compiler::BUILD_FINGERPRINT`).

use std::fs;
use std::path::{Path, PathBuf};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn main() {
    let src = Path::new("src");
    println!("cargo:rerun-if-changed=src");
    let mut files = Vec::new();
    collect(src, &mut files);
    files.sort();
    // FNV-1a over (path, contents) in path order: only needs to change when a
    // source changes, not to resist tampering.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in &files {
        eat(f.to_string_lossy().as_bytes());
        eat(&fs::read(f).unwrap_or_default());
    }
    println!("cargo:rustc-env=KILN_COMPILER_SOURCE_HASH={h:016x}");
}
