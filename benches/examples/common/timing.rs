//! Timing shared by the device examples (`device_bench`, `remat_curve`), so
//! that their figures are taken the same way: warm-up calls, then `reps` runs
//! of `iters` calls, each run ended by a sync.

use std::time::Instant;

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Median ms per call over `reps` runs of `iters` calls, each run ended by a
/// sync; also every run's figure (a spread between calls shows there first).
pub fn bench(mut f: impl FnMut() -> Res<()>, warm: usize, iters: usize, reps: usize) -> Res<(f64, Vec<f64>)> {
    for _ in 0..warm {
        f()?;
    }
    kiln::sync()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        kiln::sync()?;
        ts.push(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
    }
    let runs = ts.clone();
    ts.sort_by(f64::total_cmp);
    Ok((ts[ts.len() / 2], runs))
}
