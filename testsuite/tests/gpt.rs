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

/// The fused qkv projection keeps its output features as `[3, heads,
/// head_dim]` (so tensor parallelism can split the heads): a checkpoint
/// written before that, with the flat `[dim, 3·dim]` weight, `[3·dim]` bias
/// and their AdamW state, has the same row-major values and loads bit for
/// bit; a shape that is not such a regrouping is an error naming the tensor
/// and both types.
#[test]
fn a_checkpoint_of_the_flat_qkv_layout_loads_into_the_heads_layout() -> anyhow::Result<()> {
    use kiln::models::gpt::GptTrainer;
    use kiln::{checkpoint, Tensor};
    let dir = tempfile::tempdir()?;
    let text = gpt::read_text(Path::new(TEXT), 32)?;
    let vocab = CharVocab::new(&text);
    let cfg = GptConfig { batch: 4, layers: 1, ..GptConfig::tiny(vocab.len()) };
    let mut saved = GptTrainer::new(vocab.encode(&text), &cfg)?;
    // One step, so the AdamW moments are not zeros.
    saved.train_step(3e-3)?;
    let mut flattened = Vec::new();
    let flat = saved
        .state()
        .into_iter()
        .map(|(n, t)| {
            let d = t.dims().to_vec();
            let t = match d.len() {
                4 => t.reshape([d[0], d[1] * d[2] * d[3]])?,
                3 => t.reshape([d[0] * d[1] * d[2]])?,
                _ => t,
            };
            if d.len() >= 3 {
                flattened.push(format!("{n} {}", t.ty()));
            }
            Ok((n, t))
        })
        .collect::<kiln::Result<Vec<(String, Tensor)>>>()?;
    // The qkv weight and bias and their m and v.
    assert_eq!(flattened.len(), 6, "{flattened:?}");
    assert!(flattened.contains(&"param.h0.attn.qkv.weight tensor<64x192xf32>".to_string()), "{flattened:?}");
    let path = dir.path().join("flat.safetensors");
    checkpoint::save(&path, saved.step, &flat)?;

    // Another seed: every value differs until the restore.
    let restored = GptTrainer::new(vocab.encode(&text), &GptConfig { seed: 7, ..cfg.clone() })?;
    assert_eq!(checkpoint::restore(&path, &restored.state())?, 1);
    for ((n, a), (m, b)) in saved.state().iter().zip(&restored.state()) {
        assert_eq!((n, a.ty()), (m, b.ty()));
        let (a, b) = (a.to_literal()?, b.to_literal()?);
        assert!(a.bytes() == b.bytes(), "{n} is not bit-identical after the restore");
    }

    // Not a regrouping: the weight transposed.
    let w = saved.params.get("h0.attn.qkv.weight").expect("a GPT parameter").clone();
    let bad = dir.path().join("transposed.safetensors");
    checkpoint::save(&bad, 1, &[("h0.attn.qkv.weight".to_string(), w.reshape([64, 192])?.t()?)])?;
    let err = checkpoint::restore(&bad, &[("h0.attn.qkv.weight".to_string(), w)]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, kiln::FrontendError::Checkpoint { .. }), "{msg}");
    assert!(
        msg.contains("h0.attn.qkv.weight")
            && msg.contains("tensor<192x64xf32>")
            && msg.contains("tensor<64x3x4x16xf32>"),
        "{msg}"
    );
    Ok(())
}

/// The eager step's program writes back the training state and the loss, not
/// the gradients: they are dead once the update is recorded, and as outputs
/// they would cost a parameter-sized write per step (and a gather of whole
/// gradients under a mesh).
#[test]
fn the_eager_step_does_not_output_the_gradients() -> anyhow::Result<()> {
    use kiln::models::gpt::GptTrainer;
    kiln::set_disk_cache(None)?;
    let text = gpt::read_text(Path::new(TEXT), 32)?;
    let vocab = CharVocab::new(&text);
    let cfg = GptConfig { batch: 4, layers: 1, ..GptConfig::tiny(vocab.len()) };
    let mut t = GptTrainer::new(vocab.encode(&text), &cfg)?;
    t.train_step(3e-3)?;
    let state_bytes: u64 = t.state().iter().map(|(_, x)| x.ty().size_in_bytes() as u64).sum();
    let stats = kiln::shard::program_memory_stats()?;
    let step = stats.last().expect("the step compiled a program");
    let outputs = step.output_size_in_bytes as u64;
    // The state plus the loss and a few scalars; the gradients alone would add
    // about a third of the state (parameters, AdamW m and v).
    assert!(outputs <= state_bytes + 1024, "outputs {outputs} B, training state {state_bytes} B");
    Ok(())
}
