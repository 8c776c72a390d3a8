//! The per-thread lazy-tensor context: one home for the three parts of the
//! lazy engine, each in its own module with its own invariants.
//!
//! - [`crate::core::trace`]: the step being recorded (tensors, bindings, graph);
//! - [`crate::engine::program_cache`]: the program cache (raw-trace hits,
//!   canonical programs, the disk cache, recompile history); its miss path is
//!   `engine::compile`;
//! - [`crate::engine::executor`]: the backend, the client and replica plan, and
//!   the steps in flight.
//!
//! `mark_step` (`engine::step`) moves a closed trace through the cache to the
//! executor. The switches a user sets (the memory budget, checks, the mesh) are
//! not kept here but in `core::settings`.
//!
//! Invariants:
//! - The context is borrowed only inside [`with`], never across a call that
//!   may record ops, run a step or read a tensor (those borrow it again).
//! - On the eager backend every op recorded through the context runs at once;
//!   an op that fails there fails again, as an error, when it is read.
//! - A new client or replica plan drops the programs compiled for the old one.

use std::cell::RefCell;
use std::rc::Rc;

use kiln_compiler::ir::{DType, Op, Shape, ValueId};
use kiln_runtime::replicas::ReplicaPlan;
use kiln_runtime::{Client, DiskCache, DiskCacheConfig};

use crate::core::error::Result;
use crate::core::storage::Inner;
use crate::core::trace::Trace;
use crate::engine::executor::{Backend, Executor};
use crate::engine::program_cache::{DiskSetting, ProgramCache};

pub(crate) struct Context {
    pub trace: Trace,
    pub cache: ProgramCache,
    pub exec: Executor,
    /// The constants the composite matchers evaluated (masks, scales), kept
    /// across steps so that `grad`'s search stays O(nodes)
    /// (`kiln_compiler::composite::consts`).
    pub consts: kiln_compiler::composite::ConstCache,
}

thread_local! {
    static CONTEXT: RefCell<Context> = RefCell::new(Context {
        trace: Trace::new(),
        cache: ProgramCache::new(),
        exec: Executor::new(),
        consts: kiln_compiler::composite::ConstCache::new(),
    });
}

/// Runs `f` with the context borrowed. `f` must not call back into anything that
/// borrows the context (tensor ops, mark_step).
pub(crate) fn with<R>(f: impl FnOnce(&mut Context) -> R) -> R {
    CONTEXT.with(|c| f(&mut c.borrow_mut()))
}

impl Context {
    /// See [`Trace::value_of`].
    pub fn value_of(&mut self, op: &'static str, t: &Rc<Inner>) -> Result<ValueId> {
        self.trace.value_of(op, t)
    }

    /// See [`Trace::push`].
    pub fn push(&mut self, op: Op) -> Result<Rc<Inner>> {
        let inner = self.trace.push(op)?;
        self.run_eagerly();
        Ok(inner)
    }

    /// See [`Trace::pending`].
    pub fn pending(&mut self, value: ValueId) -> Rc<Inner> {
        let inner = self.trace.pending(value);
        self.run_eagerly();
        inner
    }

    /// See [`Trace::constant`].
    pub fn constant(&mut self, value: f64, dtype: DType, shape: &Shape) -> Result<Rc<Inner>> {
        let inner = self.trace.constant(value, dtype, shape)?;
        self.run_eagerly();
        Ok(inner)
    }

    /// On the eager backend, runs the ops recorded since the last call. An op
    /// that fails here fails again, as an error, when it is read.
    fn run_eagerly(&self) {
        if self.exec.backend == Backend::Eager {
            let _ = crate::engine::eager::catch_up(&self.trace);
        }
    }

    /// See [`Trace::track`].
    pub fn track(&mut self, inner: &Rc<Inner>) {
        self.trace.track(inner)
    }

    /// Replicas every step runs on.
    pub fn replicas(&mut self) -> Result<usize> {
        Ok(self.exec.plan()?.replicas)
    }

    pub fn client(&mut self) -> Result<Client> {
        self.exec.client()
    }

    fn clear_programs(&mut self) {
        self.cache.clear();
    }
}

/// This thread's PJRT client, opened from the environment the first time
/// (`PJRT_DEVICE`, the replica plan) unless one was set.
pub fn client() -> Result<Client> {
    with(|c| c.client())
}

/// Selects the backend for this thread's later steps.
pub fn set_backend(backend: Backend) {
    with(|c| c.exec.backend = backend);
}

pub fn backend() -> Backend {
    with(|c| c.exec.backend)
}

/// Uses `client` for this thread's later steps (instead of one discovered from
/// the environment).
pub fn set_client(client: Client) {
    with(|c| {
        c.exec.client = Some(client);
        c.clear_programs();
    });
}

/// Replaces the replica plan (and drops the client and programs made for the
/// old one). Tensors already on the devices keep their old replica count; a
/// step that mixes counts is refused.
pub(crate) fn set_plan(plan: ReplicaPlan) {
    with(|c| {
        c.exec.plan = Some(plan);
        c.exec.client = None;
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
    with(|c| c.cache.disk = setting);
    Ok(())
}
