//! Device meshes and shardings: the types a step over several devices is
//! described with (a mesh with named axes, a layout per tensor), and the
//! arithmetic on them (HLO sharding text, one device's shard of a value, a
//! value assembled from its shards). Plain data: nothing here reads the
//! active mesh, records or touches a device (`engine::partition` does).
//!
//! kiln does not partition programs itself. Under a mesh every step is still
//! one logical program over global shapes (the single-device program); the
//! lowering writes `mhlo.sharding` on each argument and result of `@main`,
//! the program is compiled with one replica × `mesh.size()` partitions and SPMD
//! partitioning on, and XLA's partitioner inserts the collectives. A tensor
//! keeps one buffer per device: its shard (or a full copy when replicated);
//! reads assemble the shards. docs/sharding.md has the design and what each
//! plugin accepts.
//!
//! Invariants:
//! - Devices are numbered row-major over the mesh axes (the last axis
//!   varies fastest); device `d` of the mesh is the client's device `d`.
//! - A [`Sharding`] names, for each dimension of its tensor, at most one mesh
//!   axis, and no axis twice; every split dimension is divisible by its axis
//!   size. Both are checked (typed errors naming tensor, dimension and axis)
//!   when the sharding is set, before anything compiles.
//! - [`Sharding::slice`] and [`Sharding::assemble`] are inverse: the shards
//!   of a value assemble back to the value, byte for byte.

use std::fmt;

use kiln_compiler::ir::{Literal, TensorType};

use crate::core::error::{FrontendError, Result};

/// Env var: a mesh for this process's steps, e.g. `data=2,model=2`. Its size
/// must match `KILN_CPU_DEVICES` / `GPU_NUM_DEVICES` when those are set.
pub const ENV_MESH: &str = "KILN_MESH";

/// The conventional axis FSDP and the batch split over.
pub const DATA: &str = "data";
/// The conventional axis tensor parallelism splits over.
pub const MODEL: &str = "model";

/// A logical grid of devices with named axes, e.g. `data=2,model=2`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<(String, usize)>,
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
        write!(f, "{}", parts.join(","))
    }
}

impl Mesh {
    /// A mesh of `axes` (name, size), outermost first. Names must be
    /// distinct identifiers and sizes at least 1.
    pub fn new(axes: &[(&str, usize)]) -> Result<Mesh> {
        let spec = axes.iter().map(|(n, s)| format!("{n}={s}")).collect::<Vec<_>>().join(",");
        let bad = |reason: String| FrontendError::BadMesh { spec: spec.clone(), reason };
        if axes.is_empty() {
            return Err(bad("a mesh needs at least one axis".into()));
        }
        for (i, (name, size)) in axes.iter().enumerate() {
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(bad(format!("axis name {name:?} is not an identifier")));
            }
            if *size == 0 {
                return Err(bad(format!("axis {name} has size 0")));
            }
            if axes[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("axis {name} appears twice")));
            }
        }
        Ok(Mesh { axes: axes.iter().map(|(n, s)| (n.to_string(), *s)).collect() })
    }

    /// Parses `data=2,model=2`.
    pub fn parse(spec: &str) -> Result<Mesh> {
        let bad = |reason: String| FrontendError::BadMesh { spec: spec.to_string(), reason };
        let mut axes = Vec::new();
        for part in spec.split(',') {
            let (name, size) =
                part.split_once('=').ok_or_else(|| bad(format!("{part:?} is not axis=size (data=2,model=2)")))?;
            let size: usize = size
                .trim()
                .parse()
                .map_err(|_| bad(format!("the size of axis {} ({size:?}) is not a count", name.trim())))?;
            axes.push((name.trim().to_string(), size));
        }
        let refs: Vec<(&str, usize)> = axes.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        Mesh::new(&refs).map_err(|e| match e {
            FrontendError::BadMesh { reason, .. } => bad(reason),
            other => other,
        })
    }

    /// `KILN_MESH`, if set and not blank.
    pub fn from_env() -> Result<Option<Mesh>> {
        match kiln_runtime::env::string_var(ENV_MESH)? {
            Some(v) if !v.trim().is_empty() => Mesh::parse(v.trim()).map(Some),
            _ => Ok(None),
        }
    }

    /// Devices in the mesh (the product of the axis sizes).
    pub fn size(&self) -> usize {
        self.axes.iter().map(|(_, s)| s).product()
    }

    /// `(name, size)` of each axis, outermost first.
    pub fn axes(&self) -> &[(String, usize)] {
        &self.axes
    }

    pub fn axis_size(&self, name: &str) -> Option<usize> {
        self.axes.iter().find(|(n, _)| n == name).map(|(_, s)| *s)
    }

    fn axis_index(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|(n, _)| n == name)
    }

    /// Device `d`'s coordinate on each axis (row-major, last axis fastest).
    pub fn coords(&self, device: usize) -> Vec<usize> {
        let mut rest = device;
        let mut out = vec![0; self.axes.len()];
        for (i, (_, size)) in self.axes.iter().enumerate().rev() {
            out[i] = rest % size;
            rest /= size;
        }
        out
    }

    fn device_of(&self, coords: &[usize]) -> usize {
        coords.iter().zip(&self.axes).fold(0, |acc, (c, (_, s))| acc * s + c)
    }
}

/// How one tensor is laid out over a mesh: for each of its dimensions, the
/// mesh axis it is split over, or `None` (whole along that dimension). Mesh
/// axes no dimension names replicate the tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sharding {
    pub(crate) dims: Vec<Option<String>>,
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<&str> = self.dims.iter().map(|d| d.as_deref().unwrap_or("_")).collect();
        write!(f, "[{}]", parts.join(", "))
    }
}

impl Sharding {
    /// Whole on every device.
    pub fn replicated(rank: usize) -> Sharding {
        Sharding { dims: vec![None; rank] }
    }

    /// Dimension `dim` split over `axis`, the others whole.
    pub fn split(rank: usize, dim: usize, axis: &str) -> Sharding {
        Sharding::replicated(rank).with(dim, axis)
    }

    /// Also splits `dim` over `axis` (out-of-range dims are refused by
    /// [`Sharding::check`]).
    pub fn with(mut self, dim: usize, axis: &str) -> Sharding {
        if dim >= self.dims.len() {
            self.dims.resize(dim + 1, None);
        }
        self.dims[dim] = Some(axis.to_string());
        self
    }

    /// The axis of each dimension.
    pub fn dims(&self) -> &[Option<String>] {
        &self.dims
    }

    pub fn is_replicated(&self) -> bool {
        self.dims.iter().all(Option::is_none)
    }

    /// Whether this sharding fits a `ty` tensor called `tensor` on `mesh`.
    pub fn check(&self, tensor: &str, ty: &TensorType, mesh: &Mesh) -> Result<()> {
        let dims = ty.shape.dims();
        if self.dims.len() != dims.len() {
            return Err(FrontendError::BadSharding {
                tensor: tensor.to_string(),
                reason: format!("sharding {self} has {} dimensions, the tensor is {ty}", self.dims.len()),
            });
        }
        for (d, axis) in self.dims.iter().enumerate() {
            let Some(axis) = axis else { continue };
            let Some(size) = mesh.axis_size(axis) else {
                return Err(FrontendError::UnknownMeshAxis {
                    tensor: tensor.to_string(),
                    axis: axis.clone(),
                    mesh: mesh.to_string(),
                });
            };
            if self.dims[..d].iter().any(|a| a.as_deref() == Some(axis.as_str())) {
                return Err(FrontendError::BadSharding {
                    tensor: tensor.to_string(),
                    reason: format!("mesh axis {axis} splits two dimensions in {self}"),
                });
            }
            if dims[d] % size != 0 {
                return Err(FrontendError::ShardNotDivisible {
                    tensor: tensor.to_string(),
                    ty: Box::new(ty.clone()),
                    dim: d,
                    size: dims[d],
                    axis: axis.clone(),
                    axis_size: size,
                });
            }
        }
        Ok(())
    }

    /// Tiles per dimension (1 where whole).
    fn tiles(&self, mesh: &Mesh) -> Vec<usize> {
        self.dims.iter().map(|a| a.as_deref().and_then(|a| mesh.axis_size(a)).unwrap_or(1)).collect()
    }

    /// XLA's HLO sharding text: `{replicated}`, `{devices=[t0,t1]ids}`, or
    /// with the axes no dimension names as a trailing replicated tile
    /// dimension (`last_tile_dim_replicate`). The device list is in tile
    /// order (row-major over the tile dimensions).
    pub(crate) fn hlo(&self, mesh: &Mesh) -> String {
        let used: Vec<usize> = self.dims.iter().flatten().filter_map(|a| mesh.axis_index(a)).collect();
        if used.is_empty() || mesh.size() == 1 {
            return "{replicated}".to_string();
        }
        let unused: Vec<usize> = (0..mesh.axes.len()).filter(|i| !used.contains(i)).collect();
        let replicate: usize = unused.iter().map(|&i| mesh.axes[i].1).product();
        let mut tile_dims = self.tiles(mesh);
        let mut axis_of_tile: Vec<Option<usize>> =
            self.dims.iter().map(|a| a.as_deref().and_then(|a| mesh.axis_index(a))).collect();
        if replicate > 1 {
            tile_dims.push(replicate);
            axis_of_tile.push(None);
        }
        // Walk the tile grid row-major; each tile's device has the tile's
        // index on the named axes and the replicated index spread over the
        // unused axes (row-major among them).
        let total: usize = tile_dims.iter().product();
        let mut devices = Vec::with_capacity(total);
        for flat in 0..total {
            let mut rest = flat;
            let mut idx = vec![0; tile_dims.len()];
            for t in (0..tile_dims.len()).rev() {
                idx[t] = rest % tile_dims[t];
                rest /= tile_dims[t];
            }
            let mut coords = vec![0; mesh.axes.len()];
            for (t, axis) in axis_of_tile.iter().enumerate() {
                if let Some(a) = axis {
                    coords[*a] = idx[t];
                }
            }
            if replicate > 1 {
                let mut r = idx[tile_dims.len() - 1];
                for &a in unused.iter().rev() {
                    coords[a] = r % mesh.axes[a].1;
                    r /= mesh.axes[a].1;
                }
            }
            devices.push(mesh.device_of(&coords).to_string());
        }
        let dims: Vec<String> = tile_dims.iter().map(ToString::to_string).collect();
        let suffix = if replicate > 1 { " last_tile_dim_replicate" } else { "" };
        format!("{{devices=[{}]{}{suffix}}}", dims.join(","), devices.join(","))
    }

    /// One device's shard dims of a `global` tensor.
    pub(crate) fn local_dims(&self, global: &[usize], mesh: &Mesh) -> Vec<usize> {
        global.iter().zip(self.tiles(mesh)).map(|(g, t)| g / t).collect()
    }

    /// Where device `device`'s shard starts in each dimension.
    fn offsets(&self, global: &[usize], mesh: &Mesh, device: usize) -> Vec<usize> {
        let coords = mesh.coords(device);
        self.dims
            .iter()
            .zip(global)
            .zip(self.tiles(mesh))
            .map(|((a, g), t)| match a.as_deref().and_then(|a| mesh.axis_index(a)) {
                Some(i) => coords[i] * (g / t),
                None => 0,
            })
            .collect()
    }

    /// Device `device`'s shard of `lit` (a copy).
    pub(crate) fn slice(&self, lit: &Literal, mesh: &Mesh, device: usize) -> Result<Literal> {
        let ty = lit.ty();
        let global = ty.shape.dims();
        let local = self.local_dims(global, mesh);
        let esize = ty.dtype.size_in_bytes();
        let mut out = vec![0u8; local.iter().product::<usize>() * esize];
        let src = lit.bytes();
        for_each_run(global, &self.offsets(global, mesh, device), &local, esize, |g, l, n| {
            out[l..l + n].copy_from_slice(&src[g..g + n]);
        });
        Ok(Literal::from_bytes(TensorType::new(ty.dtype, local.clone()), out)?)
    }

    /// The global value from every device's shard bytes (device order).
    pub(crate) fn assemble(&self, ty: &TensorType, mesh: &Mesh, parts: &[Vec<u8>]) -> Vec<u8> {
        let global = ty.shape.dims();
        let local = self.local_dims(global, mesh);
        let esize = ty.dtype.size_in_bytes();
        let mut out = vec![0u8; ty.shape.num_elements() * esize];
        for (device, part) in parts.iter().enumerate() {
            for_each_run(global, &self.offsets(global, mesh, device), &local, esize, |g, l, n| {
                out[g..g + n].copy_from_slice(&part[l..l + n]);
            });
        }
        out
    }
}

/// Calls `f(global_byte, local_byte, len)` for each contiguous run (the last
/// dimension) of the block `offsets .. offsets + local` of a row-major
/// `global` array with `esize`-byte elements.
fn for_each_run(
    global: &[usize],
    offsets: &[usize],
    local: &[usize],
    esize: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let rank = global.len();
    if rank == 0 {
        f(0, 0, esize);
        return;
    }
    if local.contains(&0) {
        return;
    }
    let run = local[rank - 1] * esize;
    let rows: usize = local[..rank - 1].iter().product();
    let mut idx = vec![0usize; rank - 1];
    for row in 0..rows {
        let mut g = 0;
        for d in 0..rank - 1 {
            g = g * global[d] + offsets[d] + idx[d];
        }
        g = (g * global[rank - 1] + offsets[rank - 1]) * esize;
        f(g, row * run, run);
        for d in (0..rank - 1).rev() {
            idx[d] += 1;
            if idx[d] < local[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// A policy chosen before the model exists (its Linear names are found in
/// the store when it is applied; `api::shard` turns it into a `ShardPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    Replicated,
    Fsdp,
    TensorParallel,
    FsdpTp,
}

/// The replica plan a mesh runs under: the mesh's device count, checked
/// against the environment's, with one logical replica.
pub fn plan_for(mesh: &Mesh, env: &kiln_runtime::ReplicaEnv) -> Result<kiln_runtime::ReplicaPlan> {
    let (var, set) = match env.device {
        kiln_runtime::PjrtDevice::Cpu => (kiln_runtime::replicas::ENV_CPU_DEVICES, &env.cpu_devices),
        kiln_runtime::PjrtDevice::Cuda => (kiln_runtime::replicas::ENV_GPU_NUM_DEVICES, &env.gpu_num_devices),
    };
    if let Some(v) = set.as_deref().map(str::trim).filter(|v| !v.is_empty()) {
        if v.parse::<usize>().ok() != Some(mesh.size()) {
            return Err(FrontendError::MeshDevices {
                mesh: mesh.to_string(),
                mesh_devices: mesh.size(),
                setting: format!("{var}={v}"),
            });
        }
    }
    let n = mesh.size().to_string();
    // Only the variable of the selected plugin (the other one is warned about).
    let cpu = env.device == kiln_runtime::PjrtDevice::Cpu;
    let sized = kiln_runtime::ReplicaEnv {
        device: env.device,
        gpu_num_devices: if cpu { env.gpu_num_devices.clone() } else { Some(n.clone()) },
        cpu_devices: if cpu { Some(n) } else { env.cpu_devices.clone() },
        node: env.node.clone(),
    };
    let mut plan = sized.plan(kiln_runtime::gpu::probe_gpus)?;
    if plan.identity.is_distributed() {
        return Err(FrontendError::BadMesh {
            spec: mesh.to_string(),
            reason: "a mesh spans the devices of one process; this run has several (KILN_NUM_NODES)".into(),
        });
    }
    // One logical program over global shapes: the devices are partitions.
    plan.replicas = 1;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::DType;

    #[test]
    fn hlo_text_of_one_and_two_axis_meshes() {
        let m4 = Mesh::new(&[("data", 4)]).unwrap();
        assert_eq!(Sharding::split(2, 0, "data").hlo(&m4), "{devices=[4,1]0,1,2,3}");
        assert_eq!(Sharding::replicated(2).hlo(&m4), "{replicated}");
        let m22 = Mesh::new(&[("data", 2), ("model", 2)]).unwrap();
        assert_eq!(Sharding::split(2, 0, "data").hlo(&m22), "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}");
        assert_eq!(Sharding::split(2, 1, "model").hlo(&m22), "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}");
        assert_eq!(Sharding::split(2, 1, "data").with(0, "model").hlo(&m22), "{devices=[2,2]0,2,1,3}");
    }

    #[test]
    fn slices_assemble_back_to_the_value() {
        let m = Mesh::new(&[("data", 2), ("model", 3)]).unwrap();
        let ty = TensorType::new(DType::F32, vec![4usize, 6, 2]);
        let data: Vec<f32> = (0..48).map(|i| i as f32 * 0.5 + 1.0).collect();
        let lit = Literal::from_bytes(ty.clone(), data.iter().flat_map(|v| v.to_le_bytes()).collect()).unwrap();
        for s in
            [Sharding::split(3, 0, "data").with(1, "model"), Sharding::split(3, 1, "data"), Sharding::replicated(3)]
        {
            let parts: Vec<Vec<u8>> = (0..6).map(|d| s.slice(&lit, &m, d).unwrap().bytes().to_vec()).collect();
            assert_eq!(s.assemble(&ty, &m, &parts), lit.bytes(), "{s}");
        }
        // Device 4 = (data 1, model 1): rows 2..4, columns 2..4.
        let s = Sharding::split(3, 0, "data").with(1, "model");
        let shard = s.slice(&lit, &m, 4).unwrap();
        let got: Vec<f32> = shard.bytes().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let mut want = Vec::new();
        for r in 2..4 {
            for c in 2..4 {
                for k in 0..2 {
                    want.push(data[r * 12 + c * 2 + k]);
                }
            }
        }
        assert_eq!(got, want);
    }

    #[test]
    fn checks_name_tensor_dimension_and_axis() {
        let m = Mesh::new(&[("data", 4)]).unwrap();
        let ty = TensorType::new(DType::F32, vec![6usize, 8]);
        let e = Sharding::split(2, 0, "data").check("w", &ty, &m).unwrap_err().to_string();
        assert!(e.contains("w") && e.contains("dimension 0") && e.contains("data") && e.contains('6'), "{e}");
        let e = Sharding::split(2, 1, "model").check("w", &ty, &m).unwrap_err().to_string();
        assert!(e.contains("model") && e.contains("data=4"), "{e}");
        assert!(Mesh::parse("data=2,data=2").is_err());
        assert!(Mesh::parse("data=x").unwrap_err().to_string().contains("data"));
    }
}
