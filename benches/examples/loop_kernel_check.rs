//! Checks kiln's loop kernels (`compiler/src/lower/loop_kernel.rs`) on a GPU:
//! the loss and every gradient of the `remat_curve` GPT step (bf16 autocast)
//! under an activation budget whose plan recomputes GELU for its backward,
//! with the loop kernels on and off (`KILN_LOOP_KERNELS`), each against the
//! same step without a remat plan. A loop kernel computes in f32 between ops
//! and sums in another order, so the planned steps differ from the unplanned
//! one a little either way; the check is that the loop kernels' difference
//! is of the size of XLA's own.
//!
//! `loop_kernel_check CONFIG PERCENT` (CONFIG: `gpt2-small` or `tiny`) prints
//! one line per gradient whose error is largest and a line `CHECK {json}`:
//! for each of `off` and `on`, the largest relative error of any gradient
//! (max |a - b| / max |b|, b the unplanned step's) and the relative L2 error
//! over all gradients. It fails (exit 1) when the loop kernels' L2 error is
//! more than twice XLA's plus 1e-3.

use kiln::models::gpt::Gpt;
use kiln::nn::ParamStore;
use kiln::{grad, DType, Tensor};
use serde_json::json;

#[path = "common/gpt_step.rs"]
mod gpt_step;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: loop_kernel_check gpt2-small|tiny PERCENT";
    let (Some(config), Some(pct)) = (args.first(), args.get(1)) else { return Err(usage.into()) };
    let cfg = gpt_step::config(config).map_err(|e| format!("{e}; {usage}"))?;
    let fraction: f64 = pct.trim_end_matches('%').parse::<f64>().map_err(|_| usage.to_string())? / 100.0;
    let client = kiln::runtime::replica_plan_from_env()?.create_client()?;
    kiln::set_client(client);
    let mut ps = ParamStore::new(0);
    let model = Gpt::new(&mut ps, &cfg)?;
    let params = ps.tensors();
    let (x, y) = gpt_step::batch(&cfg)?;
    kiln::mark_step()?;

    // The loss and the gradients at `budget`, the loop kernels on or off.
    let run = |budget: Option<f64>, loops: bool| -> Res<Vec<Vec<f32>>> {
        kiln::set_activation_budget(budget)?;
        kiln::set_loop_kernels(Some(loops));
        let compiles = kiln::metrics::snapshot().compiles;
        let mut step = kiln::compile_step(|i: &[Tensor]| {
            let loss = kiln::amp::autocast(DType::BF16, || model.loss(&i[0], &i[1], true))?;
            let mut out = vec![loss.clone()];
            out.extend(grad(&loss, &params)?);
            Ok(out)
        });
        let out = step.call(&[x.clone(), y.clone()])?;
        let values = out.iter().map(|t| t.to_vec::<f32>()).collect::<kiln::Result<Vec<_>>>()?;
        // Each setting compiles its own program (a cached one would compare
        // a program with itself).
        if kiln::metrics::snapshot().compiles == compiles {
            return Err(format!("the step at {budget:?} with the loop kernels {loops} compiled nothing").into());
        }
        Ok(values)
    };
    let base = run(None, false)?;
    let off = run(Some(fraction), false)?;
    let on = run(Some(fraction), true)?;

    let names: Vec<String> =
        std::iter::once("loss".to_string()).chain(ps.iter().map(|(n, _)| format!("d {n}"))).collect();
    let mut report = serde_json::Map::new();
    let mut l2 = [0.0f64; 2];
    for (label, got, slot) in [("off", &off, 0), ("on", &on, 1)] {
        let (mut num, mut den, mut worst) = (0.0f64, 0.0f64, (0.0f64, 0usize));
        for (i, (a, b)) in got.iter().zip(&base).enumerate() {
            let scale = b.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs()))).max(f64::MIN_POSITIVE);
            let max = a.iter().zip(b).fold(0.0f64, |m, (p, q)| m.max(f64::from((p - q).abs()))) / scale;
            if i > 0 {
                num += a.iter().zip(b).map(|(p, q)| f64::from(p - q).powi(2)).sum::<f64>();
                den += b.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>();
            }
            if max > worst.0 {
                worst = (max, i);
            }
        }
        l2[slot] = (num / den).sqrt();
        println!("{label}: worst {} at {}; gradients' relative L2 {:.3e}", worst.0, names[worst.1], l2[slot]);
        report.insert(
            label.into(),
            json!({"worst": worst.0, "worst_at": names[worst.1], "l2": l2[slot], "loss": got[0][0]}),
        );
    }
    report.insert("loss_unplanned".into(), json!(base[0][0]));
    println!("CHECK {}", serde_json::Value::Object(report));
    if l2[1] > 2.0 * l2[0] + 1e-3 {
        return Err(format!("the loop kernels' gradients are off by {:.3e} (XLA's: {:.3e})", l2[1], l2[0]).into());
    }
    Ok(())
}
