//! The persistent compile cache: serialized executables on disk, keyed by a
//! [`CompileKey`], so a second process compiles nothing it compiled before.
//!
//! Where it sits: the frontend looks a program up here after its in-memory
//! cache missed and before it compiles; a compiled program is stored here.
//!
//! Invariants:
//! - **Nothing half-written is ever visible.** An entry is written to a temp
//!   file in the cache directory and renamed over its final name; rename is
//!   atomic, so processes that fill one directory at once see either no entry
//!   or a whole one (the last writer wins; both wrote the same program).
//! - **Nothing corrupt is ever served.** An entry carries its key, its length
//!   and a SHA-256 of its payload; a mismatch, a truncation or an executable
//!   the plugin refuses is reported as [`Lookup::Corrupt`], removed (unless
//!   read-only) and recompiled by the caller.
//! - **Bounded size.** After each store, the least recently used entries (by
//!   modification time, refreshed on every hit) are removed until the directory
//!   holds at most `max_bytes`. An entry larger than `max_bytes` is neither
//!   stored nor served (`KILN_CACHE_MAX_BYTES=0` keeps and serves nothing).
//! - **Read-only mode** never writes, touches or removes anything.
//!
//! Entry layout (`<key>.kexe`): the magic `KILNCCH1`, a u32 LE header length,
//! a UTF-8 header of `name=value` lines (`key`, `compile_us`, `payload_len`,
//! `payload_sha256`), then the payload: the executable as
//! [`Executable::serialize`] writes it.

use std::fmt;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use crate::client::Client;
use crate::compile_options::CompileOptions;
use crate::error::{Result, RuntimeError};
use crate::executable::Executable;

const MAGIC: &[u8; 8] = b"KILNCCH1";
const EXTENSION: &str = "kexe";
/// Default size bound of a cache directory.
pub const DEFAULT_MAX_BYTES: u64 = 4 << 30;
/// Temp files older than this are leftovers of a process that died mid-write.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// What identifies a compiled program across processes: the program's
/// structure (the caller's canonical fingerprint, with whatever else shapes the
/// program text), the plugin (path, C API version, file size and modification
/// time, which change when the plugin is reinstalled or upgraded), the compile
/// options and kiln's version. `Display` is 64 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CompileKey([u8; 32]);

impl CompileKey {
    /// The key of `program` (opaque bytes naming the program) compiled by
    /// `client` with `options`.
    pub fn new(program: &[u8], client: &Client, options: &CompileOptions) -> Result<CompileKey> {
        let mut h = Sha256::new();
        let mut field = |name: &str, bytes: &[u8]| {
            h.update(name.as_bytes());
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field("kiln", env!("CARGO_PKG_VERSION").as_bytes());
        field("program", program);
        let plugin = client.plugin_path();
        field("plugin", plugin.to_string_lossy().as_bytes());
        let (major, minor) = client.api_version();
        field("api", format!("{major}.{minor}").as_bytes());
        // A missing file (plugin removed after loading) still gives a key.
        if let Ok(meta) = fs::metadata(plugin) {
            let mtime = meta.modified().ok().and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok());
            field("plugin-file", format!("{} {:?}", meta.len(), mtime).as_bytes());
        }
        field("platform", client.platform_name().as_bytes());
        // A run of several processes: the same program is another executable
        // on each process (its own devices), and another for another layout.
        let global = client.global_devices().len();
        if global != client.devices().len() {
            field("process", format!("{} of {global} devices", client.process_index()).as_bytes());
        }
        field("options", &options.to_proto_bytes()?);
        Ok(CompileKey(h.finalize().into()))
    }

    /// Parses the 64-hex-digit form.
    pub fn from_hex(text: &str) -> Option<CompileKey> {
        if text.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(CompileKey(out))
    }
}

impl fmt::Display for CompileKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for CompileKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CompileKey({self})")
    }
}

/// Where the cache lives and how it may be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCacheConfig {
    pub dir: PathBuf,
    /// Size bound of the directory's entries, in bytes.
    pub max_bytes: u64,
    /// Look entries up, never write, touch or remove any.
    pub read_only: bool,
}

impl DiskCacheConfig {
    /// The configuration the environment asks for, `None` when disabled.
    ///
    /// - `KILN_CACHE_DIR`: the directory (default `$XDG_CACHE_HOME/kiln`, else
    ///   `$HOME/.cache/kiln`); `KILN_CACHE=off` disables the disk cache.
    /// - `KILN_CACHE_MAX_BYTES`: the size bound (default 4 GiB; suffixes
    ///   `K`, `M`, `G` are powers of 1024).
    /// - `KILN_CACHE_READONLY=1`: read-only mode.
    ///
    /// `KILN_CACHE` and `KILN_CACHE_READONLY` are booleans
    /// ([`crate::env::parse_bool`]: `on`/`off`, `1`/`0`, `true`/`false`, ...).
    pub fn from_env() -> Result<Option<DiskCacheConfig>> {
        if crate::env::bool_var("KILN_CACHE")? == Some(false) {
            return Ok(None);
        }
        // A path: any bytes the system allows.
        let dir = match std::env::var_os("KILN_CACHE_DIR").filter(|v| !v.is_empty()) {
            Some(d) => PathBuf::from(d),
            None => {
                match default_dir() {
                    Some(d) => d,
                    None => {
                        tracing::warn!("kiln: no cache directory (set KILN_CACHE_DIR, XDG_CACHE_HOME or HOME); the disk cache is off");
                        return Ok(None);
                    }
                }
            }
        };
        let max_bytes = match crate::env::string_var("KILN_CACHE_MAX_BYTES")? {
            Some(v) => crate::env::parse_size(&v).ok_or(RuntimeError::BadCacheEnv {
                var: "KILN_CACHE_MAX_BYTES",
                value: v,
                expected: crate::env::SIZE_SPELLINGS,
            })?,
            None => DEFAULT_MAX_BYTES,
        };
        let read_only = crate::env::bool_var("KILN_CACHE_READONLY")?.unwrap_or(false);
        Ok(Some(DiskCacheConfig { dir, max_bytes, read_only }))
    }
}

fn default_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln"))
}

/// What an entry records beside the executable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    /// How long the program took to compile when it was stored: what a hit saves.
    pub compile_time: Duration,
}

/// The outcome of [`DiskCache::load`].
pub enum Lookup {
    Hit {
        exe: Executable,
        info: EntryInfo,
    },
    Miss,
    /// The entry was damaged (and has been removed unless read-only).
    Corrupt {
        path: PathBuf,
        reason: String,
    },
}

/// Entries, bytes and settings of a cache directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheStats {
    pub dir: PathBuf,
    pub entries: usize,
    pub bytes: u64,
    pub max_bytes: u64,
    pub read_only: bool,
}

/// A cache directory.
#[derive(Clone, Debug)]
pub struct DiskCache {
    config: DiskCacheConfig,
}

/// An entry that exists but cannot be read (a permission, an I/O error, a
/// link loop) costs a compile, never the run: a warning and a miss. The
/// store that follows replaces it where the directory allows.
fn unreadable(path: &Path, e: &std::io::Error) -> Lookup {
    tracing::warn!(path = %path.display(), error = %e, "kiln: compile-cache entry cannot be read; recompiling");
    Lookup::Miss
}

fn io_err(path: &Path, source: std::io::Error) -> RuntimeError {
    RuntimeError::CacheIo { path: path.to_path_buf(), source }
}

impl DiskCache {
    /// Opens (creating unless read-only) the directory of `config`.
    pub fn open(config: DiskCacheConfig) -> Result<DiskCache> {
        // `create_dir_all` on a file says only "File exists": name the problem.
        if let Ok(meta) = fs::metadata(&config.dir) {
            if !meta.is_dir() {
                return Err(RuntimeError::CacheNotADirectory { path: config.dir.clone() });
            }
        }
        if !config.read_only {
            fs::create_dir_all(&config.dir).map_err(|e| io_err(&config.dir, e))?;
        }
        Ok(DiskCache { config })
    }

    pub fn config(&self) -> &DiskCacheConfig {
        &self.config
    }

    /// The file an entry of `key` lives in.
    pub fn entry_path(&self, key: &CompileKey) -> PathBuf {
        self.config.dir.join(format!("{key}.{EXTENSION}"))
    }

    /// Looks `key` up and loads its executable into `client`.
    pub fn load(&self, key: &CompileKey, client: &Client) -> Result<Lookup> {
        let path = self.entry_path(key);
        // Reading a FIFO blocks forever and a directory cannot be read: an
        // entry that is not a regular file is skipped (and left for
        // `clear`), never opened.
        match fs::metadata(&path) {
            Ok(meta) if !meta.is_file() => {
                tracing::warn!(path = %path.display(), "kiln: compile-cache entry is not a regular file; skipped (`kiln cache clear` removes it)");
                return Ok(Lookup::Miss);
            }
            // Larger than the whole bound (lowered since it was written): the
            // cache may not hold it, so it is not served; the next store
            // trims the directory.
            Ok(meta) if meta.len() > self.config.max_bytes => return Ok(Lookup::Miss),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Lookup::Miss),
            Err(e) => return Ok(unreadable(&path, &e)),
        }
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Lookup::Miss),
            Err(e) => return Ok(unreadable(&path, &e)),
        };
        let checked = decode(&bytes, key).and_then(|(info, payload)| {
            client
                .deserialize_executable(payload, None)
                .map(|exe| (exe, info))
                .map_err(|e| format!("the plugin refused it: {e}"))
        });
        match checked {
            Ok((exe, info)) => {
                if !self.config.read_only {
                    // Refresh the entry's age for eviction; losing the race to
                    // an evicting process is harmless.
                    if let Ok(f) = fs::File::options().write(true).open(&path) {
                        let _ = f.set_modified(SystemTime::now());
                    }
                }
                Ok(Lookup::Hit { exe, info })
            }
            Err(reason) => {
                tracing::warn!(path = %path.display(), %reason, "kiln: corrupt compile-cache entry; recompiling");
                if !self.config.read_only {
                    let _ = fs::remove_file(&path);
                }
                Ok(Lookup::Corrupt { path, reason })
            }
        }
    }

    /// Stores `exe` under `key` (atomically), then evicts down to the bound.
    /// Does nothing in read-only mode.
    pub fn store(&self, key: &CompileKey, exe: &Executable, info: EntryInfo) -> Result<()> {
        if self.config.read_only {
            return Ok(());
        }
        let path = self.entry_path(key);
        if fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            tracing::warn!(path = %path.display(), "kiln: compile-cache entry is a directory; not stored (`kiln cache clear` removes it)");
            return Ok(());
        }
        let payload = exe.serialize()?;
        let bytes = encode(key, info, &payload);
        if bytes.len() as u64 > self.config.max_bytes {
            // An entry larger than the whole bound is not kept (the bound is
            // what the directory may hold: `KILN_CACHE_MAX_BYTES=0` keeps
            // nothing), and what is there is trimmed to the bound.
            tracing::debug!(
                bytes = bytes.len(),
                max = self.config.max_bytes,
                "kiln: compile-cache entry larger than the bound; not stored"
            );
            return self.evict(None);
        }
        // Created exclusively (never through a link) under an unpredictable
        // name; removed on any error before the rename.
        let write = || -> std::io::Result<()> {
            let mut tmp = tempfile::Builder::new()
                .prefix(&format!(".tmp-{}-", std::process::id()))
                .suffix(&format!("-{key}"))
                .rand_bytes(12)
                .tempfile_in(&self.config.dir)?;
            tmp.write_all(&bytes)?;
            tmp.as_file().sync_all()?;
            tmp.persist(&path).map(|_| ()).map_err(|e| e.error)
        };
        if let Err(e) = write() {
            return Err(io_err(&path, e));
        }
        self.evict(Some(&path))
    }

    /// Removes least recently used entries until the directory holds at most
    /// `max_bytes`, never `keep` (the entry just stored); also removes temp
    /// files that a dead process left behind.
    fn evict(&self, keep: Option<&Path>) -> Result<()> {
        let mut entries = Vec::new();
        let mut total = 0u64;
        for (path, meta) in self.scan()? {
            let age = meta.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok());
            let is_temp = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(".tmp-"));
            if is_temp {
                if age.is_some_and(|a| a > STALE_TEMP) {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            total += meta.len();
            entries.push((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), meta.len(), path));
        }
        if total <= self.config.max_bytes {
            return Ok(());
        }
        entries.sort();
        for (_, len, path) in entries {
            if total <= self.config.max_bytes {
                break;
            }
            if Some(path.as_path()) == keep {
                continue;
            }
            // Another process may have removed it first: either way it is gone.
            match fs::remove_file(&path) {
                Ok(()) => {
                    total -= len;
                    tracing::debug!(path = %path.display(), "kiln: evicted compile-cache entry");
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => total -= len,
                Err(e) => return Err(io_err(&path, e)),
            }
        }
        Ok(())
    }

    /// Entry files and temp files with their metadata (not followed through
    /// links); `with_odd` also lists entries that are not regular files
    /// (directories, FIFOs, links), which only `clear` wants.
    fn scan_entries(&self, with_odd: bool) -> Result<Vec<(PathBuf, fs::Metadata)>> {
        let dir = &self.config.dir;
        let rd = match fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(dir, e)),
        };
        let mut out = Vec::new();
        for e in rd {
            let e = e.map_err(|err| io_err(dir, err))?;
            let path = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            let ours = name.starts_with(".tmp-") || path.extension().is_some_and(|x| x == EXTENSION);
            if !ours {
                continue;
            }
            // Gone between listing and stat: another process evicted it.
            if let Ok(meta) = e.metadata() {
                if meta.is_file() || with_odd {
                    out.push((path, meta));
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Regular entry and temp files.
    fn scan(&self) -> Result<Vec<(PathBuf, fs::Metadata)>> {
        self.scan_entries(false)
    }

    pub fn stats(&self) -> Result<CacheStats> {
        let entries: Vec<_> =
            self.scan()?.into_iter().filter(|(p, _)| p.extension().is_some_and(|x| x == EXTENSION)).collect();
        Ok(CacheStats {
            dir: self.config.dir.clone(),
            entries: entries.len(),
            bytes: entries.iter().map(|(_, m)| m.len()).sum(),
            max_bytes: self.config.max_bytes,
            read_only: self.config.read_only,
        })
    }

    /// Removes every entry (and temp file); returns how many entries went.
    pub fn clear(&self) -> Result<usize> {
        if self.config.read_only {
            return Err(RuntimeError::CacheReadOnly { dir: self.config.dir.clone() });
        }
        let mut removed = 0;
        for (path, meta) in self.scan_entries(true)? {
            // A directory in an entry's name is removed with what it holds (it
            // is the entry itself, not followed through a link).
            let gone = if meta.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            match gone {
                Ok(()) => removed += usize::from(path.extension().is_some_and(|x| x == EXTENSION)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&path, e)),
            }
        }
        Ok(removed)
    }
}

fn encode(key: &CompileKey, info: EntryInfo, payload: &[u8]) -> Vec<u8> {
    let sha: [u8; 32] = Sha256::digest(payload).into();
    let header = format!(
        "key={key}\ncompile_us={}\npayload_len={}\npayload_sha256={}\n",
        info.compile_time.as_micros(),
        payload.len(),
        CompileKey(sha)
    );
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + header.len() + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(payload);
    out
}

/// Checks an entry's framing, key, length and checksum; returns its payload.
fn decode<'a>(bytes: &'a [u8], key: &CompileKey) -> std::result::Result<(EntryInfo, &'a [u8]), String> {
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or("no kiln cache magic")?;
    let (len, rest) = rest.split_first_chunk::<4>().ok_or("truncated before the header length")?;
    let len = u32::from_le_bytes(*len) as usize;
    if rest.len() < len {
        return Err("truncated inside the header".into());
    }
    let (header, payload) = rest.split_at(len);
    let header = std::str::from_utf8(header).map_err(|_| "the header is not UTF-8")?;
    let field = |name: &str| {
        header
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
            .ok_or_else(|| format!("the header has no {name}"))
    };
    if field("key")? != key.to_string() {
        return Err("the entry belongs to another key".into());
    }
    let want_len: usize = field("payload_len")?.parse().map_err(|_| "bad payload_len")?;
    if payload.len() != want_len {
        return Err(format!("truncated: {} of {want_len} payload bytes", payload.len()));
    }
    let sha: [u8; 32] = Sha256::digest(payload).into();
    if field("payload_sha256")? != CompileKey(sha).to_string() {
        return Err("checksum mismatch".into());
    }
    let us: u64 = field("compile_us")?.parse().map_err(|_| "bad compile_us")?;
    Ok((EntryInfo { compile_time: Duration::from_micros(us) }, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_decode_only_when_whole_and_their_own() {
        let key = CompileKey([7; 32]);
        let info = EntryInfo { compile_time: Duration::from_micros(1234) };
        let bytes = encode(&key, info, b"payload bytes");
        let (got, payload) = decode(&bytes, &key).unwrap();
        assert_eq!(got, info);
        assert_eq!(payload, b"payload bytes");
        assert!(decode(&bytes, &CompileKey([8; 32])).unwrap_err().contains("another key"));
        assert!(decode(&bytes[..bytes.len() - 3], &key).unwrap_err().contains("truncated"));
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode(&flipped, &key).unwrap_err().contains("checksum"));
        assert!(decode(b"garbage", &key).is_err());
        assert!(decode(&bytes[..10], &key).is_err());
    }

    #[test]
    fn keys_round_trip_through_hex() {
        let k = CompileKey([0xab; 32]);
        assert_eq!(CompileKey::from_hex(&k.to_string()), Some(k));
        assert_eq!(CompileKey::from_hex("xyz"), None);
    }
}
