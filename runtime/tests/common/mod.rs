//! Helpers shared by the runtime's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use kiln_runtime::{Client, ClientOptions};

/// A tiny seeded xorshift64* generator.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1), never exactly zero.
    pub fn next_f32(&mut self) -> f32 {
        loop {
            let v = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if v != 0.0 {
                return v;
            }
        }
    }

    pub fn vec_f32(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// The installed CPU plugin, found the way the runtime finds it.
pub fn cpu_plugin() -> PathBuf {
    kiln_runtime::plugin::find_plugin(kiln_runtime::PjrtDevice::Cpu, &kiln_runtime::plugin::python_site_dirs())
        .expect("the CPU PJRT plugin must be installed for these tests")
}

/// The directory holding `pjrt_c_api.h` next to the CPU plugin.
pub fn pjrt_header_dir() -> PathBuf {
    cpu_plugin().parent().expect("plugin has a parent dir").join("include")
}

pub fn cpu_client(devices: usize) -> Client {
    Client::new(&ClientOptions {
        plugin: Some(cpu_plugin()),
        cpu_device_count: Some(devices),
        ..ClientOptions::default()
    })
    .expect("CPU client")
}

/// `tanh(x · w)` for x: [4x3], w: [3x5].
pub const DOT_TANH: &str = r#"
module @dot_tanh {
  func.func public @main(%x: tensor<4x3xf32>, %w: tensor<3x5xf32>) -> (tensor<4x5xf32>) {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<4x3xf32>, tensor<3x5xf32>) -> tensor<4x5xf32>
    %1 = stablehlo.tanh %0 : tensor<4x5xf32>
    return %1 : tensor<4x5xf32>
  }
}
"#;

/// Reference for [`DOT_TANH`] in f64: `(values, scales)` where `scales[i]`
/// is `Σ|x·w|` of that output's dot product (see [`max_rel_err`]).
pub fn dot_tanh_reference(x: &[f32], w: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut scale) = (vec![0.0f64; 4 * 5], vec![0.0f64; 4 * 5]);
    for i in 0..4 {
        for j in 0..5 {
            let terms = (0..3).map(|k| f64::from(x[i * 3 + k]) * f64::from(w[k * 5 + j]));
            out[i * 5 + j] = terms.clone().sum::<f64>().tanh();
            scale[i * 5 + j] = terms.map(f64::abs).sum();
        }
    }
    (out, scale)
}

/// Largest relative error of `got` against `want`, each relative to
/// `max(|want|, scale)`: f32 summation error is proportional to the
/// magnitude of the summands (`scale = Σ|terms|`), not to the result, so a
/// result that cancels to nearly zero is judged against its summands.
pub fn max_rel_err(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert_eq!(got.len(), scale.len());
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| (f64::from(g) - w).abs() / w.abs().max(s).max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}
