//! The character-level GPT trains on a real text with one compile.

use std::path::Path;

use kiln::models::gpt::{self, CharVocab, GptConfig};

const TEXT: &str = "/usr/share/common-licenses/Apache-2.0";

#[test]
fn tiny_gpt_drives_the_loss_down_with_one_compile() -> anyhow::Result<()> {
    // Compile counts must not depend on what earlier runs left on disk.
    kiln::set_disk_cache(None)?;
    let text = gpt::read_text(Path::new(TEXT), 32)?;
    let vocab = CharVocab::new(&text);
    assert_eq!(vocab.decode(&vocab.encode("License")), "License");
    let report = gpt::train(&text, &GptConfig::tiny(0), |_| {})?;
    assert_eq!(report.steps, 300);
    // Every step has the same shapes: one program, cache hits from step 2 on.
    assert_eq!(report.compiles, 1, "{report:?}");
    assert_eq!(report.cache_hits, 299);
    let first = report.losses[0];
    let last: f64 = report.losses[280..].iter().sum::<f64>() / 20.0;
    // Measured 2026-11-22: 4.31 at step 1 (ln 73 characters = 4.29), 2.14 at step 300.
    assert!(first > 4.0, "starts near uniform: {first}");
    assert!(last < 2.6, "mean loss of the last 20 steps: {last}");
    Ok(())
}

#[test]
fn a_too_short_or_missing_text_is_an_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let err = gpt::read_text(&short, 32).unwrap_err().to_string();
    assert!(err.contains("short.txt") && err.contains("sequence length 32"), "{err}");
    let err = gpt::read_text(&dir.path().join("missing.txt"), 32).unwrap_err().to_string();
    assert!(err.contains("missing.txt"), "{err}");
}
