//! Checkpoints with replicas: every replica's RNG key is saved and restored,
//! so a resumed run with dropout draws bit-identical masks on every replica;
//! restoring into a run with another replica count is a named error.

use kiln::checkpoint;
use kiln::replicas;
use kiln::{random, DType, Tensor};

fn with_replicas<R: Send>(n: usize, f: impl FnOnce() -> anyhow::Result<R> + Send) -> anyhow::Result<R> {
    std::thread::scope(|s| {
        s.spawn(|| {
            kiln::set_disk_cache(None)?;
            replicas::set_replicas(n)?;
            f()
        })
        .join()
        .expect("the replica thread panicked")
    })
}

/// One dropout draw: each replica's mask (scaled keep pattern).
fn draw() -> anyhow::Result<Vec<Vec<f32>>> {
    let x = Tensor::full(1.0, DType::F32, [512])?;
    let y = kiln::nn::dropout(&x, 0.5, true)?;
    kiln::mark_step()?;
    Ok(replicas::replica_values::<f32>(&y)?)
}

#[test]
fn resuming_with_replicas_and_dropout_is_bit_identical() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ck.safetensors");
    let path2 = path.clone();
    with_replicas(2, move || {
        kiln::manual_seed(11);
        draw()?; // advance past the seed's first draw
        checkpoint::save(&path2, 1, &[("rng.state".to_string(), random::state())])?;
        let after_save = draw()?;
        assert_ne!(after_save[0], after_save[1], "replicas draw their own masks");
        // Lose the generator state, then restore it from the checkpoint.
        kiln::manual_seed(999);
        checkpoint::restore(&path2, &[("rng.state".to_string(), random::state())])?;
        let after_restore = draw()?;
        assert_eq!(after_restore, after_save, "every replica continues its own stream");
        Ok(())
    })?;
    // Four replicas cannot take two replicas' keys.
    let err = with_replicas(4, move || {
        Ok(checkpoint::restore(&path, &[("rng.state".to_string(), random::state())]).unwrap_err().to_string())
    })?;
    assert!(err.contains("saved with 2 replicas' values") && err.contains("4 replica(s)"), "{err}");
    Ok(())
}
