//! Host offload: keeping a saved activation in pinned host memory between its
//! forward write and its backward read, the choice for values whose
//! recomputation is dear (matmul and attention outputs).
//!
//! XLA's form (what JAX emits for `memory_kind="pinned_host"`, printed by JAX
//! on the H100 on 2026-11-23): `stablehlo.custom_call
//! @annotate_device_placement(%v) {has_side_effect = true,
//! mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}}` after
//! the write, and the same call with `"device"` before the read, the host copy
//! passing through an `optimization_barrier` in between.
//!
//! Status: the strategy is typed and always answers unavailable, naming why
//! for the target (see [`HostOffload::unavailable_reason`]). The XLA CPU
//! plugin has no host memory space and refuses the annotation. On the CUDA
//! plugin (H100 trial, `runtime/examples/host_offload.rs`, docs/memory.md)
//! XLA moves the value to host memory only in JAX's form, and there the
//! trial's device temp doubled (100.7 MB -> 201.3 MB) while 64 MiB went to
//! the host: a plan choice needs the lowering to emit the annotations and
//! the peak model to price the copies, neither of which exists yet.
//!
//! Invariants: planning with this strategy never returns a graph; it returns
//! [`CompileError::Remat`] with strategy `host-offload`.

use crate::ir::Graph;
use crate::lower::LowerTarget;
use crate::CompileError;

use super::remat::{RematOptions, RematPlan, RematStrategy};

/// Offload saved activations to pinned host memory (unavailable: see the
/// module docs).
#[derive(Clone, Copy, Debug)]
pub struct HostOffload {
    /// The target the planned program is lowered for.
    pub target: LowerTarget,
}

impl HostOffload {
    /// Why the strategy cannot run on its target, as measured.
    pub fn unavailable_reason(&self) -> &'static str {
        match self.target {
            LowerTarget::Cpu => {
                "the XLA CPU plugin has no host memory space: a program with XLA's \
                 `annotate_device_placement` annotation fails to compile (NOT_FOUND: No registered \
                 implementation for untyped custom call to annotate_device_placement for Host)"
            }
            LowerTarget::Cuda => {
                "kiln's lowering does not emit XLA's host-offload annotations; in a trial program on the \
                 H100 the CUDA plugin offloaded a 64 MiB activation only in JAX's form (through an \
                 optimization_barrier) and its device temp rose from 100.7 MB to 201.3 MB \
                 (docs/memory.md)"
            }
        }
    }
}

impl RematStrategy for HostOffload {
    fn name(&self) -> &'static str {
        "host-offload"
    }

    fn plan(&self, _g: &Graph, _opts: &RematOptions) -> Result<RematPlan, CompileError> {
        Err(CompileError::Remat { strategy: self.name(), reason: self.unavailable_reason().to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{rematerialize, EveryNodeAKernel, RematBudget};

    #[test]
    fn host_offload_is_a_typed_unavailable_error_on_every_target() {
        let mut g = Graph::new();
        let p = g.parameter(crate::ir::TensorType::new(crate::ir::DType::F32, [4]));
        g.set_outputs(vec![p]).unwrap();
        let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        for target in [LowerTarget::Cpu, LowerTarget::Cuda] {
            match rematerialize(&g, &HostOffload { target }, &opts) {
                Err(CompileError::Remat { strategy: "host-offload", reason }) => {
                    assert!(reason.contains("annotate_device_placement") || reason.contains("annotations"), "{reason}")
                }
                other => panic!("{target:?}: {:?}", other.map(|p| p.strategy)),
            }
        }
    }
}
