//! Hugging Face GPT-2 directories in and out (`kiln::models::hf`): a
//! directory kiln writes loads back to the same logits, and every way a
//! directory can be wrong is an error naming the tensor or field. The
//! numerics against `transformers` itself, for every architecture, are in
//! `hf_models.rs` (fixtures `benches/hf/check.py make` wrote) and, for
//! kiln-written directories, `benches/hf/check.py check`.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use std::path::Path;

use kiln::models::gpt2::{Gpt2, Gpt2Config};
use kiln::models::{hf, Spelling};
use kiln::nn::ParamStore;
use kiln::Tensor;

fn tiny() -> Gpt2Config {
    Gpt2Config { vocab: 61, dim: 16, layers: 2, heads: 2, max_positions: 12, eps: 1e-5 }
}

fn ids() -> Tensor {
    Tensor::from_vec((0..20).map(|i| (i * 13 + 5) % 61).collect::<Vec<i32>>(), [2, 10]).unwrap()
}

fn logits(model: &Gpt2) -> Vec<f32> {
    model.logits(&ids()).unwrap().to_vec::<f32>().unwrap()
}

#[test]
fn a_written_directory_loads_back_to_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let mut ps = ParamStore::new(11);
    let model = Gpt2::new(&mut ps, tiny(), Spelling::Builtin).unwrap();
    hf::save_gpt2(dir.path(), &model, &ps, None).unwrap();
    for spelling in Spelling::ALL {
        let (_, loaded) = hf::load_gpt2(dir.path(), spelling).unwrap();
        assert_eq!(loaded.cfg, tiny());
        let (a, b) = (logits(&model), logits(&loaded));
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        // Bit-identical in the same spelling; the plain one within f32 rounding.
        assert!(diff <= 1e-5, "{spelling:?}: {diff}");
    }
}

/// Rewrites `dir/model.safetensors` through `edit` of its tensors.
fn edit_tensors(dir: &Path, edit: impl FnOnce(&mut Vec<(String, kiln::compiler::ir::Literal)>)) {
    let mut tensors = hf::read_tensors(dir).unwrap();
    edit(&mut tensors);
    let t: Vec<(String, Tensor)> = tensors.into_iter().map(|(n, l)| (n, Tensor::from_literal(l))).collect();
    // A plain safetensors file under the same name (kiln's checkpoint writer
    // adds metadata the reader ignores).
    kiln::checkpoint::save(dir.join("model.safetensors"), 0, &t).unwrap();
}

fn refused(dir: &Path) -> String {
    match hf::load_gpt2(dir, Spelling::Builtin) {
        Ok(_) => panic!("a bad directory loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_directories_name_what_is_wrong() {
    let fresh = || {
        let dir = tempfile::tempdir().unwrap();
        let mut ps = ParamStore::new(3);
        let model = Gpt2::new(&mut ps, tiny(), Spelling::Builtin).unwrap();
        hf::save_gpt2(dir.path(), &model, &ps, None).unwrap();
        dir
    };
    let d = fresh();
    edit_tensors(d.path(), |t| t.retain(|(n, _)| n != "transformer.h.1.mlp.c_fc.bias"));
    assert!(refused(d.path()).contains("no tensor transformer.h.1.mlp.c_fc.bias"));

    let d = fresh();
    edit_tensors(d.path(), |t| {
        let extra = t[0].1.clone();
        t.push(("transformer.h.9.attn.c_attn.weight".into(), extra));
    });
    assert!(refused(d.path()).contains("tensors the model does not have: transformer.h.9.attn.c_attn.weight"));

    let d = fresh();
    edit_tensors(d.path(), |t| {
        let i = t.iter().position(|(n, _)| n == "transformer.wpe.weight").unwrap();
        let ty = kiln::TensorType::new(kiln::DType::F32, [6usize, 16]);
        t[i].1 = kiln::compiler::ir::Literal::from_f64s(ty.dtype, [6usize, 16], &[0.5; 96]).unwrap();
    });
    let e = refused(d.path());
    assert!(e.contains("tensor transformer.wpe.weight is") && e.contains("in the file, the model's"), "{e}");

    // The tied head and old mask buffers are allowed; GPT2Model's names too.
    let d = fresh();
    edit_tensors(d.path(), |t| {
        let wte = t.iter().find(|(n, _)| n == "transformer.wte.weight").unwrap().1.clone();
        t.push(("lm_head.weight".into(), wte));
        for (n, _) in t.iter_mut() {
            if let Some(short) = n.strip_prefix("transformer.") {
                *n = short.to_string();
            }
        }
    });
    hf::load_gpt2(d.path(), Spelling::Builtin).unwrap();

    // Configs kiln's GPT-2 cannot honour.
    for (field, value, said) in [
        ("activation_function", "\"relu\"", "activation_function \"relu\""),
        ("model_type", "\"bert\"", "not a gpt2 checkpoint"),
        ("n_head", "5", "sizes that make no model"),
        ("reorder_and_upcast_attn", "true", "reorder_and_upcast_attn"),
        ("n_embd", "\"wide\"", "config field n_embd"),
    ] {
        let d = fresh();
        let path = d.path().join("config.json");
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config[field] = serde_json::from_str(value).unwrap();
        std::fs::write(&path, config.to_string()).unwrap();
        let e = refused(d.path());
        assert!(e.contains(said), "{field}: {e}");
    }
    let d = fresh();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(refused(d.path()).contains("model.safetensors"));
}
