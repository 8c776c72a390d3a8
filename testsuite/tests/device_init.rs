//! On-device initialisation: the init program gives the parameters host init
//! gives for the same seed (MLP, tiny GPT, the gpt2-small config), on any
//! number of replicas, from one compiled program per model structure that
//! reads nothing from the host but the seed.

use kiln::models::gpt::{Gpt, GptConfig};
use kiln::models::mlp::Mlp;
use kiln::nn::{Init, InitForm, InitPlacement, ParamStore};
use kiln::{metrics, replicas, Tensor};

/// Runs `f` on a thread of its own (the lazy-tensor context is per thread)
/// with no disk cache and `n` replicas.
fn on_thread<R: Send>(n: usize, f: impl FnOnce() -> anyhow::Result<R> + Send) -> anyhow::Result<R> {
    std::thread::scope(|s| {
        s.spawn(|| {
            kiln::set_disk_cache(None)?;
            if n > 1 {
                replicas::set_replicas(n)?;
            }
            f()
        })
        .join()
        .expect("the test thread panicked")
    })
}

/// Every parameter of a store, as f32 bits, by name (replica 0's copy).
fn values(ps: &ParamStore) -> anyhow::Result<Vec<(String, Vec<u32>)>> {
    ps.iter().map(|(n, t)| Ok((n.to_string(), t.to_vec::<f32>()?.into_iter().map(f32::to_bits).collect()))).collect()
}

/// Elements that differ, and the largest difference in units of the last
/// place of f32.
fn compare(host: &[(String, Vec<u32>)], device: &[(String, Vec<u32>)]) -> (usize, u32) {
    assert_eq!(host.len(), device.len());
    let (mut differ, mut max_ulps) = (0, 0);
    for ((hn, h), (dn, d)) in host.iter().zip(device) {
        assert_eq!(hn, dn, "parameters in the same order");
        assert_eq!(h.len(), d.len(), "{hn}");
        for (a, b) in h.iter().zip(d) {
            if a != b {
                differ += 1;
                // Same sign and finite here: the bit distance is the ulp distance.
                max_ulps = max_ulps.max(a.abs_diff(*b));
            }
        }
    }
    (differ, max_ulps)
}

/// Builds a model with `build` on both placements and compares the values.
fn host_vs_device(
    seed: u64,
    build: impl Fn(&mut ParamStore) -> kiln::Result<()>,
) -> anyhow::Result<(usize, u32, usize)> {
    let mut host = ParamStore::with_placement(seed, InitPlacement::Host);
    build(&mut host)?;
    let mut device = ParamStore::with_placement(seed, InitPlacement::Device);
    build(&mut device)?;
    assert!(device.iter().any(|(_, t)| t.is_pending()), "device init records, it does not compute on the host");
    assert!(device.materialize()?, "a step ran");
    assert!(device.iter().all(|(_, t)| t.is_on_device()));
    let (h, d) = (values(&host)?, values(&device)?);
    let elements = h.iter().map(|(_, v)| v.len()).sum();
    let (differ, ulps) = compare(&h, &d);
    Ok((differ, ulps, elements))
}

#[test]
fn the_mlp_is_bit_identical_to_host_init() -> anyhow::Result<()> {
    on_thread(1, || {
        let (differ, ulps, n) = host_vs_device(7, |ps| Mlp::new(ps, &[784, 256, 128, 10]).map(drop))?;
        assert_eq!((differ, ulps), (0, 0), "{differ} of {n} elements differ, by up to {ulps} ulps");
        Ok(())
    })
}

#[test]
fn the_tiny_gpt_is_bit_identical_to_host_init() -> anyhow::Result<()> {
    on_thread(1, || {
        let (differ, ulps, n) = host_vs_device(3, |ps| Gpt::new(ps, &GptConfig::tiny(65)).map(drop))?;
        assert_eq!((differ, ulps), (0, 0), "{differ} of {n} elements differ, by up to {ulps} ulps");
        Ok(())
    })
}

#[test]
fn the_gpt2_small_config_is_bit_identical_to_host_init() -> anyhow::Result<()> {
    on_thread(1, || {
        let cfg = GptConfig::gpt2_small(50304);
        let (differ, ulps, n) = host_vs_device(0, |ps| Gpt::new(ps, &cfg).map(drop))?;
        assert!(n > 124_000_000, "the whole model: {n}");
        assert_eq!((differ, ulps), (0, 0), "{differ} of {n} elements differ, by up to {ulps} ulps");
        Ok(())
    })
}

#[test]
fn four_replicas_get_the_values_of_one() -> anyhow::Result<()> {
    let one = on_thread(1, || {
        let mut ps = ParamStore::with_placement(11, InitPlacement::Host);
        Gpt::new(&mut ps, &GptConfig::tiny(65))?;
        values(&ps)
    })?;
    on_thread(4, || {
        let mut ps = ParamStore::with_placement(11, InitPlacement::Device);
        Gpt::new(&mut ps, &GptConfig::tiny(65))?;
        ps.materialize()?;
        for ((name, t), (_, want)) in ps.iter().zip(&one) {
            let per_replica = replicas::replica_values::<f32>(t)?;
            assert_eq!(per_replica.len(), 4, "{name}");
            for (r, v) in per_replica.iter().enumerate() {
                let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
                assert!(bits == *want, "{name}: replica {r} differs from host init");
            }
        }
        Ok(())
    })
}

#[test]
fn one_program_per_model_structure_whatever_the_seed() -> anyhow::Result<()> {
    on_thread(1, || {
        let cfg = GptConfig::tiny(65);
        let m0 = metrics::snapshot();
        let mut a = ParamStore::with_placement(1, InitPlacement::Device);
        Gpt::new(&mut a, &cfg)?;
        a.materialize()?;
        let m1 = metrics::snapshot();
        assert_eq!(m1.compiles - m0.compiles, 1, "the init program compiles once");
        let mut b = ParamStore::with_placement(2, InitPlacement::Device);
        Gpt::new(&mut b, &cfg)?;
        b.materialize()?;
        let m2 = metrics::snapshot();
        assert_eq!(m2.compiles - m1.compiles, 0, "another seed runs the same program");
        assert!(m2.cache_hits > m1.cache_hits);
        // ... and the seed is what changed the values.
        let (wa, wb) = (a.get("wte.weight").unwrap().to_vec::<f32>()?, b.get("wte.weight").unwrap().to_vec::<f32>()?);
        assert_ne!(wa, wb);
        // Nothing to run twice.
        assert!(!a.materialize()?);
        Ok(())
    })
}

#[test]
fn the_init_program_reads_only_scalars_per_parameter() -> anyhow::Result<()> {
    on_thread(1, || {
        let text = kiln::lower(|| {
            let mut ps = ParamStore::with_placement(5, InitPlacement::Device);
            Mlp::new(&mut ps, &[20, 30, 4])?;
            Ok(ps.tensors())
        })?;
        let main = text.lines().find(|l| l.contains("func.func public @main")).expect("a main function");
        let sig = &main[..main.find("->").expect("a result list")];
        // Four uniform parameters (two weights, two biases): a u64 key, the
        // four shift amounts in u64, and lo and hi - lo in f64, each a
        // scalar; no data of any shape.
        assert_eq!(sig.matches("%arg").count(), 28, "{main}");
        assert_eq!(sig.matches("tensor<ui64>").count(), 20, "{main}");
        assert_eq!(sig.matches("tensor<f64>").count(), 8, "{main}");
        Ok(())
    })
}

#[test]
fn a_store_of_given_tensors_has_nothing_to_initialise() -> anyhow::Result<()> {
    on_thread(1, || {
        let mut ps = ParamStore::with_placement(5, InitPlacement::Device);
        ps.add("w", Tensor::from_vec(vec![1f32, 2.0], [2])?)?;
        assert!(!ps.materialize()?);
        let spec = &ps.specs()[0];
        assert_eq!(spec.init, kiln::nn::Init::Given);
        let err = kiln::nn::init_value(0, spec).unwrap_err().to_string();
        assert!(err.contains("w"), "{err}");
        Ok(())
    })
}

#[test]
fn the_per_parameter_form_gives_the_values_of_the_flat_one() -> anyhow::Result<()> {
    on_thread(1, || {
        let cfg = GptConfig::tiny(65);
        let (differ, ulps, n) = host_vs_device(9, |ps| {
            ps.set_init_form(InitForm::PerParameter);
            Gpt::new(ps, &cfg).map(drop)
        })?;
        assert_eq!((differ, ulps), (0, 0), "{differ} of {n} elements differ, by up to {ulps} ulps");
        Ok(())
    })
}

/// The init program's text in `form` for the tiny GPT, and its normal
/// parameters (weights drawn with Box–Muller).
fn init_program(form: InitForm) -> anyhow::Result<(String, usize)> {
    let mut normals = 0;
    let text = kiln::lower(|| {
        let mut ps = ParamStore::with_placement(5, InitPlacement::Device);
        ps.set_init_form(form);
        Gpt::new(&mut ps, &GptConfig::tiny(65))?;
        normals = ps.specs().iter().filter(|s| matches!(s.init, Init::Normal { .. })).count();
        ps.prepare_init()?;
        Ok(ps.tensors())
    })?;
    Ok((text, normals))
}

#[test]
fn the_flat_form_draws_every_normal_parameter_in_one_computation() -> anyhow::Result<()> {
    on_thread(1, || {
        let (flat, normals) = init_program(InitForm::Flat)?;
        let (per, _) = init_program(InitForm::PerParameter)?;
        assert!(normals > 2, "the tiny GPT has several normal weights: {normals}");
        // The tiny GPT's normal weights follow each other in the stream (its
        // other parameters are constants): one cosine and one log in all,
        // fenced from the per-parameter slices.
        assert_eq!(flat.matches("stablehlo.cosine").count(), 1, "{flat}");
        assert_eq!(flat.matches("stablehlo.log ").count(), 1, "{flat}");
        assert_eq!(flat.matches("stablehlo.optimization_barrier").count(), 1);
        assert_eq!(per.matches("stablehlo.cosine").count(), normals);
        Ok(())
    })
}

#[test]
fn a_parameter_reassigned_before_materialize_keeps_its_new_value() -> anyhow::Result<()> {
    on_thread(1, || {
        let mut ps = ParamStore::with_placement(4, InitPlacement::Device);
        Gpt::new(&mut ps, &GptConfig::tiny(65))?;
        let w = ps.get("wte.weight").expect("the token embedding").clone();
        let fresh: Vec<f32> = (0..w.elem_count()).map(|i| (i % 7) as f32 - 3.0).collect();
        w.assign(&Tensor::from_vec(fresh.clone(), w.shape().clone())?.add_scalar(0.0)?)?;
        ps.materialize()?;
        assert_eq!(w.to_vec::<f32>()?, fresh, "materialize must not overwrite a value the caller assigned");
        // The other normal weights still equal host init.
        let mut host = ParamStore::with_placement(4, InitPlacement::Host);
        Gpt::new(&mut host, &GptConfig::tiny(65))?;
        for ((name, h), (_, d)) in values(&host)?.iter().zip(values(&ps)?.iter()) {
            if name != "wte.weight" {
                assert!(h == d, "{name} differs from host init");
            }
        }
        Ok(())
    })
}
