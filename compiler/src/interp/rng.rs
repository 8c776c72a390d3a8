//! `rng_bit_generator` with the bits of XLA's expansion (its
//! `RngBitGeneratorExpander` over the `prng` builder library).
//!
//! State: `u64` words.
//! - THREE_FRY: `[key, counter]`. Element `i` of a 32-bit output comes from
//!   Threefry-2x32 (20 rounds) of `counter + j` under `key`, where `j` indexes a
//!   "half shape" whose split dimension (the first even one, else the largest)
//!   is halved: the two output words fill the even and odd positions of that
//!   dimension. 64-bit outputs use one block per element (`lo | hi << 32`).
//!   New state: `[key, counter + blocks used]`.
//! - PHILOX: `[key, c0, c1]` (128-bit counter, `c0` low) or, for two words, XLA's
//!   reading `[key, c]` with counter `(low: c, high: key)`. Philox-4x32 (10
//!   rounds) of `counter + j` fills four consecutive 32-bit outputs per block.

use crate::ir::{DType, Literal, RngAlgorithm, TensorType};
use crate::CompileError;

use super::err;

/// Threefry-2x32 with 20 rounds (Salmon et al., SC'11), as XLA's `ThreeFry2x32`.
pub fn threefry2x32(key: [u32; 2], ctr: [u32; 2]) -> [u32; 2] {
    const ROT: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];
    let ks = [key[0], key[1], 0x1BD1_1BDA ^ key[0] ^ key[1]];
    let mut x = [ctr[0].wrapping_add(ks[0]), ctr[1].wrapping_add(ks[1])];
    for i in 0..5u32 {
        for &r in &ROT[(i % 2) as usize] {
            x[0] = x[0].wrapping_add(x[1]);
            x[1] = x[1].rotate_left(r) ^ x[0];
        }
        // Key injection after every four rounds.
        let s = i as usize + 1;
        x[0] = x[0].wrapping_add(ks[s % 3]);
        x[1] = x[1].wrapping_add(ks[(s + 1) % 3]).wrapping_add(s as u32);
    }
    x
}

/// Philox-4x32 with 10 rounds, as XLA's `Philox4x32`.
pub fn philox4x32(key: [u32; 2], ctr: [u32; 4]) -> [u32; 4] {
    let (mut k, mut x) = (key, ctr);
    for _ in 0..10 {
        let p0 = u64::from(x[0]) * 0xD251_1F53;
        let p1 = u64::from(x[2]) * 0xCD9E_8D57;
        x = [(p1 >> 32) as u32 ^ x[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ x[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
    }
    x
}

fn split(w: u64) -> [u32; 2] {
    [w as u32, (w >> 32) as u32]
}

/// 32-bit Threefry outputs for `dims`, laid out as XLA's split/combine does.
fn threefry_u32(key: u64, ctr: u64, dims: &[usize]) -> (Vec<u32>, u64) {
    if dims.is_empty() {
        let x = threefry2x32(split(key), split(ctr));
        return (vec![x[0]], ctr.wrapping_add(1));
    }
    let split_dim = dims.iter().position(|d| d % 2 == 0).unwrap_or_else(|| {
        // No even dimension: the first of the largest.
        let mut best = 0;
        for (i, &d) in dims.iter().enumerate() {
            if d > dims[best] {
                best = i;
            }
        }
        best
    });
    let mut half = dims.to_vec();
    half[split_dim] = dims[split_dim].div_ceil(2);
    let half_strides = crate::ir::Shape::new(half.clone()).strides();
    let blocks: usize = half.iter().product();
    let total: usize = dims.iter().product();
    let mut out = Vec::with_capacity(total);
    let rank = dims.len();
    let mut pos = vec![0usize; rank];
    for _ in 0..total {
        let mut j = 0usize;
        for d in 0..rank {
            let c = if d == split_dim { pos[d] / 2 } else { pos[d] };
            j += c * half_strides[d];
        }
        let x = threefry2x32(split(key), split(ctr.wrapping_add(j as u64)));
        out.push(x[pos[split_dim] % 2]);
        for d in (0..rank).rev() {
            pos[d] += 1;
            if pos[d] < dims[d] {
                break;
            }
            pos[d] = 0;
        }
    }
    (out, ctr.wrapping_add(blocks as u64))
}

fn u128_add(lo: u64, hi: u64, n: u64) -> (u64, u64) {
    let (l, carry) = lo.overflowing_add(n);
    (l, hi.wrapping_add(u64::from(carry)))
}

/// `count` Philox words of 32 bits, four per block; returns the new counter.
fn philox_u32(key: u64, lo: u64, hi: u64, count: usize) -> (Vec<u32>, (u64, u64)) {
    let blocks = count.div_ceil(4);
    let mut out = Vec::with_capacity(blocks * 4);
    for j in 0..blocks {
        let (l, h) = u128_add(lo, hi, j as u64);
        let [a, b] = split(l);
        let [c, d] = split(h);
        out.extend(philox4x32(split(key), [a, b, c, d]));
    }
    (out, u128_add(lo, hi, blocks as u64))
}

/// Outputs `[new state, bits]` for `state` (u64 words) and output type `ty`.
pub(crate) fn rng_bit_generator(
    algorithm: RngAlgorithm,
    state: &Literal,
    ty: &TensorType,
) -> Result<Vec<Literal>, CompileError> {
    let words: Vec<u64> =
        state.bytes().chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    let n = ty.shape.num_elements();
    let wide = ty.dtype == DType::U64;
    let (bits, new_words): (Vec<u64>, Vec<u64>) = match algorithm {
        RngAlgorithm::ThreeFry => {
            let [key, ctr] = words[..] else {
                return Err(err("rng_bit_generator", format!("THREE_FRY needs 2 state words, got {}", words.len())));
            };
            if wide {
                let bits = (0..n)
                    .map(|j| {
                        let x = threefry2x32(split(key), split(ctr.wrapping_add(j as u64)));
                        u64::from(x[0]) | u64::from(x[1]) << 32
                    })
                    .collect();
                (bits, vec![key, ctr.wrapping_add(n as u64)])
            } else {
                let (bits, ctr) = threefry_u32(key, ctr, ty.shape.dims());
                (bits.into_iter().map(u64::from).collect(), vec![key, ctr])
            }
        }
        RngAlgorithm::Philox => {
            let (key, lo, hi, three) = match words[..] {
                [key, c] => (key, c, key, false),
                [key, lo, hi] => (key, lo, hi, true),
                _ => {
                    return Err(err(
                        "rng_bit_generator",
                        format!("PHILOX needs 2 or 3 state words, got {}", words.len()),
                    ))
                }
            };
            let count = if wide { 2 * n } else { n };
            let (raw, (nlo, nhi)) = philox_u32(key, lo, hi, count);
            let bits = if wide {
                (0..n).map(|i| u64::from(raw[2 * i]) | u64::from(raw[2 * i + 1]) << 32).collect()
            } else {
                raw[..n].iter().map(|&x| u64::from(x)).collect()
            };
            let mut new = words.clone();
            new[1] = nlo;
            if three {
                new[2] = nhi;
            }
            (bits, new)
        }
    };
    let state_bytes: Vec<u8> = new_words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let bit_bytes: Vec<u8> = if wide {
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    } else {
        bits.iter().flat_map(|&b| (b as u32).to_le_bytes()).collect()
    };
    Ok(vec![Literal::from_bytes(state.ty().clone(), state_bytes)?, Literal::from_bytes(ty.clone(), bit_bytes)?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threefry_known_answers() {
        // Random123's kat_vectors for threefry2x32_20.
        assert_eq!(threefry2x32([0, 0], [0, 0]), [0x6b20_0159, 0x99ba_4efe]);
        assert_eq!(threefry2x32([!0, !0], [!0, !0]), [0x1cb9_96fc, 0xbb00_2be7]);
        assert_eq!(threefry2x32([0x1319_8a2e, 0x0370_7344], [0x243f_6a88, 0x85a3_08d3]), [0xc492_3a9c, 0x483d_f7a0]);
    }

    #[test]
    fn philox_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(philox4x32([0, 0], [0, 0, 0, 0]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32([!0, !0], [!0, !0, !0, !0]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
    }

    #[test]
    fn threefry_split_layout() {
        // [3, 4]: dimension 1 is the first even one; output (r, c) is word c % 2
        // of block r * 2 + c / 2.
        let (bits, ctr) = threefry_u32(5, 100, &[3, 4]);
        assert_eq!(ctr, 106);
        for r in 0..3 {
            for c in 0..4 {
                let x = threefry2x32(split(5), split(100 + (r * 2 + c / 2) as u64));
                assert_eq!(bits[r * 4 + c], x[c % 2]);
            }
        }
        // [3]: odd, split it: 2 blocks, the last odd word dropped.
        let (bits, ctr) = threefry_u32(5, 0, &[3]);
        assert_eq!(ctr, 2);
        assert_eq!(bits[2], threefry2x32(split(5), split(1))[0]);
    }
}
