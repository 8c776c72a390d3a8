//! What reading a `dense<[..]>` list costs: the parser counts the values
//! against the declared type as it reads them, so a list far longer than its
//! type is refused at the first value too many, and neither that nor a list
//! far shorter than a huge type allocates more than the literal's bytes.
//!
//! One test in its own binary: it reads the process's peak RSS (`VmHWM`,
//! reset through `/proc/self/clear_refs`), which other tests running beside
//! it would move.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kiln_compiler::text::parse;
use kiln_compiler::CompileError;

/// `VmRSS` and `VmHWM` of this process, in bytes.
fn rss_and_peak() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line[name.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Parses `text`, expecting a parse error; returns its line and reason, the
/// time it took and how far the peak RSS rose above the RSS before.
fn refused(text: &str) -> (usize, String, Duration, u64) {
    // 5: reset the peak RSS to the current RSS.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let (before, _) = rss_and_peak();
    let t = Instant::now();
    let result = parse(text);
    let took = t.elapsed();
    let (_, peak) = rss_and_peak();
    match result {
        Err(CompileError::Parse { line, reason }) => (line, reason, took, peak.saturating_sub(before)),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn dense_lists_are_counted_against_their_type_as_they_are_read() {
    // 30 million values (90 MB of text) for a type of two: the list the
    // parser used to split whole (16 bytes a value, 480 MB) before counting.
    let values = 30_000_000;
    let mut long = String::from("graph() {\n  %c = constant dense<[");
    long.push_str(&"0, ".repeat(values - 1));
    long.push_str("0]> : tensor<2xf32>\n  return %c\n}\n");
    let (line, reason, took, grew) = refused(&long);
    assert_eq!(line, 2, "{reason}");
    assert_eq!(reason, "`dense` has more than 2 values, the element count of tensor<2xf32>");
    assert!(grew < 32 << 20, "the peak RSS rose by {grew} bytes");
    assert!(took < Duration::from_secs(5), "{took:?}");

    // Three values for a type of 10^11 elements: an error naming the count,
    // and no allocation of the type's 400 GB (nor of anything near it).
    let short = "graph() {\n  %c = constant dense<[1, 2, 3]> : tensor<100000000000xf32>\n  return %c\n}\n";
    let (line, reason, _, grew) = refused(short);
    assert_eq!(line, 2, "{reason}");
    assert_eq!(reason, "`dense` has 3 values but tensor<100000000000xf32> has 100000000000 elements");
    assert!(grew < 32 << 20, "the peak RSS rose by {grew} bytes");

    // A list that matches its type is read whole, into the literal's bytes.
    let n = 4_000_000;
    let mut fits = String::from("graph() {\n  %c = constant dense<[");
    fits.push_str(&"7, ".repeat(n - 1));
    fits.push_str(&format!("7]> : tensor<{n}xi32>\n  return %c\n}}\n"));
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let (before, _) = rss_and_peak();
    let g = parse(&fits).unwrap();
    let (_, peak) = rss_and_peak();
    assert_eq!(g.len(), 1);
    // The literal's 16 MB, not 16 bytes a value of list (64 MB) on top.
    assert!(peak.saturating_sub(before) < 40 << 20, "the peak RSS rose by {} bytes", peak - before);
}
