//! The store's TCP server: run by node 0 (or by `kiln launch`), one tokio
//! task per connection, serving one run of a known number of nodes.
//!
//! Why tokio: a blocking `get` holds its connection until the key appears or
//! its deadline passes, and the plugin issues many at once (every node waits
//! for the global topology, then for NCCL ids); an async server parks each
//! waiter as a small task instead of a thread, and tokio's timers give the
//! deadlines. It is the maintained, widely used choice for this in Rust.
//!
//! Invariants:
//! - nothing changes state before the request's tag is verified
//!   ([`super::wire`]): an unauthenticated, replayed or malformed request is
//!   answered with its refusal and its connection closed;
//! - every field is bounded before use: key and value lengths by the wire
//!   format; `BEAT`'s `num_nodes` must equal the run's and its node id be
//!   below it; the store holds at most [`Limits::max_store_bytes`] and the
//!   liveness table at most [`Limits::max_runs`] run prefixes;
//! - every connection is bounded in time: the whole request must arrive
//!   within [`Limits::request_timeout`], a response be taken within it too;
//!   a `GET` waits for its own timeout, at most [`MAX_GET_WAIT`];
//! - at most [`Limits::max_connections`] connections are served. When all
//!   are taken, a new one evicts the oldest connection that has not yet
//!   authenticated its request's head (that one is answered `BUSY` and
//!   closed); with none such, the new one is answered `BUSY` and closed at
//!   once. So a flood of half-open connections never queues and never keeps
//!   an honest client out for longer than one round trip; only token holders
//!   can hold slots for long (a waiting `GET`);
//! - a node id is bound to the first client that beats for it: each client
//!   sends a random 16-byte client id inside every authenticated request, and
//!   a `BEAT` for a node already held by another client id is refused
//!   `NODE_CLAIMED` without touching its liveness. This stops a second
//!   process started with the same `KILN_NODE_ID`, and, with the tags, any
//!   process without the token, from keeping a dead node "alive". (A process
//!   holding the token is trusted: it can write the run's keys anyway.)
//!
//! A waiting `GET` is woken by every insert (a watch channel carries a
//! version number) and answers `Deadline` once its own timeout passes;
//! dropping the [`StoreServer`] stops the runtime, closing every connection.
//! Liveness: `BEAT` records when each node of a run prefix last beat and
//! answers which nodes, having beaten before, have been silent longer than
//! the caller's threshold.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

use super::auth::{self, MacKey, RunToken};
use super::identity::MAX_NODES;
use super::store::MemoryStore;
use super::wire::{self, Hello, Op, Request, Status, WireError, UNVERIFIED};
use crate::error::{Result, RuntimeError};

/// The longest a `GET` may wait (PJRT's own waits are minutes at most).
pub const MAX_GET_WAIT: Duration = Duration::from_secs(3600);

/// How much the server holds at most; see the module's invariants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (waiting `GET`s included).
    pub max_connections: usize,
    /// How long a client may take to send its whole request, and to take
    /// the response.
    pub request_timeout: Duration,
    /// Bytes of keys and values the store holds (every attempt of the run).
    pub max_store_bytes: usize,
    /// Run prefixes (`kiln/<run>/<attempt>/`) the liveness table tracks.
    pub max_runs: usize,
}

impl Limits {
    /// The limits for a run of `num_nodes`: 256 connections plus 4 per node
    /// (each node has a few `GET`s waiting at once at start-up); 10 s per
    /// request (clients send theirs at once; a value of 8 MiB needs a link
    /// of at least 7 Mbit/s); 64 MiB plus 64 KiB per node of keys and
    /// values (a run stores a few KiB per node and attempt, the global
    /// topology once per attempt); 1024 run prefixes (restarts).
    pub fn for_nodes(num_nodes: u32) -> Limits {
        let n = num_nodes.min(MAX_NODES) as usize;
        Limits {
            max_connections: 256 + 4 * n,
            request_timeout: Duration::from_secs(10),
            max_store_bytes: (64 << 20) + n * (64 << 10),
            max_runs: 1024,
        }
    }
}

/// What a server serves: the run's token and size.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The run's secret; `None` only on a loopback address.
    pub token: Option<RunToken>,
    /// Nodes of the run (every `BEAT` must say the same).
    pub num_nodes: u32,
    pub limits: Limits,
}

impl ServerConfig {
    /// The configuration of a run of `num_nodes` with the default limits.
    pub fn new(token: Option<RunToken>, num_nodes: u32) -> ServerConfig {
        ServerConfig { token, num_nodes, limits: Limits::for_nodes(num_nodes) }
    }
}

/// Liveness of one run prefix: when each node last beat, and which client
/// holds it.
struct RunBeats {
    last: Vec<Option<Instant>>,
    holder: Vec<Option<[u8; 16]>>,
}

struct Shared {
    store: MemoryStore,
    version: watch::Sender<u64>,
    beats: Mutex<HashMap<String, RunBeats>>,
    mac: MacKey,
    num_nodes: u32,
    limits: Limits,
    gate: Gate,
    refusals: Mutex<HashMap<Status, u64>>,
}

/// A running store server. Stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    // Dropped last: shuts the runtime (and every connection) down.
    runtime: Option<tokio::runtime::Runtime>,
}

impl StoreServer {
    /// Binds `addr` (`127.0.0.1:0` picks a free port) and starts serving the
    /// run `config` describes. An address that is not loopback needs a
    /// token (`MissingRunToken`).
    pub fn bind(addr: &str, config: ServerConfig) -> Result<StoreServer> {
        auth::require_token(addr, config.token.as_ref())?;
        if config.num_nodes == 0 || config.num_nodes > MAX_NODES {
            return Err(RuntimeError::BadNodeEnv {
                var: super::identity::ENV_NUM_NODES,
                value: config.num_nodes.to_string(),
                expected: "a whole number of processes from 1 to 4096",
            });
        }
        let mac = MacKey::new(config.token.as_ref())?;
        let unavailable = |reason: String| RuntimeError::KvUnavailable { addr: addr.to_string(), reason };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kiln-kv-server")
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| unavailable(format!("cannot start the server's runtime: {e}")))?;
        let listener =
            runtime.block_on(TcpListener::bind(addr)).map_err(|e| unavailable(format!("cannot listen: {e}")))?;
        let local = listener.local_addr().map_err(|e| unavailable(e.to_string()))?;
        let (version, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            store: MemoryStore::bounded(config.limits.max_store_bytes),
            version,
            beats: Mutex::new(HashMap::new()),
            mac,
            num_nodes: config.num_nodes,
            gate: Gate::new(config.limits.max_connections),
            limits: config.limits,
            refusals: Mutex::new(HashMap::new()),
        });
        let accept_shared = shared.clone();
        runtime.spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let Some(slot) = Gate::admit(&accept_shared) else {
                            // No slot: say so without waiting, and close.
                            let _ = stream.try_write(&wire::encode_hello(Hello::Busy));
                            accept_shared.count(Status::Busy);
                            continue;
                        };
                        let shared = accept_shared.clone();
                        tokio::spawn(async move {
                            if let Err(err) = serve(stream, &shared, &slot).await {
                                tracing::debug!(%err, "kv server: connection refused");
                            }
                            drop(slot);
                        });
                    }
                    Err(err) => {
                        // Out of file descriptors and the like: back off
                        // instead of spinning.
                        tracing::warn!(%err, "kv server: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        tracing::info!(addr = %local, "kiln key-value store serving");
        Ok(StoreServer { addr: local, shared, runtime: Some(runtime) })
    }

    /// The address it listens on (with the real port when bound to `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Number of keys stored (all runs).
    pub fn len(&self) -> usize {
        self.shared.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of keys and values stored.
    pub fn bytes(&self) -> usize {
        self.shared.store.bytes()
    }

    /// Connections being served now.
    pub fn open_connections(&self) -> usize {
        self.shared.gate.open()
    }

    /// How many requests were refused with `status` so far.
    pub fn refusals(&self, status: Status) -> u64 {
        self.shared.refusals.lock().unwrap_or_else(|p| p.into_inner()).get(&status).copied().unwrap_or(0)
    }

    /// Nodes of `prefix` that beat before and have been silent for longer
    /// than `stale_after`, as the server sees them now.
    pub fn stale_nodes(&self, prefix: &str, stale_after: Duration) -> Vec<u32> {
        let beats = self.shared.beats.lock().unwrap_or_else(|p| p.into_inner());
        beats.get(prefix).map_or_else(Vec::new, |run| stale(run, stale_after))
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Shared {
    fn count(&self, status: Status) {
        *self.refusals.lock().unwrap_or_else(|p| p.into_inner()).entry(status).or_insert(0) += 1;
    }
}

fn stale(run: &RunBeats, stale_after: Duration) -> Vec<u32> {
    let now = Instant::now();
    (0u32..)
        .zip(&run.last)
        .filter(|(_, t)| t.is_some_and(|t| now.duration_since(t) > stale_after))
        .map(|(n, _)| n)
        .collect()
}

/// The connection slots (see the module's invariants).
struct Gate {
    max: usize,
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    open: usize,
    next: u64,
    /// Connections still before their head's tag, oldest first.
    unauthenticated: VecDeque<(u64, Arc<Notify>)>,
}

/// One admitted connection; frees its slot when dropped.
struct Slot {
    shared: Arc<Shared>,
    id: u64,
    evicted: Arc<Notify>,
}

impl Gate {
    fn new(max: usize) -> Gate {
        Gate { max: max.max(1), state: Mutex::new(GateState::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // Every update is a few integer and queue operations, never left
        // half-done by a panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open(&self) -> usize {
        self.lock().open
    }

    /// A slot for a new connection, evicting the oldest unauthenticated one
    /// when all are taken; `None` when every slot is authenticated.
    fn admit(shared: &Arc<Shared>) -> Option<Slot> {
        let gate = &shared.gate;
        let mut s = gate.lock();
        // Slots whose eviction is under way still count in `open` until
        // their task ends; bound them by evicting only while below 2·max.
        if s.open >= gate.max {
            if s.open >= 2 * gate.max {
                return None;
            }
            let (_, victim) = s.unauthenticated.pop_front()?;
            victim.notify_one();
        }
        s.open += 1;
        let id = s.next;
        s.next += 1;
        let evicted = Arc::new(Notify::new());
        s.unauthenticated.push_back((id, evicted.clone()));
        Some(Slot { shared: shared.clone(), id, evicted })
    }
}

impl Slot {
    /// The request's head verified: no longer evictable.
    fn authenticated(&self) {
        let mut s = self.shared.gate.lock();
        s.unauthenticated.retain(|(id, _)| *id != self.id);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.shared.gate.lock();
        s.open = s.open.saturating_sub(1);
        s.unauthenticated.retain(|(id, _)| *id != self.id);
    }
}

/// Why a connection ended without an answer to a valid request.
#[derive(Debug)]
enum Ended {
    Refused(WireError),
    Evicted,
    TimedOut,
    Io(std::io::Error),
    NoRandomness,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Refused(e) => write!(f, "{e}"),
            Ended::Evicted => f.write_str("closed for a newer connection (every slot taken)"),
            Ended::TimedOut => f.write_str("the request did not arrive in time"),
            Ended::Io(e) => write!(f, "{e}"),
            Ended::NoRandomness => f.write_str("no random challenge"),
        }
    }
}

async fn send(stream: &mut TcpStream, bytes: &[u8], within: Duration) -> std::result::Result<(), Ended> {
    match tokio::time::timeout(within, wire::write_all(stream, bytes)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Ended::Io(e)),
        Err(_) => Err(Ended::TimedOut),
    }
}

async fn refuse(stream: &mut TcpStream, shared: &Shared, err: WireError) -> Ended {
    let status = err.status();
    shared.count(status);
    if !matches!(err, WireError::Io(_)) {
        let bytes = wire::encode_response(&shared.mac, &UNVERIFIED, status, err.to_string().as_bytes());
        let _ = send(stream, &bytes, shared.limits.request_timeout).await;
    }
    Ended::Refused(err)
}

async fn serve(mut stream: TcpStream, shared: &Shared, slot: &Slot) -> std::result::Result<(), Ended> {
    stream.set_nodelay(true).map_err(Ended::Io)?;
    let limit = shared.limits.request_timeout;
    let deadline = tokio::time::Instant::now() + limit;
    let challenge: [u8; 16] = auth::random().map_err(|_| Ended::NoRandomness)?;
    send(&mut stream, &wire::encode_hello(Hello::Challenge(challenge)), limit).await?;
    let head = tokio::select! {
        read = tokio::time::timeout_at(deadline, wire::read_head(&mut stream, &shared.mac, &challenge)) => match read {
            Ok(Ok(head)) => head,
            Ok(Err(err)) => return Err(refuse(&mut stream, shared, err).await),
            Err(_) => return Err(Ended::TimedOut),
        },
        () = slot.evicted.notified() => {
            shared.count(Status::Busy);
            let bytes = wire::encode_response(&shared.mac, &UNVERIFIED, Status::Busy, b"every connection slot is taken");
            let _ = stream.try_write(&bytes);
            return Err(Ended::Evicted);
        }
    };
    slot.authenticated();
    let req = match tokio::time::timeout_at(deadline, wire::read_body(&mut stream, &shared.mac, &challenge, head)).await
    {
        Ok(Ok(req)) => req,
        Ok(Err(err)) => return Err(refuse(&mut stream, shared, err).await),
        Err(_) => return Err(Ended::TimedOut),
    };
    let tag = req.tag;
    let (status, bytes) = answer(req, shared).await;
    if status.is_refusal() {
        shared.count(status);
    }
    send(&mut stream, &wire::encode_response(&shared.mac, &tag, status, &bytes), limit).await
}

async fn answer(req: Request, shared: &Shared) -> (Status, Vec<u8>) {
    let Request { op, client_id, key, payload, tag: _ } = req;
    match op {
        Op::Put => match shared.store.insert(&key, &payload) {
            Ok(_) => {
                shared.version.send_modify(|v| *v += 1);
                (Status::Ok, Vec::new())
            }
            Err(RuntimeError::KvAlreadyExists { .. }) => (Status::AlreadyExists, Vec::new()),
            Err(err) => (Status::Full, err.to_string().into_bytes()),
        },
        Op::TryGet => match shared.store.lookup(&key) {
            Some(v) => (Status::Ok, v.to_vec()),
            None => (Status::NotFound, Vec::new()),
        },
        Op::Get => {
            let Some(timeout_ms) = wire::parse_u64(&payload) else {
                return (Status::BadRequest, b"GET needs an 8-byte timeout".to_vec());
            };
            let wait = Duration::from_millis(timeout_ms).min(MAX_GET_WAIT);
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                // Subscribe before looking, so an insert between the look
                // and the wait still wakes this waiter.
                let mut rx = shared.version.subscribe();
                if let Some(v) = shared.store.lookup(&key) {
                    return (Status::Ok, v.to_vec());
                }
                match tokio::time::timeout_at(deadline, rx.changed()).await {
                    Ok(Ok(())) => continue,
                    Ok(Err(_)) | Err(_) => return (Status::Deadline, Vec::new()),
                }
            }
        }
        Op::Beat => beat(shared, &key, client_id, &payload),
    }
}

fn beat(shared: &Shared, prefix: &str, client_id: [u8; 16], payload: &[u8]) -> (Status, Vec<u8>) {
    let Some((node, num_nodes, stale_ms)) = wire::parse_beat(payload) else {
        return (Status::BadRequest, b"BEAT needs 16 bytes".to_vec());
    };
    if num_nodes != shared.num_nodes {
        let msg = format!("BEAT for a run of {num_nodes} nodes; this run has {}", shared.num_nodes);
        return (Status::BadRequest, msg.into_bytes());
    }
    if node >= num_nodes {
        return (Status::BadRequest, format!("BEAT for node {node} of a run of {num_nodes}").into_bytes());
    }
    let mut beats = shared.beats.lock().unwrap_or_else(|p| p.into_inner());
    if !beats.contains_key(prefix) && beats.len() >= shared.limits.max_runs {
        let msg = format!("the liveness table holds {} runs, its limit", beats.len());
        return (Status::Full, msg.into_bytes());
    }
    let n = num_nodes as usize;
    let run =
        beats.entry(prefix.to_string()).or_insert_with(|| RunBeats { last: vec![None; n], holder: vec![None; n] });
    let i = node as usize;
    match run.holder[i] {
        Some(holder) if holder != client_id => {
            let msg = format!("node {node} of {prefix} is held by another client (a second process with its id?)");
            return (Status::NodeClaimed, msg.into_bytes());
        }
        Some(_) => {}
        None => run.holder[i] = Some(client_id),
    }
    run.last[i] = Some(Instant::now());
    let nodes = stale(run, Duration::from_millis(stale_ms));
    (Status::Ok, nodes.iter().flat_map(|n| n.to_le_bytes()).collect())
}
