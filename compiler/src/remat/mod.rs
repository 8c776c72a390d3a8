//! Rematerialization: recompute long-lived activations where they are read
//! again instead of keeping them, until the step's predicted peak fits a budget.
//!
//! Where it runs: last in [`crate::pipeline::optimize`] (after CSE and DCE),
//! when a budget is set. Its graph goes straight to lowering.
//!
//! The model. In the execution order ([`super::liveness`]), a value `v` whose
//! direct users fall into an early group and a late group separated by a long
//! idle stretch (in a training step: its forward users and the backward users
//! that autodiff made read it) is a candidate. Rematerializing it clones `v`'s
//! producer, and those of its operands that are no longer in memory at that
//! point (a chain, up to `max_chain_nodes`), just before the first late user;
//! late users read the clone, so `v`'s buffer dies after its early users.
//! Operands still in memory there (and parameters) are the chain's leaves.
//!
//! The fence. The leaves reach the clones only through one
//! `optimization_barrier`, which also takes one operand of the first late
//! user that is computed after the gap (usually a cotangent). XLA's CSE cannot
//! merge a clone with its original (their operands differ), and no scheduler
//! can hoist the recomputation above the point where the backward needs it.
//! Without the fence XLA merges the clones back and the memory returns (what
//! torch_xla's checkpointing lost).
//!
//! The barrier alone is not enough on XLA's CPU backend: its pipeline removes
//! barriers before a later CSE, which then merged the clones back (seen
//! 2026-11-23: gpt tiny's XLA temp unchanged at 7.27 MiB with 15 fenced
//! recomputations). So each fenced leaf is also read through the runtime
//! guard of [`crate::fence`], anchored on the barrier's anchor: the identity
//! bit for bit, which no simplifier can prove, so the clone's operands differ
//! from the original's after the barrier is gone, and the clone still waits
//! for the anchor.
//!
//! XLA CUDA keeps barriers through CSE but drops a barrier operand whose
//! result nothing reads (seen 2026-11-23 in the H100's optimized module: the
//! barrier of a recomputed residual add became a tuple without its anchor,
//! and the add ran before the LM-head loss, in the forward). So there every
//! reader of the anchor from the barrier on reads the barrier's pass-through
//! of it, which keeps the anchor in the barrier and the clones behind it
//! ([`LeafGuards::PassAnchor`]). A chain whose anchor nothing reads from
//! there on instead reads one guarded operand per *entry* (a clone that reads
//! no other clone; [`LeafGuards::Entries`]), as every clone then waits for
//! the anchor through its entries: a select on the smallest operand, which
//! fuses into an elementwise reader but is a copy kernel of its own before a
//! GEMM. (`RematOptions::guard_leaves`, set by the pipeline from the target.)
//!
//! Invariants:
//! - The rewrite computes the same values: clones are the same ops on the
//!   same (fenced) inputs, and a barrier passes values through unchanged, so
//!   the reference interpreter gives bit-identical outputs.
//! - Parameters, outputs and aliases keep their order and indices.
//! - Random-bit generators are never cloned (a second draw would differ),
//!   nor backward composites; they are leaves. A multi-output node (a forward
//!   composite) is cloned whole, and late readers of any of its outputs read
//!   the clone's.
//! - Every change is checked against the peak model: a candidate that does
//!   not lower the predicted peak (or the number of positions at it) is
//!   discarded, so the plan never predicts more memory than no plan.
//!
//! Layout, mechanism first: [`plan`] (the options, a plan and what every
//! strategy shares), [`chain`] (candidates and the rewrite that clones a
//! chain behind its fence), [`candidates`] (more candidates: block segments,
//! siblings; finishing rewrites: twin GEMMs, pinned kernels), [`strategy`]
//! (greedy, exact, host offload, host copies). Each imports only the layers
//! before it.

pub(crate) mod candidates;
pub(crate) mod chain;
pub(crate) mod plan;
mod strategy;
#[cfg(test)]
mod tests;

pub use chain::keeps_values_for_later;
pub use plan::{
    activation_budget_bytes, rematerialize, LeafGuards, RecomputeCost, RematBudget, RematChoice, RematOptions,
    RematPlan, RematStrategy, KERNEL_TRIES,
};
pub use strategy::{copies, Exact, Greedy, HostCopies, HostOffload, Off, StrategyKind, HOST_COPY_TRIP_SECONDS};
