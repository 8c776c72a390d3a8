//! A profiling target: record and run `chain1k` many times (cache hits).
use kiln::Tensor;

fn main() -> kiln::Result<()> {
    let x = Tensor::from_vec((0..1024).map(|i| i as f32 / 1024.0).collect::<Vec<_>>(), [1024])?;
    let iters: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    for _ in 0..iters {
        let mut y = x.clone();
        for _ in 0..250 {
            y = y.mul_scalar(1.0001)?.add_scalar(0.001)?.tanh()?.add_scalar(-0.0005)?;
        }
        kiln::mark_step()?;
    }
    println!("{}", kiln::metrics::report());
    Ok(())
}
