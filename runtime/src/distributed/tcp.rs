//! `TcpStore`: the client side of the store, one short TCP connection per
//! request to the [`super::server::StoreServer`], every request tagged with
//! the run's token ([`super::wire`]).
//!
//! Invariants: every call is bounded in time — connecting and a `try_get` or
//! `put` by [`TcpStore::io_timeout`], a `get` by its own timeout plus that —
//! so a dead server turns into `KvUnavailable`, never a hang. A server with
//! no free slot (`BUSY`) is tried again within the same bound. An answer is
//! only acted on when its tag binds it to this very request; a refusal is
//! `KvRefused` naming its status, an untagged one marked as such. A key or
//! value over the wire's limits is refused here, before anything is sent.
//! Each client has a random client id, the identity its `BEAT`s claim a
//! node with. Safe to call from any thread, concurrently (the plugin does).

use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::auth::{self, MacKey, RunToken};
use super::store::KeyValueStore;
use super::wire::{self, Hello, Op, Response, Status, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::error::{Result, RuntimeError};

/// A connection-per-request client of one store server.
pub struct TcpStore {
    addr: String,
    io_timeout: Duration,
    mac: MacKey,
    client_id: [u8; 16],
    runtime: tokio::runtime::Runtime,
}

impl TcpStore {
    /// A client for the server at `addr` (`host:port`) of the run with
    /// `token` (`None`: a loopback run without one). Nothing is connected
    /// until the first request.
    pub fn new(addr: &str, token: Option<&RunToken>, io_timeout: Duration) -> Result<TcpStore> {
        auth::require_token(addr, token)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kiln-kv-client")
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| RuntimeError::KvUnavailable {
                addr: addr.to_string(),
                reason: format!("cannot start the client's runtime: {e}"),
            })?;
        Ok(TcpStore {
            addr: addr.to_string(),
            io_timeout,
            mac: MacKey::new(token)?,
            client_id: auth::random()?,
            runtime,
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// How long connecting and a non-blocking request may take.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    fn unavailable(&self, reason: String) -> RuntimeError {
        RuntimeError::KvUnavailable { addr: self.addr.clone(), reason }
    }

    fn request(&self, op: Op, key: &str, payload: &[u8], wait: Duration) -> Result<(Status, Vec<u8>)> {
        let too_large = |what: String| RuntimeError::KvRefused {
            addr: self.addr.clone(),
            refusal: Status::TooLarge,
            reason: format!("{what} (refused before sending)"),
        };
        if key.len() > MAX_KEY_BYTES {
            return Err(too_large(format!("a key of {} bytes is over the limit of {MAX_KEY_BYTES}", key.len())));
        }
        if payload.len() > MAX_VALUE_BYTES {
            return Err(too_large(format!(
                "a value of {} bytes is over the limit of {MAX_VALUE_BYTES}",
                payload.len()
            )));
        }
        let give_up = Instant::now() + self.io_timeout;
        loop {
            match self.exchange(op, key, payload, wait)? {
                Some(answer) => return self.checked(answer),
                None if Instant::now() < give_up => std::thread::sleep(Duration::from_millis(20)),
                None => {
                    return Err(self.unavailable(format!(
                        "every connection slot stayed taken for {} ms",
                        self.io_timeout.as_millis()
                    )))
                }
            }
        }
    }

    /// One connection: `None` when the server had no slot for it.
    fn exchange(&self, op: Op, key: &str, payload: &[u8], wait: Duration) -> Result<Option<Response>> {
        let unavailable = |reason: String| self.unavailable(reason);
        let limit = self.io_timeout + wait;
        let io_timeout = self.io_timeout;
        let nonce: [u8; 16] = auth::random()?;
        self.runtime.block_on(async {
            let mut stream = tokio::time::timeout(io_timeout, TcpStream::connect(&self.addr))
                .await
                .map_err(|_| unavailable(format!("no connection within {} ms", io_timeout.as_millis())))?
                .map_err(|e| unavailable(e.to_string()))?;
            stream.set_nodelay(true).map_err(|e| unavailable(e.to_string()))?;
            let exchange = async {
                let challenge = match wire::read_hello(&mut stream).await? {
                    Hello::Challenge(c) => c,
                    Hello::Busy => return Ok(None),
                };
                let (bytes, tag) =
                    wire::encode_request(&self.mac, &challenge, &self.client_id, &nonce, op, key, payload);
                wire::write_all(&mut stream, &bytes).await?;
                let response = wire::read_response(&mut stream, &self.mac, &tag).await?;
                // An evicted connection's BUSY: try again like a full server.
                Ok(if response.status == Status::Busy { None } else { Some(response) })
            };
            match tokio::time::timeout(limit, exchange).await {
                Err(_) => Err(unavailable(format!("no answer within {} ms", limit.as_millis()))),
                Ok(Err(e)) => Err(self.wire_error(e)),
                Ok(Ok(r)) => Ok(r),
            }
        })
    }

    fn wire_error(&self, e: wire::WireError) -> RuntimeError {
        match e {
            wire::WireError::Io(kind) => self.unavailable(format!("the connection ended mid-answer ({kind})")),
            other => RuntimeError::KvProtocol { addr: self.addr.clone(), reason: other.to_string() },
        }
    }

    /// The answer if it is this request's; refusals as `KvRefused`.
    fn checked(&self, r: Response) -> Result<(Status, Vec<u8>)> {
        let text = || String::from_utf8_lossy(&r.bytes).into_owned();
        if r.status.is_refusal() {
            let reason = if r.authenticated {
                text()
            } else {
                format!("{} (this answer is not authenticated: does the run's token match?)", text())
            };
            return Err(RuntimeError::KvRefused { addr: self.addr.clone(), refusal: r.status, reason });
        }
        if !r.authenticated {
            return Err(self.protocol(format!(
                "an answer ({}) not tagged for this request: a server with another token, or tampering",
                r.status
            )));
        }
        Ok((r.status, r.bytes))
    }

    fn protocol(&self, reason: String) -> RuntimeError {
        RuntimeError::KvProtocol { addr: self.addr.clone(), reason }
    }

    fn expect_value(&self, key: &str, status: Status, bytes: Vec<u8>, timeout_ms: u64) -> Result<Vec<u8>> {
        match status {
            Status::Ok => Ok(bytes),
            Status::NotFound => Err(RuntimeError::KvNotFound { key: key.to_string() }),
            Status::Deadline => Err(RuntimeError::KvDeadline { key: key.to_string(), timeout_ms }),
            other => Err(self.protocol(format!("a read of {key:?} answered {other}"))),
        }
    }

    /// Records a heartbeat of `node` under `prefix` and returns the nodes the
    /// server has not heard from for longer than `stale_after`.
    pub fn beat(&self, prefix: &str, node: u32, num_nodes: u32, stale_after: Duration) -> Result<Vec<u32>> {
        let payload = wire::beat_payload(node, num_nodes, stale_after.as_millis() as u64);
        let (status, bytes) = self.request(Op::Beat, prefix, &payload, Duration::ZERO)?;
        match status {
            Status::Ok if bytes.len() % 4 == 0 => {
                Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            other => Err(self.protocol(format!("BEAT answered {other} with {} bytes", bytes.len()))),
        }
    }
}

impl KeyValueStore for TcpStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.request(Op::Put, key, value, Duration::ZERO)? {
            (Status::Ok, _) => Ok(()),
            (Status::AlreadyExists, _) => Err(RuntimeError::KvAlreadyExists { key: key.to_string() }),
            (status, bytes) => {
                Err(self.protocol(format!("PUT {key:?} answered {status}: {}", String::from_utf8_lossy(&bytes))))
            }
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let timeout_ms = timeout.as_millis() as u64;
        let (status, bytes) = self.request(Op::Get, key, &timeout_ms.to_le_bytes(), timeout)?;
        self.expect_value(key, status, bytes, timeout_ms)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let (status, bytes) = self.request(Op::TryGet, key, &[], Duration::ZERO)?;
        self.expect_value(key, status, bytes, 0)
    }
}
