//! The per-thread lazy-tensor context: the trace being recorded, the backend
//! that runs finished steps, and the compiled-program cache.
//!
//! Invariants:
//! - A tensor is either `Ready` (host or device storage) or `Pending` in exactly
//!   one trace, named by that trace's epoch. Epochs are unique per process, so a
//!   tensor left pending by a trace that ended without running (a `lower`) is
//!   recognised as stale, never confused with a value of a later trace.
//! - A ready tensor read by a trace becomes one parameter of it, however often
//!   it is read (memoised on the tensor by epoch).
//! - Insertion order everywhere: live tensors and parameters are kept in `Vec`s,
//!   so the outputs and parameters of a step, and with them its program, are
//!   deterministic.

use std::cell::{Cell, RefCell};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kiln_compiler::ir::{DType, Graph, Literal, Op, Shape, TensorType, ValueId};
use kiln_runtime::replicas::ReplicaPlan;
use kiln_runtime::{Buffer, Client, CompileKey, DiskCache, DiskCacheConfig};

use crate::error::{FrontendError, Result};
use crate::metrics;

static NEXT_EPOCH: AtomicU64 = AtomicU64::new(1);
static NEXT_TENSOR: AtomicU64 = AtomicU64::new(1);

/// Where a ready tensor's data lives.
#[derive(Clone)]
pub(crate) enum Storage {
    /// One host value, the same on every replica.
    Host(Arc<Literal>),
    /// One host value per replica, in replica order (data shards, the
    /// per-replica generator state).
    HostShards(Arc<Vec<Literal>>),
    /// One device buffer per replica, in replica order.
    Device(Arc<DeviceValue>),
}

/// A value on the devices: one buffer per replica, replica `r`'s on the
/// device that runs replica `r`.
pub(crate) struct DeviceValue(pub Vec<Buffer>);

impl Storage {
    /// Number of replicas the storage holds values for (`None`: the same
    /// value serves any number).
    pub fn replicas(&self) -> Option<usize> {
        match self {
            Storage::Host(_) => None,
            Storage::HostShards(s) => Some(s.len()),
            Storage::Device(d) => Some(d.0.len()),
        }
    }
}

pub(crate) enum State {
    Ready(Storage),
    Pending { epoch: u64, value: ValueId },
}

pub(crate) struct Inner {
    pub id: u64,
    pub ty: TensorType,
    pub state: RefCell<State>,
    /// `(epoch, parameter value)` when this ready tensor is a parameter of the
    /// trace with that epoch.
    pub bound: Cell<Option<(u64, ValueId)>>,
    /// A name for messages (recompile explanations): parameters get theirs
    /// from the `ParamStore`, data batches from the loader.
    pub name: RefCell<Option<Rc<str>>>,
}

impl Inner {
    pub fn new(ty: TensorType, state: State) -> Rc<Inner> {
        Rc::new(Inner {
            id: NEXT_TENSOR.fetch_add(1, Ordering::Relaxed),
            ty,
            state: RefCell::new(state),
            bound: Cell::new(None),
            name: RefCell::new(None),
        })
    }
}

/// A parameter of the trace and the data it will be fed.
pub(crate) struct Binding {
    pub tensor: Weak<Inner>,
    pub tensor_id: u64,
    pub storage: Storage,
}

/// One step being recorded.
pub(crate) struct Trace {
    pub epoch: u64,
    pub graph: Graph,
    pub bindings: Vec<Binding>,
    /// Tensors that were pending in this trace when created or assigned.
    pub live: Vec<Weak<Inner>>,
    /// Running hash of the nodes `..hashed` (ops, which carry their types'
    /// determinants), kept up to date while recording so a cache-hit step does
    /// not rehash the whole trace.
    hasher: DefaultHasher,
    hashed: usize,
    /// Scalar constants broadcast to a shape, by (value bits, dtype, shape):
    /// recorded once per trace however often `x * 2.0` appears. Only looked up.
    pub constants: HashMap<(u64, DType, Shape), ValueId>,
    /// `live` is compacted (dead handles dropped) when it reaches this length,
    /// so dead tensors are released while recording, amortised O(1) per op.
    compact_at: usize,
}

impl Trace {
    pub fn new() -> Trace {
        Trace {
            epoch: NEXT_EPOCH.fetch_add(1, Ordering::Relaxed),
            graph: Graph::new(),
            bindings: Vec::new(),
            live: Vec::new(),
            hasher: DefaultHasher::new(),
            hashed: 0,
            compact_at: 64,
            constants: HashMap::new(),
        }
    }

    /// Folds nodes recorded since the last call into the running hash.
    pub fn catch_up_hash(&mut self) {
        // Index directly: `nodes().skip(n)` would walk the first n nodes again.
        for i in self.hashed..self.graph.len() {
            self.graph.node(kiln_compiler::ir::NodeId::from_index(i)).op.hash(&mut self.hasher);
        }
        self.hashed = self.graph.len();
    }

    /// Structural key of the trace as recorded: every node, the outputs and
    /// the aliases. Two traces with the same key prune and lower to the same
    /// program.
    pub fn raw_key(&mut self) -> u64 {
        self.catch_up_hash();
        let mut h = self.hasher.clone();
        self.graph.outputs().hash(&mut h);
        self.graph.aliases().hash(&mut h);
        h.finish()
    }
}

/// A compiled program and how a raw trace's parameters feed it.
pub(crate) struct CacheEntry {
    pub program: Rc<crate::program::Program>,
    /// `kept_params[i]`: the raw trace parameter feeding program parameter `i`.
    pub kept_params: Vec<u32>,
    /// Whether program parameter `i` is donated.
    pub donated: Vec<bool>,
    /// Nodes of the pruned program.
    pub nodes: usize,
}

/// Which machinery runs a finished step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Compile to StableHLO and run through the PJRT plugin (the default).
    Pjrt,
    /// Evaluate on kiln's reference interpreter on the host (f64 arithmetic:
    /// the correctness oracle for side-by-side convergence checks).
    Reference,
    /// Run every op the moment it is recorded, on candle-core CPU tensors:
    /// values can be read mid-step without cutting it (step-through
    /// debugging), and it is the eager baseline compilation is measured
    /// against (`crate::eager`).
    Eager,
}

pub(crate) struct Context {
    pub trace: Trace,
    pub backend: Backend,
    pub client: Option<Client>,
    /// How many replicas every step runs on and how the client is made:
    /// from the environment on first use, or set by [`crate::replicas`].
    pub plan: Option<ReplicaPlan>,
    /// Compiled programs by the raw trace's key (the hit path). Only looked
    /// up, never iterated.
    pub cache: HashMap<u64, Rc<CacheEntry>>,
    /// Compiled programs by their canonical key, so traces that optimize to
    /// the same program share one executable. Only looked up.
    pub programs: HashMap<CompileKey, Rc<crate::program::Program>>,
    /// Every program compiled or loaded in this context, oldest first: what a
    /// recompile is compared with to explain it.
    pub history: Vec<Rc<crate::program::Program>>,
    /// Steps in a row that needed a new program (the recompile-every-step warning).
    pub new_programs_in_a_row: u32,
    pub disk: DiskSetting,
    /// `KILN_SAVE_GRAPHS`, read once: where each new program's graph is saved.
    pub save_graphs: Option<Option<std::path::PathBuf>>,
}

/// The persistent cache of this context: read from the environment on the first
/// miss unless set explicitly.
pub(crate) enum DiskSetting {
    FromEnv,
    Off,
    On(DiskCache),
}

thread_local! {
    static CONTEXT: RefCell<Context> = RefCell::new(Context {
        trace: Trace::new(),
        backend: Backend::Pjrt,
        client: None,
        plan: None,
        cache: HashMap::new(),
        programs: HashMap::new(),
        history: Vec::new(),
        new_programs_in_a_row: 0,
        disk: DiskSetting::FromEnv,
        save_graphs: None,
    });
}

/// Runs `f` with the context borrowed. `f` must not call back into anything that
/// borrows the context (tensor ops, mark_step).
pub(crate) fn with<R>(f: impl FnOnce(&mut Context) -> R) -> R {
    CONTEXT.with(|c| f(&mut c.borrow_mut()))
}

impl Context {
    /// The value of `t` inside the current trace, binding it as a parameter if it
    /// is ready data.
    pub fn value_of(&mut self, op: &'static str, t: &Rc<Inner>) -> Result<ValueId> {
        let epoch = self.trace.epoch;
        match &*t.state.borrow() {
            State::Pending { epoch: e, value } if *e == epoch => Ok(*value),
            State::Pending { .. } => Err(FrontendError::StaleTensor { op }),
            State::Ready(storage) => {
                if let Some((e, v)) = t.bound.get() {
                    if e == epoch {
                        return Ok(v);
                    }
                }
                let v = self.trace.graph.parameter(t.ty.clone());
                self.trace.bindings.push(Binding {
                    tensor: Rc::downgrade(t),
                    tensor_id: t.id,
                    storage: storage.clone(),
                });
                t.bound.set(Some((epoch, v)));
                Ok(v)
            }
        }
    }

    /// Records `op` and returns a pending tensor for its first output.
    pub fn push(&mut self, op: Op) -> Result<Rc<Inner>> {
        let id = self.trace.graph.add(op)?;
        Ok(self.pending(ValueId::from(id)))
    }

    /// A new pending tensor for `value` of the current trace.
    pub fn pending(&mut self, value: ValueId) -> Rc<Inner> {
        metrics::update(|m| m.ops_recorded += 1);
        self.trace.catch_up_hash();
        let ty = self.trace.graph.ty(value).clone();
        let inner = Inner::new(ty, State::Pending { epoch: self.trace.epoch, value });
        self.track(&inner);
        if self.backend == Backend::Eager {
            // An op that fails here fails again, as an error, when read.
            let _ = crate::eager::catch_up(&self.trace);
        }
        inner
    }

    /// A pending tensor holding `value` of `dtype` broadcast to `shape`,
    /// shared with earlier requests for the same constant in this trace.
    pub fn constant(&mut self, value: f64, dtype: DType, shape: &Shape) -> Result<Rc<Inner>> {
        let key = (value.to_bits(), dtype, shape.clone());
        let v = match self.trace.constants.get(&key) {
            Some(&v) => v,
            None => {
                let c = self.trace.graph.value(Op::Constant { literal: Literal::scalar(dtype, value) })?;
                let v = if shape.rank() == 0 {
                    c
                } else {
                    self.trace.graph.value(Op::BroadcastInDim { input: c, shape: shape.clone(), dims: vec![] })?
                };
                self.trace.constants.insert(key, v);
                v
            }
        };
        Ok(self.pending(v))
    }

    /// Remembers a pending tensor of the current trace.
    pub fn track(&mut self, inner: &Rc<Inner>) {
        let t = &mut self.trace;
        if t.live.len() >= t.compact_at {
            t.live.retain(|w| w.strong_count() > 0);
            t.compact_at = (2 * t.live.len()).max(64);
        }
        t.live.push(Rc::downgrade(inner));
    }

    /// The replica plan: `PJRT_DEVICE`, `GPU_NUM_DEVICES` and
    /// `KILN_CPU_DEVICES` on first use, unless set explicitly.
    pub fn plan(&mut self) -> Result<&ReplicaPlan> {
        if self.plan.is_none() {
            let plan = kiln_runtime::replicas::replica_plan_from_env()?;
            if plan.replicas > 1 {
                tracing::info!(replicas = plan.replicas, source = ?plan.source, "kiln: data-parallel replicas");
            }
            self.plan = Some(plan);
        }
        Ok(self.plan.as_ref().expect("set above"))
    }

    /// Replicas every step runs on.
    pub fn replicas(&mut self) -> Result<usize> {
        Ok(self.plan()?.replicas)
    }

    pub fn client(&mut self) -> Result<Client> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let client = self.plan()?.create_client()?;
        tracing::info!(platform = %client.platform_name(), devices = client.devices().len(), "kiln: PJRT client ready");
        self.client = Some(client.clone());
        Ok(client)
    }
}

/// Selects the backend for this thread's later steps.
pub fn set_backend(backend: Backend) {
    with(|c| c.backend = backend);
}

pub fn backend() -> Backend {
    with(|c| c.backend)
}

/// Uses `client` for this thread's later steps (instead of one discovered from
/// the environment).
pub fn set_client(client: Client) {
    with(|c| {
        c.client = Some(client);
        c.clear_programs();
    });
}

/// Replaces the replica plan (and drops the client and programs made for the
/// old one). Tensors already on the devices keep their old replica count; a
/// step that mixes counts is refused.
pub(crate) fn set_plan(plan: ReplicaPlan) {
    with(|c| {
        c.plan = Some(plan);
        c.client = None;
        c.clear_programs();
    });
}

/// Drops this thread's in-memory compiled programs; later steps compile again
/// (or load from the disk cache).
pub fn clear_compile_cache() {
    with(|c| c.clear_programs());
}

/// Sets this thread's persistent compile cache: `Some(config)` uses that
/// directory, `None` turns the disk cache off. Without a call, the first step
/// that compiles reads the environment (`KILN_CACHE_DIR`, `KILN_CACHE`,
/// `KILN_CACHE_MAX_BYTES`, `KILN_CACHE_READONLY`; see
/// [`DiskCacheConfig::from_env`]).
pub fn set_disk_cache(config: Option<DiskCacheConfig>) -> Result<()> {
    let setting = match config {
        Some(config) => DiskSetting::On(DiskCache::open(config)?),
        None => DiskSetting::Off,
    };
    with(|c| c.disk = setting);
    Ok(())
}

impl Context {
    fn clear_programs(&mut self) {
        self.cache.clear();
        self.programs.clear();
        self.history.clear();
        self.new_programs_in_a_row = 0;
    }

    /// The disk cache, opened from the environment on first use.
    pub fn disk_cache(&mut self) -> Result<Option<DiskCache>> {
        if let DiskSetting::FromEnv = self.disk {
            self.disk = match DiskCacheConfig::from_env()? {
                Some(config) => DiskSetting::On(DiskCache::open(config)?),
                None => DiskSetting::Off,
            };
        }
        Ok(match &self.disk {
            DiskSetting::On(d) => Some(d.clone()),
            DiskSetting::Off | DiskSetting::FromEnv => None,
        })
    }

    /// `KILN_SAVE_GRAPHS`, read once.
    pub fn save_graphs_dir(&mut self) -> Option<std::path::PathBuf> {
        self.save_graphs
            .get_or_insert_with(|| std::env::var_os("KILN_SAVE_GRAPHS").filter(|v| !v.is_empty()).map(Into::into))
            .clone()
    }
}
