//! The store's wire format: one request and one response per TCP connection.
//!
//! Request: `op: u8`, `key_len: u32 LE`, `key` (UTF-8), `payload_len: u32 LE`,
//! `payload`. Response: `status: u8`, `len: u32 LE`, `bytes`.
//!
//! | op | payload | OK response bytes |
//! |----|---------|-------------------|
//! | `PUT` | the value | empty |
//! | `GET` | `timeout_ms: u64 LE` | the value |
//! | `TRY_GET` | empty | the value |
//! | `BEAT` (key = run prefix) | `node: u32, num_nodes: u32, stale_after_ms: u64` | stale node ids, `u32 LE` each |
//!
//! Invariant: both sides refuse a key over [`MAX_KEY_BYTES`] or a payload
//! over [`MAX_VALUE_BYTES`] before allocating it, so a garbled length never
//! exhausts memory.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Longest key either side accepts.
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest value either side accepts (topologies and NCCL ids are a few KiB).
pub const MAX_VALUE_BYTES: usize = 16 << 20;

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    Deadline = 2,
    AlreadyExists = 3,
    BadRequest = 4,
}

impl Status {
    pub fn from_u8(b: u8) -> Option<Status> {
        match b {
            0 => Some(Status::Ok),
            1 => Some(Status::NotFound),
            2 => Some(Status::Deadline),
            3 => Some(Status::AlreadyExists),
            4 => Some(Status::BadRequest),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub key: String,
    pub payload: Vec<u8>,
}

async fn read_len<R: AsyncRead + Unpin>(r: &mut R, max: usize, what: &str) -> std::io::Result<usize> {
    let len = r.read_u32_le().await? as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what} of {len} bytes is over the limit of {max}"),
        ));
    }
    Ok(len)
}

pub async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Request> {
    let op = r.read_u8().await?;
    let op = Op::from_u8(op)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unknown op {op}")))?;
    let key_len = read_len(r, MAX_KEY_BYTES, "key").await?;
    let mut key = vec![0; key_len];
    r.read_exact(&mut key).await?;
    let key =
        String::from_utf8(key).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "key is not UTF-8"))?;
    let len = read_len(r, MAX_VALUE_BYTES, "value").await?;
    let mut payload = vec![0; len];
    r.read_exact(&mut payload).await?;
    Ok(Request { op, key, payload })
}

pub async fn write_request<W: AsyncWrite + Unpin>(w: &mut W, req: &Request) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(9 + req.key.len() + req.payload.len());
    buf.push(req.op as u8);
    buf.extend_from_slice(&(req.key.len() as u32).to_le_bytes());
    buf.extend_from_slice(req.key.as_bytes());
    buf.extend_from_slice(&(req.payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&req.payload);
    w.write_all(&buf).await?;
    w.flush().await
}

pub async fn read_response<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<(Status, Vec<u8>)> {
    let status = r.read_u8().await?;
    let status = Status::from_u8(status)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unknown status {status}")))?;
    let len = read_len(r, MAX_VALUE_BYTES, "response").await?;
    let mut bytes = vec![0; len];
    r.read_exact(&mut bytes).await?;
    Ok((status, bytes))
}

pub async fn write_response<W: AsyncWrite + Unpin>(w: &mut W, status: Status, bytes: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(5 + bytes.len());
    buf.push(status as u8);
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
    w.write_all(&buf).await?;
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
