//! A zoo run resumed from its checkpoint takes the steps the uninterrupted
//! run took, bit for bit: the batches come from the seed and the step, and
//! the checkpoint holds the weights, AdamW's moments, the clip step's state
//! and the generator.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use kiln::models::text::{TokenizerKind, TokenizerSpec};
use kiln::models::zoo::{self, Arch, Init, ZooConfig};

#[test]
fn a_resumed_run_continues_the_saved_one_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    let lines: Vec<String> = (0..120)
        .map(|i| format!("line {} has the words {} and {} in it .", i % 7, ["red", "blue", "green"][i % 3], i % 11))
        .collect();
    std::fs::write(&text, lines.join("\n")).unwrap();
    let spec = TokenizerSpec::Train { kind: TokenizerKind::WordPiece, vocab: 200 };
    for arch in [Arch::Bert, Arch::Llama] {
        let ckpt = dir.path().join(format!("{}.ckpt", arch.name()));
        let copy = dir.path().join(format!("{}-at-6.ckpt", arch.name()));
        let cfg = ZooConfig {
            steps: 12,
            checkpoint: Some(ckpt.clone()),
            checkpoint_every: Some(3),
            overwrite: true,
            ..ZooConfig::new(arch)
        };
        // The whole run, keeping a copy of its step-6 checkpoint.
        let (whole, _) = zoo::train(
            &cfg,
            &text,
            &spec,
            &Init::Fresh,
            |s| {
                if s.step == 6 {
                    std::fs::copy(&ckpt, &copy).unwrap();
                }
            },
            |_| {},
        )
        .unwrap();
        // From the copy: steps 7 to 12.
        let resumed_cfg = ZooConfig { checkpoint: Some(copy.clone()), resume: true, overwrite: false, ..cfg.clone() };
        let (resumed, _) = zoo::train(&resumed_cfg, &text, &spec, &Init::Fresh, |_| {}, |_| {}).unwrap();
        assert_eq!(resumed.train.losses, whole.train.losses[6..], "{}", arch.name());
        assert_eq!(resumed.evals.last().unwrap().loss, whole.evals.last().unwrap().loss);

        // Another learning rate is another run: refused, naming it.
        let other = ZooConfig { lr: 1e-2, ..resumed_cfg.clone() };
        let e = zoo::train(&other, &text, &spec, &Init::Fresh, |_| {}, |_| {}).err().unwrap().to_string();
        assert!(e.contains("lr 0.003 in the checkpoint, 0.01 in this run"), "{e}");
        // An existing checkpoint without --resume or --overwrite is refused.
        let fresh = ZooConfig { overwrite: false, ..cfg.clone() };
        let e = zoo::train(&fresh, &text, &spec, &Init::Fresh, |_| {}, |_| {}).err().unwrap().to_string();
        assert!(e.contains("pass --resume to continue from it"), "{e}");
    }
}
