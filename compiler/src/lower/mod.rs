//! Lowering of a [`Graph`] to StableHLO MLIR text, the last stage of the
//! compiler pipeline (after fusion and remat); the runtime hands the text to
//! XLA through PJRT.
//!
//! The module has one public function `@main` whose arguments are the graph's
//! parameters in order (`%arg0`, `%arg1`, ...) and whose results are the
//! graph's outputs in order. Donated parameters carry
//! `{tf.aliasing_output = <output> : i32}`.
//!
//! Invariants:
//! - Deterministic: the text depends only on the graph's structure and the
//!   options; nodes are visited in insertion order, no hash-map order anywhere.
//!   Snapshots and the compile cache key rely on byte-identical output.
//! - Only nodes reachable from the outputs are emitted ([`live`]); the graph
//!   is not mutated.
//! - One op per line; a node's result is `%v<id>`, multi-result nodes define
//!   `%v<id>:<n>` and are used as `%v<id>#<k>`. Helper values an op needs (init
//!   constants, converted indices) are named `%v<id>_<role>`, so names never
//!   collide and stay traceable to the node.
//! - Pretty StableHLO forms where XLA's parser (StableHLO 1.13) accepts them;
//!   ops with regions or structured attributes (`gather`, `scatter`,
//!   `all_reduce`) use the generic form with a `<{...}>` property dictionary.

mod cudnn;
mod dense;
pub use dense::{constant_form, ConstantForm, LARGE_CONSTANT_BYTES};
mod emit;
mod emit_attention;
mod guard;
pub use guard::{division_trap, DivisionTrap};
pub(crate) mod live;
pub(crate) mod loop_kernel;
mod prepare;
mod ttir;

pub use prepare::{prepare, Prepared, TARGET_PASSES};

use crate::ir::{Graph, TensorType};
use crate::target::LowerTarget;
use crate::CompileError;

/// Options that change the module's text (and therefore the compile key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LowerOptions {
    /// Number of replicas the program runs on (data parallelism). Written as
    /// `mhlo.num_replicas` and used as the single replica group of every
    /// `all_reduce`. At least 1; the runtime must compile with the same count.
    pub num_replicas: usize,
    /// The backend the module is for: composites lower to fused kernels only
    /// where the target has them ([`crate::composite::expand`]).
    pub target: LowerTarget,
    /// SPMD partitioning: `None` is one partition. `Some` writes
    /// `mhlo.num_partitions` and an `mhlo.sharding` on every argument and
    /// result of `@main`; XLA's SPMD partitioner does the rest.
    pub shardings: Option<ModuleShardings>,
    /// On the CUDA target, run each column sum and the elementwise work
    /// around it as a Triton kernel of kiln's own where that work recomputes
    /// a transcendental ([`loop_kernel`]); off, XLA fuses it. On by default;
    /// ignored on the CPU and with shardings.
    pub loop_kernels: bool,
}

/// The shardings of a partitioned module, in XLA's HLO sharding text
/// (`{replicated}`, `{devices=[4,1]0,1,2,3}`, `... last_tile_dim_replicate}`):
/// the lowering writes them as given; the frontend derives them from its mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModuleShardings {
    /// Partitions (devices) per replica; at least 1.
    pub num_partitions: usize,
    /// One per graph parameter, in order.
    pub params: Vec<String>,
    /// One per graph output, in order.
    pub outputs: Vec<String>,
    /// How the CUDA target's cuDNN attention calls split over the devices;
    /// `None` runs them as the partitioner decides.
    pub attention: Option<AttentionSplit>,
}

/// XLA's SPMD partitioner does not partition the cuDNN attention custom
/// calls: it gathers their operands and runs each call whole on every
/// device (`docs/sharding.md`). With a split, the CUDA lowering runs each
/// call on one device's shard instead, inside a manual region (`@Sharding`
/// and `@SPMDFullToShardShape` on the operands, `@SPMDShardToFullShape` on
/// the results): attention is independent across batch elements and heads,
/// so any split of those two dimensions computes the same values.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttentionSplit {
    /// Parts the batch dimension splits into.
    pub batch: usize,
    /// Parts the heads dimension splits into.
    pub heads: usize,
    /// HLO sharding text of a `[batch, seq, heads, head_dim]` operand.
    pub btnh: String,
    /// Of a `[batch, heads, seq, head_dim]` result.
    pub bnth: String,
    /// Of the `[batch, heads, seq]` statistics.
    pub bnt: String,
}

impl AttentionSplit {
    fn shard(t: &TensorType, parts: &[usize]) -> TensorType {
        let dims = t.shape.dims().iter().zip(parts.iter().chain(std::iter::repeat(&1))).map(|(d, p)| d / p);
        TensorType::new(t.dtype, dims.collect::<Vec<_>>())
    }

    /// One device's part of a `[batch, seq, heads, head_dim]` value.
    pub(crate) fn btnh_shard(&self, t: &TensorType) -> TensorType {
        Self::shard(t, &[self.batch, 1, self.heads])
    }

    /// Of a `[batch, heads, ...]` value: the results and the statistics.
    pub(crate) fn bn_shard(&self, t: &TensorType) -> TensorType {
        Self::shard(t, &[self.batch, self.heads])
    }
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions { num_replicas: 1, target: LowerTarget::Cpu, shardings: None, loop_kernels: true }
    }
}

/// Lowers `g` to the text of a StableHLO module XLA can compile: the target
/// preparation ([`prepare`]) without verifying or observing, then [`print`].
pub fn lower(g: &Graph, opts: &LowerOptions) -> Result<String, CompileError> {
    print(&prepare(g, opts, false, &mut |_, _| {})?)
}

/// The text of a prepared module. Printing changes nothing: every transform
/// ran in [`prepare`], where the verifier and the dump see it.
pub fn print(p: &Prepared) -> Result<String, CompileError> {
    emit::module(p)
}

#[cfg(test)]
mod tests {
    use crate::target::LowerTarget;

    /// Only a planned program with collectives on CUDA is held to its order.
    #[test]
    fn a_plan_keeps_its_order_where_cuda_meets_collectives() {
        assert!(LowerTarget::Cuda.keeps_plan_order(true, true));
        for (planned, collectives) in [(true, false), (false, true), (false, false)] {
            assert!(!LowerTarget::Cuda.keeps_plan_order(planned, collectives));
        }
        for (planned, collectives) in [(true, true), (true, false), (false, true), (false, false)] {
            assert!(!LowerTarget::Cpu.keeps_plan_order(planned, collectives));
        }
    }
}
