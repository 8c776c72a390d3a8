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
