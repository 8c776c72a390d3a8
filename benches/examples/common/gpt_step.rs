//! The GPT step of the remat-curve examples (`remat_curve`,
//! `loop_kernel_check`): its configs by name and its one batch, so that both
//! measure the same step.

use kiln::models::gpt::GptConfig;
use kiln::{DType, Tensor};

/// `gpt2-small` (vocab 50304) or `tiny` (vocab 64, for the CPU plugin), both
/// under bf16 autocast.
pub fn config(name: &str) -> Result<GptConfig, String> {
    match name {
        "gpt2-small" => Ok(GptConfig { amp: Some(DType::BF16), ..GptConfig::gpt2_small(50304) }),
        "tiny" => Ok(GptConfig { amp: Some(DType::BF16), ..GptConfig::tiny(64) }),
        other => Err(format!("unknown config `{other}` (gpt2-small or tiny)")),
    }
}

/// The step's token ids and targets: fixed, spread over the vocabulary (its
/// first 50257 ids, GPT-2's).
pub fn batch(cfg: &GptConfig) -> kiln::Result<(Tensor, Tensor)> {
    let top = cfg.vocab.min(50257);
    let ids = |seed: usize| (0..cfg.batch * cfg.seq).map(|i| ((i * 7919 + seed) % top) as i32).collect::<Vec<_>>();
    Ok((Tensor::from_vec(ids(1), [cfg.batch, cfg.seq])?, Tensor::from_vec(ids(2), [cfg.batch * cfg.seq])?))
}
