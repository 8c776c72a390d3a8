//! Composites: multi-op patterns that a backend runs as one fused kernel.
//!
//! Two halves (design in `docs/composites.md`):
//! - [`fuse`] finds patterns written with plain ops and turns each into one
//!   composite op in place (the pattern's last node becomes the composite; the
//!   rest is left for dead-code elimination). It runs on the recorded forward
//!   before autodiff, so the backward is built from the composite's own rule and
//!   never materialises what the fused kernel keeps on chip.
//! - [`expand`] is the inverse, run by lowering: every composite the target
//!   cannot run fused becomes its plain expansion again, and each decision is
//!   reported with its reason.
//!
//! Invariants: both are pure functions of the graph (and target); `fuse` keeps
//! every existing `ValueId` valid and typed as before; `expand` preserves
//! parameters, outputs and aliases.

pub mod attention;
pub mod consts;
mod layer_norm;
mod lm_head;
pub mod loss;
pub mod norms;

pub use consts::ConstCache;
pub use loss::LossOptions;

use crate::ir::{DType, Graph, NodeId, Op, ValueId};
use crate::target::LowerTarget;
use crate::CompileError;

/// One composite made by [`fuse`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The composite op's name (`attention`).
    pub kind: &'static str,
    /// The node that now holds the composite.
    pub node: NodeId,
    /// The composite op it holds (its operands and attributes).
    pub op: Op,
    /// The plain nodes it stands for (now unused), in increasing order.
    pub replaced: Vec<NodeId>,
}

/// A candidate [`fuse`] looked at and left plain: the node it would have
/// replaced, the composite it looked like and why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missed {
    pub kind: &'static str,
    pub node: NodeId,
    pub reason: String,
}

/// What [`fuse`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fused {
    pub found: Vec<Found>,
    pub missed: Vec<Missed>,
}

/// What [`fuse`] needs from its caller besides the graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuseOptions {
    /// How a found LM-head loss sizes its row blocks and shards.
    pub loss: LossOptions,
}

/// Rewrites every recognised pattern of `g` into its composite, in place:
/// attention, layer and RMS norms, the LM head's cross-entropy. `cache`
/// remembers the constants the matchers evaluated (keep one per process:
/// the search then costs O(nodes) per step).
pub fn fuse(g: &mut Graph, cache: &mut ConstCache, opts: FuseOptions) -> Result<Fused, CompileError> {
    let mut out = Fused::default();
    let (attentions, missed) = attention::find(g, cache);
    out.missed.extend(missed.into_iter().map(|(node, reason)| Missed { kind: "attention", node, reason }));
    for m in attentions {
        g.replace_op(m.root, m.op.clone())?;
        out.found.push(Found { kind: "attention", node: m.root, op: m.op, replaced: m.replaced });
    }
    for m in norms::find(g, cache) {
        g.replace_op(m.root, m.op.clone())?;
        out.found.push(Found { kind: m.op.name(), node: m.root, op: m.op, replaced: m.replaced });
    }
    let (losses, missed) = loss::find(g, opts.loss);
    out.missed.extend(missed.into_iter().map(|(node, reason)| Missed { kind: "lm_head_cross_entropy", node, reason }));
    for m in losses {
        g.replace_op(m.root, m.op.clone())?;
        out.found.push(Found { kind: "lm_head_cross_entropy", node: m.root, op: m.op, replaced: m.replaced });
    }
    Ok(out)
}

/// Tokens per block of kiln's `nn::lm_head_cross_entropy_blocks`: as many as fit in
/// `block_bytes` of f32 logits over `vocab` columns, rounded down to a
/// multiple of [`LM_HEAD_BLOCK_ALIGN`] when at least that many fit, and at
/// least one. A block's row count is the M of its logits and dh GEMMs and the
/// K of its dw GEMM: gpt2-small's 394 MiB blocks held 2053 rows, which cuBLAS
/// runs only padded or unaligned. On the H100 (`benches/RESULTS.md`, "The LM
/// head's running dw and block rows") 2048 rows took the fused loss loop alone
/// from 4.53 to 4.37 ms in JAX, and kiln's step 0.05 ms of cuBLAS time, within
/// the spread between processes.
pub fn lm_head_block_rows(block_bytes: u64, vocab: usize) -> usize {
    let rows = (block_bytes / (4 * vocab.max(1) as u64)).max(1) as usize;
    if rows >= LM_HEAD_BLOCK_ALIGN {
        rows - rows % LM_HEAD_BLOCK_ALIGN
    } else {
        rows
    }
}

/// The multiple [`lm_head_block_rows`] rounds to: whole 64-row GEMM tiles,
/// and a dw GEMM whose K keeps cuBLAS's 16-byte alignment in bf16.
pub const LM_HEAD_BLOCK_ALIGN: usize = 64;

/// Whether a composite runs fused on the target, and if not, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub node: NodeId,
    pub kind: &'static str,
    /// `Ok` when lowered to the fused kernel; `Err(reason)` when expanded.
    pub fused: Result<(), String>,
}

/// Whether node `id` (a composite) can lower to the target's fused kernel.
pub fn fusable(g: &Graph, id: NodeId, target: LowerTarget) -> Result<(), String> {
    let op = &g.node(id).op;
    let (q, v, bias, mask) = match op {
        Op::Attention { q, v, bias, mask, .. } | Op::AttentionGrad { q, v, bias, mask, .. } => (*q, *v, bias, *mask),
        Op::LayerNorm { .. } | Op::LayerNormGrad { .. } | Op::RmsNorm { .. } | Op::RmsNormGrad { .. } => {
            return Err("no fused norm kernel: XLA fuses the expansion".into())
        }
        Op::LmHeadCrossEntropy { chunk, .. }
        | Op::LmHeadCrossEntropyGrad { chunk, .. }
        | Op::LmHeadCrossEntropyFused { chunk, .. } => {
            return Err(format!("lowered as plain ops in blocks of {chunk} tokens on every target"))
        }
        other => return Err(format!("`{}` is not a composite", other.name())),
    };
    if target != LowerTarget::Cuda {
        return Err(format!("the {target:?} target has no fused attention kernel (cuDNN is CUDA only)"));
    }
    let t = g.ty(q);
    if !matches!(t.dtype, DType::BF16 | DType::F16) {
        return Err(format!("cuDNN flash attention takes bf16 or f16, not {}", t.dtype));
    }
    let d = t.shape.dims()[3];
    if d % 8 != 0 || d > 128 {
        return Err(format!("cuDNN flash attention needs a head size that is a multiple of 8 up to 128, not {d}"));
    }
    let (tq, s) = (t.shape.dims()[2], g.ty(v).shape.dims()[2]);
    let biased = !bias.is_empty() || mask.is_some();
    if biased && (tq % 2 != 0 || s % 2 != 0) {
        return Err(format!("cuDNN flash attention with a bias or mask needs even sequence lengths, not {tq} x {s}"));
    }
    if let Op::AttentionGrad { .. } = op {
        let read = |k: usize| g.users(id).iter().any(|&u| g.node(u).op.inputs().contains(&ValueId::new(id, k as u32)));
        let wants_dbias = (3..3 + bias.len()).any(read) || g.outputs().iter().any(|o| o.node == id && o.output >= 3);
        let shape = attention::cudnn_bias_shape(g, q, bias, mask);
        if wants_dbias && shape.as_ref().is_some_and(|s| s[0] != 1 || s[1] != t.shape.dims()[1]) {
            return Err(format!(
                "cuDNN returns a bias gradient only for a [1, heads, t, s] bias, not {:?} (bias and mask together)",
                shape.unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// Every composite of `g` with its decision for `target`, in node order.
pub fn decisions(g: &Graph, target: LowerTarget) -> Vec<Decision> {
    g.nodes()
        .filter(|(_, n)| is_composite(&n.op))
        .map(|(id, n)| Decision { node: id, kind: n.op.name(), fused: fusable(g, id, target) })
        .collect()
}

/// Whether `op` is a composite ([`crate::ir::OpProps::composite`]).
pub fn is_composite(op: &Op) -> bool {
    op.props().composite
}

/// `g` with every composite that `target` cannot run fused replaced by its
/// plain expansion. Returns `g` unchanged (cloned) when there is none.
pub fn expand(g: &Graph, target: LowerTarget) -> Result<Graph, CompileError> {
    let todo: Vec<bool> = g.nodes().map(|(id, n)| is_composite(&n.op) && fusable(g, id, target).is_err()).collect();
    // Fused attentions are rewritten too, into the cuDNN lowering's form.
    let fused = g.nodes().any(|(_, n)| matches!(n.op, Op::Attention { .. } | Op::AttentionGrad { .. }));
    if !todo.iter().any(|&t| t) && !fused {
        return Ok(g.clone());
    }
    let guard = !target.keeps_barriers();
    let mut out = Graph::new();
    let mut map: Vec<Vec<ValueId>> = Vec::with_capacity(g.len());
    for (id, node) in g.nodes() {
        let mut o = node.op.clone();
        o.map_inputs(|v| map[v.node.index()][v.output as usize]);
        let values: Vec<ValueId> = match (todo[id.index()], o) {
            (true, Op::Attention { q, k, v, bias, mask, attrs }) => {
                let a = attention::Operands { q, k, v, bias, mask, attrs };
                attention::expand_forward(&mut out, &a)?.to_vec()
            }
            (true, Op::AttentionGrad { q, k, v, bias, mask, out: o, stats, dout, attrs }) => {
                let a = attention::Operands { q, k, v, bias, mask, attrs };
                let saved = attention::Saved { out: o, stats, dout };
                attention::expand_backward(&mut out, &a, saved, guard)?
            }
            (false, Op::Attention { q, k, v, bias, mask, attrs }) => {
                let a = attention::Operands { q, k, v, bias, mask, attrs };
                attention::prepare_forward(&mut out, &a)?.to_vec()
            }
            (false, Op::AttentionGrad { q, k, v, bias, mask, out: o, stats, dout, attrs }) => {
                let a = attention::Operands { q, k, v, bias, mask, attrs };
                attention::prepare_backward(&mut out, &a, attention::Saved { out: o, stats, dout })?
            }
            (true, Op::LayerNorm { x, gamma, beta, eps_bits }) => {
                layer_norm::expand_forward(&mut out, x, gamma, beta, f64::from_bits(eps_bits))?.to_vec()
            }
            (true, Op::LayerNormGrad { x, gamma, mean, rstd, dy }) => {
                layer_norm::expand_backward(&mut out, x, gamma, mean, rstd, dy)?.to_vec()
            }
            (true, Op::RmsNorm { x, gamma, eps_bits }) => {
                layer_norm::expand_rms_forward(&mut out, x, gamma, f64::from_bits(eps_bits))?.to_vec()
            }
            (true, Op::RmsNormGrad { x, gamma, rstd, dy }) => {
                layer_norm::expand_rms_backward(&mut out, x, gamma, rstd, dy)?.to_vec()
            }
            (true, Op::LmHeadCrossEntropy { h, w, labels, chunk, shards }) => {
                lm_head::expand_forward(&mut out, h, w, labels, lm_head::Rows { chunk, shards }, guard)?.to_vec()
            }
            (true, Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, chunk, shards }) => {
                let rows = lm_head::Rows { chunk, shards };
                lm_head::expand_backward(&mut out, h, w, labels, lse, dnll, rows, guard)?.to_vec()
            }
            (true, Op::LmHeadCrossEntropyFused { h, w, labels, scale, chunk, shards }) => {
                let rows = lm_head::Rows { chunk, shards };
                lm_head::expand_fused(&mut out, h, w, labels, scale, rows, guard)?.to_vec()
            }
            (_, o) => {
                let n = out.add(o)?;
                (0..node.outputs.len() as u32).map(|k| ValueId::new(n, k)).collect()
            }
        };
        map.push(values);
    }
    out.set_outputs(g.outputs().iter().map(|v| map[v.node.index()][v.output as usize]).collect())?;
    for &a in g.aliases() {
        out.add_alias(a)?;
    }
    Ok(out)
}
