//! Checkpoint files as a user meets them: a flipped header is caught, files
//! of the earlier format still load, `restore_training` refuses tensors the
//! model lacks, and a mixed-precision run resumes bit-identically with its
//! loss scaler (`save_training_with`).

use kiln::amp::{self, LossScalerConfig};
use kiln::checkpoint;
use kiln::nn::{self, Linear, Module, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::train_step::{TrainStep, TrainStepOptions};
use kiln::{DType, Tensor};

mod common;
use common::Rng;

struct Net {
    l1: Linear,
    l2: Linear,
}

impl Net {
    fn new(seed: u64) -> kiln::Result<Net> {
        let mut ps = ParamStore::new(seed);
        Ok(Net { l1: Linear::new(&mut ps, "l1", 6, 8, true)?, l2: Linear::new(&mut ps, "l2", 8, 3, true)? })
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
    fn describe(&self) -> String {
        "Net".into()
    }
    fn children(&self) -> Vec<&dyn Module> {
        vec![&self.l1, &self.l2]
    }
}

fn batches(n: usize) -> Vec<(Tensor, Tensor)> {
    let mut rng = Rng::new(7);
    (0..n)
        .map(|_| {
            let x = Tensor::from_vec(rng.normal_vec(30), [5, 6]).expect("x");
            let y: Vec<i32> = (0..5).map(|_| (rng.next_u64() % 3) as i32).collect();
            (x, Tensor::from_vec(y, [5]).expect("y"))
        })
        .collect()
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_literal().expect("read").bytes().to_vec()
}

/// A file's header (the JSON after the 8-byte length) with `from` replaced
/// by `to` once; the two must have the same length, so the file stays a
/// readable safetensors file.
fn with_header_edit(file: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let n = u64::from_le_bytes(file[..8].try_into().expect("8 bytes")) as usize;
    let header = std::str::from_utf8(&file[8..8 + n]).expect("utf-8 header");
    assert!(header.contains(from), "{from} not in {header}");
    let mut out = file[..8].to_vec();
    out.extend_from_slice(header.replacen(from, to, 1).as_bytes());
    out.extend_from_slice(&file[8 + n..]);
    out
}

#[test]
fn a_flipped_step_dtype_or_shape_in_the_header_is_caught() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("c.safetensors");
    let mut rng = Rng::new(3);
    let w = Tensor::from_vec(rng.normal_vec(30), [5, 6])?;
    let b = Tensor::from_vec(rng.normal_vec(6), [6])?;
    checkpoint::save(&path, 5, &[("param.w".into(), w.clone()), ("param.b".into(), b)])?;
    let file = std::fs::read(&path)?;
    let loaded = checkpoint::load_bytes(&file, &path)?;
    assert_eq!(loaded.step, 5);
    assert_eq!(loaded.tensors.iter().find(|(n, _)| n == "param.w").expect("w").1.bytes(), bytes(&w));
    for (from, to) in [(r#""step":"5""#, r#""step":"9""#), (r#""F32""#, r#""U32""#), ("[5,6]", "[6,5]")] {
        let bad = with_header_edit(&file, from, to);
        let e = checkpoint::load_bytes(&bad, &path).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch") && e.contains("the file is corrupt"), "{from} -> {to}: {e}");
    }
    Ok(())
}

/// FNV-1a over each tensor's name, byte length and bytes, sorted by name:
/// the checksum of format 1 (files written before 2026-11-25).
fn format_1_checksum(tensors: &[(&str, Vec<u8>)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, data) in tensors {
        eat(name.as_bytes());
        eat(&(data.len() as u64).to_le_bytes());
        eat(data);
    }
    h
}

#[test]
fn a_checkpoint_of_the_earlier_format_still_loads() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("old.safetensors");
    let data: Vec<u8> = [1.5f32, -2.25, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let sum = format_1_checksum(&[("param.w", data.clone())]);
    let meta: std::collections::HashMap<String, String> = [
        ("format".to_string(), "kiln-checkpoint-1".to_string()),
        ("step".to_string(), "12".to_string()),
        ("checksum".to_string(), format!("{sum:016x}")),
    ]
    .into();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3], &data)?;
    std::fs::write(&path, safetensors::serialize([("param.w", view)], Some(meta))?)?;
    let loaded = checkpoint::load(&path)?;
    assert_eq!(loaded.step, 12);
    assert_eq!(loaded.tensors[0].1.bytes(), &data[..]);
    // Its data is still checked.
    let mut bad = std::fs::read(&path)?;
    *bad.last_mut().expect("data") ^= 1;
    assert!(checkpoint::load_bytes(&bad, &path).unwrap_err().to_string().contains("checksum mismatch"));
    Ok(())
}

#[test]
fn tensor_names_that_checkpoints_keep_for_replicas_are_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let t = Tensor::from_vec(vec![1f32, 2.0], [2]).expect("t");
    let e = checkpoint::save(dir.path().join("c.safetensors"), 1, &[("w@replica1".into(), t)]).unwrap_err();
    assert!(e.to_string().contains(r#"tensor name "w@replica1" contains "@replica""#), "{e}");
}

/// f16 autocast with a loss scale that grows every 2 clean steps, so the
/// scale a resumed run starts from matters.
fn train(net: &Net, opt: &mut AdamW, ts: &mut TrainStep, data: &[(Tensor, Tensor)]) -> kiln::Result<()> {
    let params = net.parameters();
    for (x, y) in data {
        let loss = amp::autocast(DType::F16, || nn::cross_entropy(&net.forward(x)?, y, None))?;
        ts.step(&loss, &params, opt, 1e-2)?;
    }
    Ok(())
}

fn scaled_step() -> kiln::Result<TrainStep> {
    let scaler = LossScalerConfig { init_scale: 256.0, growth_interval: 2, ..LossScalerConfig::default() };
    TrainStep::new(TrainStepOptions { loss_scaling: Some(scaler), max_grad_norm: Some(1.0) })
}

#[test]
fn a_mixed_precision_run_resumes_bit_identically_with_its_loss_scaler() -> anyhow::Result<()> {
    let data = batches(12);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.safetensors");
    // Uninterrupted.
    let a = Net::new(1)?;
    let mut opt_a = AdamW::new(&a.parameters(), AdamWConfig::default())?;
    let mut ts_a = scaled_step()?;
    train(&a, &mut opt_a, &mut ts_a, &data)?;
    // Six steps, saved, and six more in a fresh model, optimizer and TrainStep.
    let b = Net::new(1)?;
    let mut opt_b = AdamW::new(&b.parameters(), AdamWConfig::default())?;
    let mut ts_b = scaled_step()?;
    train(&b, &mut opt_b, &mut ts_b, &data[..6])?;
    checkpoint::save_training_with(&path, 6, &b, &opt_b, &ts_b)?;
    let c = Net::new(99)?;
    let mut opt_c = AdamW::new(&c.parameters(), AdamWConfig::default())?;
    let mut ts_c = scaled_step()?;
    // Without the TrainStep the scaler's state has nowhere to go: refused,
    // naming it, rather than resumed from the initial scale.
    let e = checkpoint::restore_training(&path, &c, &opt_c).unwrap_err().to_string();
    assert!(
        e.contains("tensor(s) this model and optimizer lack: loss_scaler.growth_tracker, loss_scaler.scale"),
        "{e}"
    );
    assert!(e.contains("restore_training_with"), "{e}");
    assert_eq!(checkpoint::restore_training_with(&path, &c, &opt_c, &ts_c)?, 6);
    assert_eq!(bytes(&ts_c.state()[0].1), bytes(&ts_b.state()[0].1), "the loss scale");
    train(&c, &mut opt_c, &mut ts_c, &data[6..])?;
    for ((n, p), (_, q)) in a.named_parameters().iter().zip(c.named_parameters()) {
        assert_eq!(bytes(p), bytes(&q), "parameter {n}");
    }
    for ((n, s), (_, t)) in ts_a.state().iter().zip(ts_c.state()) {
        assert_eq!(bytes(s), bytes(&t), "{n}");
    }
    Ok(())
}

#[test]
fn restore_training_refuses_a_file_with_tensors_the_model_lacks() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("c.safetensors");
    let net = Net::new(2)?;
    let opt = AdamW::new(&net.parameters(), AdamWConfig::default())?;
    let mut state = checkpoint::training_state(&net, &opt);
    state.push(("param.l3.weight".into(), Tensor::from_vec(vec![1f32; 4], [2, 2])?));
    checkpoint::save(&path, 3, &state)?;
    let before = bytes(&net.parameters()[0]);
    let e = checkpoint::restore_training(&path, &net, &opt).unwrap_err().to_string();
    assert!(e.contains("1 tensor(s) this model and optimizer lack: param.l3.weight"), "{e}");
    assert_eq!(bytes(&net.parameters()[0]), before, "nothing is assigned");
    // `restore` loads the subset it is asked for.
    assert_eq!(checkpoint::restore(&path, &checkpoint::training_state(&net, &opt))?, 3);
    Ok(())
}
