//! Standalone smoke test of the runtime on whatever plugin the environment
//! selects (`KILN_PJRT_PLUGIN`, or `PJRT_DEVICE=CPU|CUDA` discovery).
//!
//! Runs `tanh(x · w)` on device 0 and, with two or more devices, an
//! `all_reduce` sum over all of them; checks both against f64 and prints a
//! short report. Needs no file from the source tree at run time.
//!
//! ```text
//! PJRT_DEVICE=CUDA cargo run --release -p kiln-runtime --example pjrt_smoke
//! ```

use anyhow::{ensure, Context};
use kiln_runtime::{Client, ClientOptions, CompileOptions, ExecArg};

const TOLERANCE: f64 = 1e-5;

const DOT_TANH: &str = r#"
func.func public @main(%x: tensor<32x48xf32>, %w: tensor<48x16xf32>) -> tensor<32x16xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<32x48xf32>, tensor<48x16xf32>) -> tensor<32x16xf32>
  %1 = stablehlo.tanh %0 : tensor<32x16xf32>
  return %1 : tensor<32x16xf32>
}
"#;

struct XorShift(u64);

impl XorShift {
    /// Uniform in [-1, 1), never zero.
    fn next_f32(&mut self) -> f32 {
        loop {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            let v = bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if v != 0.0 {
                return v;
            }
        }
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// Largest relative error, each relative to `max(|want|, scale)` where
/// `scale = Σ|terms|` of the sum behind that value: f32 summation error is
/// proportional to the summands, so a result that cancels to nearly zero is
/// judged against them.
fn max_rel_err(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| (f64::from(g) - w).abs() / w.abs().max(s).max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

fn dot_tanh(client: &Client, rng: &mut XorShift) -> anyhow::Result<f64> {
    let (m, k, n) = (32, 48, 16);
    let device = client.devices().into_iter().next().context("the plugin has no devices")?;
    let exe = client.compile(DOT_TANH, &CompileOptions::default())?;
    // Scaled so pre-activations stay O(1): tanh is then not saturated and
    // f32 accumulation error stays well inside the tolerance.
    let scale = 1.0 / (k as f32).sqrt();
    let x: Vec<f32> = rng.vec(m * k).into_iter().map(|v| v * scale).collect();
    let w = rng.vec(k * n);
    let xb = client.buffer_from_host(&x, &[m, k], &device)?;
    let wb = client.buffer_from_host(&w, &[k, n], &device)?;
    let out = exe.execute(&[ExecArg::Borrowed(&xb), ExecArg::Borrowed(&wb)])?;
    let got = out[0].to_vec::<f32>()?;
    let (mut want, mut scale) = (vec![0.0f64; m * n], vec![0.0f64; m * n]);
    for i in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|p| f64::from(x[i * k + p]) * f64::from(w[p * n + j]));
            want[i * n + j] = terms.clone().sum::<f64>().tanh();
            scale[i * n + j] = terms.map(f64::abs).sum();
        }
    }
    Ok(max_rel_err(&got, &want, &scale))
}

fn all_reduce(client: &Client, rng: &mut XorShift) -> anyhow::Result<f64> {
    let devices = client.devices();
    let replicas = devices.len();
    let ids = (0..replicas).map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
    let program = format!(
        r#"
func.func public @main(%x: tensor<256xf32>) -> tensor<256xf32> {{
  %0 = "stablehlo.all_reduce"(%x) ({{
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }}) {{replica_groups = dense<[[{ids}]]> : tensor<1x{replicas}xi64>}} : (tensor<256xf32>) -> tensor<256xf32>
  return %0 : tensor<256xf32>
}}
"#
    );
    let exe = client.compile(&program, &CompileOptions { num_replicas: replicas, ..CompileOptions::default() })?;
    let inputs: Vec<Vec<f32>> = (0..replicas).map(|_| rng.vec(256)).collect();
    let buffers = inputs
        .iter()
        .zip(&devices)
        .map(|(x, d)| client.buffer_from_host(x, &[256], d))
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = exe.execute_replicated(buffers.iter().map(|b| vec![ExecArg::Borrowed(b)]).collect())?;
    let want: Vec<f64> = (0..256).map(|i| inputs.iter().map(|x| f64::from(x[i])).sum()).collect();
    let scale: Vec<f64> = (0..256).map(|i| inputs.iter().map(|x| f64::from(x[i]).abs()).sum()).collect();
    let mut worst = 0.0f64;
    for out in &outputs {
        worst = worst.max(max_rel_err(&out[0].to_vec::<f32>()?, &want, &scale));
    }
    Ok(worst)
}

fn main() -> anyhow::Result<()> {
    let client = Client::new(&ClientOptions::default())?;
    let (major, minor) = client.api_version();
    println!("plugin:      {}", client.plugin_path().display());
    println!("platform:    {} (PJRT C API {major}.{minor})", client.platform_name());
    let devices = client.devices();
    println!("devices:     {}", devices.len());
    for d in &devices {
        println!("  id {}: {}", d.id(), d.kind());
    }
    let mut rng = XorShift(0x5eed_1234);
    let err = dot_tanh(&client, &mut rng)?;
    println!("dot+tanh:    max relative error {err:.3e}");
    ensure!(err < TOLERANCE, "dot+tanh error {err:.3e} exceeds {TOLERANCE:e}");
    if devices.len() >= 2 {
        let err = all_reduce(&client, &mut rng)?;
        println!("all_reduce:  {} replicas, max relative error {err:.3e}", devices.len());
        ensure!(err < TOLERANCE, "all_reduce error {err:.3e} exceeds {TOLERANCE:e}");
    } else {
        println!("all_reduce:  skipped (one device)");
    }
    println!("ok");
    Ok(())
}
