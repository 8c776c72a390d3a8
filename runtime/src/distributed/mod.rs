//! Several processes in one run: identity, the key-value store PJRT needs,
//! the start-up barrier, and the watchdog that ends a run whose peer died.
//!
//! Where it runs: [`crate::ReplicaPlan::create_client`] calls [`join`] before
//! the client is made when `KILN_NUM_NODES > 1`; the client then gets the
//! session's store through PJRT's client-creation callbacks
//! (`runtime/src/pjrt/kv.rs`). The GPU plugin does the rest (topology
//! exchange, NCCL ids) through that store.
//!
//! Invariants:
//! - one session per process, kept for the life of the process: the plugin
//!   may call the store at any time (NCCL ids are fetched at first
//!   execution), so the store must outlive every client;
//! - every key is scoped `kiln/<run>/<attempt>/`: a restarted attempt never
//!   reads an earlier attempt's keys;
//! - no wait is unbounded: nodes that have not all arrived within
//!   `startup_ms` end with `NodesMissing` naming the absent nodes; once
//!   running, a node silent for `peer_ms` (or an unreachable coordinator)
//!   makes every other node print `PeersLost` / `CoordinatorLost` naming it
//!   and exit with [`EXIT_PEER_LOST`] within [`Timeouts::failure_bound`].
//!   Exit (not an error value) because a collective whose peer died blocks
//!   inside NCCL and PJRT cannot cancel it.

pub mod auth;
pub mod identity;
pub mod server;
pub mod store;
pub mod tcp;
pub mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use auth::RunToken;
pub use identity::{Identity, NodeEnv, Timeouts, EXIT_GRACE};
pub use server::{Limits, ServerConfig, StoreServer};
pub use store::{KeyValueStore, MemoryStore, RunScope, Scoped, StoreHandle};
pub use tcp::TcpStore;

use crate::error::{Result, RuntimeError};

/// Exit status of a process the watchdog ends (a peer or the coordinator
/// was lost). `kiln launch` reports it by name.
pub const EXIT_PEER_LOST: i32 = 75;

/// How long one store request may take to connect and answer (blocking
/// `get`s add their own timeout).
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Keys kiln itself uses in the run's scope (the plugin's live beside them).
fn arrived_key(node: u32) -> String {
    format!("arrived/{node}")
}
fn done_key(node: u32) -> String {
    format!("done/{node}")
}

/// This process's place in a run of several processes.
pub struct Session {
    identity: Identity,
    tcp: Arc<TcpStore>,
    store: Arc<Scoped<Arc<TcpStore>>>,
    _server: Option<StoreServer>,
    finished: Arc<AtomicBool>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("identity", &self.identity).finish()
    }
}

static SESSION: OnceLock<Arc<Session>> = OnceLock::new();
static JOINING: Mutex<()> = Mutex::new(());

/// The session of this process, if it joined a run.
pub fn session() -> Option<Arc<Session>> {
    SESSION.get().cloned()
}

/// Joins the run `identity` describes (once per process; later calls return
/// the same session): starts the store server on node 0 unless a launcher
/// serves it, waits for every node at the start-up barrier, and starts the
/// watchdog.
pub fn join(identity: &Identity) -> Result<Arc<Session>> {
    let _guard = JOINING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = SESSION.get() {
        return Ok(s.clone());
    }
    bind_to_launcher()?;
    let session = Arc::new(Session::start(identity.clone())?);
    session.spawn_watchdog(WatchdogAction::Exit);
    let _ = SESSION.set(session.clone());
    Ok(session)
}

/// Under `kiln launch` (`KILN_LAUNCHER_PID` names the launcher): the node
/// asks the kernel for SIGKILL when the launcher dies, so a launcher killed
/// with SIGKILL (which cannot pass it on) leaves no node running. Does
/// nothing for a process whose parent is not the launcher (a node started
/// through a shell: the launcher's stop still reaches its process group), nor
/// outside a launch. Called at the `kiln` binary's start and when a node
/// joins its run; idempotent. A launcher already gone is an error
/// ([`EXIT_PEER_LOST`] is the exit a caller gives it).
pub fn bind_to_launcher() -> Result<()> {
    let Some(text) = crate::env::string_var(identity::ENV_LAUNCHER_PID)? else { return Ok(()) };
    let launcher: i32 = text.trim().parse().map_err(|_| RuntimeError::BadNodeEnv {
        var: identity::ENV_LAUNCHER_PID,
        value: text.clone(),
        expected: "the launcher's process id",
    })?;
    let parent = nix::unistd::getppid().as_raw();
    if parent != launcher {
        // Started through another process (a shell), or adopted because the
        // launcher died: the launcher is then among the ancestors, or not.
        return if ancestors(parent).contains(&launcher) {
            Ok(())
        } else {
            Err(RuntimeError::LauncherGone { pid: launcher })
        };
    }
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .map_err(|e| RuntimeError::Os { call: "prctl(PR_SET_PDEATHSIG)", reason: e.to_string() })?;
    // The launcher may have died between the two calls.
    if nix::unistd::getppid().as_raw() != launcher {
        return Err(RuntimeError::LauncherGone { pid: launcher });
    }
    tracing::debug!(launcher, "kiln: this node dies with its launcher");
    Ok(())
}

/// `pid` and its ancestors, from `/proc` (at most 64; empty without `/proc`).
fn ancestors(pid: i32) -> Vec<i32> {
    let mut chain = Vec::new();
    let mut at = pid;
    while at > 1 && chain.len() < 64 {
        chain.push(at);
        // `pid (comm) state ppid ...`: the command may hold spaces and
        // parentheses, so fields are counted after the last ')'.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{at}/stat")) else { break };
        let Some(ppid) = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
        else {
            break;
        };
        at = ppid;
    }
    chain
}

/// What the watchdog does when it finds a lost peer.
#[derive(Clone)]
pub enum WatchdogAction {
    /// Print the error and exit with [`EXIT_PEER_LOST`] at once (no
    /// destructors).
    Exit,
    /// Hand the error to a callback and stop watching (tests).
    Report(Arc<dyn Fn(RuntimeError) + Send + Sync>),
}

impl Session {
    /// Connects (and serves, on node 0) and passes the start-up barrier; no
    /// watchdog yet. Most callers want [`join`].
    pub fn start(identity: Identity) -> Result<Session> {
        let coordinator =
            identity.coordinator.clone().ok_or(RuntimeError::MissingCoordinator { num_nodes: identity.num_nodes })?;
        let token = identity.token.as_ref();
        let server = if identity.serves_store {
            Some(StoreServer::bind(&coordinator, ServerConfig::new(identity.token.clone(), identity.num_nodes))?)
        } else {
            None
        };
        let tcp = Arc::new(TcpStore::new(&coordinator, token, IO_TIMEOUT)?);
        let store = Arc::new(Scoped::new(tcp.clone(), &identity.scope));
        let session = Session { identity, tcp, store, _server: server, finished: Arc::new(AtomicBool::new(false)) };
        session.barrier()?;
        Ok(session)
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The run-scoped store (what the plugin's callbacks reach).
    pub fn store(&self) -> StoreHandle {
        StoreHandle(self.store.clone())
    }

    /// Waits until every node has put its `arrived` key; the nodes still
    /// absent at the deadline are named in `NodesMissing`.
    fn barrier(&self) -> Result<()> {
        let id = &self.identity;
        let started = Instant::now();
        let deadline = started + Duration::from_millis(id.timeouts.startup_ms);
        let me = arrived_key(id.node_id);
        // Node 0's server may not listen yet: retry until the deadline.
        loop {
            match self.store.put(&me, &id.node_id.to_le_bytes()) {
                Ok(()) => break,
                Err(RuntimeError::KvUnavailable { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(RuntimeError::KvUnavailable { .. }) => {
                    return Err(self.missing(started, (0..id.num_nodes).filter(|&n| n != id.node_id).collect()))
                }
                Err(e) => return Err(e),
            }
        }
        let _ = self.tcp.beat(&id.scope.prefix(), id.node_id, id.num_nodes, Duration::from_millis(id.timeouts.peer_ms));
        loop {
            let mut missing = Vec::new();
            for n in 0..id.num_nodes {
                match self.store.try_get(&arrived_key(n)) {
                    Ok(_) => {}
                    Err(RuntimeError::KvNotFound { .. }) => missing.push(n),
                    Err(e) => return Err(e),
                }
            }
            if missing.is_empty() {
                tracing::info!(node = id.node_id, nodes = id.num_nodes, "kiln: every node arrived");
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.missing(started, missing));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn missing(&self, started: Instant, missing: Vec<u32>) -> RuntimeError {
        RuntimeError::NodesMissing {
            missing,
            num_nodes: self.identity.num_nodes,
            waited_ms: started.elapsed().as_millis() as u64,
            coordinator: self.tcp.addr().to_string(),
            me: self.identity.node_id,
        }
    }

    /// One watchdog round: beats, then returns the error that should end
    /// the process, if any. `last_ok` is when the store last answered.
    pub fn watch_once(&self, last_ok: &mut Instant) -> Option<RuntimeError> {
        let id = &self.identity;
        let peer = Duration::from_millis(id.timeouts.peer_ms);
        match self.tcp.beat(&id.scope.prefix(), id.node_id, id.num_nodes, peer) {
            Ok(stale) => {
                *last_ok = Instant::now();
                // A node that finished cleanly stops beating; it is not lost.
                let lost: Vec<u32> = stale
                    .into_iter()
                    .filter(|&n| n != id.node_id && self.store.try_get(&done_key(n)).is_err())
                    .collect();
                (!lost.is_empty()).then_some(RuntimeError::PeersLost {
                    nodes: lost,
                    timeout_ms: id.timeouts.peer_ms,
                    me: id.node_id,
                })
            }
            Err(err) if last_ok.elapsed() > peer => Some(RuntimeError::CoordinatorLost {
                coordinator: self.tcp.addr().to_string(),
                timeout_ms: id.timeouts.peer_ms,
                reason: err.to_string(),
                me: id.node_id,
            }),
            Err(_) => None,
        }
    }

    /// Starts the heartbeat/watchdog thread.
    pub fn spawn_watchdog(self: &Arc<Self>, action: WatchdogAction) {
        let session = Arc::downgrade(self);
        let interval = self.identity.timeouts.heartbeat_interval();
        let finished = self.finished.clone();
        let spawned = std::thread::Builder::new().name("kiln-watchdog".into()).spawn(move || {
            let mut last_ok = Instant::now();
            loop {
                std::thread::sleep(interval);
                if finished.load(Ordering::Acquire) {
                    return;
                }
                let Some(s) = session.upgrade() else { return };
                let Some(err) = s.watch_once(&mut last_ok) else { continue };
                if s.finished.load(Ordering::Acquire) {
                    return;
                }
                match &action {
                    WatchdogAction::Report(f) => {
                        f(err);
                        return;
                    }
                    WatchdogAction::Exit => end_process(&err),
                }
            }
        });
        if let Err(err) = spawned {
            tracing::error!(%err, "kiln: cannot start the watchdog thread; a lost peer may hang this node");
        }
    }

    /// Marks this node done (peers stop watching it) and, on the node that
    /// serves the store, waits up to the peer timeout for the others to be
    /// done too, so the store is not taken away from a node still finishing.
    pub fn finish(&self) {
        let id = &self.identity;
        if let Err(err) = self.store.put(&done_key(id.node_id), b"") {
            tracing::warn!(%err, "kiln: could not mark this node done");
        }
        self.finished.store(true, Ordering::Release);
        if self._server.is_some() {
            let deadline = Instant::now() + Duration::from_millis(id.timeouts.peer_ms);
            for n in 0..id.num_nodes {
                let left = deadline.saturating_duration_since(Instant::now());
                if self.store.get(&done_key(n), left).is_err() {
                    tracing::warn!(node = n, "kiln: node did not finish before the store closes");
                }
            }
        }
    }

    /// Waits until `key` of this run exists (bounded by the peer timeout per
    /// try, and by the watchdog overall).
    pub fn wait_for(&self, key: &str) -> Result<Vec<u8>> {
        self.store.get(key, Duration::from_millis(self.identity.timeouts.startup_ms))
    }

    /// Puts `key` in this run's scope.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.put(key, value)
    }
}

/// Prints `err`, then ends the process with [`EXIT_PEER_LOST`] at once,
/// without exit handlers or destructors: after a peer died, a plugin
/// destructor can wait forever on the collective it shared with it (seen on
/// two H200s: `exit` hung past [`EXIT_GRACE`] and the old guard aborted, 134).
fn end_process(err: &RuntimeError) -> ! {
    use std::io::Write as _;
    eprintln!("kiln: error: {err}");
    tracing::error!(%err, "kiln: ending this node");
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    crate::pjrt::exit_immediately(EXIT_PEER_LOST)
}

/// Marks this process's session (if any) finished: call at the end of a
/// successful run.
pub fn finish() {
    if let Some(s) = session() {
        s.finish();
    }
}
