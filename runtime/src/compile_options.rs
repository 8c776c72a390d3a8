//! Compile options and their encoding as XLA's `CompileOptionsProto`.
//!
//! The message structs below mirror the few fields kiln sets, with the field
//! numbers of `xla/pjrt/proto/compile_options.proto` and `xla/xla_data.proto`.
//! Invariant: the encoded message always carries `executable_build_options`
//! with `num_replicas` and `num_partitions` ≥ 1 (an empty message aborts the
//! CPU plugin).
//!
//! It also always carries [`SEMANTIC_OVERRIDES`], XLA options that make the
//! plugins compute what StableHLO specifies; being in the bytes, they are in
//! every compile cache key.

use std::collections::BTreeMap;

use prost::Message;

use crate::error::{Result, RuntimeError};

/// A value of an XLA debug option as `env_option_overrides` carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionValue {
    /// A bool field.
    Bool(bool),
    /// A repeated string field, comma-separated as XLA reads it, that adds
    /// to what `XLA_FLAGS` gives the same option: PJRT's override replaces
    /// that value, so it is sent along ([`merged_list`]).
    List(&'static str),
}

impl OptionValue {
    /// The override for option `name`, given `xla_flags` (the `XLA_FLAGS`
    /// variable's value).
    fn to_override(self, name: &str, xla_flags: Option<&str>) -> OptionOverrideProto {
        match self {
            OptionValue::Bool(b) => OptionOverrideProto { string_field: None, bool_field: Some(b) },
            OptionValue::List(l) => {
                OptionOverrideProto { string_field: Some(merged_list(name, l, xla_flags)), bool_field: None }
            }
        }
    }
}

/// XLA debug options set on every compile, by name (`env_option_overrides`,
/// which PJRT applies over the plugin's defaults), each to keep a program's
/// meaning the plugin's choice would change:
///
/// - `xla_cpu_enable_fast_min_max = false`: the XLA CPU plugin 0.0.1 defaults
///   it to on, and then `maximum`/`minimum` and max/min reductions skip NaN,
///   depending on operand order (`max([1, NaN, 3])` was 3, `maximum(1, NaN)`
///   1 but `maximum(NaN, 2)` NaN). StableHLO's `maximum` propagates NaN, as
///   PyTorch, JAX and kiln's reference interpreter do. The CUDA plugin's own
///   option, `xla_gpu_enable_fast_min_max`, is off by default (the NaN test
///   passes there, H100, 2026-11-25).
/// - `xla_disable_hlo_passes = rematerialization`: XLA's own
///   rematerialization, which the CUDA plugin runs when a program's temp
///   exceeds its scheduler's memory limit (80% of the device's memory less
///   the arguments and outputs, times 95%), changed what kiln's train steps
///   compute. With that limit lowered to about 0.9 GB (the compile options'
///   `device_memory_size`, a trial build; H200, 2026-11-28), XLA's pass ran,
///   and gpt2-small's unplanned step trained to a loss of 7.02 and the 50%
///   plan's to 4.49 where every correct run reads 8.84-8.95; with the pass
///   off the same builds read 8.90-8.95 (`benches/RESULTS.md`, "XLA's own
///   rematerialization"). With the pass on and donation off they trained
///   right, so it is the pass meeting parameters aliased to outputs ("XLA's
///   rematerialization and donation"). kiln plans memory itself (the remat pass,
///   `--memory-limit`); a step too large for the device now fails with the
///   plugin's out-of-memory error instead of running wrong. The CPU plugin
///   0.0.1 does not contain the pass (none of its messages is in the
///   library); the override is a no-op there. PJRT's override replaces the
///   option's value from `XLA_FLAGS` (on the CPU plugin a pass disabled
///   there ran again), so it is an [`OptionValue::List`]: the passes named
///   by `--xla_disable_hlo_passes=` in `XLA_FLAGS` are sent with it.
pub const SEMANTIC_OVERRIDES: [(&str, OptionValue); 2] = [
    ("xla_cpu_enable_fast_min_max", OptionValue::Bool(false)),
    ("xla_disable_hlo_passes", OptionValue::List("rematerialization")),
];

/// The value sent for list option `name`: kiln's items, then those
/// `--NAME=` in `xla_flags` (the `XLA_FLAGS` variable's value) gives, each
/// once, comma-separated as XLA reads the option.
pub fn merged_list(name: &str, kiln: &str, xla_flags: Option<&str>) -> String {
    let flag = format!("--{name}=");
    let mut items: Vec<&str> = kiln.split(',').filter(|p| !p.is_empty()).collect();
    let users = xla_flags
        .into_iter()
        .flat_map(str::split_whitespace)
        .filter_map(|f| f.strip_prefix(flag.as_str()))
        .flat_map(|v| v.split(','));
    for p in users {
        if !p.is_empty() && !items.contains(&p) {
            items.push(p);
        }
    }
    items.join(",")
}

/// How to compile a program: replica and partition counts and an optional
/// fixed device assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileOptions {
    /// Number of data-parallel replicas (≥ 1).
    pub num_replicas: usize,
    /// Number of SPMD partitions per replica (≥ 1).
    pub num_partitions: usize,
    /// Device ids indexed `[replica][partition]`; `None` lets XLA choose.
    pub device_assignment: Option<Vec<Vec<i64>>>,
    /// Run the program in its own order on GPUs: XLA's latency-hiding
    /// scheduler off ([`KEEP_ORDER_OVERRIDE`]).
    pub keep_order: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions { num_replicas: 1, num_partitions: 1, device_assignment: None, keep_order: false }
    }
}

/// The override [`CompileOptions::keep_order`] sends. A rematerialized step
/// relies on its order: a recomputation runs just before the backward kernel
/// that reads it. In a step with collectives (SPMD partitions, replicas' gradient
/// all-reduce) XLA CUDA's latency-hiding scheduler reorders the backward around
/// them and undoes the plan. gpt2-small on two H200s (2026-11-28,
/// `docs/memory-journal.md`, "Remat with collectives on GPUs"), XLA's temp a device:
/// under FSDP 4.63 GB unplanned, 3.60 GB at 50% of the activation memory and
/// 3.75 GB at 25% with the scheduler, 2.76 and 1.76 GB without; data-parallel
/// replicas 5.06 GB unplanned, 4.85 GB at 25% with it, 1.05 GB without. Step
/// times moved by 0.4 ms or less. On one GPU the scheduler keeps the plans,
/// and is left on.
pub const KEEP_ORDER_OVERRIDE: (&str, OptionValue) =
    ("xla_gpu_enable_latency_hiding_scheduler", OptionValue::Bool(false));

#[derive(Clone, PartialEq, Message)]
struct CompileOptionsProto {
    #[prost(message, optional, tag = "3")]
    executable_build_options: Option<ExecutableBuildOptionsProto>,
    #[prost(btree_map = "string, message", tag = "7")]
    env_option_overrides: BTreeMap<String, OptionOverrideProto>,
}

/// One value of `env_option_overrides` (the string and bool arms of its
/// `oneof`, with presence, so that `false` is sent).
#[derive(Clone, PartialEq, Message)]
struct OptionOverrideProto {
    #[prost(string, optional, tag = "1")]
    string_field: Option<String>,
    #[prost(bool, optional, tag = "2")]
    bool_field: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
struct ExecutableBuildOptionsProto {
    #[prost(int64, tag = "1")]
    device_ordinal: i64,
    #[prost(int64, tag = "4")]
    num_replicas: i64,
    #[prost(int64, tag = "5")]
    num_partitions: i64,
    #[prost(bool, tag = "6")]
    use_spmd_partitioning: bool,
    #[prost(message, optional, tag = "9")]
    device_assignment: Option<DeviceAssignmentProto>,
}

#[derive(Clone, PartialEq, Message)]
struct DeviceAssignmentProto {
    #[prost(int32, tag = "1")]
    replica_count: i32,
    #[prost(int32, tag = "2")]
    computation_count: i32,
    /// Indexed by computation (partition); each lists one device per replica.
    #[prost(message, repeated, tag = "3")]
    computation_devices: Vec<ComputationDevice>,
}

#[derive(Clone, PartialEq, Message)]
struct ComputationDevice {
    #[prost(int64, repeated, tag = "1")]
    replica_device_ids: Vec<i64>,
}

fn invalid(message: String) -> RuntimeError {
    RuntimeError::CompileOptions { message }
}

impl CompileOptions {
    /// Checks the options and encodes the `CompileOptionsProto` bytes.
    pub fn to_proto_bytes(&self) -> Result<Vec<u8>> {
        if self.num_replicas == 0 || self.num_partitions == 0 {
            return Err(invalid(format!(
                "num_replicas ({}) and num_partitions ({}) must be at least 1",
                self.num_replicas, self.num_partitions
            )));
        }
        let to_i32 = |n: usize, what: &str| i32::try_from(n).map_err(|_| invalid(format!("{what} {n} is too large")));
        let device_assignment = match &self.device_assignment {
            None => None,
            Some(rows) => {
                if rows.len() != self.num_replicas {
                    return Err(invalid(format!(
                        "device_assignment has {} replica rows, num_replicas is {}",
                        rows.len(),
                        self.num_replicas
                    )));
                }
                if let Some((r, row)) = rows.iter().enumerate().find(|(_, row)| row.len() != self.num_partitions) {
                    return Err(invalid(format!(
                        "device_assignment row {r} has {} devices, num_partitions is {}",
                        row.len(),
                        self.num_partitions
                    )));
                }
                let computation_devices = (0..self.num_partitions)
                    .map(|p| ComputationDevice { replica_device_ids: rows.iter().map(|row| row[p]).collect() })
                    .collect();
                Some(DeviceAssignmentProto {
                    replica_count: to_i32(self.num_replicas, "num_replicas")?,
                    computation_count: to_i32(self.num_partitions, "num_partitions")?,
                    computation_devices,
                })
            }
        };
        let proto = CompileOptionsProto {
            executable_build_options: Some(ExecutableBuildOptionsProto {
                device_ordinal: -1,
                num_replicas: i64::from(to_i32(self.num_replicas, "num_replicas")?),
                num_partitions: i64::from(to_i32(self.num_partitions, "num_partitions")?),
                use_spmd_partitioning: self.num_partitions > 1,
                device_assignment,
            }),
            env_option_overrides: {
                let xla_flags = std::env::var("XLA_FLAGS").ok();
                SEMANTIC_OVERRIDES
                    .iter()
                    .chain(self.keep_order.then_some(&KEEP_ORDER_OVERRIDE))
                    .map(|&(name, v)| (name.to_string(), v.to_override(name, xla_flags.as_deref())))
                    .collect()
            },
        };
        Ok(proto.encode_to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_encodes_replicas_and_partitions() {
        // field 3 (len 6) { field 1 = -1 (10 bytes varint) ... }: check the
        // nested fields 4 and 5 are present with value 1.
        let bytes = CompileOptions::default().to_proto_bytes().unwrap();
        assert_eq!(bytes[0], (3 << 3) | 2);
        let inner = &bytes[2..];
        assert!(inner.windows(2).any(|w| w == [4 << 3, 1]));
        assert!(inner.windows(2).any(|w| w == [5 << 3, 1]));
    }

    #[test]
    fn every_compile_carries_the_semantic_overrides() {
        let bytes = CompileOptions::default().to_proto_bytes().unwrap();
        let decoded = CompileOptionsProto::decode(bytes.as_slice()).unwrap();
        let got: Vec<(&str, Option<&str>, Option<bool>)> = decoded
            .env_option_overrides
            .iter()
            .map(|(k, v)| (k.as_str(), v.string_field.as_deref(), v.bool_field))
            .collect();
        assert_eq!(
            got,
            [
                ("xla_cpu_enable_fast_min_max", None, Some(false)),
                (
                    "xla_disable_hlo_passes",
                    Some(
                        merged_list(
                            "xla_disable_hlo_passes",
                            "rematerialization",
                            std::env::var("XLA_FLAGS").ok().as_deref()
                        )
                        .as_str()
                    ),
                    None
                )
            ]
        );
    }

    #[test]
    fn passes_the_user_disables_are_sent_with_kilns() {
        let passes = |flags| merged_list("xla_disable_hlo_passes", "rematerialization", flags);
        assert_eq!(passes(None), "rematerialization");
        assert_eq!(passes(Some("--xla_dump_to=/tmp/d")), "rematerialization");
        assert_eq!(
            passes(Some("--xla_dump_to=/tmp/d  --xla_disable_hlo_passes=algsimp,rematerialization,,cse")),
            "rematerialization,algsimp,cse"
        );
        assert_eq!(passes(Some("--xla_disable_hlo_passes=a --xla_disable_hlo_passes=b")), "rematerialization,a,b");
    }

    #[test]
    fn keep_order_turns_the_latency_hiding_scheduler_off_and_only_then() {
        let overrides = |o: &CompileOptions| {
            CompileOptionsProto::decode(o.to_proto_bytes().unwrap().as_slice()).unwrap().env_option_overrides
        };
        let kept = overrides(&CompileOptions { keep_order: true, num_partitions: 2, ..CompileOptions::default() });
        assert_eq!(kept[KEEP_ORDER_OVERRIDE.0].bool_field, Some(false));
        assert_eq!(kept.len(), SEMANTIC_OVERRIDES.len() + 1);
        let plain = overrides(&CompileOptions { num_partitions: 2, ..CompileOptions::default() });
        assert!(!plain.contains_key(KEEP_ORDER_OVERRIDE.0));
        assert_eq!(plain.len(), SEMANTIC_OVERRIDES.len());
    }

    #[test]
    fn device_assignment_is_transposed_and_checked() {
        let opts = CompileOptions {
            device_assignment: Some(vec![vec![1], vec![0]]),
            num_replicas: 2,
            ..CompileOptions::default()
        };
        let bytes = opts.to_proto_bytes().unwrap();
        let decoded = CompileOptionsProto::decode(bytes.as_slice()).unwrap();
        let da = decoded.executable_build_options.unwrap().device_assignment.unwrap();
        assert_eq!(da.computation_devices[0].replica_device_ids, vec![1, 0]);
        let bad =
            CompileOptions { num_replicas: 2, device_assignment: Some(vec![vec![0]]), ..CompileOptions::default() };
        assert!(matches!(bad.to_proto_bytes(), Err(RuntimeError::CompileOptions { .. })));
    }
}
