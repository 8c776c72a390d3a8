//! Shard policies: how a [`ParamStore`]'s parameters are laid out over the
//! mesh (FSDP, Megatron-style tensor parallelism, both, or explicit), and the
//! policy the built-in models apply when they are created under a mesh.
//!
//! Invariants:
//! - A policy decides a sharding per parameter from its name and type alone,
//!   in store order; every sharding it gives is checked against the mesh
//!   ([`Sharding::check`]) before any is set, and a name it refers to that
//!   the store lacks is a typed error.
//! - Optimizer state made from a parameter afterwards takes its sharding, so a
//!   policy applied before the optimizer is made covers the state too.

use std::fmt;

use kiln_compiler::ir::TensorType;

use crate::api::nn::ParamStore;
use crate::core::error::{FrontendError, Result};
use crate::core::mesh::{Mesh, PolicyKind, Sharding, DATA, MODEL};
use crate::core::settings;
use crate::engine::partition::mesh;

/// How a [`ParamStore`]'s parameters (and, through [`Tensor::sharding`](crate::Tensor::sharding) being
/// copied to the state made from them, their optimizer state) are sharded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardPolicy {
    /// Every parameter whole on every device (data parallel under a mesh).
    Replicated,
    /// ZeRO-3 / FSDP: each parameter split over `axis` along its largest
    /// dimension that the axis divides (whole when none does).
    Fsdp { axis: String },
    /// Megatron tensor parallelism over `axis`: `column` Linears (by name,
    /// `h0.attn.qkv`) split their output features (weight dim 1, bias; for
    /// shaped outputs such as the attention's `[in, 3, heads, head_dim]`, the
    /// heads dimension), `row` Linears their input features (weight dim 0;
    /// bias whole); the rest stays whole.
    TensorParallel { axis: String, column: Vec<String>, row: Vec<String> },
    /// Both: the tensor-parallel splits over `model`, then each parameter
    /// split over `data` along its largest remaining dimension that divides.
    FsdpTp { data: String, model: String, column: Vec<String>, row: Vec<String> },
    /// These parameters as given, the rest whole.
    Explicit(Vec<(String, Sharding)>),
}

impl fmt::Display for ShardPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardPolicy::Replicated => write!(f, "replicated"),
            ShardPolicy::Fsdp { axis } => write!(f, "fsdp over {axis}"),
            ShardPolicy::TensorParallel { axis, .. } => write!(f, "tensor parallel over {axis}"),
            ShardPolicy::FsdpTp { data, model, .. } => write!(f, "fsdp over {data} x tensor parallel over {model}"),
            ShardPolicy::Explicit(list) => write!(f, "explicit ({} parameters)", list.len()),
        }
    }
}

/// Megatron's pairs by parameter names: a block's row-parallel Linear (input
/// features split) and the column-parallel Linears (output features split)
/// that feed it. kiln's own blocks, then the Hugging Face names of the
/// model zoo's: GPT-2, Llama, BERT/RoBERTa, DistilBERT, T5 (self- and
/// cross-attention, ReLU and gated feed-forwards).
const MEGATRON: [(&str, &[&str]); 12] = [
    (".attn.proj", &[".attn.qkv"]),
    (".mlp.proj", &[".mlp.fc"]),
    (".attn.c_proj", &[".attn.c_attn"]),
    (".mlp.c_proj", &[".mlp.c_fc"]),
    (".self_attn.o_proj", &[".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj"]),
    (".mlp.down_proj", &[".mlp.gate_proj", ".mlp.up_proj"]),
    (".attention.output.dense", &[".attention.self.query", ".attention.self.key", ".attention.self.value"]),
    (".output.dense", &[".intermediate.dense"]),
    (".attention.out_lin", &[".attention.q_lin", ".attention.k_lin", ".attention.v_lin"]),
    (".ffn.lin2", &[".ffn.lin1"]),
    (".o", &[".q", ".k", ".v"]),
    (".DenseReluDense.wo", &[".DenseReluDense.wi", ".DenseReluDense.wi_0", ".DenseReluDense.wi_1"]),
];

/// The Megatron Linear pairs found in `store` (see [`MEGATRON`]): (column,
/// row) Linear names, a row kept only with at least one of its columns.
/// GPT-2's fused `c_attn` is one flat `[dim, 3·dim]` Linear: its output
/// split is contiguous thirds, not whole heads, so the partitioner moves
/// q, k and v between devices after it (kiln's own `attn.qkv` keeps a
/// heads axis instead: docs/sharding.md).
pub fn megatron_pairs(store: &ParamStore) -> (Vec<String>, Vec<String>) {
    let mut column = Vec::new();
    let mut row = Vec::new();
    for (name, _) in store.iter() {
        let Some(linear) = name.strip_suffix(".weight") else { continue };
        for (r, cols) in MEGATRON {
            let Some(prefix) = linear.strip_suffix(r) else { continue };
            let found: Vec<String> = cols
                .iter()
                .map(|c| format!("{prefix}{c}"))
                .filter(|c| store.get(&format!("{c}.weight")).is_some())
                .collect();
            if !found.is_empty() && !row.iter().any(|x: &String| x == linear) {
                column.extend(found);
                row.push(linear.to_string());
            }
        }
    }
    (column, row)
}

impl ShardPolicy {
    /// FSDP over the `data` axis.
    pub fn fsdp() -> ShardPolicy {
        ShardPolicy::Fsdp { axis: DATA.into() }
    }

    /// Tensor parallelism over `model` for the transformer Linear pairs of `store`.
    pub fn tensor_parallel(store: &ParamStore) -> ShardPolicy {
        let (column, row) = megatron_pairs(store);
        ShardPolicy::TensorParallel { axis: MODEL.into(), column, row }
    }

    /// FSDP over `data` and tensor parallelism over `model`.
    pub fn fsdp_tp(store: &ParamStore) -> ShardPolicy {
        let (column, row) = megatron_pairs(store);
        ShardPolicy::FsdpTp { data: DATA.into(), model: MODEL.into(), column, row }
    }

    /// The sharding every parameter of `store` gets on `mesh`, in store
    /// order: what on-device initialization places each parameter in.
    /// Every parameter a policy names must exist; every sharding is checked.
    pub fn shardings(&self, store: &ParamStore, mesh: &Mesh) -> Result<Vec<(String, Sharding)>> {
        let unknown =
            |name: &str| FrontendError::UnknownShardParam { policy: self.to_string(), name: name.to_string() };
        // Names the policy refers to must exist.
        match self {
            ShardPolicy::TensorParallel { column, row, .. } | ShardPolicy::FsdpTp { column, row, .. } => {
                for linear in column.iter().chain(row) {
                    if store.get(&format!("{linear}.weight")).is_none() {
                        return Err(unknown(&format!("{linear}.weight")));
                    }
                }
            }
            ShardPolicy::Explicit(list) => {
                for (name, _) in list {
                    if store.get(name).is_none() {
                        return Err(unknown(name));
                    }
                }
            }
            ShardPolicy::Replicated | ShardPolicy::Fsdp { .. } => {}
        }
        let mut out = Vec::with_capacity(store.len());
        for (name, t) in store.iter() {
            let s = self.sharding_of(name, t.ty(), mesh)?;
            s.check(&format!("{name} ({})", t.ty()), t.ty(), mesh)?;
            out.push((name.to_string(), s));
        }
        Ok(out)
    }

    /// The sharding parameter `name` of type `ty` gets (not checked; see
    /// [`ShardPolicy::shardings`]).
    pub fn sharding_of(&self, name: &str, ty: &TensorType, mesh: &Mesh) -> Result<Sharding> {
        let rank = ty.shape.dims().len();
        let tp = |axis: &str, column: &[String], row: &[String]| -> Sharding {
            let linear = name.strip_suffix(".weight").or_else(|| name.strip_suffix(".bias"));
            let is_weight = name.ends_with(".weight");
            match linear {
                Some(l) if column.iter().any(|c| c == l) => {
                    // Flat output features (weight `[in, out]`, bias `[out]`)
                    // split whole; shaped ones (`[in, 3, heads, head_dim]`,
                    // `[3, heads, head_dim]`) on the heads, the second to last
                    // dimension, so every device holds whole heads of q, k and
                    // v alike.
                    let flat = if is_weight { rank == 2 } else { rank == 1 };
                    let dim = if flat { rank.saturating_sub(1) } else { rank.saturating_sub(2) };
                    Sharding::split(rank, dim, axis)
                }
                Some(l) if row.iter().any(|r| r == l) && is_weight && rank == 2 => Sharding::split(2, 0, axis),
                _ => Sharding::replicated(rank),
            }
        };
        let fsdp = |mut s: Sharding, axis: &str| -> Sharding {
            let Some(size) = mesh.axis_size(axis) else { return s };
            if size == 1 {
                return s;
            }
            let dims = ty.shape.dims();
            // The largest whole dimension the axis divides (first on ties).
            let pick = (0..rank)
                .filter(|&d| s.dims[d].is_none())
                .filter(|&d| {
                    let tiles = s.dims[d].as_deref().and_then(|a| mesh.axis_size(a)).unwrap_or(1);
                    (dims[d] / tiles) % size == 0 && dims[d] >= size
                })
                .max_by(|&a, &b| dims[a].cmp(&dims[b]).then(b.cmp(&a)));
            if let Some(d) = pick {
                s.dims[d] = Some(axis.to_string());
            }
            s
        };
        Ok(match self {
            ShardPolicy::Replicated => Sharding::replicated(rank),
            ShardPolicy::Fsdp { axis } => fsdp(Sharding::replicated(rank), axis),
            ShardPolicy::TensorParallel { axis, column, row } => tp(axis, column, row),
            ShardPolicy::FsdpTp { data, model, column, row } => fsdp(tp(model, column, row), data),
            ShardPolicy::Explicit(list) => list
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
                .unwrap_or_else(|| Sharding::replicated(rank)),
        })
    }
}

/// Shards `store`'s parameters by `policy` over the active mesh. Optimizer
/// state made afterwards from the parameters takes their shardings.
pub fn apply(policy: &ShardPolicy, store: &ParamStore) -> Result<()> {
    let mesh = mesh()?.ok_or_else(|| FrontendError::BadMesh {
        spec: String::new(),
        reason: format!("shard policy {policy} needs a mesh (kiln::shard::set_mesh or KILN_MESH)"),
    })?;
    let shardings = policy.shardings(store, &mesh)?;
    for (name, s) in shardings {
        let t = store.get(&name).expect("shardings lists the store's own names");
        t.set_sharding(s)?;
    }
    Ok(())
}

/// Sets the policy the built-in models apply to their parameters when they
/// are created under a mesh (`kiln train gpt --shard`).
pub fn set_policy(policy: Option<PolicyKind>) {
    settings::with(|s| s.shard_policy = policy);
}

impl PolicyKind {
    pub fn for_store(self, store: &ParamStore) -> ShardPolicy {
        match self {
            PolicyKind::Replicated => ShardPolicy::Replicated,
            PolicyKind::Fsdp => ShardPolicy::fsdp(),
            PolicyKind::TensorParallel => ShardPolicy::tensor_parallel(store),
            PolicyKind::FsdpTp => ShardPolicy::fsdp_tp(store),
        }
    }
}

/// Applies the policy set by [`set_policy`] (none: nothing) to `store`.
pub fn apply_active(store: &ParamStore) -> Result<()> {
    let Some(kind) = settings::with(|s| s.shard_policy) else { return Ok(()) };
    if mesh()?.is_none() {
        return Ok(());
    }
    apply(&kind.for_store(store), store)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::DType;

    #[test]
    fn tensor_parallelism_splits_the_fused_qkv_on_its_heads() {
        let m = Mesh::new(&[("data", 2), ("model", 2)]).unwrap();
        let ty = |dims: &[usize]| TensorType::new(DType::F32, dims.to_vec());
        let (column, row) = (vec!["h0.attn.qkv".to_string()], vec!["h0.attn.proj".to_string()]);
        let tp = ShardPolicy::TensorParallel { axis: "model".into(), column: column.clone(), row: row.clone() };
        let of = |p: &ShardPolicy, name: &str, dims: &[usize]| p.sharding_of(name, &ty(dims), &m).unwrap().to_string();
        // Shaped output features: the heads dimension (weight 2, bias 1).
        assert_eq!(of(&tp, "h0.attn.qkv.weight", &[64, 3, 4, 16]), "[_, _, model, _]");
        assert_eq!(of(&tp, "h0.attn.qkv.bias", &[3, 4, 16]), "[_, model, _]");
        // Flat ones (a user's [in, 3·dim] Linear of that name): whole output features.
        assert_eq!(of(&tp, "h0.attn.qkv.weight", &[64, 192]), "[_, model]");
        assert_eq!(of(&tp, "h0.attn.qkv.bias", &[192]), "[model]");
        assert_eq!(of(&tp, "h0.attn.proj.weight", &[64, 64]), "[model, _]");
        assert_eq!(of(&tp, "h0.attn.proj.bias", &[64]), "[_]");
        // FSDP×TP: data on the largest dimension left.
        let both = ShardPolicy::FsdpTp { data: "data".into(), model: "model".into(), column, row };
        assert_eq!(of(&both, "h0.attn.qkv.weight", &[64, 3, 4, 16]), "[data, _, model, _]");
        assert_eq!(of(&both, "h0.attn.qkv.bias", &[3, 4, 16]), "[_, model, data]");
        // Heads that do not divide the axis: refused, naming the dimension.
        let m3 = Mesh::new(&[("model", 3)]).unwrap();
        let s = tp.sharding_of("h0.attn.qkv.weight", &ty(&[48, 3, 4, 12]), &m3).unwrap();
        let e = s.check("h0.attn.qkv.weight", &ty(&[48, 3, 4, 12]), &m3).unwrap_err().to_string();
        assert!(e.contains("dimension 2") && e.contains("size 4") && e.contains("model (size 3)"), "{e}");
    }
}
