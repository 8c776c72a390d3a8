//! XLA's cuDNN fused-attention custom calls, as the CUDA PJRT plugin accepts
//! them (the operand/result layout and the config fields JAX 0.11.2 emits for
//! `jax.nn.dot_product_attention(..., implementation="cudnn")`, seen on the H100
//! on 2026-11-23; `docs/composites.md`).
//!
//! The calls take q, k, v in `[batch, seq, heads, head_dim]` (BTNH) with the
//! default layout and return `[batch, heads, seq, head_dim]` (BNTH) results whose
//! physical layout is BTNH (`minor_to_major [3, 1, 2, 0]`). kiln's composite
//! works in BNTH, so the lowering transposes the operands and uses the results as
//! they are. The backward takes q, k, v, the statistics, dout, out (in that
//! order). Each call also returns a zero-sized u8 workspace, unused.

use crate::ir::{AttentionAttrs, DType, KvHeads, NodeId, TensorType, ValueId};
use crate::CompileError;

/// The forward call, with or without a bias operand.
pub(super) fn forward_target(bias: bool) -> &'static str {
    if bias {
        "__cudnn$fmhaScaleBiasSoftmax"
    } else {
        "__cudnn$fmhaSoftmax"
    }
}

/// The backward call, with or without a bias operand.
pub(super) fn backward_target(bias: bool) -> &'static str {
    if bias {
        "__cudnn$fmhaScaleBiasSoftmaxBackward"
    } else {
        "__cudnn$fmhaSoftmaxBackward"
    }
}

/// Whether the backward returns the bias's gradient: only for a bias of one
/// batch entry and every query head (`[1, hq, t, s]`), as JAX asks it.
pub(super) fn exports_dbias(bias: &TensorType, q_bnth: &TensorType) -> bool {
    let (b, q) = (bias.shape.dims(), q_bnth.shape.dims());
    b[0] == 1 && b[1] == q[1]
}

/// Refuses an attention that `composite::expand` did not put in the form
/// these calls take: `k` as `[b, hkv, s, d]`, grouped heads, at most one bias
/// `[b|1, h|1, t, s]` of q's dtype, no mask.
pub(super) fn check_prepared(
    id: NodeId,
    q: &TensorType,
    v: &TensorType,
    bias: &[ValueId],
    mask: Option<ValueId>,
    attrs: AttentionAttrs,
) -> Result<(), CompileError> {
    let tiled = attrs.kv_heads == KvHeads::Tiled && q.shape.dims()[1] != v.shape.dims()[1];
    if bias.len() > 1 || mask.is_some() || attrs.k_transposed || tiled {
        return Err(CompileError::Verify {
            node: id.to_string(),
            reason: "an attention reached the cuDNN lowering unprepared (composite::expand prepares it)".into(),
        });
    }
    Ok(())
}

/// `minor_to_major` of a BNTH result stored as BTNH.
pub(super) const BNTH_AS_BTNH: &str = "dense<[3, 1, 2, 0]> : tensor<4xindex>";
pub(super) const WORKSPACE: &str = "tensor<0xui8>";

/// A dot's dimension numbers as the config spells them (numbers as strings).
fn dims(lc: usize, rc: usize, lb: [usize; 2], rb: [usize; 2]) -> String {
    format!(
        "{{\"lhs_contracting_dimensions\": [\"{lc}\"], \"rhs_contracting_dimensions\": [\"{rc}\"], \
         \"lhs_batch_dimensions\": [\"{}\", \"{}\"], \"rhs_batch_dimensions\": [\"{}\", \"{}\"]}}",
        lb[0], lb[1], rb[0], rb[1]
    )
}

/// The `backend_config` attribute's string (MLIR-escaped JSON) for `q: [b, h, t, d]`
/// (BNTH) and `s` keys.
pub(super) fn backend_config(q: &TensorType, s: usize, attrs: AttentionAttrs, backward: bool) -> String {
    let d = q.shape.dims();
    let element = match q.dtype {
        DType::F16 => "F16",
        _ => "BF16",
    };
    // Operands are BTNH: batch dims [0, 2] and head_dim 3 for q, k, v; the
    // probabilities are BNTS: batch dims [0, 1].
    let bmm = if backward {
        format!(
            "\"bmm1_grad_gemm1_dot_dimension_numbers\": {}, \"bmm1_grad_gemm2_dot_dimension_numbers\": {}, \
             \"bmm2_grad_gemm1_dot_dimension_numbers\": {}, \"bmm2_grad_gemm2_dot_dimension_numbers\": {}",
            dims(2, 1, [0, 1], [0, 2]),
            dims(3, 1, [0, 1], [0, 2]),
            dims(2, 1, [0, 1], [0, 2]),
            dims(3, 3, [0, 2], [0, 2]),
        )
    } else {
        format!(
            "\"bmm1_dot_dimension_numbers\": {}, \"bmm2_dot_dimension_numbers\": {}",
            dims(3, 3, [0, 2], [0, 2]),
            dims(3, 1, [0, 1], [0, 2]),
        )
    };
    let json = format!(
        "{{\"operation_queue_id\": \"0\", \"cudnn_fmha_backend_config\": {{\"algorithm\": {{\"algo_id\": \"0\", \
         \"math_type\": \"TENSOR_OP_MATH\", \"tuning_knobs\": {{\"17\": \"1\", \"24\": \"0\"}}, \
         \"is_cudnn_frontend\": true, \"workspace_size\": \"0\"}}, \"fmha_scale\": {scale:?}, \
         \"intermediate_tensor_shape\": {{\"element_type\": \"{element}\", \"dimensions\": [\"{}\", \"{}\", \"{}\", \"{s}\"], \
         \"tuple_shapes\": [], \"layout\": {{\"dim_level_types\": [], \"dim_unique\": [], \"dim_ordered\": [], \
         \"minor_to_major\": [\"3\", \"2\", \"1\", \"0\"], \"tiles\": [], \"element_size_in_bits\": \"0\", \
         \"memory_space\": \"0\", \"index_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \
         \"pointer_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \"dynamic_shape_metadata_prefix_bytes\": \"0\"}}, \
         \"is_dynamic_dimension\": [false, false, false, false]}}, \"is_flash_attention\": true, \
         \"mask_type\": \"{mask}\", {bmm}, \"dropout_rate\": 0.0, \"seed\": 42, \"sliding_window_length\": 0, \
         \"max_seg_per_batch\": 1, \"is_paged_attention\": false}}}}",
        d[0],
        d[1],
        d[2],
        scale = attrs.scale(),
        mask = if attrs.causal { "CAUSAL" } else { "NO_MASK" },
    );
    super::emit::mlir_escape(&json)
}

/// BTNH type of a BNTH operand.
pub(super) fn btnh(t: &TensorType) -> TensorType {
    let d = t.shape.dims();
    TensorType::new(t.dtype, vec![d[0], d[2], d[1], d[3]])
}
