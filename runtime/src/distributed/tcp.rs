//! `TcpStore`: the client side of the store, one short TCP connection per
//! request to the [`super::server::StoreServer`].
//!
//! Invariants: every call is bounded in time — connecting and a `try_get` or
//! `put` by [`TcpStore::io_timeout`], a `get` by its own timeout plus that —
//! so a dead server turns into `KvUnavailable`, never a hang. Safe to call
//! from any thread, concurrently (the plugin does).

use std::time::Duration;

use tokio::net::TcpStream;

use super::store::KeyValueStore;
use super::wire::{self, Op, Request, Status};
use crate::error::{Result, RuntimeError};

/// A connection-per-request client of one store server.
pub struct TcpStore {
    addr: String,
    io_timeout: Duration,
    runtime: tokio::runtime::Runtime,
}

impl TcpStore {
    /// A client for the server at `addr` (`host:port`). Nothing is
    /// connected until the first request.
    pub fn new(addr: &str, io_timeout: Duration) -> Result<TcpStore> {
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
        Ok(TcpStore { addr: addr.to_string(), io_timeout, runtime })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// How long connecting and a non-blocking request may take.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    fn request(&self, req: Request, wait: Duration) -> Result<(Status, Vec<u8>)> {
        let unavailable = |reason: String| RuntimeError::KvUnavailable { addr: self.addr.clone(), reason };
        let limit = self.io_timeout + wait;
        let addr = self.addr.clone();
        let io_timeout = self.io_timeout;
        self.runtime.block_on(async move {
            let mut stream = tokio::time::timeout(io_timeout, TcpStream::connect(&addr))
                .await
                .map_err(|_| unavailable(format!("no connection within {} ms", io_timeout.as_millis())))?
                .map_err(|e| unavailable(e.to_string()))?;
            stream.set_nodelay(true).map_err(|e| unavailable(e.to_string()))?;
            let exchange = async {
                wire::write_request(&mut stream, &req).await?;
                wire::read_response(&mut stream).await
            };
            tokio::time::timeout(limit, exchange)
                .await
                .map_err(|_| unavailable(format!("no answer within {} ms", limit.as_millis())))?
                .map_err(|e| unavailable(e.to_string()))
        })
    }

    fn protocol(&self, reason: String) -> RuntimeError {
        RuntimeError::KvProtocol { addr: self.addr.clone(), reason }
    }

    fn expect_value(&self, key: &str, status: Status, bytes: Vec<u8>, timeout_ms: u64) -> Result<Vec<u8>> {
        match status {
            Status::Ok => Ok(bytes),
            Status::NotFound => Err(RuntimeError::KvNotFound { key: key.to_string() }),
            Status::Deadline => Err(RuntimeError::KvDeadline { key: key.to_string(), timeout_ms }),
            Status::AlreadyExists => Err(self.protocol(format!("a read of {key:?} answered ALREADY_EXISTS"))),
            Status::BadRequest => Err(self.protocol(String::from_utf8_lossy(&bytes).into_owned())),
        }
    }

    /// Records a heartbeat of `node` under `prefix` and returns the nodes the
    /// server has not heard from for longer than `stale_after`.
    pub fn beat(&self, prefix: &str, node: u32, num_nodes: u32, stale_after: Duration) -> Result<Vec<u32>> {
        let req = Request {
            op: Op::Beat,
            key: prefix.to_string(),
            payload: wire::beat_payload(node, num_nodes, stale_after.as_millis() as u64),
        };
        let (status, bytes) = self.request(req, Duration::ZERO)?;
        match status {
            Status::Ok => Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            other => Err(self.protocol(format!("BEAT answered {other:?}"))),
        }
    }
}

impl KeyValueStore for TcpStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request { op: Op::Put, key: key.to_string(), payload: value.to_vec() };
        match self.request(req, Duration::ZERO)? {
            (Status::Ok, _) => Ok(()),
            (Status::AlreadyExists, _) => Err(RuntimeError::KvAlreadyExists { key: key.to_string() }),
            (status, bytes) => {
                Err(self.protocol(format!("PUT {key:?} answered {status:?}: {}", String::from_utf8_lossy(&bytes))))
            }
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let timeout_ms = timeout.as_millis() as u64;
        let req = Request { op: Op::Get, key: key.to_string(), payload: timeout_ms.to_le_bytes().to_vec() };
        let (status, bytes) = self.request(req, timeout)?;
        self.expect_value(key, status, bytes, timeout_ms)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let req = Request { op: Op::TryGet, key: key.to_string(), payload: Vec::new() };
        let (status, bytes) = self.request(req, Duration::ZERO)?;
        self.expect_value(key, status, bytes, 0)
    }
}
