//! kiln runtime: runs StableHLO programs through a PJRT plugin.
//!
//! Where it sits: the compiler hands StableHLO text to [`Client::compile`];
//! the frontend moves data with [`Buffer`]s and runs [`Executable`]s. The
//! runtime never sees the graph IR.
//!
//! - [`plugin`] finds the plugin (explicit path, `KILN_PJRT_PLUGIN`, `PJRT_DEVICE`);
//! - [`cache`] is the persistent compile cache (serialized executables on disk);
//! - [`gpu`] probes the CUDA driver for GPUs (names, memory); [`replicas`]
//!   turns `GPU_NUM_DEVICES` / `KILN_CPU_DEVICES` into a replica count and
//!   client options;
//! - [`gpu_memory`] is how much of each GPU the CUDA plugin takes
//!   (`KILN_GPU_MEMORY_FRACTION`, `KILN_GPU_PREALLOCATE`);
//! - [`distributed`] is several processes in one run: identity from
//!   `KILN_NUM_NODES`/`KILN_NODE_ID`/`KILN_COORDINATOR`, the key-value store
//!   PJRT asks for, the start-up barrier and the lost-peer watchdog;
//! - [`pjrt`] is kiln's binding to the PJRT C API (the only `unsafe` code);
//! - [`Client`], [`Device`], [`Buffer`], [`Executable`] are the checked API:
//!   argument counts, dtypes, shapes, devices and client identity are verified
//!   before the plugin is called, and every PJRT object is freed on drop.

pub mod buffer;
pub mod cache;
pub mod client;
pub mod compile_options;
pub mod distributed;
pub mod element_type;
pub mod env;
pub mod error;
pub mod executable;
pub mod gpu;
pub mod gpu_memory;
mod memory_stats;
pub mod pjrt;
pub mod plugin;
pub mod plugin_logs;
pub mod replicas;
pub mod signature;

pub use buffer::{live_buffer_count, Buffer, HostCopy};
pub use cache::{CacheStats, CompileKey, DiskCache, DiskCacheConfig, EntryInfo, Lookup};
pub use client::{Client, ClientOptions, Device, DistributedOptions, GlobalDevice};
pub use compile_options::CompileOptions;
pub use element_type::ArgType;
pub use element_type::{ElementType, NativeType};
pub use error::{CountProblem, DevicesFound, PjrtErrorCode, Result, RuntimeError};
pub use executable::{CompiledMemoryStats, Completion, ExecArg, Executable};
pub use gpu::{probe_gpus, GpuInfo, GpuProbe};
pub use gpu_memory::{GpuMemory, MemoryFraction};
pub use pjrt::PluginExtension;
pub use plugin::PjrtDevice;
pub use replicas::{replica_plan_from_env, ReplicaEnv, ReplicaPlan, ReplicaSource};
pub use signature::Signature;
