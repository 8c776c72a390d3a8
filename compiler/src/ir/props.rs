//! What the passes ask of an op, answered in one place: one exhaustive table,
//! one row per `Op` variant and no default arm, so a new op must say what it is
//! before anything compiles (Cranelift's opcode queries, XLA's
//! `HasSideEffect`).
//!
//! Invariants: every answer is a function of the variant alone (not of its
//! attributes or operands); callers ask [`Op::props`] and never match on
//! variants for these questions themselves.

use super::Op;

/// How a node fuses with its neighbours (the fusion pass's grouping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FusionKind {
    /// Program inputs and literals: read by whoever needs them.
    Input,
    /// Elementwise arithmetic, comparisons, selects, converts.
    Elementwise,
    /// Broadcasts, reshapes, transposes, slices, pads, concatenations, iota.
    Movement,
    /// Reductions: fuse their producers, end their group.
    Reduction,
    /// Matrix products: fuse elementwise consumers (epilogues).
    Matmul,
    /// Runs as its own kernel (gathers, scatters, dynamic slices, RNG,
    /// barriers, collectives, composites).
    Opaque,
}

/// The properties of one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpProps {
    /// The same operands always give the same value (so CSE may merge two
    /// equal nodes): not a program input, a random draw or a collective,
    /// whose values depend on more than the operands.
    pub deterministic: bool,
    /// Communicates across replicas or partitions.
    pub collective: bool,
    /// Never merged with an op of equal operands and attributes: its value
    /// depends on more than those (the caller's inputs, the replica, a side
    /// channel), or it exists to keep values apart (a barrier, a placement).
    pub unique: bool,
    /// The remat pass may clone it: the same inputs give the same outputs
    /// and a second run is harmless. Forward composites are cloned whole;
    /// backward composites run once, late; unique ops never.
    pub clonable: bool,
    /// A composite (`docs/composites.md`): a fused kernel or its expansion.
    pub composite: bool,
    /// How it fuses.
    pub fusion: FusionKind,
    /// XLA emits it as one loop over the output elements.
    pub loop_fusible: bool,
    /// A kernel whose result may take the buffer of an operand that dies in it.
    pub in_place: bool,
}

impl OpProps {
    const fn new(fusion: FusionKind) -> OpProps {
        OpProps {
            deterministic: true,
            collective: false,
            unique: false,
            clonable: true,
            composite: false,
            fusion,
            loop_fusible: false,
            in_place: false,
        }
    }
    /// Elementwise and movement ops XLA loops over, which may write in place.
    const fn looped(fusion: FusionKind) -> OpProps {
        OpProps { loop_fusible: true, in_place: true, ..OpProps::new(fusion) }
    }
    const fn unique(fusion: FusionKind) -> OpProps {
        OpProps { unique: true, clonable: false, ..OpProps::new(fusion) }
    }
    const fn forward_composite() -> OpProps {
        OpProps { composite: true, ..OpProps::new(FusionKind::Opaque) }
    }
    const fn backward_composite() -> OpProps {
        OpProps { composite: true, clonable: false, ..OpProps::new(FusionKind::Opaque) }
    }
}

impl Op {
    /// This op's properties ([`OpProps`]).
    pub fn props(&self) -> OpProps {
        use FusionKind::{Elementwise, Input, Matmul, Movement, Opaque, Reduction};
        match self {
            Op::Parameter { .. } => OpProps { deterministic: false, ..OpProps::unique(Input) },
            Op::Constant { .. } => OpProps { loop_fusible: true, ..OpProps::new(Input) },
            Op::Iota { .. } => OpProps { loop_fusible: true, ..OpProps::new(Movement) },
            Op::Unary { .. }
            | Op::Binary { .. }
            | Op::Compare { .. }
            | Op::Select { .. }
            | Op::Clamp { .. }
            | Op::Convert { .. } => OpProps::looped(Elementwise),
            Op::BroadcastInDim { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Concatenate { .. }
            | Op::Pad { .. } => OpProps::looped(Movement),
            // A bitcast: never a buffer of its own.
            Op::Reshape { .. } => OpProps { loop_fusible: true, ..OpProps::new(Movement) },
            Op::Reduce { .. } => OpProps::new(Reduction),
            Op::DotGeneral { .. } => OpProps::new(Matmul),
            Op::DynamicSlice { .. } | Op::Gather { .. } => OpProps::new(Opaque),
            Op::DynamicUpdateSlice { .. } | Op::ScatterAdd { .. } => OpProps { in_place: true, ..OpProps::new(Opaque) },
            Op::RngBitGenerator { .. } => OpProps { deterministic: false, ..OpProps::unique(Opaque) },
            Op::AllReduce { .. } => OpProps { deterministic: false, collective: true, ..OpProps::unique(Opaque) },
            Op::OptimizationBarrier { .. } | Op::Place { .. } | Op::HostCopy { .. } => OpProps::unique(Opaque),
            // The identity with a sharding constraint: loops like a copy,
            // kept apart like a placement.
            Op::Whole { .. } => OpProps { loop_fusible: true, ..OpProps::unique(Opaque) },
            Op::Attention { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::LmHeadCrossEntropy { .. } => {
                OpProps::forward_composite()
            }
            Op::AttentionGrad { .. }
            | Op::LayerNormGrad { .. }
            | Op::RmsNormGrad { .. }
            | Op::LmHeadCrossEntropyGrad { .. }
            | Op::LmHeadCrossEntropyFused { .. } => OpProps::backward_composite(),
        }
    }
}
