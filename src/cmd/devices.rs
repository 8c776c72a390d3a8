//! `kiln devices`: the plugin, its devices, the GPUs and the replica count.

use serde_json::json;

/// Lists the plugin's devices, the GPUs the CUDA driver shows (on CUDA or
/// where a driver is installed) and the replica count the environment gives.
/// Every part is shown even when another fails; any failure makes the command
/// fail after printing, with each error on stderr.
pub fn run(json: bool) -> anyhow::Result<()> {
    use kiln::runtime::{Client, ClientOptions, GpuProbe, PjrtDevice, ReplicaEnv};

    let env = match ReplicaEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            // Nothing else can be shown without the environment; a script
            // reading --json still gets an object naming the error.
            if json {
                println!("{}", json!({ "errors": [e.to_string()] }));
            }
            return Err(e.into());
        }
    };
    let probe = kiln::runtime::probe_gpus();
    let plan = env.plan(|| probe.clone());
    // A refused count still leaves the plugin's own devices worth showing.
    let options = plan.as_ref().map(|p| p.client_options.clone()).unwrap_or_else(|_| ClientOptions::default());
    let client = Client::new(&options);
    let pjrt_devices: Vec<String> = match &client {
        Ok(c) => c.devices().iter().map(|d| format!("[{}] {}", d.id(), d.kind())).collect(),
        Err(_) => Vec::new(),
    };
    // Checked against the client when there is one; without a client its
    // error below already fails the command.
    let checked: Result<&kiln::runtime::ReplicaPlan, String> = match (&plan, &client) {
        (Err(e), _) => Err(e.to_string()),
        (Ok(p), Ok(_)) => p.check_pjrt_devices(&pjrt_devices).map(|()| p).map_err(|e| e.to_string()),
        (Ok(p), Err(_)) => Ok(p),
    };
    let mut errors: Vec<String> = Vec::new();
    if let Err(e) = &checked {
        errors.push(e.clone());
    }
    if let Err(e) = &client {
        // The whole chain: a plugin that fails to load names the loader's
        // reason (missing symbol, wrong ELF class, ...) only in its source.
        let mut msg = format!("cannot create the PJRT client: {e}");
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            msg.push_str(&format!(": {s}"));
            source = s.source();
        }
        errors.push(msg);
    }
    let show_gpus = env.device == PjrtDevice::Cuda || probe.driver_found();
    // KILN_MESH, checked against the device count the environment sets.
    let mesh = kiln::shard::Mesh::from_env()
        .and_then(|m| match m {
            Some(m) => kiln::shard::plan_for(&m, &env).map(|_| Some(m)),
            None => Ok(None),
        })
        .map_err(|e| e.to_string());
    if let Err(e) = &mesh {
        errors.push(e.clone());
    }

    if json {
        let (platform, plugin, api_version, extensions, list) = match &client {
            Ok(c) => (
                Some(c.platform_name().to_string()),
                Some(c.plugin_path().display().to_string()),
                Some(format!("{}.{}", c.api_version().0, c.api_version().1)),
                c.plugin_extensions()
                    .iter()
                    .map(|e| json!({"type": e.kind, "name": e.name(), "struct_size": e.struct_size}))
                    .collect(),
                c.devices().iter().map(|d| json!({"id": d.id(), "kind": d.kind()})).collect(),
            ),
            Err(_) => (None, None, None, Vec::new(), Vec::new()),
        };
        let (driver, driver_version) = match &probe {
            GpuProbe::NoDriver { .. } => ("missing", None),
            GpuProbe::DriverFailed { .. } => ("failed", None),
            GpuProbe::Found { driver_version, .. } => {
                ("found", driver_version.map(|(major, minor)| format!("{major}.{minor}")))
            }
        };
        let gpus: Vec<_> = probe
            .gpus()
            .iter()
            .map(|g| json!({"ordinal": g.ordinal, "name": g.name, "total_bytes": g.total_bytes, "free_bytes": g.free_bytes}))
            .collect();
        println!(
            "{}",
            json!({
                "pjrt_device": env.device.to_string(),
                "platform": platform,
                "plugin": plugin,
                "pjrt_api_version": api_version,
                "plugin_extensions": extensions,
                "devices": list,
                "gpu_probe": {"driver": driver, "driver_version": driver_version, "summary": probe.to_string(), "gpus": gpus},
                "mesh": mesh.as_ref().ok().and_then(|m| m.as_ref()).map(|m| json!({
                    "spec": m.to_string(),
                    "devices": m.size(),
                    "axes": m.axes().iter().map(|(n, s)| json!({"name": n, "size": s})).collect::<Vec<_>>(),
                })),
                "replicas": checked.as_ref().ok().map(|p| p.replicas),
                "replicas_source": checked.as_ref().ok().map(|p| p.source.to_string()),
                "errors": errors,
            })
        );
    } else {
        match &client {
            Ok(c) => {
                let (major, minor) = c.api_version();
                println!("platform {} ({}, PJRT C API {major}.{minor})", c.platform_name(), c.plugin_path().display());
                for d in c.devices() {
                    println!("  device {}: {}", d.id(), d.kind());
                }
                let extensions: Vec<String> = c.plugin_extensions().iter().map(|e| e.to_string()).collect();
                if extensions.is_empty() {
                    println!("  extensions: none");
                } else {
                    println!("  extensions: {}", extensions.join(", "));
                }
            }
            Err(_) => println!("platform: no PJRT client (error below)"),
        }
        if show_gpus {
            match &probe {
                GpuProbe::Found { driver_version, gpus } if !gpus.is_empty() => {
                    match driver_version {
                        Some((major, minor)) => println!("GPUs (CUDA driver {major}.{minor}):"),
                        None => println!("GPUs:"),
                    }
                    for g in gpus {
                        let free = g
                            .free_bytes
                            .map_or_else(|| "free memory unknown".to_string(), |b| format!("{} free", gib(b)));
                        println!("  gpu {}: {}, {free} of {}", g.ordinal, g.name, gib(g.total_bytes));
                    }
                }
                other => println!("GPUs: {other}"),
            }
        }
        match &mesh {
            Ok(Some(m)) => println!("mesh: {m} ({} devices, {})", m.size(), kiln::shard::ENV_MESH),
            Ok(None) => println!("mesh: none (set {} to partition, e.g. data=2,model=2)", kiln::shard::ENV_MESH),
            Err(_) => println!("mesh: refused (error below)"),
        }
        match &checked {
            Ok(p) => println!("replicas: {} ({})", p.replicas, p.source),
            Err(_) => println!("replicas: none (error below)"),
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        // main prints the first "error: "; each further error gets its own.
        Err(anyhow::anyhow!(errors.join("\nerror: ")))
    }
}

/// Bytes as GiB with one decimal (`79.1 GiB`).
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}
