//! The peak-memory model: what a step needs on the device, split the way XLA
//! reports compiled memory (arguments, outputs, temporaries).
//!
//! Invariants:
//! - `peak_bytes = argument_bytes + constant_bytes + max over positions of
//!   (live temporaries + outputs already written)`; the position of that
//!   maximum is `peak_position`.
//! - An output written into a donated argument's buffer adds nothing to the
//!   peak; it counts in `output_bytes` and `alias_bytes`, as in XLA's stats.
//! - `temp_peak_bytes` is the largest sum of temporaries (kernels' scratch
//!   included) live at one position,
//!   a lower bound on an allocator that packs them perfectly (XLA's heap
//!   simulator can only do worse by fragmentation; it may do better only by
//!   choosing another order).
//! - `allocated_bytes` is what XLA's compiled memory stats count: its
//!   arguments, outputs less aliased ones, and temps (plus constants). Every
//!   output that is not donated is allocated for the whole run, and
//!   temporaries live in those allocations before the outputs are written
//!   where they fit (`Liveness::allocation`); `allocated_temp_bytes` is the
//!   rest, XLA's temp size. Plans are made on `peak_bytes` (what is live);
//!   the two differ on steps whose outputs are not donated (the CPU
//!   plugin's).

use crate::ir::Graph;

use super::{liveness, BufferKind, Liveness, Materialization};

/// A step's memory in one execution order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeakMemory {
    pub argument_bytes: u64,
    pub constant_bytes: u64,
    /// Every output, donated or not (XLA's output size).
    pub output_bytes: u64,
    /// Outputs written into donated arguments' buffers (XLA's alias size).
    pub alias_bytes: u64,
    pub temp_peak_bytes: u64,
    pub peak_bytes: u64,
    /// XLA's temp size by the model: temporaries outside outputs'
    /// allocations.
    pub allocated_temp_bytes: u64,
    /// XLA's arguments + outputs − aliased + temps by the model, plus
    /// constants.
    pub allocated_bytes: u64,
    /// Index into the execution order where `peak_bytes` is reached.
    pub peak_position: usize,
}

/// The peak memory of `g` when `fusion` decides which values reach memory.
pub fn peak_memory(g: &Graph, fusion: &dyn Materialization) -> PeakMemory {
    peak_of(&liveness(g, fusion))
}

pub fn peak_of(l: &Liveness) -> PeakMemory {
    let sum = |kind: BufferKind| l.buffers.iter().filter(|b| b.kind == kind).map(|b| b.bytes).sum::<u64>();
    let (peak_position, peak_bytes) = live_peak(l);
    let allocation = l.allocation();
    PeakMemory {
        allocated_temp_bytes: allocation.temp_bytes,
        allocated_bytes: allocation.total_bytes,
        argument_bytes: sum(BufferKind::Argument),
        constant_bytes: sum(BufferKind::Constant),
        output_bytes: sum(BufferKind::Output) + sum(BufferKind::Donated),
        alias_bytes: sum(BufferKind::Donated),
        temp_peak_bytes: l.temp_curve().into_iter().max().unwrap_or(0),
        peak_bytes,
        peak_position,
    }
}

/// `peak_of`'s `(peak_position, peak_bytes)` alone: what a plan's search
/// measures each candidate by, without the rest of the figures.
pub fn live_peak(l: &Liveness) -> (usize, u64) {
    l.live_curve().into_iter().enumerate().fold((0, 0), |best, (i, b)| if b > best.1 { (i, b) } else { best })
}
