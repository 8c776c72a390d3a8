//! `Client`: one PJRT client of one plugin, with its addressable devices.
//!
//! Invariants: a `Client` is an `Arc` over the PJRT client, so buffers,
//! devices and executables that hold a clone keep it alive; the device lists
//! are read once at creation and never change. `devices()` are this
//! process's (addressable) devices; `global_devices()` are every process's,
//! in global-id order, and equal `devices()` in a single process. A client
//! of several nodes always has a key-value store (refused before the plugin
//! is called otherwise) and is never a CPU client.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::buffer::Buffer;
use crate::compile_options::CompileOptions;
use crate::distributed::StoreHandle;
use crate::element_type::ArgType;
use crate::element_type::{ElementType, NativeType};
use crate::error::{Result, RuntimeError};
use crate::executable::Executable;
use crate::gpu_memory::MemoryFraction;
use crate::pjrt::handles::{OptionValue, RawClient, RawDevice};
use crate::pjrt::host::as_bytes;
use crate::pjrt::Api;
use crate::plugin;
use crate::signature::Signature;

/// How to create a [`Client`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientOptions {
    /// The plugin `.so`; `None` = discovery (see [`crate::plugin`]).
    pub plugin: Option<PathBuf>,
    /// Number of CPU devices the CPU plugin exposes (`cpu_device_count`);
    /// `None` leaves the plugin's default. Sent as a create option whenever
    /// set, so set it only for the CPU plugin (replica plans do).
    pub cpu_device_count: Option<usize>,
    /// GPU ordinals the CUDA plugin opens (`visible_devices`); `None` opens
    /// every GPU. Sent only when set, so set it only for the CUDA plugin.
    pub visible_devices: Option<Vec<usize>>,
    /// This process's place in a run of several; `None` is one process.
    pub distributed: Option<DistributedOptions>,
    /// The share of each GPU the CUDA plugin's allocator may take
    /// (`memory_fraction`); `None` leaves the plugin's 75%. Set it only for
    /// the CUDA plugin (`crate::gpu_memory`).
    pub memory_fraction: Option<MemoryFraction>,
    /// Whether the CUDA allocator reserves its fraction at start
    /// (`preallocate`); `None` leaves the plugin's default (it does). kiln's
    /// own clients (`ReplicaPlan::create_client`) fill it from
    /// `KILN_GPU_PREALLOCATE`, else `false` (`crate::gpu_memory`).
    pub preallocate: Option<bool>,
}

/// The client-creation inputs of a multi-process run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedOptions {
    /// This process, `0..num_nodes` (the plugin's `node_id`).
    pub node_id: u32,
    /// Processes in the run (the plugin's `num_nodes`).
    pub num_nodes: u32,
    /// The store behind the plugin's key-value callbacks; required when
    /// `num_nodes > 1`.
    pub store: Option<StoreHandle>,
}

/// A device of the run as every process sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalDevice {
    /// The global device id (what a device assignment names).
    pub id: i32,
    /// The process that addresses it.
    pub process_index: i32,
    pub kind: String,
}

pub(crate) struct DeviceEntry {
    pub(crate) raw: RawDevice,
    pub(crate) id: i32,
    pub(crate) kind: String,
    pub(crate) debug_string: String,
}

pub(crate) struct ClientInner {
    // Declared before nothing that outlives it: fields drop in order, and
    // `raw` is the only owner of the PJRT client.
    pub(crate) raw: RawClient,
    pub(crate) api: &'static Api,
    pub(crate) platform_name: String,
    pub(crate) devices: Vec<DeviceEntry>,
    pub(crate) global_devices: Vec<GlobalDevice>,
    pub(crate) process_index: usize,
}

impl ClientInner {
    pub(crate) fn device_index(&self, raw: RawDevice) -> Option<usize> {
        self.devices.iter().position(|d| d.raw == raw)
    }
}

/// A PJRT client. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("platform", &self.inner.platform_name)
            .field("plugin", &self.inner.api.path())
            .field("devices", &self.inner.devices.len())
            .finish()
    }
}

/// The plugin's create options for `options`, by the names and types the
/// plugins read (`cpu_device_count`; the CUDA plugin's `visible_devices`,
/// `memory_fraction` as a float, `preallocate` as a bool; `node_id` and
/// `num_nodes` for several processes). Only what is set is sent.
pub(crate) fn create_options(options: &ClientOptions) -> Result<Vec<(String, OptionValue)>> {
    let to_i64 = |what: &str, n: usize| {
        i64::try_from(n).map_err(|_| RuntimeError::CompileOptions { message: format!("{what} {n} is too large") })
    };
    let mut create_options = Vec::new();
    if let Some(count) = options.cpu_device_count {
        create_options.push(("cpu_device_count".to_string(), OptionValue::Int64(to_i64("cpu_device_count", count)?)));
    }
    if let Some(list) = &options.visible_devices {
        let list = list.iter().map(|&d| to_i64("visible device", d)).collect::<Result<Vec<_>>>()?;
        create_options.push(("visible_devices".to_string(), OptionValue::Int64List(list)));
    }
    if let Some(f) = options.memory_fraction {
        create_options.push(("memory_fraction".to_string(), OptionValue::Float(f.get())));
    }
    if let Some(p) = options.preallocate {
        create_options.push(("preallocate".to_string(), OptionValue::Bool(p)));
    }
    if let Some(d) = options.distributed.as_ref().filter(|d| d.num_nodes > 1) {
        create_options.push(("node_id".to_string(), OptionValue::Int64(i64::from(d.node_id))));
        create_options.push(("num_nodes".to_string(), OptionValue::Int64(i64::from(d.num_nodes))));
    }
    Ok(create_options)
}

impl Client {
    /// Loads the plugin (once per process) and creates a client.
    pub fn new(options: &ClientOptions) -> Result<Client> {
        // The GPU plugin asserts (aborting the process) when several nodes
        // come without a store: refuse that before loading anything.
        let kv = match &options.distributed {
            Some(d) if d.num_nodes > 1 => match &d.store {
                Some(store) => Some(store.0.clone()),
                None => return Err(RuntimeError::MissingCoordinator { num_nodes: d.num_nodes }),
            },
            Some(d) => d.store.as_ref().map(|s| s.0.clone()),
            None => None,
        };
        let path = plugin::resolve_plugin(options.plugin.as_deref())?;
        let api = Api::load(&path)?;
        let create_options = create_options(options)?;
        let num_nodes = options.distributed.as_ref().map_or(1, |d| d.num_nodes);
        let raw = RawClient::create(api, &create_options, kv)?;
        let platform_name = raw.platform_name()?;
        if num_nodes > 1 && platform_name == "cpu" {
            return Err(RuntimeError::PlatformNotDistributed { platform: platform_name, num_nodes });
        }
        // kiln's host copies (custom calls the compiler emits for values it
        // sends to host memory): a plugin that cannot take them still runs
        // every program without them.
        if let Err(reason) = crate::pjrt::host_copy::register(api, &platform_name) {
            tracing::debug!(platform = %platform_name, %reason, "host-copy handlers not registered");
        }
        let devices = raw
            .addressable_devices()?
            .into_iter()
            .map(|d| {
                let info = d.info(api)?;
                Ok(DeviceEntry { raw: d, id: info.id, kind: info.kind, debug_string: info.debug_string })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut global_devices = raw
            .global_devices()?
            .into_iter()
            .map(|d| {
                let info = d.info(api)?;
                Ok(GlobalDevice { id: info.id, process_index: info.process_index, kind: info.kind })
            })
            .collect::<Result<Vec<_>>>()?;
        global_devices.sort_by_key(|d| d.id);
        let process_index = usize::try_from(raw.process_index()?).unwrap_or(0);
        tracing::info!(
            platform = %platform_name,
            devices = devices.len(),
            global_devices = global_devices.len(),
            process_index,
            plugin = %path.display(),
            "PJRT client created"
        );
        Ok(Client { inner: Arc::new(ClientInner { raw, api, platform_name, devices, global_devices, process_index }) })
    }

    /// Every device of the run in global-id order (this process's and the
    /// others'); in a single process, the same devices as [`Client::devices`].
    pub fn global_devices(&self) -> &[GlobalDevice] {
        &self.inner.global_devices
    }

    /// This process's index in the run (0 in a single process).
    pub fn process_index(&self) -> usize {
        self.inner.process_index
    }

    /// Replica `r` on the `r`-th global device (by id), one partition: the
    /// assignment every process computes alike, so all agree on which
    /// replica runs where without relying on the plugin's default.
    pub fn replica_assignment(&self, replicas: usize) -> Result<Vec<Vec<i64>>> {
        let global = &self.inner.global_devices;
        if replicas > global.len() {
            return Err(RuntimeError::CompileOptions {
                message: format!("{replicas} replicas need as many devices; the run has {}", global.len()),
            });
        }
        Ok(global[..replicas].iter().map(|d| vec![i64::from(d.id)]).collect())
    }

    /// The global replica indices this process runs, in replica order, for
    /// `replicas` replicas assigned by [`Client::replica_assignment`].
    pub fn local_replicas(&self, replicas: usize) -> Vec<usize> {
        let me = self.inner.process_index as i32;
        self.inner.global_devices[..replicas.min(self.inner.global_devices.len())]
            .iter()
            .enumerate()
            .filter(|(_, d)| d.process_index == me)
            .map(|(r, _)| r)
            .collect()
    }

    /// The platform (`cpu`, `cuda`, ...).
    pub fn platform_name(&self) -> &str {
        &self.inner.platform_name
    }

    /// Path of the loaded plugin.
    pub fn plugin_path(&self) -> &Path {
        self.inner.api.path()
    }

    /// PJRT C API version the plugin implements (major, minor).
    pub fn api_version(&self) -> (i32, i32) {
        self.inner.api.version()
    }

    /// The extensions the plugin offers beside the core C API, in the order
    /// it chains them.
    pub fn plugin_extensions(&self) -> Vec<crate::pjrt::PluginExtension> {
        self.inner.api.extensions()
    }

    /// The addressable devices, in the plugin's order.
    /// Which PJRT event functions the plugin implements (its table slot is
    /// set), by C name: what asynchronous execution can rely on. kiln needs
    /// `PJRT_Event_Await` and `PJRT_Event_IsReady`.
    pub fn event_functions(&self) -> Vec<(&'static str, bool)> {
        self.inner.api.event_functions()
    }

    pub fn devices(&self) -> Vec<Device> {
        (0..self.inner.devices.len()).map(|index| Device { client: self.clone(), index }).collect()
    }

    /// Makes each addressable device's memory pool exist: a 4-byte buffer
    /// per device, copied in, waited for and dropped. The CUDA plugin's
    /// allocator reserves its pool (`memory_fraction` of the GPU, with
    /// `preallocate`) at the first allocation, not when the client is
    /// created: about 1 s for 60 GB on an H100 (`benches/RESULTS.md`). On a
    /// thread of its own this overlaps that with the caller's host work; a
    /// later allocation waits for it.
    pub fn reserve_device_memory(&self) -> Result<()> {
        for device in self.devices() {
            self.buffer_from_bytes(&[0u8; 4], ElementType::F32, &[], &device)?;
        }
        Ok(())
    }

    pub(crate) fn same_client(&self, other: &Client) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn check_device(&self, device: &Device) -> Result<()> {
        if self.same_client(&device.client) {
            Ok(())
        } else {
            Err(RuntimeError::ForeignDevice { device: device.id() })
        }
    }

    /// Copies `data` (row-major, `dims`) to a new buffer on `device`.
    pub fn buffer_from_host<T: NativeType>(&self, data: &[T], dims: &[usize], device: &Device) -> Result<Buffer> {
        self.buffer_from_bytes(as_bytes(data), T::TYPE, dims, device)
    }

    /// Copies raw host bytes (row-major, `ty` elements of `dims`) to a new
    /// buffer on `device`. `Pred` takes one byte (0 or 1) per element.
    pub fn buffer_from_bytes(&self, bytes: &[u8], ty: ElementType, dims: &[usize], device: &Device) -> Result<Buffer> {
        self.check_device(device)?;
        let expected = ArgType::new(ty, dims).size_in_bytes();
        if bytes.len() != expected {
            return Err(RuntimeError::HostDataLength { ty, dims: dims.to_vec(), expected, got: bytes.len() });
        }
        let dims_i64 = dims
            .iter()
            .map(|&d| i64::try_from(d))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| RuntimeError::HostDataLength { ty, dims: dims.to_vec(), expected, got: bytes.len() })?;
        let raw = self.inner.raw.buffer_from_host(bytes, ty.to_pjrt(), &dims_i64, device.raw())?;
        Ok(Buffer::from_parts(self.clone(), raw, ty, dims.to_vec(), device.index))
    }

    /// Parses `@main`'s signature, then compiles the StableHLO text.
    pub fn compile(&self, stablehlo_text: &str, options: &CompileOptions) -> Result<Executable> {
        let signature = Signature::from_stablehlo(stablehlo_text)?;
        let proto = options.to_proto_bytes()?;
        let raw = self.inner.raw.compile(stablehlo_text, "mlir", &proto)?;
        Executable::new(self.clone(), raw, signature)
    }

    /// Loads an executable written by [`Executable::serialize`] (the kiln
    /// envelope restores the signature), or raw PJRT bytes together with
    /// `signature`. An explicit `signature` overrides the envelope's.
    pub fn deserialize_executable(&self, bytes: &[u8], signature: Option<Signature>) -> Result<Executable> {
        let (envelope_signature, pjrt_bytes) = match crate::executable::envelope::open(bytes)? {
            Some((sig, rest)) => (Some(sig), rest),
            None => (None, bytes),
        };
        let signature = signature.or(envelope_signature).ok_or_else(|| RuntimeError::Deserialize {
            reason: "the bytes are not a kiln executable envelope and no signature was given".into(),
        })?;
        let raw = self.inner.raw.deserialize_and_load(pjrt_bytes)?;
        Executable::new(self.clone(), raw, signature)
    }
}

/// An addressable device of a [`Client`] (keeps the client alive).
#[derive(Clone)]
pub struct Device {
    pub(crate) client: Client,
    pub(crate) index: usize,
}

impl Device {
    fn entry(&self) -> &DeviceEntry {
        &self.client.inner.devices[self.index]
    }

    pub(crate) fn raw(&self) -> RawDevice {
        self.entry().raw
    }

    /// The plugin's device id.
    pub fn id(&self) -> i32 {
        self.entry().id
    }

    /// Vendor-specific kind (`cpu`, `NVIDIA H100 80GB HBM3`, ...).
    pub fn kind(&self) -> &str {
        &self.entry().kind
    }

    /// Verbose description for logs.
    pub fn debug_string(&self) -> &str {
        &self.entry().debug_string
    }

    /// The client this device belongs to.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The most bytes the plugin's allocator lets this device's buffers take:
    /// on the CUDA plugin its `memory_fraction` of the GPU (75% unless set,
    /// [`crate::GpuMemory`]), not the GPU's whole memory. `None` where the
    /// plugin reports no limit; an error where it has no memory stats.
    pub fn memory_limit_bytes(&self) -> Result<Option<u64>> {
        let limit = self.raw().bytes_limit(self.client.inner.api)?;
        Ok(limit.and_then(|b| u64::try_from(b).ok()))
    }

    /// The bytes this device's buffers hold now, and the most they have held
    /// (`None` where the plugin does not track it); an error where the plugin
    /// has no memory stats (the XLA CPU plugin).
    pub fn memory_in_use(&self) -> Result<(u64, Option<u64>)> {
        let (now, peak) = self.raw().bytes_in_use(self.client.inner.api)?;
        Ok((u64::try_from(now).unwrap_or(0), peak.and_then(|p| u64::try_from(p).ok())))
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.client.same_client(&other.client) && self.index == other.index
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({}, id={}, {})", self.client.platform_name(), self.id(), self.kind())
    }
}

impl crate::gpu_memory::GpuMemory {
    /// Fills the settings `options` leaves unset: from these, and
    /// `preallocate` from [`crate::gpu_memory::DEFAULT_PREALLOCATE`] when these leave it unset too.
    pub fn apply(self, options: &mut ClientOptions) {
        options.memory_fraction = options.memory_fraction.or(self.memory_fraction);
        options.preallocate = options.preallocate.or(self.preallocate).or(Some(crate::gpu_memory::DEFAULT_PREALLOCATE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(options: &[(String, OptionValue)]) -> Vec<&str> {
        options.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn nothing_set_sends_nothing() {
        assert!(create_options(&ClientOptions::default()).unwrap().is_empty());
    }

    #[test]
    fn gpu_options_travel_with_the_names_and_types_the_cuda_plugin_reads() {
        let options = ClientOptions {
            visible_devices: Some(vec![0, 2]),
            memory_fraction: Some(MemoryFraction::new(0.3).unwrap()),
            preallocate: Some(false),
            ..ClientOptions::default()
        };
        let encoded = create_options(&options).unwrap();
        assert_eq!(names(&encoded), ["visible_devices", "memory_fraction", "preallocate"]);
        assert!(matches!(&encoded[0].1, OptionValue::Int64List(l) if l == &[0, 2]));
        assert!(matches!(encoded[1].1, OptionValue::Float(f) if f == 0.3f32));
        assert!(matches!(encoded[2].1, OptionValue::Bool(false)));
    }

    #[test]
    fn the_cpu_device_count_is_an_int64() {
        let encoded = create_options(&ClientOptions { cpu_device_count: Some(4), ..ClientOptions::default() }).unwrap();
        assert_eq!(names(&encoded), ["cpu_device_count"]);
        assert!(matches!(encoded[0].1, OptionValue::Int64(4)));
    }
}
