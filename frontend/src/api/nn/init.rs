//! Seeded host-side initialisation of parameters.
//!
//! `nn::device_init` computes the same values on the devices: it relies on
//! SplitMix64 being counter-based (draw `k` is a function of `seed + (k+1)·γ`).
//!
//! Parameters start as host data drawn from a small counter-free generator
//! (SplitMix64), so the first training step has the same program as every later
//! one (host data and device data are both plain parameters): no extra compile
//! for initialisation, and the same seed gives the same weights everywhere.
//!
//! Invariant: draw `k` of a seed's stream depends only on the seed and `k`
//! (the generator is counter-based), which is what lets `device_init` compute
//! the same values, and the same seed give the same weights everywhere.

/// SplitMix64: tiny, fast, and good enough for initial weights.
#[derive(Clone, Debug)]
pub struct HostRng {
    state: u64,
}

impl HostRng {
    pub fn new(seed: u64) -> HostRng {
        HostRng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Skips `n` draws (SplitMix64 is counter-based: the state after `n`
    /// draws is the seed plus `n` increments).
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A permutation of `0..n` (Fisher–Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            p.swap(i, j);
        }
        p
    }

    pub fn uniform_vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n).map(|_| (lo + (hi - lo) * self.uniform()) as f32).collect()
    }

    pub fn normal_vec(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| (std * self.normal()) as f32).collect()
    }
}
