//! The strategies that choose what to recompute (or move to the host):
//! [`Off`], [`Greedy`] by the cost model, [`Exact`] by an integer program,
//! [`HostOffload`] and [`HostCopies`] with the host link beside greedy.

mod exact;
mod greedy;
mod host_copies;
mod offload;

pub use exact::Exact;
pub use greedy::Greedy;
pub use host_copies::{copies, HostCopies, HOST_COPY_TRIP_SECONDS};
pub use offload::HostOffload;

use crate::analysis::{liveness, peak_of};
use crate::ir::Graph;
use crate::CompileError;

use super::plan::{finish, RematOptions, RematPlan, RematStrategy};

/// Which strategy plans: the one choice the pipeline's `remat` pass
/// ([`crate::pipeline::PassOptions::remat_strategy`]), the training loops'
/// settings and `kiln compile --remat-strategy` share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StrategyKind {
    /// [`Off`].
    Off,
    /// [`Greedy`]: what the training loops run by default.
    #[default]
    Greedy,
    /// [`Exact`].
    Exact,
    /// [`HostOffload`] (CUDA only).
    HostOffload,
    /// [`HostCopies`].
    HostCopy,
}

impl StrategyKind {
    /// Every strategy, in the order the CLI lists them.
    pub const ALL: [StrategyKind; 5] = [
        StrategyKind::Off,
        StrategyKind::Greedy,
        StrategyKind::Exact,
        StrategyKind::HostOffload,
        StrategyKind::HostCopy,
    ];

    /// The name the CLI spells and a plan reports ([`RematStrategy::name`]).
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::Off => "off",
            StrategyKind::Greedy => "greedy",
            StrategyKind::Exact => "exact",
            StrategyKind::HostOffload => "host-offload",
            StrategyKind::HostCopy => "host-copy",
        }
    }

    /// One line on what the strategy does, for the CLI's help.
    pub fn about(self) -> &'static str {
        match self {
            StrategyKind::Off => "No recomputation: the unplanned step's figures.",
            StrategyKind::Greedy => {
                "By the cost model, one recomputation at a time (the default; what the training loops run)."
            }
            StrategyKind::Exact => {
                "An integer program over the unplanned step's candidates, for small graphs: its solver and \
                 rounds can take a minute, and greedy's plan is printed beside it."
            }
            StrategyKind::HostOffload => {
                "Saved activations in pinned host memory between forward and backward, then greedy \
                 recomputation for the rest (CUDA plugin only: on the CPU plugin a typed error naming its refusal)."
            }
            StrategyKind::HostCopy => {
                "Greedy recomputation, and what its plan still holds across the peak moved to pinned host \
                 memory over kiln's own copies while the kernels run (both plugins)."
            }
        }
    }

    /// The strategy called `name`, if one is.
    pub fn from_name(name: &str) -> Option<StrategyKind> {
        StrategyKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Plans `g` with this strategy for `target`; host copies run over a
    /// link of `link_bytes_per_second` each way.
    pub fn plan(
        self,
        g: &Graph,
        opts: &RematOptions,
        target: crate::target::LowerTarget,
        link_bytes_per_second: f64,
    ) -> Result<RematPlan, CompileError> {
        match self {
            StrategyKind::Off => super::rematerialize(g, &Off, opts),
            StrategyKind::Greedy => super::rematerialize(g, &Greedy, opts),
            StrategyKind::Exact => super::rematerialize(g, &Exact, opts),
            StrategyKind::HostOffload => super::rematerialize(g, &HostOffload { target }, opts),
            StrategyKind::HostCopy => {
                super::rematerialize(g, &HostCopies { link_bytes_per_second, ..HostCopies::default() }, opts)
            }
        }
    }
}

impl std::fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// No recomputation: the baseline every plan is compared with.
#[derive(Clone, Copy, Debug, Default)]
pub struct Off;

impl RematStrategy for Off {
    fn name(&self) -> &'static str {
        "off"
    }

    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        let before = peak_of(&liveness(g, opts.fusion));
        Ok(finish(self.name(), g, g.clone(), Vec::new(), before, opts))
    }
}
