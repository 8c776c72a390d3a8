//! The miss path of `mark_step`: from a closed trace to a compiled program.
//!
//! Prune dead code, optimize, take the canonical key (the optimized program's
//! fingerprint, the compiler build, the plugin, the compile options, kiln's
//! version), then look in this thread's programs, then in the persistent cache,
//! and compile only when both miss. A new program that resembles an earlier one
//! is explained (what changed, how to avoid it); `KILN_SAVE_GRAPHS=dir` saves
//! each new program's graph in the text form for `kiln compile`/`kiln profile`.
//!
//! The programs found or built are kept in this thread's program cache
//! (`engine::program_cache`).
//!
//! Invariants:
//! - The key covers everything the executable depends on: the optimized
//!   program's fingerprint, the compiler build, the replica count, the loop
//!   kernels, the partitioning, the plugin and the compile options; two steps
//!   with the same key share one executable.
//! - A program is compiled only when neither this thread's programs nor the
//!   persistent cache has it; a persistent cache that cannot be written costs
//!   later runs a compile, never this run its result.
//! - Under a mesh every parameter's and output's sharding is checked against
//!   the mesh before anything compiles.

use std::rc::Rc;
use std::time::Instant;

use kiln_compiler::ir::Graph;
use kiln_compiler::{fingerprint, lower, pipeline, LowerOptions, LowerTarget, BUILD_FINGERPRINT};
use kiln_runtime::{Client, CompileKey, CompileOptions, EntryInfo, Lookup};

use crate::core::atomic_write::write_atomically;
use crate::core::error::Result;
use crate::core::metrics;
use crate::core::trace::Binding;
use crate::engine::context;
use crate::engine::explain;
use crate::engine::program_cache::{CacheEntry, Layout, Program};

/// What [`obtain`] found or built.
pub(crate) struct Obtained {
    /// The program and how the raw trace's parameters feed it.
    pub entry: CacheEntry,
    /// Compiled by this call (not found in memory or on disk).
    pub compiled: bool,
    /// Why this step needed a new program, when it resembles an earlier one.
    pub explanation: Option<String>,
}

/// The pipeline's options: the default passes, or `KILN_PASSES` when set (a
/// comma-separated list of pass names, `none` for no pass: the same step with
/// the optimizer off, for measuring it), then the memory limit's remat pass.
fn pipeline_options() -> Result<pipeline::PipelineOptions> {
    let mut opts = pipeline::PipelineOptions::default();
    if let Some(v) = kiln_runtime::env::string_var("KILN_PASSES")? {
        opts.passes = v.split(',').map(str::trim).filter(|p| !p.is_empty() && *p != "none").map(String::from).collect();
        // An unknown name is the pipeline's typed error, before any work.
        for p in &opts.passes {
            pipeline::pass(p)?;
        }
    }
    crate::core::settings::check_memory_limit_for_mesh()?;
    let opts = opts
        .with_memory_limit(crate::core::settings::memory_limit())
        .with_activation_budget(crate::core::settings::activation_budget())
        .with_host_offload(crate::core::settings::host_offload())
        .with_host_copies(crate::core::settings::host_copies());
    // The link's rate matters (and a bad one is refused) only with host copies on.
    Ok(if crate::core::settings::host_copies() { opts.with_host_link_rate(host_link_rate()?) } else { opts })
}

/// The host link's rate kiln's host copies are planned for, in bytes per
/// second each way: `KILN_HOST_LINK_GBPS` (decimal GB/s, above 0) where it
/// is set, else the compiler's default (`HOST_COPY_LINK_BYTES_PER_SECOND`, 40 GB/s).
/// Read by the training loops' pipeline, `kiln compile` and the benchmarks
/// alike.
pub fn host_link_rate() -> Result<f64> {
    const VAR: &str = "KILN_HOST_LINK_GBPS";
    match kiln_runtime::env::string_var(VAR)? {
        None => Ok(kiln_compiler::target::HOST_COPY_LINK_BYTES_PER_SECOND),
        Some(v) => match v.trim().parse::<f64>() {
            Ok(gbps) if gbps.is_finite() && gbps > 0.0 => Ok(gbps * 1e9),
            _ => Err(crate::core::error::FrontendError::BadEnv {
                var: VAR,
                value: v,
                expected: "a rate in GB/s above 0, e.g. 30",
            }),
        },
    }
}

/// The program of `graph` (a closed raw trace fed by `bindings`, `assigned`
/// saying which of them an output is assigned over), compiled with
/// `replicas` replicas.
/// A closed trace taken through the pipeline and the partitioner, with the
/// options its lowering and compile take: all of a program but the compile,
/// shared by `mark_step` ([`obtain`]) and `lower` ([`program_text`]) so that
/// the two cannot differ.
struct Planned {
    opts: pipeline::PipelineOptions,
    stats: pipeline::PipelineStats,
    pipeline_time: std::time::Duration,
    optimized: Graph,
    pruned: kiln_compiler::passes::Pruned,
    partitioned: Option<Partitioned>,
    lower_opts: LowerOptions,
    compile_opts: CompileOptions,
}

fn plan(
    graph: &Graph,
    bindings: &[Binding],
    assigned: &[bool],
    out_shardings: Option<&[crate::core::mesh::Sharding]>,
    client: &Client,
    replicas: usize,
    observe: &mut dyn FnMut(&str, &Graph),
) -> Result<Planned> {
    let t = Instant::now();
    let opts = pipeline_options()?
        .with_target(LowerTarget::from_platform(client.platform_name()))
        .with_gathered_params(crate::engine::partition::gathered_params(bindings, assigned));
    let out = pipeline::run(graph, &opts, observe)?;
    let pipeline_time = t.elapsed();
    // A remat plan relies on the program's order (`LowerTarget::keeps_plan_order`).
    let planned = out.stats.passes.iter().any(|p| p.remat().is_some_and(|r| !r.recomputed.is_empty()));
    let pipeline::Optimized { graph: optimized, pruned, stats } = out;
    let partitioned = match (crate::core::settings::active_mesh(), out_shardings) {
        (Some(mesh), Some(outs)) => Some(partition(&mesh, &pruned, &optimized, bindings, outs)?),
        _ => None,
    };
    let lower_opts = LowerOptions {
        num_replicas: replicas,
        target: LowerTarget::from_platform(client.platform_name()),
        shardings: partitioned.as_ref().map(|p| p.module.clone()),
        loop_kernels: crate::core::settings::loop_kernels()?,
    };
    // Across processes every node must agree on which replica runs where:
    // replica r on the r-th global device, spelled out (in one process the
    // plugin's default is the same and keeps existing cache keys).
    let device_assignment = if client.global_devices().len() != client.devices().len() {
        Some(client.replica_assignment(replicas)?)
    } else {
        None
    };
    let keep_order = lower_opts.target.keeps_plan_order(planned, partitioned.is_some() || replicas > 1);
    let compile_opts = match &partitioned {
        // One replica × the mesh's devices, device d of the mesh on the
        // client's d-th device.
        Some(p) => {
            let devices = client.global_devices().get(..p.module.num_partitions).ok_or_else(|| {
                crate::core::error::FrontendError::MeshDevices {
                    mesh: format!("of {} devices", p.module.num_partitions),
                    mesh_devices: p.module.num_partitions,
                    setting: format!("the client's {} devices", client.global_devices().len()),
                }
            })?;
            CompileOptions {
                num_replicas: 1,
                num_partitions: p.module.num_partitions,
                device_assignment: Some(vec![devices.iter().map(|d| i64::from(d.id)).collect()]),
                keep_order,
            }
        }
        None => CompileOptions { num_replicas: replicas, device_assignment, keep_order, ..CompileOptions::default() },
    };
    Ok(Planned { opts, stats, pipeline_time, optimized, pruned, partitioned, lower_opts, compile_opts })
}

/// The StableHLO text of the program [`obtain`] would compile for the same
/// closed trace (the pipeline, the partitioner and the target passes, with the
/// same options), without compiling it: what `kiln::lower` returns.
pub(crate) fn program_text(
    graph: &Graph,
    bindings: &[Binding],
    assigned: &[bool],
    out_shardings: Option<&[crate::core::mesh::Sharding]>,
    client: &Client,
    replicas: usize,
) -> Result<String> {
    let p = plan(graph, bindings, assigned, out_shardings, client, replicas, &mut |_, _| {})?;
    let prepared = lower::prepare(&p.optimized, &p.lower_opts, p.opts.verify, &mut |_, _| {})?;
    Ok(lower::print(&prepared)?)
}

/// The program for a closed trace: this thread's, the disk cache's, or newly
/// compiled (see the module docs).
pub(crate) fn obtain(
    graph: &Graph,
    bindings: &[Binding],
    assigned: &[bool],
    out_shardings: Option<&[crate::core::mesh::Sharding]>,
    client: &Client,
    replicas: usize,
) -> Result<Obtained> {
    let mut dump = crate::engine::dump::Dump::from_env();
    let Planned { opts, stats, pipeline_time, optimized, pruned, partitioned, lower_opts, compile_opts } =
        plan(graph, bindings, assigned, out_shardings, client, replicas, &mut |p, g| dump.observe(p, g))?;
    // The fusion analysis of the result, for the metrics report.
    let fusion_groups = kiln_compiler::fusion::plan_fusion(&optimized).num_groups();
    metrics::update(|m| m.record_pipeline(&stats, fusion_groups, pipeline_time));
    let donated =
        (0..pruned.kept_params.len()).map(|i| pruned.graph.aliases().iter().any(|a| a.param as usize == i)).collect();
    let fp = fingerprint(&optimized);
    let mut program_id = Vec::with_capacity(64);
    program_id.extend_from_slice(&fp.0);
    program_id.extend_from_slice(BUILD_FINGERPRINT.as_bytes());
    program_id.extend_from_slice(&(replicas as u64).to_le_bytes());
    // The same graph lowers to another module with the loop kernels off.
    program_id.push(u8::from(lower_opts.loop_kernels));
    if let Some(p) = &partitioned {
        for text in p.module.params.iter().chain(&p.module.outputs) {
            program_id.extend_from_slice(text.as_bytes());
            program_id.push(0);
        }
    }
    let key = CompileKey::new(&program_id, client, &compile_opts)?;
    let nodes = pruned.graph.len();

    if let Some(program) = context::with(|c| c.cache.programs.get(&key).cloned()) {
        // Another trace (dead code elsewhere, another recording order) of a
        // program this thread already has.
        metrics::update(|m| m.cache_hits += 1);
        let entry = CacheEntry { program, kept_params: pruned.kept_params, donated, nodes };
        dump.finish()?;
        return Ok(Obtained { entry, compiled: false, explanation: None });
    }

    // A budget remat cannot meet still compiles, with the lowest-peak plan the
    // strategy reached; say so, naming the program as KILN_SAVE_GRAPHS names
    // its file (a run compiles helper programs too, which a percentage of the
    // activation memory may not fit), once per program.
    // The program's name in warnings and in KILN_SAVE_GRAPHS's file name.
    let name = format!("step-{}", &fp.to_string()[..16]);
    let remat = stats.passes.iter().find_map(|p| p.remat());
    // The parameters' init program is named so: a user who set a limit for
    // training did not write it. A percentage of the activation memory means
    // nothing for a program that keeps no values for a backward (the init, an
    // evaluation), so that goes unsaid.
    let init = crate::engine::param_init::in_param_init();
    let what = if init { "the parameters' init, " } else { "" };
    let percentage = opts.pass_options.activation_fraction.is_some();
    if let Some(r) = remat.filter(|r| !r.met && (!percentage || r.keeps_values)) {
        let limit = match opts.pass_options.activation_fraction {
            Some(f) => format!("{} B ({:.0}% of its activation memory)", r.budget_bytes, f * 100.0),
            None => format!("{} B", r.budget_bytes),
        };
        let values = r.values_recomputed();
        // Nothing taken: there was nothing to recompute, or no candidate
        // lowered the peak (a peak in the optimizer's update is past them).
        let why = match (values, r.keeps_values) {
            (0, false) => "; the program keeps no values for a backward, so there is nothing to recompute",
            (0, true) => {
                "; no recomputation found lowers this program's peak (as where the peak is in the optimizer's \
                 update, after the values it keeps are read)"
            }
            _ => "",
        };
        tracing::warn!(
            "kiln: memory limit {limit} not met by rematerialization in program {name} ({what}{} nodes): it runs \
             the lowest-peak plan reached, {} B predicted (from {} B, {values} value(s) recomputed){why}",
            nodes,
            r.after.peak_bytes,
            r.before.peak_bytes,
        );
    }

    let param_names = pruned
        .kept_params
        .iter()
        .map(|&p| bindings[p as usize].tensor.upgrade().and_then(|t| t.name.borrow().clone()))
        .collect::<Vec<_>>();
    let explanation = context::with(|c| explain::new_program(&pruned.graph, &param_names, &c.cache.history));

    let disk = context::with(|c| c.cache.disk_cache())?;
    let mut exe = None;
    let mut compiled = false;
    if let Some(d) = &disk {
        let t = Instant::now();
        match d.load(&key, client)? {
            Lookup::Hit { exe: e, info } => {
                metrics::update(|m| {
                    m.disk_hits += 1;
                    m.disk_load_time += t.elapsed();
                    m.compile_time_saved += info.compile_time;
                });
                metrics::span("disk_load", t);
                exe = Some(e);
            }
            Lookup::Miss => {}
            Lookup::Corrupt { .. } => metrics::update(|m| m.corrupt_cache_entries += 1),
        }
    }
    let exe = match exe {
        Some(e) => {
            dump.finish()?;
            e
        }
        None => {
            let t = Instant::now();
            // The target passes, verified and dumped after the pipeline's.
            let prepared = lower::prepare(&optimized, &lower_opts, opts.verify, &mut |p, g| dump.observe(p, g))?;
            let text = lower::print(&prepared)?;
            dump.text("stablehlo.mlir", &text);
            // The dump is whole: a write error fails the step before the compile.
            dump.finish()?;
            let e = client.compile(&text, &compile_opts)?;
            let took = t.elapsed();
            metrics::update(|m| {
                m.compiles += 1;
                m.compile_time += took;
            });
            metrics::span("compile", t);
            compiled = true;
            if let Some(d) = &disk {
                // A cache that cannot be written costs later runs a compile,
                // never this run its result.
                let t_store = Instant::now();
                let stored = d.store(&key, &e, EntryInfo { compile_time: took });
                metrics::update(|m| m.disk_store_time += t_store.elapsed());
                if let Err(err) = stored {
                    // With the OS's reason (the error's source), not just the path.
                    let mut reason = err.to_string();
                    let mut source = std::error::Error::source(&err);
                    while let Some(s) = source {
                        reason.push_str(&format!(": {s}"));
                        source = s.source();
                    }
                    tracing::warn!(err = %reason, "kiln: could not store the compiled program in the disk cache");
                }
            }
            e
        }
    };
    // A plan that meets a byte limit in live bytes can still compile to more:
    // XLA allocates each output that is not donated for the whole run (every
    // output on the CPU plugin, which donates nothing) and may order the step
    // its own way (docs/memory.md). Where XLA's stats show that, say so.
    if let Some(r) = remat.filter(|r| r.met && opts.pass_options.activation_fraction.is_none()) {
        if let Ok(m) = exe.compiled_memory_stats() {
            // In i128: a limit of 2^63 B or more is no i64, and casting it
            // would wrap it negative and warn for every program.
            if i128::from(m.held_bytes()) > i128::from(r.budget_bytes) {
                tracing::warn!(
                    "kiln: memory limit {} B met by rematerialization in program {name} ({what}{} nodes), but XLA's \
                     compiled program holds {} B (arguments {}, outputs {} less {} aliased, temporaries {}); \
                     the plan's live peak is {} B",
                    r.budget_bytes,
                    nodes,
                    m.held_bytes(),
                    m.argument_size_in_bytes,
                    m.output_size_in_bytes,
                    m.alias_size_in_bytes,
                    m.temp_size_in_bytes,
                    r.after.peak_bytes
                );
            }
        }
    }
    let (exe, layout) = match partitioned {
        Some(p) => (exe.with_local_signature(p.local)?, Some(p.layout)),
        None => (exe, None),
    };
    if let Some(dir) = context::with(|c| c.cache.save_graphs_dir()) {
        let path = dir.join(format!("{name}.kiln"));
        std::fs::create_dir_all(&dir)
            .map_err(|source| crate::core::error::FrontendError::Io { path: dir.clone(), source })?;
        write_atomically(&path, kiln_compiler::text::print(&pruned.graph).as_bytes())?;
    }
    let explanation = match (explanation, explain::current_bucket()) {
        // A loop's named bucket: its one compile is expected, not a storm.
        (Some(text), Some(bucket)) => {
            // What changed, without the remedy (the loop is already bucketing).
            let what = text.trim_start_matches("recompiling: ").split(". ").next().unwrap_or_default();
            let text = format!("bucket {bucket}: compiling its program ({what})");
            tracing::info!("kiln: {text}");
            metrics::explain(text.clone());
            Some(text)
        }
        (Some(text), None) => {
            tracing::warn!("kiln: {text}");
            crate::core::warnings::show_once(crate::core::warnings::Warning::Recompile, || text.clone());
            metrics::explain(text.clone());
            Some(text)
        }
        (None, _) => None,
    };
    let program = Rc::new(Program {
        exe,
        graph: pruned.graph.clone(),
        flops: kiln_compiler::cost::graph_flops(&optimized),
        layout,
    });
    context::with(|c| {
        c.cache.programs.insert(key, program.clone());
        c.cache.history.push(program.clone());
    });
    let entry = CacheEntry { program, kept_params: pruned.kept_params, donated, nodes };
    Ok(Obtained { entry, compiled, explanation })
}

/// What partitioning a program over a mesh needs: the module's sharding
/// texts, one device's signature, and the parameters' layouts.
struct Partitioned {
    module: kiln_compiler::ModuleShardings,
    local: kiln_runtime::Signature,
    layout: Layout,
}

/// The shardings of `optimized`'s parameters (their tensors', replicated when
/// unset) and outputs (`outs`, from the receivers), checked against `mesh`
/// before anything compiles.
fn partition(
    mesh: &crate::core::mesh::Mesh,
    pruned: &kiln_compiler::passes::Pruned,
    optimized: &Graph,
    bindings: &[Binding],
    outs: &[crate::core::mesh::Sharding],
) -> Result<Partitioned> {
    use crate::core::mesh::Sharding;
    let param_types = optimized.param_types();
    let output_types = optimized.output_types();
    let mut params = Vec::with_capacity(param_types.len());
    for (ty, &raw) in param_types.iter().zip(&pruned.kept_params) {
        let t = bindings[raw as usize].tensor.upgrade();
        let s =
            t.as_ref().map_or_else(|| Sharding::replicated(ty.shape.dims().len()), |t| crate::engine::partition::of(t));
        let name = t
            .as_ref()
            .and_then(|t| t.name.borrow().as_deref().map(str::to_string))
            .unwrap_or_else(|| format!("parameter {raw}"));
        s.check(&format!("{name} ({ty})"), ty, mesh)?;
        params.push(s);
    }
    if outs.len() != output_types.len() {
        return Err(crate::core::error::FrontendError::InvalidArgument {
            op: "mark_step",
            reason: format!("{} output layouts for {} outputs", outs.len(), output_types.len()),
        });
    }
    for (i, (s, ty)) in outs.iter().zip(&output_types).enumerate() {
        s.check(&format!("output {i} ({ty})"), ty, mesh)?;
    }
    let arg = |ty: &kiln_compiler::ir::TensorType, s: &Sharding| {
        kiln_runtime::ArgType::new(crate::core::element::element_type(ty.dtype), &s.local_dims(ty.shape.dims(), mesh))
    };
    let local = kiln_runtime::Signature {
        inputs: param_types.iter().zip(&params).map(|(t, s)| arg(t, s)).collect(),
        outputs: output_types.iter().zip(outs).map(|(t, s)| arg(t, s)).collect(),
    };
    let module = kiln_compiler::ModuleShardings {
        num_partitions: mesh.size(),
        params: params.iter().map(|s| s.hlo(mesh)).collect(),
        outputs: outs.iter().map(|s| s.hlo(mesh)).collect(),
        attention: crate::engine::partition::attention_split(mesh),
    };
    Ok(Partitioned { module, local, layout: Layout { mesh: mesh.clone(), params } })
}
