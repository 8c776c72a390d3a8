//! The store's wire format: one authenticated request and one authenticated
//! response per TCP connection.
//!
//! ```text
//! hello     (server, on accept)  kind: u8 (HELLO or BUSY), challenge: [u8; 16]
//! request   (client)             head: version u8 = 1, op u8, client_id [16], nonce [16],
//!                                      key_len u32 LE, payload_len u32 LE   (42 bytes)
//!                                key, head_tag [32], payload, tag [32]
//! response  (server)             status u8, len u32 LE, bytes, tag [32]
//! ```
//!
//! Tags are HMAC-SHA256 under the run's key ([`super::auth::MacKey`]):
//! `head_tag` over `"kiln-kv head v1" ‖ challenge ‖ head ‖ key`, `tag` over
//! `"kiln-kv request v1" ‖ challenge ‖ head ‖ key ‖ payload`, and a
//! response's over `"kiln-kv response v1" ‖ request tag ‖ status ‖ len ‖
//! bytes`. The challenge is fresh random bytes per connection, so a captured
//! request is worthless on any other connection (no replay, and no state to
//! keep); the client's random nonce makes every request differ, so a fake
//! server cannot replay an old answer to it either. A refusal sent before
//! the request's tag was checked is tagged over 32 zero bytes in place of
//! the request tag (the client then knows it is not authenticated).
//!
//! | op | payload | OK response bytes |
//! |----|---------|-------------------|
//! | `PUT` | the value, at most [`MAX_VALUE_BYTES`] | empty |
//! | `GET` | `timeout_ms: u64 LE` | the value |
//! | `TRY_GET` | empty | the value |
//! | `BEAT` (key = run prefix) | `node: u32, num_nodes: u32, stale_after_ms: u64` | stale node ids, `u32 LE` each |
//!
//! Invariants: every length is checked against its limit before anything is
//! allocated for it (a key over [`MAX_KEY_BYTES`], a payload longer than its
//! op takes); nothing of the payload is read before the head's tag is
//! verified, so a client without the token makes the server hold at most
//! one head and key; every way a frame can be wrong is a [`WireError`],
//! never a panic.

use std::future::Future;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::auth::{MacKey, TAG_BYTES};

/// Longest key either side accepts. PJRT's keys are short names
/// (`cuda:local_topology/cuda/3`, `nccl_clique_id:...`) under kiln's run
/// prefix (`kiln/<run, ≤ 64>/<attempt>/`): under 200 bytes in every run
/// seen; 1 KiB leaves room without letting keys be a second value channel.
pub const MAX_KEY_BYTES: usize = 1024;
/// Largest value either side accepts. The largest value PJRT stores is the
/// global topology: every node's devices, about 150 bytes a GPU, so 8 GPUs
/// on each of [`super::identity::MAX_NODES`] nodes is about 5 MB; NCCL ids
/// are 128 bytes and kiln's own values 4. 8 MiB holds the largest run.
pub const MAX_VALUE_BYTES: usize = 8 << 20;
/// Bytes of the fixed part of a request.
pub const HEAD_BYTES: usize = 42;
/// Bytes of the server's hello.
pub const HELLO_BYTES: usize = 17;
/// The version this module speaks.
pub const VERSION: u8 = 1;

const HELLO: u8 = 0xA5;
const BUSY: u8 = 0xB5;
const HEAD_DOMAIN: &[u8] = b"kiln-kv head v1";
const REQUEST_DOMAIN: &[u8] = b"kiln-kv request v1";
const RESPONSE_DOMAIN: &[u8] = b"kiln-kv response v1";
/// What a response to a request whose tag was never checked is bound to.
pub const UNVERIFIED: [u8; TAG_BYTES] = [0; TAG_BYTES];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Put = 1,
    Get = 2,
    TryGet = 3,
    Beat = 4,
}

impl Op {
    fn from_u8(b: u8) -> Option<Op> {
        match b {
            1 => Some(Op::Put),
            2 => Some(Op::Get),
            3 => Some(Op::TryGet),
            4 => Some(Op::Beat),
            _ => None,
        }
    }

    /// The payload lengths the op takes: (least, most).
    fn payload_bounds(self) -> (usize, usize) {
        match self {
            Op::Put => (0, MAX_VALUE_BYTES),
            Op::Get => (8, 8),
            Op::TryGet => (0, 0),
            Op::Beat => (16, 16),
        }
    }
}

/// A response's status; every refusal has its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    Deadline = 2,
    AlreadyExists = 3,
    /// The frame or a field is malformed or out of range.
    BadRequest = 4,
    /// A tag did not verify: wrong token, a replay, or tampering.
    Unauthenticated = 5,
    /// A key or value over its limit.
    TooLarge = 6,
    /// The store (or the table of runs) is at its size limit.
    Full = 7,
    /// A heartbeat for a node another client holds.
    NodeClaimed = 8,
    /// Every connection slot is taken (or this one was closed for a newer).
    Busy = 9,
}

impl Status {
    pub fn from_u8(b: u8) -> Option<Status> {
        match b {
            0 => Some(Status::Ok),
            1 => Some(Status::NotFound),
            2 => Some(Status::Deadline),
            3 => Some(Status::AlreadyExists),
            4 => Some(Status::BadRequest),
            5 => Some(Status::Unauthenticated),
            6 => Some(Status::TooLarge),
            7 => Some(Status::Full),
            8 => Some(Status::NodeClaimed),
            9 => Some(Status::Busy),
            _ => None,
        }
    }

    /// Whether the status refuses the request (as opposed to answering it).
    pub fn is_refusal(self) -> bool {
        match self {
            Status::Ok | Status::NotFound | Status::Deadline | Status::AlreadyExists => false,
            Status::BadRequest
            | Status::Unauthenticated
            | Status::TooLarge
            | Status::Full
            | Status::NodeClaimed
            | Status::Busy => true,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Status::Ok => "OK",
            Status::NotFound => "NOT_FOUND",
            Status::Deadline => "DEADLINE",
            Status::AlreadyExists => "ALREADY_EXISTS",
            Status::BadRequest => "BAD_REQUEST",
            Status::Unauthenticated => "UNAUTHENTICATED",
            Status::TooLarge => "TOO_LARGE",
            Status::Full => "FULL",
            Status::NodeClaimed => "NODE_CLAIMED",
            Status::Busy => "BUSY",
        };
        f.write_str(s)
    }
}

/// Why a frame was refused. The server answers with [`WireError::status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// The stream ended or failed before the frame did.
    Io(std::io::ErrorKind),
    UnknownVersion(u8),
    UnknownOp(u8),
    UnknownStatus(u8),
    /// The hello was neither HELLO nor BUSY.
    UnknownHello(u8),
    KeyTooLong {
        len: usize,
    },
    ValueTooLarge {
        len: usize,
    },
    /// The payload's length does not fit the op.
    PayloadLength {
        op: Op,
        len: usize,
    },
    KeyNotUtf8,
    /// The head's or the request's tag did not verify.
    BadTag,
}

impl WireError {
    /// The status the server answers this refusal with.
    pub fn status(&self) -> Status {
        match self {
            WireError::BadTag => Status::Unauthenticated,
            WireError::KeyTooLong { .. } | WireError::ValueTooLarge { .. } => Status::TooLarge,
            WireError::Io(_)
            | WireError::UnknownVersion(_)
            | WireError::UnknownOp(_)
            | WireError::UnknownStatus(_)
            | WireError::UnknownHello(_)
            | WireError::PayloadLength { .. }
            | WireError::KeyNotUtf8 => Status::BadRequest,
        }
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(kind) => write!(f, "the connection ended mid-frame ({kind})"),
            WireError::UnknownVersion(v) => write!(f, "protocol version {v} (this side speaks {VERSION})"),
            WireError::UnknownOp(op) => write!(f, "unknown op {op}"),
            WireError::UnknownStatus(s) => write!(f, "unknown status {s}"),
            WireError::UnknownHello(h) => write!(f, "unknown hello {h:#x} (not a kiln store?)"),
            WireError::KeyTooLong { len } => write!(f, "a key of {len} bytes is over the limit of {MAX_KEY_BYTES}"),
            WireError::ValueTooLarge { len } => {
                write!(f, "a value of {len} bytes is over the limit of {MAX_VALUE_BYTES}")
            }
            WireError::PayloadLength { op, len } => {
                let (lo, hi) = op.payload_bounds();
                write!(f, "{op:?} takes {lo} to {hi} payload bytes, not {len}")
            }
            WireError::KeyNotUtf8 => f.write_str("the key is not UTF-8"),
            WireError::BadTag => f.write_str("the message is not authenticated by this run's token (or is a replay)"),
        }
    }
}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> WireError {
        WireError::Io(e.kind())
    }
}

/// The server's first bytes on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hello {
    /// Go ahead; tag the request with this challenge.
    Challenge([u8; 16]),
    /// No slot for this connection: try again shortly.
    Busy,
}

pub fn encode_hello(hello: Hello) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    match hello {
        Hello::Challenge(c) => {
            b[0] = HELLO;
            b[1..].copy_from_slice(&c);
        }
        Hello::Busy => b[0] = BUSY,
    }
    b
}

pub async fn read_hello<R: AsyncRead + Unpin>(r: &mut R) -> Result<Hello, WireError> {
    let mut b = [0u8; HELLO_BYTES];
    r.read_exact(&mut b).await?;
    let mut challenge = [0u8; 16];
    challenge.copy_from_slice(&b[1..]);
    match b[0] {
        HELLO => Ok(Hello::Challenge(challenge)),
        BUSY => Ok(Hello::Busy),
        other => Err(WireError::UnknownHello(other)),
    }
}

/// The fixed part of a request, its key, and what it commits to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub op: Op,
    /// Random per client: the identity a node id is bound to.
    pub client_id: [u8; 16],
    /// Random per request.
    pub nonce: [u8; 16],
    pub key: String,
    payload_len: usize,
    head: [u8; HEAD_BYTES],
}

/// A whole, authenticated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub client_id: [u8; 16],
    pub key: String,
    pub payload: Vec<u8>,
    /// The request's tag: what the response is bound to.
    pub tag: [u8; TAG_BYTES],
}

fn head_bytes(op: Op, client_id: &[u8; 16], nonce: &[u8; 16], key_len: usize, payload_len: usize) -> [u8; HEAD_BYTES] {
    let mut h = [0u8; HEAD_BYTES];
    h[0] = VERSION;
    h[1] = op as u8;
    h[2..18].copy_from_slice(client_id);
    h[18..34].copy_from_slice(nonce);
    h[34..38].copy_from_slice(&(key_len as u32).to_le_bytes());
    h[38..42].copy_from_slice(&(payload_len as u32).to_le_bytes());
    h
}

/// Encodes a request for the connection whose hello gave `challenge`;
/// returns the bytes and the request's tag. The caller keeps `key` and
/// `payload` within the limits (the server refuses them otherwise).
#[allow(clippy::too_many_arguments)]
pub fn encode_request(
    mac: &MacKey,
    challenge: &[u8; 16],
    client_id: &[u8; 16],
    nonce: &[u8; 16],
    op: Op,
    key: &str,
    payload: &[u8],
) -> (Vec<u8>, [u8; TAG_BYTES]) {
    let head = head_bytes(op, client_id, nonce, key.len(), payload.len());
    let head_tag = mac.tag(&[HEAD_DOMAIN, challenge, &head, key.as_bytes()]);
    let tag = mac.tag(&[REQUEST_DOMAIN, challenge, &head, key.as_bytes(), payload]);
    let mut buf = Vec::with_capacity(HEAD_BYTES + key.len() + payload.len() + 2 * TAG_BYTES);
    buf.extend_from_slice(&head);
    buf.extend_from_slice(key.as_bytes());
    buf.extend_from_slice(&head_tag);
    buf.extend_from_slice(payload);
    buf.extend_from_slice(&tag);
    (buf, tag)
}

fn u32_at(b: &[u8], at: usize) -> usize {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x) as usize
}

/// Reads and authenticates a request's head and key (nothing of the
/// payload): a client without the token gets no further.
pub async fn read_head<R: AsyncRead + Unpin>(r: &mut R, mac: &MacKey, challenge: &[u8; 16]) -> Result<Head, WireError> {
    let mut head = [0u8; HEAD_BYTES];
    r.read_exact(&mut head).await?;
    if head[0] != VERSION {
        return Err(WireError::UnknownVersion(head[0]));
    }
    let op = Op::from_u8(head[1]).ok_or(WireError::UnknownOp(head[1]))?;
    let key_len = u32_at(&head, 34);
    let payload_len = u32_at(&head, 38);
    if key_len > MAX_KEY_BYTES {
        return Err(WireError::KeyTooLong { len: key_len });
    }
    let (lo, hi) = op.payload_bounds();
    if op == Op::Put && payload_len > hi {
        return Err(WireError::ValueTooLarge { len: payload_len });
    }
    if payload_len < lo || payload_len > hi {
        return Err(WireError::PayloadLength { op, len: payload_len });
    }
    let mut key = vec![0u8; key_len];
    r.read_exact(&mut key).await?;
    let mut head_tag = [0u8; TAG_BYTES];
    r.read_exact(&mut head_tag).await?;
    if !mac.verify(&[HEAD_DOMAIN, challenge, &head, &key], &head_tag) {
        return Err(WireError::BadTag);
    }
    let key = String::from_utf8(key).map_err(|_| WireError::KeyNotUtf8)?;
    let mut client_id = [0u8; 16];
    client_id.copy_from_slice(&head[2..18]);
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&head[18..34]);
    Ok(Head { op, client_id, nonce, key, payload_len, head })
}

/// Reads the rest of the request `head` began and checks its tag.
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    mac: &MacKey,
    challenge: &[u8; 16],
    head: Head,
) -> Result<Request, WireError> {
    let mut payload = vec![0u8; head.payload_len];
    r.read_exact(&mut payload).await?;
    let mut tag = [0u8; TAG_BYTES];
    r.read_exact(&mut tag).await?;
    if !mac.verify(&[REQUEST_DOMAIN, challenge, &head.head, head.key.as_bytes(), &payload], &tag) {
        return Err(WireError::BadTag);
    }
    Ok(Request { op: head.op, client_id: head.client_id, key: head.key, payload, tag })
}

/// Decodes one request from `bytes` exactly as the server reads one from a
/// connection (the same [`read_head`] and [`read_body`]); what follows the
/// request is ignored. For tests and the fuzz target.
pub fn decode_request(bytes: &[u8], mac: &MacKey, challenge: &[u8; 16]) -> Result<Request, WireError> {
    let mut r = bytes;
    poll_ready(async {
        let head = read_head(&mut r, mac, challenge).await?;
        read_body(&mut r, mac, challenge, head).await
    })
}

/// Runs a future that never waits (it reads a byte slice) to completion.
fn poll_ready<T>(fut: impl Future<Output = Result<T, WireError>>) -> Result<T, WireError> {
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(r) => r,
        // A slice reader is always ready; were it not, that is a stream that
        // ended early, not a reason to block.
        Poll::Pending => Err(WireError::Io(std::io::ErrorKind::WouldBlock)),
    }
}

/// Encodes a response to the request whose tag is `request_tag`
/// ([`UNVERIFIED`] when it was never checked).
pub fn encode_response(mac: &MacKey, request_tag: &[u8; TAG_BYTES], status: Status, bytes: &[u8]) -> Vec<u8> {
    let len = (bytes.len() as u32).to_le_bytes();
    let code = [status as u8];
    let tag = mac.tag(&[RESPONSE_DOMAIN, request_tag, &code, &len, bytes]);
    let mut buf = Vec::with_capacity(5 + bytes.len() + TAG_BYTES);
    buf.push(status as u8);
    buf.extend_from_slice(&len);
    buf.extend_from_slice(bytes);
    buf.extend_from_slice(&tag);
    buf
}

/// A response as read, and whether its tag binds it to the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: Status,
    pub bytes: Vec<u8>,
    /// `true`: tagged for this very request. `false`: a refusal tagged as
    /// [`UNVERIFIED`] (or not tagged at all), which a client may report but
    /// never act on as an answer.
    pub authenticated: bool,
}

pub async fn read_response<R: AsyncRead + Unpin>(
    r: &mut R,
    mac: &MacKey,
    request_tag: &[u8; TAG_BYTES],
) -> Result<Response, WireError> {
    let code = r.read_u8().await?;
    let status = Status::from_u8(code).ok_or(WireError::UnknownStatus(code))?;
    let len = r.read_u32_le().await? as usize;
    if len > MAX_VALUE_BYTES {
        return Err(WireError::ValueTooLarge { len });
    }
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes).await?;
    let mut tag = [0u8; TAG_BYTES];
    r.read_exact(&mut tag).await?;
    let lenb = (len as u32).to_le_bytes();
    let authenticated = mac.verify(&[RESPONSE_DOMAIN, request_tag, &[code], &lenb, &bytes], &tag);
    Ok(Response { status, bytes, authenticated })
}

/// Writes `bytes` and flushes.
pub async fn write_all<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}

/// The `BEAT` payload.
pub fn beat_payload(node: u32, num_nodes: u32, stale_after_ms: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(16);
    p.extend_from_slice(&node.to_le_bytes());
    p.extend_from_slice(&num_nodes.to_le_bytes());
    p.extend_from_slice(&stale_after_ms.to_le_bytes());
    p
}

pub fn parse_beat(payload: &[u8]) -> Option<(u32, u32, u64)> {
    let node = u32::from_le_bytes(payload.get(0..4)?.try_into().ok()?);
    let num_nodes = u32::from_le_bytes(payload.get(4..8)?.try_into().ok()?);
    let stale = u64::from_le_bytes(payload.get(8..16)?.try_into().ok()?);
    Some((node, num_nodes, stale))
}

pub fn parse_u64(payload: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(payload.get(0..8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::auth::RunToken;

    fn mac() -> MacKey {
        MacKey::new(Some(&RunToken::new("0123456789abcdef-test", "T").unwrap())).unwrap()
    }

    #[test]
    fn a_request_round_trips_only_on_its_own_connection() {
        let m = mac();
        let (c, id, n) = ([7u8; 16], [1u8; 16], [2u8; 16]);
        let (bytes, tag) = encode_request(&m, &c, &id, &n, Op::Put, "kiln/r/0/k", b"value");
        let req = decode_request(&bytes, &m, &c).unwrap();
        assert_eq!(
            (req.op, req.key.as_str(), req.payload.as_slice(), req.tag),
            (Op::Put, "kiln/r/0/k", &b"value"[..], tag)
        );
        assert_eq!(req.client_id, id);
        // Replayed on a connection with another challenge: refused.
        assert_eq!(decode_request(&bytes, &m, &[8u8; 16]), Err(WireError::BadTag));
        // Under another token: refused.
        let other = MacKey::new(None).unwrap();
        assert_eq!(decode_request(&bytes, &other, &c), Err(WireError::BadTag));
        // Any byte changed: refused (or a length error), never accepted.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(decode_request(&b, &m, &c).is_err(), "byte {i} flipped and accepted");
        }
    }

    #[test]
    fn lengths_are_refused_before_anything_is_read_for_them() {
        let m = mac();
        let c = [0u8; 16];
        let mut head = head_bytes(Op::Put, &[0; 16], &[0; 16], 0, MAX_VALUE_BYTES + 1);
        assert_eq!(decode_request(&head, &m, &c), Err(WireError::ValueTooLarge { len: MAX_VALUE_BYTES + 1 }));
        head = head_bytes(Op::Get, &[0; 16], &[0; 16], u32::MAX as usize, 8);
        assert_eq!(decode_request(&head, &m, &c), Err(WireError::KeyTooLong { len: u32::MAX as usize }));
        head = head_bytes(Op::Beat, &[0; 16], &[0; 16], 1, 1 << 30);
        assert_eq!(decode_request(&head, &m, &c), Err(WireError::PayloadLength { op: Op::Beat, len: 1 << 30 }));
        assert_eq!(decode_request(&head[..10], &m, &c), Err(WireError::Io(std::io::ErrorKind::UnexpectedEof)));
    }

    #[test]
    fn responses_are_bound_to_their_request() {
        let m = mac();
        let t = [3u8; 32];
        let bytes = encode_response(&m, &t, Status::Ok, b"v");
        let read = |tag: &[u8; 32]| poll_ready(read_response(&mut bytes.as_slice(), &m, tag)).unwrap();
        assert!(read(&t).authenticated);
        assert!(!read(&[4u8; 32]).authenticated);
        assert_eq!(read(&t).bytes, b"v");
    }
}
