//! A tensor's layout over the mesh: [`Tensor::set_sharding`] and
//! [`Tensor::sharding`].
//!
//! Invariant: a tensor already on the devices keeps the layout its buffers
//! have; setting another one is refused, never applied to buffers laid out
//! otherwise.

use crate::core::error::{FrontendError, Result};
use crate::core::mesh::Sharding;
use crate::core::storage::{State, Storage};
use crate::core::tensor::Tensor;
use crate::engine::partition::mesh;

impl Tensor {
    /// Lays this tensor out as `sharding` over the active mesh. Checked now:
    /// rank, axis names, divisibility (errors name the tensor, the dimension
    /// and the axis). A tensor already on the devices in another layout is
    /// refused: set shardings before the first step reads the tensor.
    pub fn set_sharding(&self, sharding: Sharding) -> Result<()> {
        let name = self.describe_for_errors();
        let mesh = mesh()?.ok_or_else(|| FrontendError::BadSharding {
            tensor: name.clone(),
            reason: "no mesh is set (kiln::shard::set_mesh or KILN_MESH)".into(),
        })?;
        sharding.check(&name, self.ty(), &mesh)?;
        let current = self.inner.sharding.borrow().clone().unwrap_or_else(|| Sharding::replicated(self.rank()));
        if current != sharding && matches!(&*self.inner.state.borrow(), State::Ready(Storage::Device(_))) {
            return Err(FrontendError::BadSharding {
                tensor: name,
                reason: format!("it is already on the devices as {current}; set shardings before the first step"),
            });
        }
        *self.inner.sharding.borrow_mut() = (!sharding.is_replicated()).then_some(sharding);
        Ok(())
    }

    /// The tensor's layout over the mesh (`None`: replicated).
    pub fn sharding(&self) -> Option<Sharding> {
        self.inner.sharding.borrow().clone()
    }

    fn describe_for_errors(&self) -> String {
        match self.inner.name.borrow().as_deref() {
            Some(n) => format!("{n} ({})", self.ty()),
            None => format!("a {} tensor", self.ty()),
        }
    }
}
