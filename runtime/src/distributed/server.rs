//! The store's TCP server: run by node 0 (or by `kiln launch`), one tokio
//! task per connection.
//!
//! Why tokio: a blocking `get` holds its connection until the key appears or
//! its deadline passes, and the plugin issues many at once (every node waits
//! for the global topology, then for NCCL ids); an async server parks each
//! waiter as a small task instead of a thread, and tokio's timers give the
//! deadlines. It is the maintained, widely used choice for this in Rust.
//!
//! Invariants: a waiting `GET` is woken by every insert (a watch channel
//! carries a version number) and answers `Deadline` once its own timeout
//! passes; a malformed request closes only its own connection; dropping the
//! [`StoreServer`] stops the runtime, closing every connection.
//! Liveness: `BEAT` records when each node of a run prefix last beat and
//! answers which nodes, having beaten before, have been silent longer than
//! the caller's threshold.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::store::MemoryStore;
use super::wire::{self, Op, Request, Status};
use crate::error::{Result, RuntimeError};

struct Shared {
    store: MemoryStore,
    version: watch::Sender<u64>,
    beats: Mutex<HashMap<(String, u32), Instant>>,
}

/// A running store server. Stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    // Dropped last: shuts the runtime (and every connection) down.
    runtime: Option<tokio::runtime::Runtime>,
}

impl StoreServer {
    /// Binds `addr` (`127.0.0.1:0` picks a free port) and starts serving.
    pub fn bind(addr: &str) -> Result<StoreServer> {
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
        let shared = Arc::new(Shared { store: MemoryStore::new(), version, beats: Mutex::new(HashMap::new()) });
        let accept_shared = shared.clone();
        runtime.spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let shared = accept_shared.clone();
                        tokio::spawn(async move {
                            if let Err(err) = serve(stream, &shared).await {
                                tracing::debug!(%err, "kv server: connection ended with an error");
                            }
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

    /// Nodes of `prefix` that beat before and have been silent for longer
    /// than `stale_after`, as the server sees them now.
    pub fn stale_nodes(&self, prefix: &str, num_nodes: u32, stale_after: Duration) -> Vec<u32> {
        stale(&self.shared, prefix, num_nodes, stale_after)
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn stale(shared: &Shared, prefix: &str, num_nodes: u32, stale_after: Duration) -> Vec<u32> {
    let beats = shared.beats.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    (0..num_nodes)
        .filter(|&n| beats.get(&(prefix.to_string(), n)).is_some_and(|&t| now.duration_since(t) > stale_after))
        .collect()
}

async fn serve(mut stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let req = match wire::read_request(&mut stream).await {
        Ok(req) => req,
        Err(err) => {
            let msg = err.to_string();
            wire::write_response(&mut stream, Status::BadRequest, msg.as_bytes()).await?;
            return Err(err);
        }
    };
    let (status, bytes) = answer(req, shared).await;
    wire::write_response(&mut stream, status, &bytes).await
}

async fn answer(req: Request, shared: &Shared) -> (Status, Vec<u8>) {
    let Request { op, key, payload } = req;
    match op {
        Op::Put => match shared.store.insert(&key, &payload) {
            Ok(_) => {
                shared.version.send_modify(|v| *v += 1);
                (Status::Ok, Vec::new())
            }
            Err(_) => (Status::AlreadyExists, Vec::new()),
        },
        Op::TryGet => match shared.store.lookup(&key) {
            Some(v) => (Status::Ok, v.to_vec()),
            None => (Status::NotFound, Vec::new()),
        },
        Op::Get => {
            let Some(timeout_ms) = wire::parse_u64(&payload) else {
                return (Status::BadRequest, b"GET needs an 8-byte timeout".to_vec());
            };
            let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
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
        Op::Beat => {
            let Some((node, num_nodes, stale_ms)) = wire::parse_beat(&payload) else {
                return (Status::BadRequest, b"BEAT needs 16 bytes".to_vec());
            };
            shared.beats.lock().unwrap_or_else(|p| p.into_inner()).insert((key.clone(), node), Instant::now());
            let nodes = stale(shared, &key, num_nodes, Duration::from_millis(stale_ms));
            (Status::Ok, nodes.iter().flat_map(|n| n.to_le_bytes()).collect())
        }
    }
}
