//! The run's secret and the message authentication of the key-value store.
//!
//! A run has one token, a secret every one of its processes knows: `kiln
//! launch` makes a random one and hands it to its children in
//! `KILN_RUN_TOKEN`; a multi-host run gives it as `KILN_RUN_TOKEN` or as a
//! file named by `KILN_RUN_TOKEN_FILE` (the token is the file's text, a final
//! newline dropped). Every store message carries an HMAC-SHA256 tag keyed by
//! the token ([`MacKey`]); see [`super::wire`] for what the tags cover.
//!
//! Invariants:
//! - a coordinator whose address is not loopback never runs without a token
//!   ([`require_token`]): the process refuses to start with
//!   `MissingRunToken`, naming both ways to give one;
//! - without a token (loopback only) the key is a fixed public constant: the
//!   framing is still checked, but any local process can speak to the store.
//!   `kiln launch` always makes a token, so only hand-started local runs are
//!   in this case;
//! - a given token has at least [`MIN_TOKEN_BYTES`] bytes, so a placeholder
//!   (`KILN_RUN_TOKEN=x`) is refused instead of silently being a weak key;
//! - the token never appears in `Debug` output or error messages.

use std::net::IpAddr;
use std::path::PathBuf;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Result, RuntimeError};

pub const ENV_RUN_TOKEN: &str = "KILN_RUN_TOKEN";
pub const ENV_RUN_TOKEN_FILE: &str = "KILN_RUN_TOKEN_FILE";

/// The shortest token accepted (16 bytes: 128 bits when random).
pub const MIN_TOKEN_BYTES: usize = 16;
/// The longest token accepted (a token file is read up to this).
pub const MAX_TOKEN_BYTES: usize = 4096;
/// Bytes of an HMAC-SHA256 tag.
pub const TAG_BYTES: usize = 32;

/// The key used on loopback when no token is given (public: see the module
/// doc).
const LOOPBACK_KEY: &[u8] = b"kiln-kv loopback run without KILN_RUN_TOKEN";

/// A run's secret. `Debug` prints no byte of it.
#[derive(Clone, PartialEq, Eq)]
pub struct RunToken(String);

impl std::fmt::Debug for RunToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunToken({} bytes, redacted)", self.0.len())
    }
}

impl RunToken {
    /// A token from its text (`KILN_RUN_TOKEN`), checked for length.
    pub fn new(text: &str, var: &'static str) -> Result<RunToken> {
        let len = text.len();
        if !(MIN_TOKEN_BYTES..=MAX_TOKEN_BYTES).contains(&len) {
            return Err(RuntimeError::BadRunToken {
                var,
                reason: format!(
                    "it has {} bytes; a token has {MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES} (e.g. 64 hex digits: `openssl rand -hex 32`)",
                    len
                ),
            });
        }
        Ok(RunToken(text.to_string()))
    }

    /// A fresh random token (32 random bytes as 64 hex digits), what `kiln
    /// launch` gives its children.
    pub fn generate() -> Result<RunToken> {
        let bytes: [u8; 32] = random()?;
        Ok(RunToken(hex(&bytes)))
    }

    /// The token as the text to put in `KILN_RUN_TOKEN`.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The token given by the values of `KILN_RUN_TOKEN` (`direct`) and
    /// `KILN_RUN_TOKEN_FILE` (`file`, a path read here); both set is an
    /// error (which one is meant?), neither is `None`.
    pub fn from_values(direct: Option<&str>, file: Option<&str>) -> Result<Option<RunToken>> {
        match (direct, file) {
            (Some(_), Some(_)) => Err(RuntimeError::BadRunToken {
                var: ENV_RUN_TOKEN_FILE,
                reason: format!("both {ENV_RUN_TOKEN} and {ENV_RUN_TOKEN_FILE} are set; set one"),
            }),
            (Some(t), None) => RunToken::new(t, ENV_RUN_TOKEN).map(Some),
            (None, Some(path)) => RunToken::from_file(PathBuf::from(path)).map(Some),
            (None, None) => Ok(None),
        }
    }

    fn from_file(path: PathBuf) -> Result<RunToken> {
        let bad = |reason: String| RuntimeError::BadRunToken {
            var: ENV_RUN_TOKEN_FILE,
            reason: format!("{}: {reason}", path.display()),
        };
        let meta = std::fs::metadata(&path).map_err(|e| bad(e.to_string()))?;
        // Before the read: a FIFO would block it until a writer came, a
        // device could read without end (the frontend's `input::open` says
        // the same of every other input; the runtime sits below it).
        if !meta.is_file() {
            return Err(bad("not a regular file (a FIFO, device, socket or directory)".into()));
        }
        if meta.len() > MAX_TOKEN_BYTES as u64 + 2 {
            return Err(bad(format!("{} bytes is longer than a token ({MAX_TOKEN_BYTES} at most)", meta.len())));
        }
        let bytes = std::fs::read(&path).map_err(|e| bad(e.to_string()))?;
        let text = String::from_utf8(bytes).map_err(|_| bad("the token is not UTF-8 text".into()))?;
        let text = text.strip_suffix('\n').unwrap_or(&text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        RunToken::new(text, ENV_RUN_TOKEN_FILE)
    }
}

/// Refuses a run whose coordinator is not on loopback and has no token.
pub fn require_token(coordinator: &str, token: Option<&RunToken>) -> Result<()> {
    if token.is_none() && !is_loopback(coordinator) {
        return Err(RuntimeError::MissingRunToken { coordinator: coordinator.to_string() });
    }
    Ok(())
}

/// Whether `host:port` names this machine only: a loopback IP (127.0.0.0/8,
/// `[::1]`) or `localhost`. Any other name may resolve to anything, so it is
/// not loopback; neither is `0.0.0.0` (every interface).
pub fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The HMAC key every message of one run is tagged with.
#[derive(Clone)]
pub struct MacKey(Hmac<Sha256>);

impl std::fmt::Debug for MacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MacKey(redacted)")
    }
}

impl MacKey {
    /// The key of a run with `token` (the public loopback key without one).
    pub fn new(token: Option<&RunToken>) -> Result<MacKey> {
        let key = token.map_or(LOOPBACK_KEY, |t| t.0.as_bytes());
        // HMAC takes keys of any length: the error is never seen in practice.
        <Hmac<Sha256> as Mac>::new_from_slice(key)
            .map(MacKey)
            .map_err(|e| RuntimeError::BadRunToken { var: ENV_RUN_TOKEN, reason: format!("HMAC refused the key: {e}") })
    }

    /// The tag of the concatenation of `parts`.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; TAG_BYTES] {
        let mut mac = self.0.clone();
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` (compared in constant time).
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut mac = self.0.clone();
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(tag).is_ok()
    }
}

/// `N` random bytes from the operating system.
pub fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| RuntimeError::NoRandomness { reason: e.to_string() })?;
    Ok(b)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_only_this_machine() {
        for a in ["127.0.0.1:7070", "127.3.2.1:1", "[::1]:9", "localhost:80", "LOCALHOST:1"] {
            assert!(is_loopback(a), "{a}");
        }
        for a in ["0.0.0.0:7070", "10.0.0.1:7070", "node0:7070", "[::]:1", "[fe80::1]:2", "localhost.evil:1"] {
            assert!(!is_loopback(a), "{a}");
        }
    }

    #[test]
    fn a_remote_coordinator_without_a_token_is_refused_naming_both_variables() {
        let err = require_token("10.0.0.1:7070", None).unwrap_err();
        assert!(matches!(&err, RuntimeError::MissingRunToken { coordinator } if coordinator == "10.0.0.1:7070"));
        let msg = err.to_string();
        assert!(msg.contains(ENV_RUN_TOKEN) && msg.contains(ENV_RUN_TOKEN_FILE), "{msg}");
        require_token("127.0.0.1:7070", None).unwrap();
        let t = RunToken::generate().unwrap();
        require_token("10.0.0.1:7070", Some(&t)).unwrap();
    }

    #[test]
    fn tokens_are_long_enough_random_and_never_printed() {
        let err = RunToken::new("short", ENV_RUN_TOKEN).unwrap_err();
        assert!(matches!(err, RuntimeError::BadRunToken { var: ENV_RUN_TOKEN, .. }), "{err}");
        assert!(!err.to_string().contains("short"), "{err}");
        let a = RunToken::generate().unwrap();
        let b = RunToken::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 64);
        let shown = format!("{a:?}");
        assert!(!shown.contains(&a.expose()[..8]), "{shown}");
    }

    #[test]
    fn a_token_file_is_its_text_without_the_final_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        assert_eq!(RunToken::from_file(path.clone()).unwrap().expose(), "0123456789abcdef0123");
        std::fs::write(&path, [0xffu8; 20]).unwrap();
        assert!(matches!(RunToken::from_file(path).unwrap_err(), RuntimeError::BadRunToken { .. }));
        let missing = RunToken::from_file(dir.path().join("absent")).unwrap_err();
        assert!(missing.to_string().contains("absent"), "{missing}");
        // A FIFO with no writer is refused, not opened (open would block).
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let err = RunToken::from_file(fifo).unwrap_err().to_string();
        assert!(err.contains("fifo: not a regular file"), "{err}");
        let err = RunToken::from_file(dir.path().to_path_buf()).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn tags_depend_on_the_key_and_every_byte() {
        let t = RunToken::new("0123456789abcdef", ENV_RUN_TOKEN).unwrap();
        let k = MacKey::new(Some(&t)).unwrap();
        let tag = k.tag(&[b"ab", b"c"]);
        assert!(k.verify(&[b"abc"], &tag));
        assert!(!k.verify(&[b"abd"], &tag));
        assert!(!MacKey::new(None).unwrap().verify(&[b"abc"], &tag));
        assert!(!k.verify(&[b"abc"], &tag[..31]));
    }
}
