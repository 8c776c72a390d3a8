//! `Executable`: a compiled program bound to a client's devices.
//!
//! Invariants: an executable keeps the `@main` signature it was compiled
//! from; `execute*` check argument count, element type, dims, client and
//! device against it before calling the plugin; `execute` and
//! `execute_replicated` return outputs only after every device has finished;
//! `execute_replicated_async` returns them at once with a [`Completion`] that
//! owns the run's events; every PJRT event is destroyed exactly once.
//!
//! Donation: an `ExecArg::Donated` buffer may be reused by the program for
//! an aliased output (`tf.aliasing_output`); it is consumed either way.
//! Borrowed buffers are passed as non-donatable, so they stay valid.

use std::fmt;

use crate::buffer::Buffer;
use crate::client::Client;
use crate::error::{Result, RuntimeError};
pub use crate::memory_stats::CompiledMemoryStats;
use crate::pjrt::handles::{RawBuffer, RawEvent, RawExecutable, RawLoadedExecutable};
use crate::signature::Signature;

/// One argument of an execution.
pub enum ExecArg<'a> {
    /// The buffer stays valid and unchanged.
    Borrowed(&'a Buffer),
    /// The buffer is handed over; the program may reuse its memory for an
    /// aliased output. It must not be used afterwards (when passed in a
    /// slice the plugin has deleted its contents and reads return an error).
    Donated(Buffer),
}

impl ExecArg<'_> {
    fn buffer(&self) -> &Buffer {
        match self {
            ExecArg::Borrowed(b) => b,
            ExecArg::Donated(b) => b,
        }
    }

    fn is_donated(&self) -> bool {
        matches!(self, ExecArg::Donated(_))
    }
}

/// The completion of one enqueued run: one event per device. `Send + Sync`.
///
/// Dropping it does not cancel the run (PJRT runs cannot be cancelled); the
/// outputs stay valid and later reads or runs wait for them.
pub struct Completion {
    events: Vec<RawEvent>,
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Completion({} events)", self.events.len())
    }
}

impl Completion {
    /// Whether every device has finished (successfully or not), without blocking.
    pub fn is_ready(&self) -> Result<bool> {
        for e in &self.events {
            if !e.is_ready()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Blocks until every device has finished; the first failure of the run,
    /// if any. Waiting again returns the same status.
    pub fn wait(&self) -> Result<()> {
        let mut status = Ok(());
        for e in &self.events {
            let result = e.wait();
            if status.is_ok() {
                status = result;
            }
        }
        status
    }
}

/// A compiled, loaded program. `Send + Sync`.
pub struct Executable {
    // Field order is drop order: the executable handles go before the
    // client that owns their devices.
    raw: RawLoadedExecutable,
    compiled: RawExecutable,
    client: Client,
    signature: Signature,
    /// What one device's argument and output buffers look like: the
    /// signature itself unless the program is SPMD-partitioned, where each
    /// device holds its shard (set by [`Executable::with_local_signature`]).
    local_signature: Signature,
    /// Client device index of each replica, in execution order.
    replica_devices: Vec<usize>,
    num_replicas: usize,
    num_outputs: usize,
}

impl fmt::Debug for Executable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executable")
            .field("signature", &self.signature.to_string())
            .field("num_replicas", &self.num_replicas)
            .finish()
    }
}

impl Executable {
    pub(crate) fn new(client: Client, raw: RawLoadedExecutable, signature: Signature) -> Result<Executable> {
        let compiled = raw.executable()?;
        let num_replicas = compiled.num_replicas()?;
        let num_outputs = compiled.num_outputs()?;
        if num_outputs != signature.outputs.len() {
            return Err(RuntimeError::OutputCount { expected: signature.outputs.len(), got: num_outputs });
        }
        let replica_devices = raw
            .addressable_devices()?
            .into_iter()
            .map(|d| {
                client.inner.device_index(d).ok_or_else(|| RuntimeError::Pjrt {
                    function: "PJRT_LoadedExecutable_AddressableDevices",
                    code: crate::error::PjrtErrorCode::Internal,
                    message: "the executable runs on a device this client does not address".into(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let local_signature = signature.clone();
        Ok(Executable { raw, compiled, client, signature, local_signature, replica_devices, num_replicas, num_outputs })
    }

    /// The `@main` signature the program was compiled from.
    pub fn signature(&self) -> &Signature {
        &self.signature
    }

    /// Declares the per-device argument and output types of an
    /// SPMD-partitioned program (shards of the global `@main` types); the
    /// argument checks use them from then on. Refused when the counts differ
    /// from the global signature's.
    pub fn with_local_signature(mut self, local: Signature) -> Result<Executable> {
        if local.inputs.len() != self.signature.inputs.len() {
            return Err(RuntimeError::ArgCount { expected: self.signature.inputs.len(), got: local.inputs.len() });
        }
        if local.outputs.len() != self.signature.outputs.len() {
            return Err(RuntimeError::OutputCount { expected: self.signature.outputs.len(), got: local.outputs.len() });
        }
        self.local_signature = local;
        Ok(self)
    }

    /// Per-device argument and output types (the signature unless partitioned).
    pub fn local_signature(&self) -> &Signature {
        &self.local_signature
    }

    /// Devices one execution runs on (replicas × partitions in a single
    /// process): how many argument lists `execute_replicated` takes.
    pub fn num_local_devices(&self) -> usize {
        self.replica_devices.len()
    }

    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// Replicas this process runs (all of them in a single process; its own
    /// share in a run of several): how many argument lists `execute_replicated` takes.
    pub fn num_local_replicas(&self) -> usize {
        self.replica_devices.len()
    }

    /// The device each of this process's replicas runs on, in replica
    /// order: where its arguments must live.
    pub fn replica_devices(&self) -> Vec<crate::client::Device> {
        self.replica_devices.iter().map(|&index| crate::client::Device { client: self.client.clone(), index }).collect()
    }

    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// A fingerprint of the compiled program; `None` if the plugin has none.
    pub fn fingerprint(&self) -> Result<Option<String>> {
        self.compiled.fingerprint()
    }

    pub fn compiled_memory_stats(&self) -> Result<CompiledMemoryStats> {
        self.compiled.compiled_memory_stats()
    }

    /// A kiln envelope (magic, signature, PJRT bytes) that
    /// [`Client::deserialize_executable`] turns back into an executable.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let pjrt_bytes = self.compiled.serialize()?;
        Ok(envelope::seal(&self.signature, &pjrt_bytes))
    }

    /// Runs replica 0 (a single-device program) and returns its outputs.
    pub fn execute(&self, args: &[ExecArg<'_>]) -> Result<Vec<Buffer>> {
        if self.num_replicas != 1 {
            return Err(RuntimeError::ReplicaCount { expected: self.num_replicas, got: 1 });
        }
        let lists = [args.iter().collect::<Vec<_>>()];
        let (mut outputs, done) = self.run(&lists)?;
        done.wait()?;
        Ok(outputs.pop().unwrap_or_default())
    }

    /// Runs every replica: `args[replica][arg]` → `[replica][output]`.
    pub fn execute_replicated(&self, args: Vec<Vec<ExecArg<'_>>>) -> Result<Vec<Vec<Buffer>>> {
        let (outputs, done) = self.execute_replicated_async(args)?;
        done.wait()?;
        Ok(outputs)
    }

    /// Enqueues every replica: `args[replica][arg]` → `[replica][output]` and
    /// the run's completion, without waiting for the devices. A failure
    /// inside the run surfaces from [`Completion::wait`] and from reads of the
    /// outputs.
    pub fn execute_replicated_async(&self, args: Vec<Vec<ExecArg<'_>>>) -> Result<(Vec<Vec<Buffer>>, Completion)> {
        let lists: Vec<Vec<&ExecArg<'_>>> = args.iter().map(|l| l.iter().collect()).collect();
        self.run(&lists)
        // `args` drops here: donated (and borrowed) handles may be destroyed
        // while the run is in flight; PJRT frees their memory after its uses.
    }

    fn check(&self, args: &[Vec<&ExecArg<'_>>]) -> Result<()> {
        let replicas = self.replica_devices.len();
        if args.len() != replicas {
            return Err(RuntimeError::ReplicaCount { expected: replicas, got: args.len() });
        }
        for (replica, list) in args.iter().enumerate() {
            if list.len() != self.local_signature.inputs.len() {
                return Err(RuntimeError::ArgCount { expected: self.local_signature.inputs.len(), got: list.len() });
            }
            for (index, (arg, expected)) in list.iter().zip(&self.local_signature.inputs).enumerate() {
                let buffer = arg.buffer();
                if !buffer.client().same_client(&self.client) {
                    return Err(RuntimeError::ForeignBuffer { index });
                }
                let got = buffer.arg_type();
                if &got != expected {
                    return Err(RuntimeError::ArgType { index, expected: expected.clone(), got });
                }
                let want = self.replica_devices[replica];
                if buffer.device_index() != want {
                    let devices = &self.client.inner.devices;
                    return Err(RuntimeError::WrongDevice {
                        replica,
                        index,
                        expected: devices[want].id,
                        got: devices[buffer.device_index()].id,
                    });
                }
            }
        }
        Ok(())
    }

    fn run(&self, args: &[Vec<&ExecArg<'_>>]) -> Result<(Vec<Vec<Buffer>>, Completion)> {
        self.check(args)?;
        // An argument index may be donated only if every replica donates it.
        let num_args = self.signature.inputs.len();
        let non_donatable: Vec<i64> =
            (0..num_args).filter(|&i| !args.iter().all(|list| list[i].is_donated())).map(|i| i as i64).collect();
        let raw_args: Vec<Vec<&RawBuffer>> = args.iter().map(|l| l.iter().map(|a| &a.buffer().raw).collect()).collect();
        let (outputs, events) = self.raw.execute(&raw_args, &non_donatable, self.num_outputs)?;
        let done = Completion { events };
        let outputs = outputs
            .into_iter()
            .map(|list| list.into_iter().map(|raw| Buffer::from_plugin(&self.client, raw)).collect())
            .collect::<Result<Vec<Vec<Buffer>>>>()?;
        Ok((outputs, done))
    }
}

/// The serialized-executable envelope: `KILNEXE1`, u32 LE signature length,
/// the signature's text form, then the plugin's bytes.
pub(crate) mod envelope {
    use super::*;

    const MAGIC: &[u8; 8] = b"KILNEXE1";

    pub(crate) fn seal(signature: &Signature, pjrt_bytes: &[u8]) -> Vec<u8> {
        let sig = signature.to_string();
        let mut out = Vec::with_capacity(MAGIC.len() + 4 + sig.len() + pjrt_bytes.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(sig.len() as u32).to_le_bytes());
        out.extend_from_slice(sig.as_bytes());
        out.extend_from_slice(pjrt_bytes);
        out
    }

    /// `Ok(None)` when `bytes` has no kiln magic (raw PJRT bytes).
    pub(crate) fn open(bytes: &[u8]) -> Result<Option<(Signature, &[u8])>> {
        let Some(rest) = bytes.strip_prefix(MAGIC.as_slice()) else {
            return Ok(None);
        };
        let bad = |reason: &str| RuntimeError::Deserialize { reason: reason.to_string() };
        let (len, rest) =
            rest.split_first_chunk::<4>().ok_or_else(|| bad("envelope truncated before the signature length"))?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(bad("envelope truncated inside the signature"));
        }
        let (sig, pjrt) = rest.split_at(len);
        let sig = std::str::from_utf8(sig).map_err(|_| bad("signature is not UTF-8"))?;
        let signature = Signature::parse_function_type(sig)
            .map_err(|e| RuntimeError::Deserialize { reason: format!("bad signature in envelope: {e}") })?;
        if pjrt.is_empty() {
            return Err(bad("envelope holds no executable bytes"));
        }
        Ok(Some((signature, pjrt)))
    }
}
