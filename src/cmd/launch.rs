//! `kiln launch --nodes N -- <cmd>`: runs one command as N processes of one
//! run on this machine, the way a cluster launcher would on N hosts.
//!
//! The launcher serves the run's key-value store itself (so the store
//! outlives any child) and gives child `i` its identity: `KILN_NUM_NODES=N`,
//! `KILN_NODE_ID=i`, `KILN_COORDINATOR=127.0.0.1:<port>`,
//! `KILN_COORDINATOR_SERVED=1`, `KILN_RUN_ID`, `KILN_ATTEMPT`, `KILN_RUN_TOKEN`
//! (a random secret made per launch: every store message is authenticated
//! with it, so no other local process can speak to the run), and with GPUs
//! `KILN_LOCAL_DEVICES` (child `i` drives GPUs `i·g .. (i+1)·g`, which become
//! the CUDA client's `visible_devices`).
//!
//! Invariants: each child runs in its own process group, so stopping a child
//! stops what it started too; the first child to fail (non-zero status or a
//! signal) stops every other child — SIGTERM, then SIGKILL after `--grace-ms`
//! — and the launcher exits with that child's status, so a failed run never
//! leaves processes behind or hangs on a peer blocked in a collective.
//! SIGINT/SIGTERM sent to the launcher are passed on to every child the same way.
//! A child dies with the launcher (a parent-death signal, SIGKILL, set before
//! it runs): a launcher killed with SIGKILL leaves no node running. A node
//! still running `--straggler-s` after another finished successfully is
//! reported and stopped like a failed run (a peer that hangs after node 0
//! ended once kept the launcher waiting forever).
//! With `--restarts`, a failed attempt is followed by the next
//! (`KILN_ATTEMPT` + 1) on the same store; its keys are scoped by attempt, so
//! it never reads what the failed attempt left there.

use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kiln_runtime::distributed::auth::{ENV_RUN_TOKEN, ENV_RUN_TOKEN_FILE};
use kiln_runtime::distributed::identity::MAX_NODES;
use kiln_runtime::distributed::identity::{
    ENV_ATTEMPT, ENV_COORDINATOR, ENV_COORDINATOR_SERVED, ENV_LAUNCHER_PID, ENV_LOCAL_DEVICES, ENV_NODE_ID,
    ENV_NUM_NODES, ENV_RUN_ID,
};
use kiln_runtime::distributed::{RunToken, ServerConfig, StoreServer, EXIT_PEER_LOST};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// The most GPUs one process may drive (`--gpus-per-node`): far above any
/// host; it stops a typo from listing billions of ordinals.
pub const MAX_GPUS_PER_NODE: usize = 1024;

#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Processes to start.
    #[arg(long)]
    pub nodes: u32,
    /// GPUs each process drives (KILN_LOCAL_DEVICES), 1 to 1024; default 1
    /// with PJRT_DEVICE=CUDA, none otherwise.
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// Port of the key-value store on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Names the run's keys (default: one per launch): 1 to 64 characters of
    /// A-Z a-z 0-9 . _ -
    #[arg(long, value_parser = parse_run_id)]
    pub run_id: Option<String>,
    /// Restart count of this run (a new attempt never reads older keys).
    #[arg(long, default_value_t = 0)]
    pub attempt: u32,
    /// After a failure, start every process again (as the next attempt, with
    /// fresh keys in the same store) up to this many times.
    #[arg(long, default_value_t = 0)]
    pub restarts: u32,
    /// After a failure, how long the other processes get between SIGTERM and SIGKILL.
    #[arg(long, default_value_t = 3000)]
    pub grace_ms: u64,
    /// Seconds the other processes may keep running after one finished
    /// successfully; then they are stopped (SIGTERM, SIGKILL after
    /// --grace-ms) and the run fails, naming them.
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub straggler_s: u64,
    /// The command every process runs.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// The launcher's exit code when it stopped nodes that outlived a finished
/// one by `--straggler-s` (the run did not end as a whole).
pub const EXIT_STRAGGLER: i32 = 3;

/// How a child ended.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(EXIT_PEER_LOST), _) => format!("status {EXIT_PEER_LOST} (it lost a peer or the coordinator)"),
        (Some(code), _) => format!("status {code}"),
        (None, Some(sig)) => format!(
            "signal {sig} ({})",
            Signal::try_from(sig).map_or_else(|_| "unknown".to_string(), |s| s.as_str().to_string())
        ),
        (None, None) => "an unknown status".into(),
    }
}

/// The launcher's own exit code for a child's status.
fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().filter(|&c| c != 0).or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

fn signal_group(child: &Child, signal: Signal) {
    // The child leads its own group (process_group(0)); ESRCH just means it
    // has already exited.
    let _ = killpg(Pid::from_raw(child.id() as i32), signal);
}

/// Runs the launch; `Ok(code)` is the launcher's exit status.
pub fn run(args: &LaunchArgs) -> anyhow::Result<i32> {
    if args.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    // Every attempt this launch may start has its own number.
    if args.attempt.checked_add(args.restarts).is_none() {
        bail!(
            "--attempt {} with --restarts {}: the attempts would pass {} and wrap to 0, reusing the keys of \
             attempt 0",
            args.attempt,
            args.restarts,
            u32::MAX
        );
    }
    if args.nodes > MAX_NODES {
        bail!("--nodes {} is more than the {MAX_NODES} nodes a run may have", args.nodes);
    }
    match args.gpus_per_node {
        Some(0) => bail!("--gpus-per-node 0: each process needs at least 1 GPU (leave the flag out for none)"),
        Some(g) if g > MAX_GPUS_PER_NODE => {
            bail!("--gpus-per-node {g} is more than the {MAX_GPUS_PER_NODE} GPUs a process may drive")
        }
        _ => {}
    }
    let (program, rest) = args.command.split_first().context("no command after --")?;
    let token = RunToken::generate().context("making the run's token")?;
    let config = ServerConfig::new(Some(token.clone()), args.nodes);
    let server =
        StoreServer::bind(&format!("127.0.0.1:{}", args.port), config).context("starting the key-value store")?;
    let coordinator = server.local_addr().to_string();
    let run_id = args.run_id.clone().unwrap_or_else(|| format!("launch-{}-{}", std::process::id(), unix_ms()));
    let cuda = kiln::runtime::PjrtDevice::from_env()? == kiln::runtime::PjrtDevice::Cuda;
    let gpus = args.gpus_per_node.or(cuda.then_some(1));
    let stop = Arc::new(AtomicI32::new(0));
    forward_signals(stop.clone());
    let mut attempt = args.attempt;
    let mut restarts_left = args.restarts;
    loop {
        eprintln!("kiln launch: {} processes, store at {coordinator}, run {run_id} attempt {attempt}", args.nodes);
        let code = run_attempt(args, program, rest, &coordinator, &run_id, &token, attempt, gpus, &stop)?;
        if code == 0 || stop.load(Ordering::Acquire) != 0 || restarts_left == 0 {
            drop(server);
            return Ok(code);
        }
        restarts_left -= 1;
        attempt += 1;
        eprintln!("kiln launch: restarting every node as attempt {attempt} ({restarts_left} restart(s) left)");
    }
}

/// Runs one attempt: starts every node, waits, stops the rest on the first
/// failure; returns the attempt's exit status.
#[allow(clippy::too_many_arguments)]
fn run_attempt(
    args: &LaunchArgs,
    program: &str,
    rest: &[String],
    coordinator: &str,
    run_id: &str,
    token: &RunToken,
    attempt: u32,
    gpus: Option<usize>,
    stop: &AtomicI32,
) -> anyhow::Result<i32> {
    use std::os::unix::process::CommandExt;
    let local_devices = local_devices(args.nodes, gpus)?;
    let mut children: Vec<Option<Child>> = Vec::new();
    for node in 0..args.nodes {
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .env(ENV_NUM_NODES, args.nodes.to_string())
            .env(ENV_NODE_ID, node.to_string())
            .env(ENV_COORDINATOR, coordinator)
            .env(ENV_COORDINATOR_SERVED, "1")
            .env(ENV_RUN_ID, run_id)
            .env(ENV_ATTEMPT, attempt.to_string())
            .env(ENV_RUN_TOKEN, token.expose())
            .env_remove(ENV_RUN_TOKEN_FILE)
            .process_group(0);
        if let Some(list) = &local_devices[node as usize] {
            cmd.env(ENV_LOCAL_DEVICES, list);
        }
        // The node binds its life to the launcher's (a parent-death signal,
        // `kiln_runtime::distributed::bind_to_launcher`).
        cmd.env(ENV_LAUNCHER_PID, std::process::id().to_string());
        match cmd.spawn() {
            Ok(child) => children.push(Some(child)),
            Err(err) => {
                for c in children.iter().flatten() {
                    signal_group(c, Signal::SIGKILL);
                }
                for c in children.iter_mut().flatten() {
                    let _ = c.wait();
                }
                return Err(err).with_context(|| format!("starting node {node}: {program}"));
            }
        }
    }

    let started = Instant::now();
    let mut failure: Option<(u32, ExitStatus)> = None;
    let mut stopping_since: Option<Instant> = None;
    let mut killed = false;
    // When the first node finished successfully, and which.
    let mut first_done: Option<(u32, Instant)> = None;
    let mut stragglers = false;
    loop {
        for (node, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() && failure.is_none() && stopping_since.is_none() {
                        failure = Some((node as u32, status));
                        eprintln!(
                            "kiln launch: node {node} exited with {} after {:.1} s; stopping the others",
                            describe(status),
                            started.elapsed().as_secs_f64()
                        );
                    } else if !status.success() {
                        eprintln!("kiln launch: node {node} exited with {}", describe(status));
                    } else if first_done.is_none() {
                        first_done = Some((node as u32, Instant::now()));
                    }
                }
                Ok(None) => {}
                Err(err) => eprintln!("kiln launch: cannot wait for node {node}: {err}"),
            }
        }
        if children.iter().all(Option::is_none) {
            break;
        }
        let signalled = stop.load(Ordering::Acquire);
        if let Some((done, at)) = first_done.filter(|_| stopping_since.is_none() && failure.is_none()) {
            if at.elapsed() >= Duration::from_secs(args.straggler_s) {
                let running: Vec<String> = children
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.is_some())
                    .map(|(node, _)| node.to_string())
                    .collect();
                eprintln!(
                    "kiln launch: node(s) {} still running {} s after node {done} finished; stopping them \
                     (--straggler-s)",
                    running.join(", "),
                    args.straggler_s
                );
                stragglers = true;
            }
        }
        if stopping_since.is_none() && (failure.is_some() || signalled != 0 || stragglers) {
            if signalled != 0 && failure.is_none() {
                eprintln!("kiln launch: got signal {signalled}; stopping every node");
            }
            for c in children.iter().flatten() {
                signal_group(c, Signal::SIGTERM);
            }
            stopping_since = Some(Instant::now());
        }
        if let Some(since) = stopping_since {
            if !killed && since.elapsed() >= Duration::from_millis(args.grace_ms) {
                for c in children.iter().flatten() {
                    signal_group(c, Signal::SIGKILL);
                }
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = stop.load(Ordering::Acquire);
    Ok(match failure {
        Some((_, status)) => exit_code(status),
        None if signalled != 0 => 128 + signalled,
        None if stragglers => EXIT_STRAGGLER,
        None => 0,
    })
}

/// Each node's `KILN_LOCAL_DEVICES` (node `i` drives GPUs `i·g .. (i+1)·g`),
/// made before any child starts; the ordinals use checked arithmetic (`run`
/// bounds `nodes` and `g`, so an overflow is never reached).
fn local_devices(nodes: u32, gpus: Option<usize>) -> anyhow::Result<Vec<Option<String>>> {
    (0..nodes as usize)
        .map(|node| {
            let Some(g) = gpus else { return Ok(None) };
            let first = node.checked_mul(g).context("--gpus-per-node: GPU ordinals overflow")?;
            let end = first.checked_add(g).context("--gpus-per-node: GPU ordinals overflow")?;
            Ok(Some((first..end).map(|d| d.to_string()).collect::<Vec<_>>().join(",")))
        })
        .collect()
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// Records SIGINT/SIGTERM sent to the launcher in `stop` (the main loop
/// then stops every child), through tokio's safe signal API on a thread.
fn forward_signals(stop: Arc<AtomicI32>) {
    let spawned = std::thread::Builder::new().name("kiln-launch-signals".into()).spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_io().build() else { return };
        rt.block_on(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
                return;
            };
            loop {
                let sig = tokio::select! {
                    _ = int.recv() => Signal::SIGINT as i32,
                    _ = term.recv() => Signal::SIGTERM as i32,
                };
                stop.store(sig, Ordering::Release);
            }
        });
    });
    if let Err(err) = spawned {
        eprintln!("kiln launch: cannot watch for signals ({err}); Ctrl-C stops only the launcher");
    }
}

/// `--run-id`, checked where it is given rather than in every child.
fn parse_run_id(v: &str) -> Result<String, String> {
    if kiln::runtime::distributed::identity::is_run_id(v) {
        Ok(v.to_string())
    } else {
        Err(format!("{v:?} is not a run id: {}", kiln::runtime::distributed::identity::RUN_ID_SPELLING))
    }
}
