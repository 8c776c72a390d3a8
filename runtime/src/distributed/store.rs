//! The key-value store PJRT asks its caller for, as a Rust trait.
//!
//! The GPU plugin exchanges each node's topology and the NCCL clique ids
//! through three callbacks (`put`, blocking `get`, `try_get`); kiln answers
//! them from a [`KeyValueStore`]. [`MemoryStore`] is the store itself (the
//! TCP server in [`super::server`] serves one; tests use it directly), and
//! [`super::tcp::TcpStore`] is the client every node talks through.
//!
//! Invariants:
//! - a key, once put, keeps its value: putting the same value again is
//!   accepted (a retried put), a different value is `KvAlreadyExists`. So a
//!   reader never sees a value change under it.
//! - `get` returns as soon as the key exists, and `KvDeadline` once the
//!   timeout has passed without it; it never waits longer than the timeout
//!   plus the time to wake up.
//! - [`Scoped`] puts `kiln/<run>/<attempt>/` before every key, so a restarted
//!   attempt or another run sharing the server never reads these keys.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Result, RuntimeError};

/// The store PJRT's client-creation callbacks reach. Implementations must be
/// thread-safe: the plugin calls from its own threads, concurrently.
pub trait KeyValueStore: Send + Sync {
    /// Stores `value` under `key` (see the module's rule on existing keys).
    fn put(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, waiting up to `timeout` for it to be put.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// The value of `key` now, or `KvNotFound`.
    fn try_get(&self, key: &str) -> Result<Vec<u8>>;
}

/// A shared handle on a store: what [`crate::ClientOptions`] carries. Two
/// handles are equal when they share the same store.
#[derive(Clone)]
pub struct StoreHandle(pub Arc<dyn KeyValueStore>);

impl fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreHandle(..)")
    }
}

impl PartialEq for StoreHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for StoreHandle {}

/// What a put did to the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Inserted,
    /// The key already held exactly this value.
    Unchanged,
}

/// An in-process store: a map under a mutex and a condition variable that
/// wakes waiting `get`s on every insert. Optionally bounded
/// ([`MemoryStore::bounded`]): an insert that would pass the limit on bytes
/// (keys and values together) is `KvStoreFull` and changes nothing.
pub struct MemoryStore {
    map: Mutex<Entries>,
    changed: Condvar,
    max_bytes: usize,
}

#[derive(Default)]
struct Entries {
    map: HashMap<String, Arc<[u8]>>,
    /// Sum of every key's and value's length.
    bytes: usize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::bounded(usize::MAX)
    }
}

impl MemoryStore {
    /// A store without a size limit (tests, one process).
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// A store holding at most `max_bytes` of keys and values.
    pub fn bounded(max_bytes: usize) -> MemoryStore {
        MemoryStore { map: Mutex::new(Entries::default()), changed: Condvar::new(), max_bytes }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // Inserts are the only mutation and cannot be left half-done by a
        // panic, so a poisoned map is still consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Inserts `key` unless it holds another value or the store is full.
    pub fn insert(&self, key: &str, value: &[u8]) -> Result<PutOutcome> {
        let mut entries = self.lock();
        match entries.map.get(key) {
            Some(old) if **old == *value => Ok(PutOutcome::Unchanged),
            Some(_) => Err(RuntimeError::KvAlreadyExists { key: key.to_string() }),
            None => {
                let size = key.len().saturating_add(value.len());
                let total = entries.bytes.saturating_add(size);
                if total > self.max_bytes {
                    return Err(RuntimeError::KvStoreFull {
                        key: key.to_string(),
                        bytes: size,
                        used_bytes: entries.bytes,
                        limit_bytes: self.max_bytes,
                    });
                }
                entries.bytes = total;
                entries.map.insert(key.to_string(), Arc::from(value));
                drop(entries);
                self.changed.notify_all();
                Ok(PutOutcome::Inserted)
            }
        }
    }

    /// Bytes of keys and values stored.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The value of `key`, if present (cheap: shares the stored bytes).
    pub fn lookup(&self, key: &str) -> Option<Arc<[u8]>> {
        self.lock().map.get(key).cloned()
    }

    /// Waits until `key` exists or `deadline` passes (blocking the thread).
    pub fn wait_for(&self, key: &str, deadline: Instant) -> Option<Arc<[u8]>> {
        let mut map = self.lock();
        loop {
            if let Some(v) = map.map.get(key) {
                return Some(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            map = self.changed.wait_timeout(map, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Number of keys stored.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl KeyValueStore for MemoryStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.insert(key, value).map(|_| ())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_for(key, Instant::now() + timeout)
            .map(|v| v.to_vec())
            .ok_or_else(|| RuntimeError::KvDeadline { key: key.to_string(), timeout_ms: timeout.as_millis() as u64 })
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.lookup(key).map(|v| v.to_vec()).ok_or_else(|| RuntimeError::KvNotFound { key: key.to_string() })
    }
}

/// Identifies one attempt of one run: the scope of every key it uses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunScope {
    /// Names the job (`KILN_RUN_ID`; `kiln launch` makes one per launch).
    pub run_id: String,
    /// Counts restarts of the job (`KILN_ATTEMPT`, 0 first).
    pub attempt: u32,
}

impl RunScope {
    /// `kiln/<run>/<attempt>/`.
    pub fn prefix(&self) -> String {
        format!("kiln/{}/{}/", self.run_id, self.attempt)
    }
}

/// A store whose keys all live under one [`RunScope`]. Errors name the key
/// as the caller gave it (without the prefix).
pub struct Scoped<S> {
    inner: S,
    prefix: String,
}

impl<S: KeyValueStore> Scoped<S> {
    pub fn new(inner: S, scope: &RunScope) -> Scoped<S> {
        Scoped { inner, prefix: scope.prefix() }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn unscoped(&self, err: RuntimeError) -> RuntimeError {
        let strip = |key: String| key.strip_prefix(&self.prefix).map(str::to_string).unwrap_or(key);
        match err {
            RuntimeError::KvNotFound { key } => RuntimeError::KvNotFound { key: strip(key) },
            RuntimeError::KvDeadline { key, timeout_ms } => RuntimeError::KvDeadline { key: strip(key), timeout_ms },
            RuntimeError::KvAlreadyExists { key } => RuntimeError::KvAlreadyExists { key: strip(key) },
            other => other,
        }
    }
}

impl<S: KeyValueStore> KeyValueStore for Scoped<S> {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.put(&self.full(key), value).map_err(|e| self.unscoped(e))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.full(key), timeout).map_err(|e| self.unscoped(e))
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.try_get(&self.full(key)).map_err(|e| self.unscoped(e))
    }
}

impl<S: KeyValueStore + ?Sized> KeyValueStore for Arc<S> {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).put(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        (**self).try_get(key)
    }
}
