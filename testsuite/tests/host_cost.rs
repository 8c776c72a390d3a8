//! `kiln::grad`'s host cost on a model written as users write it: a 12-layer
//! grouped-query decoder (`kiln_models::llama`, seq 1024) with attention,
//! norms and loss in plain ops must cost at most 3× the same model with the
//! built-in calls. A ratio measured in one process (medians of interleaved
//! runs, after one step that fills the cache of evaluated masks), not a
//! wall-clock bound: before the search was local and its constants cached,
//! the plain spelling's `grad` took 1,154 ms against 0.8 ms.

use std::time::{Duration, Instant};

use kiln::nn::{Module, ParamStore};
use kiln::{metrics, Tensor};
use kiln_models::llama::{Llama, LlamaConfig};
use kiln_models::Spelling;

/// The 110M decoder's structure (12 layers, 12/4 heads) at small widths:
/// recording and `grad` do not depend on tensor sizes, only the mask's
/// evaluation does (seq 1024, as in the measured model).
fn config() -> LlamaConfig {
    LlamaConfig { vocab: 512, dim: 96, ffn: 128, ..LlamaConfig::llama_110m() }
}

/// One `grad` of `model`'s loss: its time and the composites it found.
fn grad_once(model: &Llama, params: &[Tensor], ids: &Tensor, targets: &Tensor) -> kiln::Result<(Duration, u64)> {
    let loss = model.loss(ids, targets)?;
    let before = metrics::snapshot().composites_found;
    let t = Instant::now();
    let grads = kiln::grad(&loss, params)?;
    let took = t.elapsed();
    let found = metrics::snapshot().composites_found - before;
    drop((loss, grads));
    kiln::mark_step()?;
    Ok((took, found))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

#[test]
fn plain_ops_grad_costs_at_most_three_times_the_builtin() -> kiln::Result<()> {
    let cfg = config();
    let (b, t) = (1, 1024);
    let ids = Tensor::from_vec((0..b * t).map(|i| (i % cfg.vocab) as i32).collect::<Vec<_>>(), [b, t])?;
    let targets = Tensor::from_vec((0..b * t).map(|i| ((i + 1) % cfg.vocab) as i32).collect::<Vec<_>>(), [b * t])?;
    let mut models = Vec::new();
    for spelling in [Spelling::Plain, Spelling::Builtin] {
        let model = Llama::new(&mut ParamStore::new(1), cfg, spelling)?;
        let params = model.parameters();
        let (first, found) = grad_once(&model, &params, &ids, &targets)?;
        eprintln!("{}: first grad {first:?}, composites found {found}", spelling.name());
        if spelling == Spelling::Plain {
            assert!(found >= cfg.layers as u64, "the plain spelling's {} attentions: found {found}", cfg.layers);
        }
        models.push((model, params, Vec::new()));
    }
    for _ in 0..7 {
        for (model, params, times) in &mut models {
            times.push(grad_once(model, params, &ids, &targets)?.0);
        }
    }
    let plain = median(std::mem::take(&mut models[0].2));
    let builtin = median(std::mem::take(&mut models[1].2));
    let ratio = plain.as_secs_f64() / builtin.as_secs_f64();
    eprintln!("grad: plain {plain:?}, builtin {builtin:?}, ratio {ratio:.2}");
    assert!(ratio <= 3.0, "the plain spelling's grad costs {ratio:.2}x the builtin's ({plain:?} vs {builtin:?})");
    Ok(())
}
