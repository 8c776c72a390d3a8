//! A user's model written against the public API only: a residual MLP with
//! LayerNorm and odd widths (53 -> 37 -> 2 blocks of 37 -> 71 -> 37 -> 5),
//! built as a `Module` so its parameters, training state and checkpoints need
//! no plumbing. Trained on the compiled (PJRT) backend and on the eager
//! (candle) backend from the same weights and data: the loss curves agree
//! within 1e-4 relative over 20 steps. A checkpoint taken mid-run through
//! `checkpoint::save_training` resumes bit-identically.

use kiln::checkpoint;
use kiln::nn::{self, Dropout, LayerNorm, Linear, Module, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{Backend, Tensor};

mod common;
use common::Rng;

const IN: usize = 53;
const WIDTH: usize = 37;
const HIDDEN: usize = 71;
const CLASSES: usize = 5;
const BATCH: usize = 24;

/// `x + fc2(gelu(fc1(ln(x))))`.
struct Block {
    ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    drop: Dropout,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let h = self.fc1.forward(&self.ln.forward(x)?)?;
        let h = self.drop.forward(&self.fc2.forward(&nn::gelu(&h)?)?)?;
        x.add(&h)
    }
    fn describe(&self) -> String {
        format!("Block({WIDTH} -> {HIDDEN})")
    }
    fn children(&self) -> Vec<&dyn Module> {
        vec![&self.ln, &self.fc1, &self.fc2, &self.drop]
    }
}

struct ResidualMlp {
    stem: Linear,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
}

impl ResidualMlp {
    fn new(seed: u64, dropout: f64) -> kiln::Result<ResidualMlp> {
        let mut ps = ParamStore::new(seed);
        let stem = Linear::new(&mut ps, "stem", IN, WIDTH, true)?;
        let blocks = (0..2)
            .map(|i| {
                Ok(Block {
                    ln: LayerNorm::new(&mut ps, &format!("b{i}.ln"), WIDTH)?,
                    fc1: Linear::new(&mut ps, &format!("b{i}.fc1"), WIDTH, HIDDEN, true)?,
                    fc2: Linear::new(&mut ps, &format!("b{i}.fc2"), HIDDEN, WIDTH, true)?,
                    drop: Dropout::new(dropout)?,
                })
            })
            .collect::<kiln::Result<_>>()?;
        Ok(ResidualMlp {
            stem,
            blocks,
            ln_f: LayerNorm::new(&mut ps, "ln_f", WIDTH)?,
            head: Linear::new(&mut ps, "head", WIDTH, CLASSES, true)?,
        })
    }
}

impl Module for ResidualMlp {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        nn::scoped(
            || self.describe(),
            || {
                let mut h = self.stem.forward(x)?;
                for b in &self.blocks {
                    h = nn::scoped(|| b.describe(), || b.forward(&h))?;
                }
                self.head.forward(&self.ln_f.forward(&h)?)
            },
        )
    }
    fn describe(&self) -> String {
        "ResidualMlp".into()
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut c: Vec<&dyn Module> = vec![&self.stem];
        c.extend(self.blocks.iter().map(|b| b as &dyn Module));
        c.extend([&self.ln_f as &dyn Module, &self.head]);
        c
    }
}

/// Fresh batches: inputs normal, labels from a fixed linear rule plus noise
/// (learnable, never all one class).
fn batches(n: usize) -> Vec<(Vec<f32>, Vec<i32>)> {
    let mut rng = Rng::new(77);
    let w = rng.normal_vec(IN * CLASSES);
    (0..n)
        .map(|_| {
            let x = rng.normal_vec(BATCH * IN);
            let y = x
                .chunks(IN)
                .map(|row| {
                    let scores: Vec<f32> = (0..CLASSES)
                        .map(|c| row.iter().enumerate().map(|(i, v)| v * w[i * CLASSES + c]).sum())
                        .collect();
                    (0..CLASSES).max_by(|&a, &b| scores[a].total_cmp(&scores[b])).unwrap() as i32
                })
                .collect();
            (x, y)
        })
        .collect()
}

fn train(model: &ResidualMlp, opt: &mut AdamW, data: &[(Vec<f32>, Vec<i32>)]) -> anyhow::Result<Vec<f64>> {
    let params = model.parameters();
    let mut losses = Vec::new();
    for (x, y) in data {
        let x = Tensor::from_vec(x.clone(), [BATCH, IN])?;
        let y = Tensor::from_vec(y.clone(), [BATCH])?;
        let loss = nn::cross_entropy(&model.forward(&x)?, &y, None)?;
        let grads = kiln::grad(&loss, &params)?;
        opt.step(&params, &grads, 3e-3)?;
        kiln::mark_step()?;
        losses.push(loss.item()?);
    }
    Ok(losses)
}

fn run_on(backend: Backend, steps: usize) -> anyhow::Result<Vec<f64>> {
    kiln::set_backend(backend);
    kiln::manual_seed(5);
    let model = ResidualMlp::new(11, 0.0)?;
    let mut opt = AdamW::new(&model.parameters(), AdamWConfig::default())?;
    let losses = train(&model, &mut opt, &batches(steps));
    kiln::set_backend(Backend::Pjrt);
    losses
}

#[test]
fn module_lists_named_parameters_in_creation_order() -> anyhow::Result<()> {
    let model = ResidualMlp::new(1, 0.1)?;
    let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), 2 + 2 * 6 + 2 + 2);
    assert_eq!(&names[..4], ["stem.weight", "stem.bias", "b0.ln.weight", "b0.ln.bias"]);
    assert_eq!(names.last().map(String::as_str), Some("head.bias"));
    let elems = IN * WIDTH
        + WIDTH
        + 2 * (2 * WIDTH + WIDTH * HIDDEN + HIDDEN + HIDDEN * WIDTH + WIDTH)
        + 2 * WIDTH
        + WIDTH * CLASSES
        + CLASSES;
    assert_eq!(model.num_parameters(), elems);
    // Train/eval reaches the dropout layers inside the blocks.
    assert!(model.is_training());
    model.eval();
    assert!(!model.is_training());
    model.train();
    assert!(model.is_training());
    Ok(())
}

#[test]
fn eval_mode_turns_dropout_off() -> anyhow::Result<()> {
    let model = ResidualMlp::new(2, 0.5)?;
    let x = Tensor::from_vec(Rng::new(3).normal_vec(BATCH * IN), [BATCH, IN])?;
    model.eval();
    let (a, b) = (model.forward(&x)?, model.forward(&x)?);
    model.train();
    let (c, d) = (model.forward(&x)?, model.forward(&x)?);
    kiln::mark_step()?;
    assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?, "eval mode is deterministic");
    assert_ne!(c.to_vec::<f32>()?, d.to_vec::<f32>()?, "train mode draws two dropout masks");
    Ok(())
}

#[test]
fn eager_candle_and_compiled_loss_curves_agree_over_20_steps() -> anyhow::Result<()> {
    let compiled = run_on(Backend::Pjrt, 20)?;
    let eager = run_on(Backend::Eager, 20)?;
    assert!(compiled.last() < compiled.first(), "the model learns: {compiled:?}");
    for (i, (a, b)) in compiled.iter().zip(&eager).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(rel <= 1e-4, "step {i}: compiled {a} vs eager {b} (relative {rel:.2e})");
    }
    Ok(())
}

#[test]
fn checkpoint_round_trip_through_the_public_helper_resumes_bit_identically() -> anyhow::Result<()> {
    let data = batches(8);
    kiln::manual_seed(9);
    let model = ResidualMlp::new(3, 0.1)?;
    let mut opt = AdamW::new(&model.parameters(), AdamWConfig::default())?;
    train(&model, &mut opt, &data[..4])?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("resmlp.safetensors");
    checkpoint::save_training(&path, 4, &model, &opt)?;
    let names: Vec<String> = checkpoint::training_state(&model, &opt).into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"param.b1.fc2.weight".to_string()) && names.contains(&"rng.state".to_string()));
    assert!(names.iter().any(|n| n.starts_with("optim.")));
    let uninterrupted = train(&model, &mut opt, &data[4..])?;

    // A fresh model and optimizer (other init, other seed) restored from the file.
    kiln::manual_seed(1234);
    let resumed = ResidualMlp::new(99, 0.1)?;
    let mut opt2 = AdamW::new(&resumed.parameters(), AdamWConfig::default())?;
    let step = checkpoint::restore_training(&path, &resumed, &opt2)?;
    assert_eq!(step, 4);
    let after = train(&resumed, &mut opt2, &data[4..])?;
    assert_eq!(uninterrupted, after, "dropout masks, moments and weights all resume");
    Ok(())
}

#[test]
fn an_error_inside_a_layer_names_the_layer_path() -> anyhow::Result<()> {
    let model = ResidualMlp::new(4, 0.0)?;
    let mut ps = ParamStore::new(0);
    let ln = LayerNorm::new(&mut ps, "ln", 257)?;
    let err = ln.forward(&Tensor::from_vec(vec![0.5f32; 800], [8, 100])?).unwrap_err().to_string();
    assert!(err.starts_with("LayerNorm(257): "), "{err}");
    // The stem expects 53 features; 50 fail in the matmul, named with the path.
    let err = model.forward(&Tensor::from_vec(vec![0.5f32; 100], [2, 50])?).unwrap_err().to_string();
    assert_eq!(
        err,
        "ResidualMlp: Linear(53 -> 37): matmul: inner dimensions 50 and 53 differ ([2, 50] times [53, 37])"
    );
    Ok(())
}
