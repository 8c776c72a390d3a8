//! Sharding on one host through XLA's SPMD partitioner: a device mesh with
//! named axes, a sharding per tensor, and policies that shard a
//! [`ParamStore`] (FSDP, Megatron-style tensor parallelism, both).
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
//! - Under a mesh the run has one logical replica: [`crate::engine::replicas`] sees 1,
//!   so no `all_reduce` is recorded; a tensor without a sharding is
//!   replicated over the whole mesh.
//! - A tensor's sharding is its layout on the devices: the program that
//!   produced its buffers was lowered with it, and every later program that
//!   reads them is lowered with it (the raw-trace key includes the layouts).

use std::fmt;
use std::hash::{Hash, Hasher};
use std::rc::Rc;

use kiln_compiler::ir::{Literal, TensorType};

use crate::api::nn::ParamStore;
use crate::api::tensor::Tensor;
use crate::core::error::{FrontendError, Result};
use crate::engine::context::{self, Inner, State, Storage};

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
        match std::env::var(ENV_MESH) {
            Ok(v) if !v.trim().is_empty() => Mesh::parse(v.trim()).map(Some),
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
    dims: Vec<Option<String>>,
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

// ---- the active mesh -----------------------------------------------------------

/// Runs this thread's later steps on `mesh`: one replica × `mesh.size()`
/// partitions of the selected plugin (`PJRT_DEVICE`). Call it before creating
/// tensors. Refused when `KILN_CPU_DEVICES` / `GPU_NUM_DEVICES` set another
/// device count, when there are not that many devices, or in a run of
/// several processes.
pub fn set_mesh(mesh: Mesh) -> Result<()> {
    let env = kiln_runtime::ReplicaEnv::from_env()?;
    let plan = plan_for(&mesh, &env)?;
    context::set_plan(plan);
    context::with(|c| c.exec.mesh = Some(mesh));
    Ok(())
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

/// The mesh this thread's steps run on (`None`: no partitioning). Reads
/// `KILN_MESH` on first use, as the replica plan reads its variables.
pub fn mesh() -> Result<Option<Mesh>> {
    context::with(|c| c.exec.plan().map(|_| ()))?;
    Ok(context::with(|c| c.exec.mesh.clone()))
}

/// The active mesh without reading the environment (internal fast path).
pub(crate) fn active_mesh() -> Option<Mesh> {
    context::with(|c| c.exec.mesh.clone())
}

/// XLA's compiled memory statistics of every program this thread compiled
/// or loaded, oldest first. Under a mesh they are one device's: argument
/// bytes count that device's shards.
pub fn program_memory_stats() -> Result<Vec<kiln_runtime::CompiledMemoryStats>> {
    let programs = context::with(|c| c.cache.history.clone());
    programs.iter().map(|p| p.exe.compiled_memory_stats().map_err(FrontendError::from)).collect()
}

// ---- tensors --------------------------------------------------------------------

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

/// Splits a batch's first dimension over the mesh's `data` axis; nothing
/// without a mesh or without that axis.
pub fn shard_batch(t: &Tensor) -> Result<()> {
    let Some(mesh) = active_mesh() else { return Ok(()) };
    if mesh.axis_size(DATA).is_none_or(|s| s == 1) || t.rank() == 0 {
        return Ok(());
    }
    t.set_sharding(Sharding::split(t.rank(), 0, DATA))
}

/// How many equal contiguous parts the rows of a batch-major `[n, ...]`
/// activation come in under the active mesh: the `data` axis's size when it
/// divides `n` ([`shard_batch`] splits the batch over it, and the tokens' rows
/// follow the batch), else 1. The LM-head composite makes its row blocks
/// within each part, so no rows move between devices (`docs/sharding.md`,
/// "The LM head on each device's rows").
pub(crate) fn row_shards(n: usize) -> usize {
    match data_parts() {
        d if d > 1 && n % d == 0 => d,
        _ => 1,
    }
}

/// How many parts the active mesh's `data` axis splits a batch into (1
/// without one).
pub(crate) fn data_parts() -> usize {
    active_mesh().and_then(|m| m.axis_size(DATA)).unwrap_or(1)
}

/// How the cuDNN attention calls split under `mesh` (the CUDA lowering runs
/// each on one device's shard, `kiln_compiler::AttentionSplit`): the batch
/// over `data`, as [`shard_batch`] splits it, and the heads over `model`, as
/// tensor parallelism splits the fused qkv projection. `None` when neither
/// axis splits anything.
pub(crate) fn attention_split(mesh: &Mesh) -> Option<kiln_compiler::AttentionSplit> {
    let batch = mesh.axis_size(DATA).unwrap_or(1);
    let heads = mesh.axis_size(MODEL).unwrap_or(1);
    if batch * heads == 1 {
        return None;
    }
    // The axes of dimension 0 (batch) and of the heads dimension.
    let split = |rank: usize, heads_dim: usize| {
        let mut s = Sharding::replicated(rank);
        if batch > 1 {
            s = s.with(0, DATA);
        }
        if heads > 1 {
            s = s.with(heads_dim, MODEL);
        }
        s.hlo(mesh)
    };
    Some(kiln_compiler::AttentionSplit { batch, heads, btnh: split(4, 2), bnth: split(4, 1), bnt: split(3, 1) })
}

/// The sharding of `inner` (replicated when unset).
pub(crate) fn of(inner: &Inner) -> Sharding {
    inner.sharding.borrow().clone().unwrap_or_else(|| Sharding::replicated(inner.ty.shape.dims().len()))
}

/// The parameters of a trace fed by `bindings` that XLA's SPMD partitioner
/// gathers where they are computed with: the state a step updates
/// (`assigned`: an output is assigned over it) that is split over the `data`
/// axis, as FSDP splits weights. Batches are split over it too but are not
/// assigned over. Empty without a mesh or without that axis.
pub(crate) fn gathered_params(bindings: &[crate::core::trace::Binding], assigned: &[bool]) -> Vec<u32> {
    let Some(mesh) = active_mesh() else { return Vec::new() };
    if mesh.axis_size(DATA).is_none_or(|s| s == 1) {
        return Vec::new();
    }
    let split = |b: &crate::core::trace::Binding| {
        b.tensor.upgrade().is_some_and(|t| of(&t).dims().iter().any(|d| d.as_deref() == Some(DATA)))
    };
    (0..bindings.len()).filter(|&i| assigned[i] && split(&bindings[i])).map(|i| i as u32).collect()
}

/// Under a mesh, the layout of each output of a closing trace: the first
/// receiver's sharding that is set (replicated when none is), which every
/// receiver of that output then takes, so all handles on the buffers agree on
/// their layout. `None` without a mesh.
pub(crate) fn output_shardings(receivers: &[Vec<Rc<Inner>>]) -> Option<Vec<Sharding>> {
    active_mesh()?;
    Some(
        receivers
            .iter()
            .map(|rs| {
                let chosen = rs.iter().find_map(|r| r.sharding.borrow().clone());
                for r in rs {
                    *r.sharding.borrow_mut() = chosen.clone();
                }
                match (chosen, rs.first()) {
                    (Some(s), _) => s,
                    (None, Some(r)) => Sharding::replicated(r.ty.shape.dims().len()),
                    (None, None) => Sharding::replicated(0),
                }
            })
            .collect(),
    )
}

/// A hash of the layouts of a trace's parameters and outputs, mixed into the
/// raw-trace key so a trace recorded under other layouts compiles anew.
/// 0 without a mesh.
pub(crate) fn layout_key(params: &[crate::core::trace::Binding], outputs: Option<&[Sharding]>) -> u64 {
    let Some(mesh) = active_mesh() else { return 0 };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    mesh.hash(&mut h);
    for p in params {
        p.tensor.upgrade().and_then(|i| i.sharding.borrow().clone()).hash(&mut h);
    }
    outputs.hash(&mut h);
    h.finish()
}

/// Reads a device value laid out over the active mesh: the assembled global
/// bytes (device 0's copy when replicated). `None` when no mesh is active
/// (replica layout: the caller reads replica buffers).
pub(crate) fn read_device(inner: &Inner, value: &crate::engine::context::DeviceValue) -> Result<Option<Vec<u8>>> {
    let Some(mesh) = active_mesh() else { return Ok(None) };
    if value.0.len() != mesh.size() || value.0.len() == 1 {
        return Ok(None);
    }
    let sharding = of(inner);
    if sharding.is_replicated() {
        return Ok(Some(crate::engine::executor::download(value, 0..1)?.swap_remove(0)));
    }
    let parts = crate::engine::executor::download(value, 0..value.0.len())?;
    Ok(Some(sharding.assemble(&inner.ty, &mesh, &parts)))
}

/// The storage `to` takes when assigned `from`'s ready `storage`: the same
/// buffers when the layouts agree, else the assembled value on the host (the
/// next step uploads it in `to`'s layout).
pub(crate) fn relayout(from: &Inner, to: &Inner, storage: Storage) -> Result<Storage> {
    let Storage::Device(value) = &storage else { return Ok(storage) };
    if active_mesh().is_none() || of(from) == of(to) {
        return Ok(storage);
    }
    let bytes = match read_device(from, value)? {
        Some(b) => b,
        None => return Ok(storage),
    };
    Ok(Storage::Host(std::sync::Arc::new(Literal::from_bytes(from.ty.clone(), bytes)?)))
}

// ---- policies -------------------------------------------------------------------

/// How a [`ParamStore`]'s parameters (and, through [`Tensor::sharding`] being
/// copied to the state made from them, their optimizer state) are sharded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardPolicy {
    /// Every parameter whole on every device (data parallel under a mesh).
    Replicated,
    /// ZeRO-3 / FSDP: each parameter split over `axis` along its largest
    /// dimension that the axis divides (whole when none does).
    Fsdp { axis: String },
    /// Megatron tensor parallelism over `axis`: `column` Linears (by name,
    /// `h0.attn.qkv`) split their output features (weight dim 1, bias; for
    /// shaped outputs such as the attention's `[in, 3, heads, head_dim]`, the
    /// heads dimension), `row` Linears their input features (weight dim 0;
    /// bias whole); the rest stays whole.
    TensorParallel { axis: String, column: Vec<String>, row: Vec<String> },
    /// Both: the tensor-parallel splits over `model`, then each parameter
    /// split over `data` along its largest remaining dimension that divides.
    FsdpTp { data: String, model: String, column: Vec<String>, row: Vec<String> },
    /// These parameters as given, the rest whole.
    Explicit(Vec<(String, Sharding)>),
}

impl fmt::Display for ShardPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardPolicy::Replicated => write!(f, "replicated"),
            ShardPolicy::Fsdp { axis } => write!(f, "fsdp over {axis}"),
            ShardPolicy::TensorParallel { axis, .. } => write!(f, "tensor parallel over {axis}"),
            ShardPolicy::FsdpTp { data, model, .. } => write!(f, "fsdp over {data} x tensor parallel over {model}"),
            ShardPolicy::Explicit(list) => write!(f, "explicit ({} parameters)", list.len()),
        }
    }
}

/// The Linear pairs of kiln's transformer blocks (`<block>.attn.qkv` →
/// `<block>.attn.proj`, `<block>.mlp.fc` → `<block>.mlp.proj`) found in
/// `store`: (column, row) names.
pub fn megatron_pairs(store: &ParamStore) -> (Vec<String>, Vec<String>) {
    let mut column = Vec::new();
    let mut row = Vec::new();
    for (name, _) in store.iter() {
        for (col, r) in [(".attn.qkv.weight", ".attn.proj.weight"), (".mlp.fc.weight", ".mlp.proj.weight")] {
            if let Some(prefix) = name.strip_suffix(col) {
                if store.get(&format!("{prefix}{r}")).is_some() {
                    column.push(format!("{prefix}{}", col.trim_end_matches(".weight")));
                    row.push(format!("{prefix}{}", r.trim_end_matches(".weight")));
                }
            }
        }
    }
    (column, row)
}

impl ShardPolicy {
    /// FSDP over the `data` axis.
    pub fn fsdp() -> ShardPolicy {
        ShardPolicy::Fsdp { axis: DATA.into() }
    }

    /// Tensor parallelism over `model` for the transformer Linear pairs of `store`.
    pub fn tensor_parallel(store: &ParamStore) -> ShardPolicy {
        let (column, row) = megatron_pairs(store);
        ShardPolicy::TensorParallel { axis: MODEL.into(), column, row }
    }

    /// FSDP over `data` and tensor parallelism over `model`.
    pub fn fsdp_tp(store: &ParamStore) -> ShardPolicy {
        let (column, row) = megatron_pairs(store);
        ShardPolicy::FsdpTp { data: DATA.into(), model: MODEL.into(), column, row }
    }

    /// The sharding every parameter of `store` gets on `mesh`, in store
    /// order: what on-device initialization places each parameter in.
    /// Every parameter a policy names must exist; every sharding is checked.
    pub fn shardings(&self, store: &ParamStore, mesh: &Mesh) -> Result<Vec<(String, Sharding)>> {
        let unknown =
            |name: &str| FrontendError::UnknownShardParam { policy: self.to_string(), name: name.to_string() };
        // Names the policy refers to must exist.
        match self {
            ShardPolicy::TensorParallel { column, row, .. } | ShardPolicy::FsdpTp { column, row, .. } => {
                for linear in column.iter().chain(row) {
                    if store.get(&format!("{linear}.weight")).is_none() {
                        return Err(unknown(&format!("{linear}.weight")));
                    }
                }
            }
            ShardPolicy::Explicit(list) => {
                for (name, _) in list {
                    if store.get(name).is_none() {
                        return Err(unknown(name));
                    }
                }
            }
            ShardPolicy::Replicated | ShardPolicy::Fsdp { .. } => {}
        }
        let mut out = Vec::with_capacity(store.len());
        for (name, t) in store.iter() {
            let s = self.sharding_of(name, t.ty(), mesh)?;
            s.check(&format!("{name} ({})", t.ty()), t.ty(), mesh)?;
            out.push((name.to_string(), s));
        }
        Ok(out)
    }

    /// The sharding parameter `name` of type `ty` gets (not checked; see
    /// [`ShardPolicy::shardings`]).
    pub fn sharding_of(&self, name: &str, ty: &TensorType, mesh: &Mesh) -> Result<Sharding> {
        let rank = ty.shape.dims().len();
        let tp = |axis: &str, column: &[String], row: &[String]| -> Sharding {
            let linear = name.strip_suffix(".weight").or_else(|| name.strip_suffix(".bias"));
            let is_weight = name.ends_with(".weight");
            match linear {
                Some(l) if column.iter().any(|c| c == l) => {
                    // Flat output features (weight `[in, out]`, bias `[out]`)
                    // split whole; shaped ones (`[in, 3, heads, head_dim]`,
                    // `[3, heads, head_dim]`) on the heads, the second to last
                    // dimension, so every device holds whole heads of q, k and
                    // v alike.
                    let flat = if is_weight { rank == 2 } else { rank == 1 };
                    let dim = if flat { rank.saturating_sub(1) } else { rank.saturating_sub(2) };
                    Sharding::split(rank, dim, axis)
                }
                Some(l) if row.iter().any(|r| r == l) && is_weight && rank == 2 => Sharding::split(2, 0, axis),
                _ => Sharding::replicated(rank),
            }
        };
        let fsdp = |mut s: Sharding, axis: &str| -> Sharding {
            let Some(size) = mesh.axis_size(axis) else { return s };
            if size == 1 {
                return s;
            }
            let dims = ty.shape.dims();
            // The largest whole dimension the axis divides (first on ties).
            let pick = (0..rank)
                .filter(|&d| s.dims[d].is_none())
                .filter(|&d| {
                    let tiles = s.dims[d].as_deref().and_then(|a| mesh.axis_size(a)).unwrap_or(1);
                    (dims[d] / tiles) % size == 0 && dims[d] >= size
                })
                .max_by(|&a, &b| dims[a].cmp(&dims[b]).then(b.cmp(&a)));
            if let Some(d) = pick {
                s.dims[d] = Some(axis.to_string());
            }
            s
        };
        Ok(match self {
            ShardPolicy::Replicated => Sharding::replicated(rank),
            ShardPolicy::Fsdp { axis } => fsdp(Sharding::replicated(rank), axis),
            ShardPolicy::TensorParallel { axis, column, row } => tp(axis, column, row),
            ShardPolicy::FsdpTp { data, model, column, row } => fsdp(tp(model, column, row), data),
            ShardPolicy::Explicit(list) => list
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
                .unwrap_or_else(|| Sharding::replicated(rank)),
        })
    }
}

/// Shards `store`'s parameters by `policy` over the active mesh. Optimizer
/// state made afterwards from the parameters takes their shardings.
pub fn apply(policy: &ShardPolicy, store: &ParamStore) -> Result<()> {
    let mesh = mesh()?.ok_or_else(|| FrontendError::BadMesh {
        spec: String::new(),
        reason: format!("shard policy {policy} needs a mesh (kiln::shard::set_mesh or KILN_MESH)"),
    })?;
    let shardings = policy.shardings(store, &mesh)?;
    for (name, s) in shardings {
        let t = store.get(&name).expect("shardings lists the store's own names");
        t.set_sharding(s)?;
    }
    Ok(())
}

/// Sets the policy the built-in models apply to their parameters when they
/// are created under a mesh (`kiln train gpt --shard`).
pub fn set_policy(policy: Option<PolicyKind>) {
    context::with(|c| c.exec.policy = policy);
}

/// A policy chosen before the model exists (its Linear names are found in
/// the store when it is applied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    Replicated,
    Fsdp,
    TensorParallel,
    FsdpTp,
}

impl PolicyKind {
    pub fn for_store(self, store: &ParamStore) -> ShardPolicy {
        match self {
            PolicyKind::Replicated => ShardPolicy::Replicated,
            PolicyKind::Fsdp => ShardPolicy::fsdp(),
            PolicyKind::TensorParallel => ShardPolicy::tensor_parallel(store),
            PolicyKind::FsdpTp => ShardPolicy::fsdp_tp(store),
        }
    }
}

/// What `--shard` asks for: `dp` (replicas, no mesh), `fsdp`, `tp=N`, or
/// `fsdp,tp=N`, over `devices` devices. `tp=N` puts the devices that remain
/// on a `data` axis (the batch splits over it; with `fsdp` the parameters
/// too). `None`: data parallel, the replica path.
pub fn parse_shard_flag(spec: &str, devices: usize) -> Result<Option<(Mesh, PolicyKind)>> {
    let bad = |reason: String| FrontendError::BadMesh { spec: spec.to_string(), reason };
    let mut fsdp = false;
    let mut tp: Option<usize> = None;
    let mut dp = false;
    let mut seen: Vec<&str> = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let name = part.split_once('=').map_or(part, |(n, _)| n);
        if seen.contains(&name) {
            return Err(bad(format!("{name} is given twice")));
        }
        seen.push(name);
        match part.split_once('=') {
            None if part == "dp" => dp = true,
            None if part == "fsdp" => fsdp = true,
            Some(("tp", n)) => {
                let n: usize = match n.trim().parse::<usize>() {
                    Ok(v) if v >= 1 => v,
                    // Beyond usize: a count, just far more than the devices.
                    Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
                        return Err(bad(format!("tp={n}: more than the {devices} device(s)")))
                    }
                    _ => return Err(bad(format!("tp={n}: the tensor-parallel degree must be a count of at least 1"))),
                };
                tp = Some(n);
            }
            _ => return Err(bad(format!("{part:?} is not dp, fsdp, tp=N or fsdp,tp=N"))),
        }
    }
    if dp && (fsdp || tp.is_some()) {
        return Err(bad("dp (replicas) does not combine with fsdp or tp".into()));
    }
    if dp {
        return Ok(None);
    }
    let model = tp.unwrap_or(1);
    if devices % model != 0 {
        return Err(FrontendError::MeshDevices {
            mesh: format!("model={model}"),
            mesh_devices: model,
            setting: format!("{devices} devices (tp={model} must divide them)"),
        });
    }
    let data = devices / model;
    let mut axes: Vec<(&str, usize)> = Vec::new();
    if data > 1 || tp.is_none() {
        axes.push((DATA, data));
    }
    if tp.is_some() {
        axes.push((MODEL, model));
    }
    let kind = match (fsdp, tp.is_some()) {
        (true, true) => PolicyKind::FsdpTp,
        (true, false) => PolicyKind::Fsdp,
        (false, true) => PolicyKind::TensorParallel,
        (false, false) => PolicyKind::Replicated,
    };
    Ok(Some((Mesh::new(&axes)?, kind)))
}

/// Applies the policy set by [`set_policy`] (none: nothing) to `store`.
pub fn apply_active(store: &ParamStore) -> Result<()> {
    let Some(kind) = context::with(|c| c.exec.policy) else { return Ok(()) };
    if mesh()?.is_none() {
        return Ok(());
    }
    apply(&kind.for_store(store), store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_flag_names_a_part_given_twice_and_a_degree_beyond_any_count() {
        let msg = |spec: &str| parse_shard_flag(spec, 4).unwrap_err().to_string();
        assert!(msg("fsdp,fsdp").ends_with("fsdp is given twice"), "{}", msg("fsdp,fsdp"));
        assert!(msg("tp=2,tp=2").ends_with("tp is given twice"));
        assert!(msg("tp=99999999999999999999").ends_with("tp=99999999999999999999: more than the 4 device(s)"));
        assert!(msg("tp=0").contains("must be a count of at least 1"));
        assert!(parse_shard_flag("fsdp,tp=2", 4).unwrap().is_some());
    }
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
    fn attention_splits_the_batch_over_data_and_the_heads_over_model() {
        let split = |spec: &str| attention_split(&Mesh::parse(spec).unwrap());
        let fsdp = split("data=2").unwrap();
        assert_eq!((fsdp.batch, fsdp.heads), (2, 1));
        assert_eq!((fsdp.btnh.as_str(), fsdp.bnt.as_str()), ("{devices=[2,1,1,1]0,1}", "{devices=[2,1,1]0,1}"));
        let tp = split("model=2").unwrap();
        assert_eq!((tp.batch, tp.heads), (1, 2));
        assert_eq!((tp.btnh.as_str(), tp.bnth.as_str()), ("{devices=[1,1,2,1]0,1}", "{devices=[1,2,1,1]0,1}"));
        let both = split("data=2,model=2").unwrap();
        assert_eq!((both.batch, both.heads), (2, 2));
        assert_eq!(both.btnh, "{devices=[2,1,2,1]0,1,2,3}");
        assert!(split("data=1").is_none());
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
    fn tensor_parallelism_splits_the_fused_qkv_on_its_heads() {
        let m = Mesh::new(&[("data", 2), ("model", 2)]).unwrap();
        let ty = |dims: &[usize]| TensorType::new(DType::F32, dims.to_vec());
        let (column, row) = (vec!["h0.attn.qkv".to_string()], vec!["h0.attn.proj".to_string()]);
        let tp = ShardPolicy::TensorParallel { axis: "model".into(), column: column.clone(), row: row.clone() };
        let of = |p: &ShardPolicy, name: &str, dims: &[usize]| p.sharding_of(name, &ty(dims), &m).unwrap().to_string();
        // Shaped output features: the heads dimension (weight 2, bias 1).
        assert_eq!(of(&tp, "h0.attn.qkv.weight", &[64, 3, 4, 16]), "[_, _, model, _]");
        assert_eq!(of(&tp, "h0.attn.qkv.bias", &[3, 4, 16]), "[_, model, _]");
        // Flat ones (a user's [in, 3·dim] Linear of that name): whole output features.
        assert_eq!(of(&tp, "h0.attn.qkv.weight", &[64, 192]), "[_, model]");
        assert_eq!(of(&tp, "h0.attn.qkv.bias", &[192]), "[model]");
        assert_eq!(of(&tp, "h0.attn.proj.weight", &[64, 64]), "[model, _]");
        assert_eq!(of(&tp, "h0.attn.proj.bias", &[64]), "[_]");
        // FSDP×TP: data on the largest dimension left.
        let both = ShardPolicy::FsdpTp { data: "data".into(), model: "model".into(), column, row };
        assert_eq!(of(&both, "h0.attn.qkv.weight", &[64, 3, 4, 16]), "[data, _, model, _]");
        assert_eq!(of(&both, "h0.attn.qkv.bias", &[3, 4, 16]), "[_, model, data]");
        // Heads that do not divide the axis: refused, naming the dimension.
        let m3 = Mesh::new(&[("model", 3)]).unwrap();
        let s = tp.sharding_of("h0.attn.qkv.weight", &ty(&[48, 3, 4, 12]), &m3).unwrap();
        let e = s.check("h0.attn.qkv.weight", &ty(&[48, 3, 4, 12]), &m3).unwrap_err().to_string();
        assert!(e.contains("dimension 2") && e.contains("size 4") && e.contains("model (size 3)"), "{e}");
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
