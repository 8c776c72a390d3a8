//! The optimizer state made with the init program (device placement): AdamW's
//! zeros are outputs of the init step, one buffer per tensor, nothing
//! uploaded; the first training step donates them as a host-initialised run
//! does, and training gives the host run's losses to the bit. Its own test
//! binary, since it sets `KILN_DONATE=1` (process-wide).

use kiln::models::gpt::{Gpt, GptConfig};
use kiln::nn::{InitPlacement, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{metrics, Tensor};

mod common;
use common::Rng;

/// What one placement's run gave: the init step's host-to-device bytes, the
/// state's values after it, and per training step (loss, donated buffers).
struct Run {
    params: usize,
    init_upload_bytes: u64,
    state_values: Vec<f32>,
    steps: Vec<(f64, usize)>,
}

fn run(placement: InitPlacement) -> anyhow::Result<Run> {
    std::thread::scope(|s| {
        s.spawn(|| -> anyhow::Result<Run> {
            kiln::set_disk_cache(None)?;
            let cfg = GptConfig::tiny(17);
            let mut ps = ParamStore::with_placement(5, placement);
            let model = Gpt::new(&mut ps, &cfg)?;
            let params = ps.tensors();
            let mut opt = AdamW::with_state_on(&params, AdamWConfig::default(), placement)?;
            let before = metrics::snapshot();
            ps.materialize()?;
            kiln::sync()?;
            let init_upload_bytes = metrics::snapshot().host_to_device_bytes - before.host_to_device_bytes;
            let mut state_values = Vec::new();
            for t in opt.m.iter().chain(&opt.v) {
                assert_eq!(t.is_on_device(), placement == InitPlacement::Device, "{t:?}");
                state_values.extend(t.to_vec::<f32>()?);
            }
            let mut rng = Rng::new(9);
            let mut steps = Vec::new();
            for _ in 0..3 {
                let (b, t) = (cfg.batch, cfg.seq);
                let ids: Vec<i32> = (0..b * t + 1).map(|_| (rng.next_u64() % 17) as i32).collect();
                let x = Tensor::from_vec(ids[..b * t].to_vec(), [b, t])?;
                let y = Tensor::from_vec(ids[1..].to_vec(), [b * t])?;
                let loss = model.loss(&x, &y, true)?;
                let grads = kiln::grad(&loss, &params)?;
                opt.step(&params, &grads, 1e-3)?;
                let report = kiln::mark_step()?;
                steps.push((loss.item()?, report.donated));
            }
            Ok(Run { params: params.len(), init_upload_bytes, state_values, steps })
        })
        .join()
        .expect("the test thread panicked")
    })
}

#[test]
fn adamw_state_made_on_the_device_is_zeros_in_buffers_the_first_step_donates() -> anyhow::Result<()> {
    std::env::set_var("KILN_DONATE", "1");
    let host = run(InitPlacement::Host)?;
    let device = run(InitPlacement::Device)?;
    // Zeros, every element, on both placements.
    assert!(!device.state_values.is_empty());
    assert_eq!(device.state_values.len(), host.state_values.len());
    assert!(device.state_values.iter().all(|v| v.to_bits() == 0), "the device state is +0.0 everywhere");
    assert!(host.state_values.iter().all(|v| v.to_bits() == 0));
    // Nothing of the state's size travelled with the init step: only the
    // init program's scalars (keys, scales, divisors).
    let state_bytes = 4 * device.state_values.len() as u64;
    assert!(device.init_upload_bytes < 4096, "{} B uploaded by the init step", device.init_upload_bytes);
    assert!(state_bytes > 100_000, "the tiny GPT's state is {state_bytes} B");
    // Every step donates as many buffers as the host run's (parameters, m,
    // v: each in a buffer of its own), and the losses agree to the bit.
    let params_and_state = |r: &Run| r.steps.iter().map(|s| s.1).collect::<Vec<_>>();
    assert_eq!(params_and_state(&device), params_and_state(&host));
    assert!(device.steps[0].1 >= 3 * device.params, "{} parameters: {:?}", device.params, device.steps);
    for (i, (d, h)) in device.steps.iter().zip(&host.steps).enumerate() {
        assert_eq!(d.0.to_bits(), h.0.to_bits(), "loss of step {i}: device {} host {}", d.0, h.0);
    }
    Ok(())
}
