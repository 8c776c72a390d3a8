//! Replica counts from `GPU_NUM_DEVICES` / `KILN_CPU_DEVICES`: every refused
//! value's message, the unset cases, the driver/PJRT disagreement, the GPU
//! probe on this machine, and a real CPU client made from a plan.
//!
//! The decisions are pure functions of the value and a GPU probe, so the CUDA
//! cases run here with made-up probes; the environment itself is read only by
//! the CLI tests (each in its own process).

mod common;

use kiln_runtime::replicas::{cpu_replica_plan, gpu_replica_plan, MAX_CPU_DEVICES};
use kiln_runtime::{
    ClientOptions, CountProblem, GpuInfo, GpuProbe, PjrtDevice, ReplicaEnv, ReplicaSource, RuntimeError,
};

fn h100(ordinal: usize) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: "NVIDIA H100 80GB HBM3".into(),
        total_bytes: 85_520_809_984,
        free_bytes: Some(84_967_161_856),
    }
}

fn gpus(n: usize) -> GpuProbe {
    GpuProbe::Found { driver_version: Some((13, 0)), gpus: (0..n).map(h100).collect() }
}

fn no_driver() -> GpuProbe {
    GpuProbe::NoDriver {
        library: "libcuda.so.1",
        reason: "libcuda.so.1: cannot open shared object file: No such file or directory".into(),
    }
}

fn gpu_error(value: Option<&str>, probe: GpuProbe) -> String {
    match gpu_replica_plan(value, probe) {
        Ok(plan) => panic!("{value:?} was accepted: {plan:?}"),
        Err(e) => e.to_string(),
    }
}

fn cpu_error(value: &str) -> String {
    match cpu_replica_plan(Some(value)) {
        Ok(plan) => panic!("{value:?} was accepted: {plan:?}"),
        Err(e) => e.to_string(),
    }
}

// ---- GPU_NUM_DEVICES ----

#[test]
fn gpu_unset_uses_every_visible_gpu() {
    let plan = gpu_replica_plan(None, gpus(2)).unwrap();
    assert_eq!(plan.replicas, 2);
    assert_eq!(plan.source, ReplicaSource::AllGpus);
    assert_eq!(plan.device, PjrtDevice::Cuda);
    assert_eq!(plan.client_options, ClientOptions::default());
    assert_eq!(plan.gpus, Some(gpus(2)));
    // A blank value is unset too, as for PJRT_DEVICE.
    assert_eq!(gpu_replica_plan(Some(" "), gpus(3)).unwrap().replicas, 3);
}

#[test]
fn gpu_count_within_the_visible_gpus_is_taken() {
    let plan = gpu_replica_plan(Some("1"), gpus(2)).unwrap();
    assert_eq!(plan.replicas, 1);
    assert_eq!(plan.source, ReplicaSource::Env { var: "GPU_NUM_DEVICES", value: "1".into() });
    assert_eq!(plan.source.to_string(), "GPU_NUM_DEVICES=1");
    // Only the GPU it trains on is opened (and gets memory reserved).
    assert_eq!(plan.client_options.visible_devices, Some(vec![0]));
    assert_eq!(gpu_replica_plan(Some(" 2 "), gpus(2)).unwrap().replicas, 2);
    assert_eq!(gpu_replica_plan(Some("2"), gpus(3)).unwrap().client_options.visible_devices, Some(vec![0, 1]));
}

#[test]
fn gpu_count_above_the_visible_gpus_names_them() {
    assert_eq!(
        gpu_error(Some("3"), gpus(2)),
        "GPU_NUM_DEVICES=\"3\" asks for more devices than the 2 available; \
         devices found: 2 GPUs: [0] NVIDIA H100 80GB HBM3, [1] NVIDIA H100 80GB HBM3"
    );
    // Past every integer type it is still "too many", not "not a number".
    assert_eq!(
        gpu_error(Some("1000000000000000000000000000000000000000000"), gpus(1)),
        "GPU_NUM_DEVICES=\"1000000000000000000000000000000000000000000\" asks for more \
         devices than the 1 available; devices found: 1 GPU: [0] NVIDIA H100 80GB HBM3"
    );
}

#[test]
fn gpu_zero_and_negative_counts_are_refused() {
    assert_eq!(
        gpu_error(Some("0"), gpus(1)),
        "GPU_NUM_DEVICES=\"0\" must be at least 1; devices found: 1 GPU: [0] NVIDIA H100 80GB HBM3"
    );
    assert_eq!(
        gpu_error(Some("-2"), gpus(1)),
        "GPU_NUM_DEVICES=\"-2\" must be at least 1; devices found: 1 GPU: [0] NVIDIA H100 80GB HBM3"
    );
}

#[test]
fn gpu_count_that_is_not_a_number_is_refused() {
    for value in ["two", "1.5", "2 GPUs", "0x2"] {
        assert_eq!(
            gpu_error(Some(value), gpus(1)),
            format!(
                "GPU_NUM_DEVICES={value:?} is not a whole number; \
                 devices found: 1 GPU: [0] NVIDIA H100 80GB HBM3"
            )
        );
    }
}

#[test]
fn gpu_errors_keep_their_structure() {
    let err = gpu_replica_plan(Some("4"), gpus(2)).unwrap_err();
    match err {
        RuntimeError::BadDeviceCount { var, value, problem, .. } => {
            assert_eq!(var, "GPU_NUM_DEVICES");
            assert_eq!(value, "4");
            assert_eq!(problem, CountProblem::TooMany { available: 2 });
        }
        other => panic!("unexpected error {other:?}"),
    }
}

#[test]
fn without_a_driver_the_error_says_so() {
    assert_eq!(
        gpu_error(Some("2"), no_driver()),
        "GPU_NUM_DEVICES=\"2\" asks for more devices than the 0 available; devices found: \
         no CUDA driver found (libcuda.so.1): libcuda.so.1: cannot open shared object file: \
         No such file or directory"
    );
    assert_eq!(
        gpu_error(None, no_driver()),
        "PJRT_DEVICE=CUDA with GPU_NUM_DEVICES unset uses every visible GPU as a replica, but \
         there is none: no CUDA driver found (libcuda.so.1): libcuda.so.1: cannot open shared \
         object file: No such file or directory"
    );
}

#[test]
fn a_driver_without_gpus_or_failing_is_named() {
    let empty = GpuProbe::Found { driver_version: Some((13, 0)), gpus: vec![] };
    assert_eq!(
        gpu_error(None, empty.clone()),
        "PJRT_DEVICE=CUDA with GPU_NUM_DEVICES unset uses every visible GPU as a replica, but \
         there is none: the CUDA driver shows no GPUs"
    );
    assert_eq!(
        gpu_error(Some("1"), empty),
        "GPU_NUM_DEVICES=\"1\" asks for more devices than the 0 available; devices found: the \
         CUDA driver shows no GPUs"
    );
    let failed = GpuProbe::DriverFailed {
        call: "cuInit",
        error: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: system has unsupported display driver / cuda driver combination"
            .into(),
    };
    assert_eq!(
        gpu_error(Some("1"), failed),
        "GPU_NUM_DEVICES=\"1\" asks for more devices than the 0 available; devices found: the \
         CUDA driver failed in cuInit: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: system has unsupported \
         display driver / cuda driver combination"
    );
}

// ---- the driver and the PJRT client must agree ----

#[test]
fn driver_and_pjrt_disagreeing_is_an_error_with_both_counts() {
    let plan = gpu_replica_plan(None, gpus(2)).unwrap();
    let err = plan.check_pjrt_devices(&["[0] NVIDIA H100 80GB HBM3".to_string()]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the CUDA driver shows 2 GPU(s) ([0] NVIDIA H100 80GB HBM3, [1] NVIDIA H100 80GB HBM3) \
         but the PJRT plugin exposes 1 device(s) ([0] NVIDIA H100 80GB HBM3); GPU_NUM_DEVICES is \
         checked against the driver's GPUs, so the two must agree (is CUDA_VISIBLE_DEVICES the \
         same for both, and the plugin built for this driver?)"
    );
    let none: &[String] = &[];
    assert!(plan.check_pjrt_devices(none).unwrap_err().to_string().contains("exposes 0 device(s) (none)"));
}

#[test]
fn a_count_checks_the_gpus_it_opened() {
    // GPU_NUM_DEVICES=1 of 2: the plugin opens one GPU, which is right.
    let plan = gpu_replica_plan(Some("1"), gpus(2)).unwrap();
    plan.check_pjrt_devices(&["[0] NVIDIA H100 80GB HBM3".to_string()]).unwrap();
    // A plugin that ignored visible_devices shows two: named by the variable.
    let two = ["[0] NVIDIA H100 80GB HBM3".to_string(), "[1] NVIDIA H100 80GB HBM3".to_string()];
    let err = plan.check_pjrt_devices(&two).unwrap_err().to_string();
    assert!(err.contains("GPU_NUM_DEVICES") && err.contains("exposes 2 device(s)"), "{err}");
}

#[test]
fn driver_and_pjrt_agreeing_passes() {
    let plan = gpu_replica_plan(None, gpus(2)).unwrap();
    let pjrt = ["[0] NVIDIA H100 80GB HBM3".to_string(), "[1] NVIDIA H100 80GB HBM3".to_string()];
    plan.check_pjrt_devices(&pjrt).unwrap();
}

#[test]
fn cpu_plugin_ignoring_the_count_is_an_error() {
    let plan = cpu_replica_plan(Some("4")).unwrap();
    let one = ["[0] cpu".to_string()];
    assert_eq!(
        plan.check_pjrt_devices(&one).unwrap_err().to_string(),
        "KILN_CPU_DEVICES=4 asked the PJRT CPU client for 4 devices, but it exposes 1"
    );
    let four: Vec<String> = (0..4).map(|i| format!("[{i}] cpu")).collect();
    plan.check_pjrt_devices(&four).unwrap();
    // Unset, one replica needs one device, whatever the plugin's default.
    cpu_replica_plan(None).unwrap().check_pjrt_devices(&four).unwrap();
}

// ---- KILN_CPU_DEVICES ----

#[test]
fn cpu_unset_is_one_replica_on_the_plugins_defaults() {
    for value in [None, Some(""), Some("  ")] {
        let plan = cpu_replica_plan(value).unwrap();
        assert_eq!(plan.replicas, 1);
        assert_eq!(plan.source, ReplicaSource::CpuDefault);
        assert_eq!(plan.client_options, ClientOptions::default());
        assert_eq!(plan.gpus, None);
    }
}

#[test]
fn cpu_count_sets_the_plugin_option() {
    let plan = cpu_replica_plan(Some("4")).unwrap();
    assert_eq!(plan.replicas, 4);
    assert_eq!(plan.client_options.cpu_device_count, Some(4));
    assert_eq!(plan.source.to_string(), "KILN_CPU_DEVICES=4");
    let max = MAX_CPU_DEVICES.to_string();
    assert_eq!(cpu_replica_plan(Some(&max)).unwrap().replicas, MAX_CPU_DEVICES);
}

#[test]
fn cpu_bad_counts_name_the_variable_and_value() {
    assert_eq!(
        cpu_error("zero"),
        "KILN_CPU_DEVICES=\"zero\" is not a whole number; the XLA CPU plugin makes 1 to 64 devices"
    );
    assert_eq!(cpu_error("0"), "KILN_CPU_DEVICES=\"0\" must be at least 1; the XLA CPU plugin makes 1 to 64 devices");
    assert_eq!(cpu_error("-4"), "KILN_CPU_DEVICES=\"-4\" must be at least 1; the XLA CPU plugin makes 1 to 64 devices");
    assert_eq!(
        cpu_error("65"),
        "KILN_CPU_DEVICES=\"65\" asks for more devices than the 64 available; the XLA CPU \
         plugin makes 1 to 64 devices"
    );
}

// ---- the environment layer ----

#[test]
fn cpu_plans_never_run_the_gpu_probe() {
    let env = ReplicaEnv {
        device: PjrtDevice::Cpu,
        gpu_num_devices: Some("8".into()),
        cpu_devices: Some("2".into()),
        node: Default::default(),
    };
    let plan = env.plan(|| panic!("the GPU probe ran for a CPU plan")).unwrap();
    assert_eq!(plan.replicas, 2);
}

#[test]
fn cuda_plans_use_gpu_num_devices_and_the_probe() {
    let env = ReplicaEnv {
        device: PjrtDevice::Cuda,
        gpu_num_devices: Some("2".into()),
        cpu_devices: Some("16".into()),
        node: Default::default(),
    };
    assert_eq!(env.plan(|| gpus(4)).unwrap().replicas, 2);
    assert!(env.plan(no_driver).unwrap_err().to_string().contains("no CUDA driver found (libcuda.so.1)"));
}

// ---- the probe and the plugin on this machine ----

#[test]
fn the_probe_answers_without_panicking() {
    let probe = kiln_runtime::probe_gpus();
    match &probe {
        GpuProbe::NoDriver { library, reason } => {
            assert_eq!(*library, "libcuda.so.1");
            assert!(!reason.is_empty());
            assert!(probe.to_string().starts_with("no CUDA driver found (libcuda.so.1)"), "{probe}");
            assert!(!probe.driver_found() && probe.gpus().is_empty());
        }
        GpuProbe::DriverFailed { call, error } => {
            assert!(!call.is_empty() && !error.is_empty(), "{probe:?}");
        }
        GpuProbe::Found { gpus, .. } => {
            for (i, g) in gpus.iter().enumerate() {
                assert_eq!(g.ordinal, i);
                assert!(!g.name.is_empty() && g.total_bytes > 0, "{g:?}");
                assert!(g.free_bytes.is_none_or(|free| free <= g.total_bytes), "{g:?}");
            }
        }
    }
    // Asking twice gives the same devices (the driver is opened once).
    assert_eq!(kiln_runtime::probe_gpus().gpus().len(), probe.gpus().len());
}

#[test]
fn a_cpu_plan_makes_a_client_with_that_many_devices() {
    for (value, expected) in [("4", 4), ("3", 3)] {
        let mut plan = cpu_replica_plan(Some(value)).unwrap();
        plan.client_options.plugin = Some(common::cpu_plugin());
        let client = plan.create_client().unwrap();
        assert_eq!(client.platform_name(), "cpu");
        assert_eq!(client.devices().len(), expected);
        assert_eq!(plan.replicas, expected);
    }
}

// ---- several processes ----

fn node_env(pairs: &[(&str, &str)]) -> kiln_runtime::distributed::NodeEnv {
    let mut e = kiln_runtime::distributed::NodeEnv::default();
    for (k, v) in pairs {
        let v = Some(v.to_string());
        match *k {
            "KILN_NUM_NODES" => e.num_nodes = v,
            "KILN_NODE_ID" => e.node_id = v,
            "KILN_COORDINATOR" => e.coordinator = v,
            "KILN_LOCAL_DEVICES" => e.local_devices = v,
            other => panic!("unknown variable {other}"),
        }
    }
    e
}

#[test]
fn cpu_plans_refuse_several_nodes_before_any_plugin_call() {
    let env = ReplicaEnv {
        device: PjrtDevice::Cpu,
        gpu_num_devices: None,
        cpu_devices: Some("2".into()),
        node: node_env(&[("KILN_NUM_NODES", "2"), ("KILN_NODE_ID", "1"), ("KILN_COORDINATOR", "127.0.0.1:1")]),
    };
    let err = env.plan(|| panic!("no probe for CPU")).unwrap_err();
    assert!(matches!(err, RuntimeError::PlatformNotDistributed { num_nodes: 2, .. }), "{err}");
}

#[test]
fn several_nodes_without_a_coordinator_are_refused_in_the_plan() {
    let env = ReplicaEnv {
        device: PjrtDevice::Cuda,
        gpu_num_devices: None,
        cpu_devices: None,
        node: node_env(&[("KILN_NUM_NODES", "2"), ("KILN_NODE_ID", "0")]),
    };
    let err = env.plan(|| gpus(2)).unwrap_err();
    assert!(matches!(err, RuntimeError::MissingCoordinator { num_nodes: 2 }), "{err}");
}

#[test]
fn local_devices_pick_the_visible_gpus() {
    let env = ReplicaEnv {
        device: PjrtDevice::Cuda,
        gpu_num_devices: Some("2".into()),
        cpu_devices: None,
        node: node_env(&[
            ("KILN_NUM_NODES", "2"),
            ("KILN_NODE_ID", "1"),
            ("KILN_COORDINATOR", "127.0.0.1:7070"),
            ("KILN_LOCAL_DEVICES", "1"),
        ]),
    };
    let plan = env.plan(|| gpus(2)).unwrap();
    assert_eq!(plan.replicas, 1);
    assert_eq!(plan.client_options.visible_devices, Some(vec![1]));
    assert_eq!((plan.identity.node_id, plan.identity.num_nodes), (1, 2));
    // The plugin exposing one device is what the plan expects.
    plan.check_pjrt_devices(&["[1] NVIDIA H200".into()]).unwrap();
    assert!(plan.check_pjrt_devices(&["[0] a".into(), "[1] b".into()]).is_err());
    let err = env.plan(|| gpus(1)).unwrap_err();
    assert!(matches!(err, RuntimeError::LocalDeviceOutOfRange { ordinal: 1, available: 1 }), "{err}");
}

#[test]
fn a_client_of_several_nodes_without_a_store_is_refused_before_loading_the_plugin() {
    let err = kiln_runtime::Client::new(&kiln_runtime::ClientOptions {
        plugin: Some("/nonexistent/never-loaded.so".into()),
        distributed: Some(kiln_runtime::DistributedOptions { node_id: 0, num_nodes: 2, store: None }),
        ..Default::default()
    })
    .unwrap_err();
    assert!(matches!(err, RuntimeError::MissingCoordinator { num_nodes: 2 }), "{err}");
}
