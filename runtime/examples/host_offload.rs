//! Host-offload trial: does the plugin accept XLA's host-offload annotations,
//! and does the compiled program then keep saved activations in host memory?
//!
//! Three programs compute the same value: `a = tanh(x)` is written early,
//! three matmuls run, and `a` is read again at the end (the shape of an
//! activation saved for a backward pass). The second sends `a` to pinned
//! host memory right after it is written and back just before it is read,
//! with the custom calls JAX emits for `memory_kind="pinned_host"`:
//! `annotate_device_placement` with the frontend attribute
//! `_xla_buffer_placement` = `pinned_host`, then = `device`; the third passes
//! the host copy through an `optimization_barrier` with the last matmul.
//!
//! Then a chain of [`LAYERS`] layers whose outputs a backward reads in
//! reverse, kept on the device, and offloaded with the copy back tied (by a
//! barrier) to the backward's value 0, 1 or 2 layers before its read.
//!
//! Prints every program's compiled memory stats (device and host temp
//! bytes), runs each on the same random inputs and compares the outputs
//! with the plain program's bit for bit (`HOST_OFFLOAD_PRINT=1` prints the
//! programs). Any compile or run error is printed whole (docs/memory-journal.md ("Host offload")
//! records them).
//!
//! ```text
//! PJRT_DEVICE=CUDA cargo run --release -p kiln-runtime --example host_offload
//! ```

use anyhow::Context;
use kiln_runtime::{Client, ClientOptions, CompileOptions, ExecArg};

const N: usize = 4096;

/// How the program treats the saved activation.
#[derive(Clone, Copy, Debug)]
enum Variant {
    /// Kept on the device.
    Plain,
    /// Sent to pinned host memory and straight back where it is read.
    Offloaded,
    /// As JAX emits it under `jax.checkpoint`: the host copy passes through
    /// an `optimization_barrier` with the value computed last before the read.
    OffloadedThroughBarrier,
}

fn program(variant: Variant) -> String {
    let offload = !matches!(variant, Variant::Plain);
    let barrier = matches!(variant, Variant::OffloadedThroughBarrier);
    let t = format!("tensor<{N}x{N}xf32>");
    let dot =
        |a: &str, b: &str| format!("stablehlo.dot_general {a}, {b}, contracting_dims = [1] x [0] : ({t}, {t}) -> {t}");
    let (to_host, to_device, saved) = if offload {
        (
            format!(
                "  %h = stablehlo.custom_call @annotate_device_placement(%a) {{has_side_effect = true, \
                 mhlo.frontend_attributes = {{_xla_buffer_placement = \"pinned_host\"}}}} : ({t}) -> {t}\n"
            ),
            format!(
                "{}  %back = stablehlo.custom_call @annotate_device_placement({}) {{has_side_effect = true, \
                 mhlo.frontend_attributes = {{_xla_buffer_placement = \"device\"}}}} : ({t}) -> {t}\n",
                if barrier {
                    format!("  %hb:2 = stablehlo.optimization_barrier %h, %f : {t}, {t}\n")
                } else {
                    String::new()
                },
                if barrier { "%hb#0" } else { "%h" },
            ),
            "%back",
        )
    } else {
        (String::new(), String::new(), "%a")
    };
    format!(
        "func.func public @main(%x: {t}, %w: {t}) -> {t} {{\n\
         \x20 %a = stablehlo.tanh %x : {t}\n\
         {to_host}\
         \x20 %b = {}\n\
         \x20 %c = stablehlo.tanh %b : {t}\n\
         \x20 %d = {}\n\
         \x20 %e = stablehlo.tanh %d : {t}\n\
         \x20 %f = {}\n\
         {to_device}\
         \x20 %out = stablehlo.multiply {last}, {saved} : {t}\n\
         \x20 return %out : {t}\n\
         }}\n",
        dot("%x", "%w"),
        dot("%c", "%w"),
        dot("%e", "%w"),
        last = if barrier { "%hb#1" } else { "%f" },
    )
}

/// A forward of `LAYERS` layers whose outputs are all read again by a
/// backward in reverse order: the shape of a train step's saved activations.
/// `lag` (with offloading) says how many backward layers before its use each
/// saved value is brought back: its host copy passes through an
/// `optimization_barrier` with the backward's value of that many layers
/// earlier.
const LAYERS: usize = 8;

fn chain(offload: Option<usize>) -> String {
    let t = format!("tensor<{N}x{N}xf32>");
    let dot = |a: &str| format!("stablehlo.dot_general {a}, %w, contracting_dims = [1] x [0] : ({t}, {t}) -> {t}");
    let place = |v: &str, to: &str| {
        format!(
            "stablehlo.custom_call @annotate_device_placement({v}) {{has_side_effect = true, \
             mhlo.frontend_attributes = {{_xla_buffer_placement = \"{to}\"}}}} : ({t}) -> {t}"
        )
    };
    let mut body = String::new();
    let mut h = "%x".to_string();
    for i in 0..LAYERS {
        body += &format!("  %m{i} = {}\n  %a{i} = stablehlo.tanh %m{i} : {t}\n", dot(&h));
        if offload.is_some() {
            body += &format!("  %host{i} = {}\n", place(&format!("%a{i}"), "pinned_host"));
        }
        h = format!("%a{i}");
    }
    // g_L = a_{L-1}; g_i = (g_{i+1} . w) * a_i.
    let mut g = vec![String::new(); LAYERS + 1];
    g[LAYERS] = h.clone();
    let mut back = vec![String::new(); LAYERS];
    for i in (0..LAYERS).rev() {
        if let Some(lag) = offload {
            // Bring a_j back once g_{j+1+lag} exists (lag layers early).
            for j in 0..LAYERS {
                if back[j].is_empty() && (j + 1 + lag >= LAYERS || j + 1 + lag == i + 1) {
                    let anchor = &g[(j + 1 + lag).min(LAYERS)];
                    body += &format!(
                        "  %hb{j}:2 = stablehlo.optimization_barrier %host{j}, {anchor} : {t}, {t}\n  %dev{j} = {}\n",
                        place(&format!("%hb{j}#0"), "device")
                    );
                    back[j] = format!("%dev{j}");
                }
            }
        }
        let saved = if offload.is_some() { back[i].clone() } else { format!("%a{i}") };
        body += &format!("  %n{i} = {}\n  %g{i} = stablehlo.multiply %n{i}, {saved} : {t}\n", dot(&g[i + 1]));
        g[i] = format!("%g{i}");
    }
    format!("func.func public @main(%x: {t}, %w: {t}) -> {t} {{\n{body}  return %g0 : {t}\n}}\n")
}

fn main() -> anyhow::Result<()> {
    let client = Client::new(&ClientOptions::default())?;
    println!("platform: {}", client.platform_name());
    let device = client.devices().into_iter().next().context("the plugin has no devices")?;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05
    };
    let x: Vec<f32> = (0..N * N).map(|_| rand()).collect();
    let w: Vec<f32> = (0..N * N).map(|_| rand()).collect();
    let xb = client.buffer_from_host(&x, &[N, N], &device)?;
    let wb = client.buffer_from_host(&w, &[N, N], &device)?;
    let mut outs = Vec::new();
    let mut programs: Vec<(String, String)> = [Variant::Plain, Variant::Offloaded, Variant::OffloadedThroughBarrier]
        .into_iter()
        .map(|v| (format!("{v:?}"), program(v)))
        .collect();
    programs.push((format!("chain of {LAYERS}, on the device"), chain(None)));
    for lag in [0, 1, 2] {
        programs.push((format!("chain of {LAYERS}, offloaded, back {lag} layers early"), chain(Some(lag))));
    }
    if std::env::var_os("HOST_OFFLOAD_PRINT").is_some() {
        for (name, text) in &programs {
            println!("// {name}\n{text}");
        }
    }
    for (i, (name, text)) in programs.iter().enumerate() {
        if i == 3 {
            compare(&outs);
            outs.clear();
        }
        let exe = match client.compile(text, &CompileOptions::default()) {
            Ok(e) => e,
            Err(e) => {
                println!("{name}: compile error: {e:#}");
                continue;
            }
        };
        match exe.compiled_memory_stats() {
            Ok(m) => println!(
                "{name}: device temp {} B, args {} B, outputs {} B; host temp {} B, host args {} B, host outputs {} B",
                m.temp_size_in_bytes,
                m.argument_size_in_bytes,
                m.output_size_in_bytes,
                m.host_temp_size_in_bytes,
                m.host_argument_size_in_bytes,
                m.host_output_size_in_bytes
            ),
            Err(e) => println!("{name}: memory stats error: {e:#}"),
        }
        match exe.execute(&[ExecArg::Borrowed(&xb), ExecArg::Borrowed(&wb)]).and_then(|o| o[0].to_vec::<f32>()) {
            Ok(v) => {
                let t = std::time::Instant::now();
                for _ in 0..5 {
                    exe.execute(&[ExecArg::Borrowed(&xb), ExecArg::Borrowed(&wb)])?[0].to_vec::<f32>()?;
                }
                println!(
                    "{name}: ran, {:.2} ms per run (5 runs, with the copy back)",
                    t.elapsed().as_secs_f64() * 200.0
                );
                outs.push(v);
            }
            Err(e) => println!("{name}: run error: {e:#}"),
        }
    }
    compare(&outs);
    Ok(())
}

/// Prints how each output after the first compares with the first.
fn compare(outs: &[Vec<f32>]) {
    for b in outs.iter().skip(1) {
        let a = &outs[0];
        let same = a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
        let worst = a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        println!("outputs bit-identical to the plain program: {same}, max abs difference {worst:e}");
    }
}
