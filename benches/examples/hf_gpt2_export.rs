//! Writes a tiny random kiln GPT-2 as a Hugging Face directory
//! (`hf::save_gpt2`) with its logits on fixed token ids, for
//! `benches/hf/gpt2_check.py check DIR` to load with `transformers` and
//! compare: `cargo run --release -p kiln-benches --example hf_gpt2_export -- DIR`.

use kiln::models::gpt2::{Gpt2, Gpt2Config};
use kiln::models::{hf, Spelling};
use kiln::nn::ParamStore;
use kiln::Tensor;

fn main() -> kiln::Result<()> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "hf-gpt2-export".into()));
    let cfg = Gpt2Config { vocab: 97, dim: 32, layers: 2, heads: 4, max_positions: 16, eps: 1e-5 };
    let mut ps = ParamStore::new(5);
    let model = Gpt2::new(&mut ps, cfg, Spelling::Builtin)?;
    // Biases and norms away from their init (zeros, ones), so a swapped
    // tensor shows in the logits.
    for (i, (_, p)) in ps.iter().enumerate() {
        if p.rank() == 1 {
            let n = p.dims()[0];
            let shift: Vec<f32> = (0..n).map(|j| (((i * 31 + j * 7) % 23) as f32 - 11.0) * 0.01).collect();
            p.assign(&p.add(&Tensor::from_vec(shift, [n])?)?)?;
        }
    }
    kiln::mark_step()?;
    let ids: Vec<i32> = (0..16).map(|i| (i * 37 + 11) % 97).collect();
    let ids = Tensor::from_vec(ids, [2, 8])?;
    let logits = model.logits(&ids)?;
    kiln::mark_step()?;
    hf::save_gpt2(&dir.join("model"), &model, &ps)?;
    kiln::checkpoint::save(
        dir.join("expected.safetensors"),
        0,
        &[("input_ids".to_string(), ids), ("logits".to_string(), logits)],
    )?;
    println!("wrote {}", dir.display());
    Ok(())
}
