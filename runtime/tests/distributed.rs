//! The key-value store and the run's start-up and failure handling, on
//! loopback only and without a plugin: the TCP server under concurrent
//! clients, blocking gets with deadlines, try-get, restart isolation by key
//! scope, the start-up barrier naming absent nodes, and the watchdog naming a
//! node that stopped.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use kiln_runtime::distributed::identity::Timeouts;
use kiln_runtime::distributed::{
    Identity, KeyValueStore, RunScope, Scoped, ServerConfig, Session, StoreServer, TcpStore, WatchdogAction,
};
use kiln_runtime::RuntimeError;

/// A loopback server for a run of 3 nodes, without a token (loopback runs
/// may go without one).
fn server() -> StoreServer {
    server_of(3)
}

/// A loopback server for a run of `nodes` (every `BEAT` must say as many).
fn server_of(nodes: u32) -> StoreServer {
    StoreServer::bind("127.0.0.1:0", ServerConfig::new(None, nodes)).expect("a loopback server")
}

fn client(s: &StoreServer) -> TcpStore {
    TcpStore::new(&s.local_addr().to_string(), None, Duration::from_secs(2)).unwrap()
}

#[test]
fn put_get_try_get_over_tcp() {
    let s = server();
    let c = client(&s);
    c.put("a", b"\x00\x01binary\xff").unwrap();
    assert_eq!(c.get("a", Duration::from_millis(10)).unwrap(), b"\x00\x01binary\xff");
    assert_eq!(c.try_get("a").unwrap(), b"\x00\x01binary\xff");
    c.put("a", b"\x00\x01binary\xff").expect("putting the same value again is fine");
    let err = c.put("a", b"other").unwrap_err();
    assert!(matches!(&err, RuntimeError::KvAlreadyExists { key } if key == "a"), "{err}");
    let err = c.try_get("missing").unwrap_err();
    assert!(matches!(&err, RuntimeError::KvNotFound { key } if key == "missing"), "{err}");
    c.put("empty", b"").unwrap();
    assert_eq!(c.try_get("empty").unwrap(), b"");
}

#[test]
fn get_blocks_until_put_and_times_out_at_its_deadline() {
    let s = server();
    let addr = s.local_addr().to_string();
    let waiter = std::thread::spawn(move || {
        let c = TcpStore::new(&addr, None, Duration::from_secs(2)).unwrap();
        let t = Instant::now();
        let v = c.get("late", Duration::from_secs(5));
        (v, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(150));
    client(&s).put("late", b"here").unwrap();
    let (v, waited) = waiter.join().unwrap();
    assert_eq!(v.unwrap(), b"here");
    assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(3), "{waited:?}");

    let c = client(&s);
    let t = Instant::now();
    let err = c.get("never", Duration::from_millis(200)).unwrap_err();
    let took = t.elapsed();
    assert!(matches!(&err, RuntimeError::KvDeadline { key, timeout_ms: 200 } if key == "never"), "{err}");
    assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn concurrent_clients_see_every_value_exactly() {
    let s = server();
    let addr = s.local_addr().to_string();
    let threads = 16;
    let keys_each = 20;
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let addr = addr.clone();
            let start = start.clone();
            std::thread::spawn(move || {
                let c = TcpStore::new(&addr, None, Duration::from_secs(5)).unwrap();
                start.wait();
                for k in 0..keys_each {
                    c.put(&format!("t{t}/k{k}"), format!("{t}:{k}").as_bytes()).unwrap();
                }
                // Every thread reads every other thread's keys, blocking for
                // those not written yet.
                for other in 0..threads {
                    for k in 0..keys_each {
                        let v = c.get(&format!("t{other}/k{k}"), Duration::from_secs(10)).unwrap();
                        assert_eq!(v, format!("{other}:{k}").as_bytes());
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a client thread failed");
    }
    assert_eq!(s.len(), threads * keys_each);
}

#[test]
fn a_restarted_attempt_never_reads_the_previous_attempts_keys() {
    let s = server();
    let scope = |attempt| RunScope { run_id: "job".into(), attempt };
    let first = Scoped::new(client(&s), &scope(0));
    first.put("global_topology/cuda", b"attempt 0").unwrap();
    first.put("nccl_id/0", b"stale").unwrap();
    let second = Scoped::new(client(&s), &scope(1));
    let err = second.try_get("global_topology/cuda").unwrap_err();
    assert!(matches!(&err, RuntimeError::KvNotFound { key } if key == "global_topology/cuda"), "{err}");
    let err = second.get("nccl_id/0", Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, RuntimeError::KvDeadline { .. }), "{err}");
    // The new attempt writes its own value under the same key without a clash.
    second.put("global_topology/cuda", b"attempt 1").unwrap();
    assert_eq!(second.try_get("global_topology/cuda").unwrap(), b"attempt 1");
    assert_eq!(first.try_get("global_topology/cuda").unwrap(), b"attempt 0");
    // Another run shares the server without seeing either.
    let other = Scoped::new(client(&s), &RunScope { run_id: "other".into(), attempt: 0 });
    assert!(other.try_get("global_topology/cuda").is_err());
}

#[test]
fn an_unreachable_store_is_a_typed_error_not_a_hang() {
    let addr = {
        let s = server();
        s.local_addr().to_string()
    };
    // The server is gone; nothing listens there now.
    let c = TcpStore::new(&addr, None, Duration::from_millis(300)).unwrap();
    let t = Instant::now();
    let err = c.get("k", Duration::from_millis(100)).unwrap_err();
    assert!(matches!(err, RuntimeError::KvUnavailable { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2));
}

fn identity(node: u32, nodes: u32, coordinator: &str, run: &str, timeouts: Timeouts) -> Identity {
    Identity {
        node_id: node,
        num_nodes: nodes,
        coordinator: Some(coordinator.to_string()),
        serves_store: false,
        scope: RunScope { run_id: run.into(), attempt: 0 },
        local_devices: None,
        timeouts,
        token: None,
    }
}

#[test]
fn nodes_pass_the_start_barrier_together() {
    let s = server();
    let addr = s.local_addr().to_string();
    let t = Timeouts { startup_ms: 5_000, peer_ms: 1_000 };
    let handles: Vec<_> = (0..3)
        .map(|n| {
            let id = identity(n, 3, &addr, "barrier", t);
            std::thread::spawn(move || Session::start(id).map(|_| ()))
        })
        .collect();
    for h in handles {
        h.join().unwrap().expect("every node arrives");
    }
}

#[test]
fn a_node_that_never_arrives_is_named_after_the_startup_timeout() {
    let s = server();
    let addr = s.local_addr().to_string();
    let t = Timeouts { startup_ms: 300, peer_ms: 1_000 };
    let ids: Vec<_> = (0..2).map(|n| identity(n, 3, &addr, "missing", t)).collect();
    let started = Instant::now();
    let handles: Vec<_> = ids.into_iter().map(|id| std::thread::spawn(move || Session::start(id))).collect();
    for h in handles {
        let err = h.join().unwrap().unwrap_err();
        assert!(
            matches!(&err, RuntimeError::NodesMissing { missing, num_nodes: 3, .. } if missing == &vec![2]),
            "{err}"
        );
        assert!(err.to_string().contains("[2]"), "{err}");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[test]
fn a_coordinator_that_never_listens_is_named_after_the_startup_timeout() {
    let addr = {
        let s = server();
        s.local_addr().to_string()
    };
    let t = Timeouts { startup_ms: 300, peer_ms: 1_000 };
    let err = Session::start(identity(1, 2, &addr, "nocoord", t)).unwrap_err();
    assert!(matches!(&err, RuntimeError::NodesMissing { missing, .. } if missing == &vec![0]), "{err}");
}

#[test]
fn the_watchdog_names_a_node_that_stopped_beating() {
    let s = server_of(2);
    let addr = s.local_addr().to_string();
    let t = Timeouts { startup_ms: 5_000, peer_ms: 400 };
    let (a, b) = {
        let ia = identity(0, 2, &addr, "watch", t);
        let ib = identity(1, 2, &addr, "watch", t);
        let hb = std::thread::spawn(move || Session::start(ib));
        let a = Session::start(ia).unwrap();
        (Arc::new(a), Arc::new(hb.join().unwrap().unwrap()))
    };
    let seen: Arc<Mutex<Option<(RuntimeError, Instant)>>> = Arc::default();
    let sink = seen.clone();
    a.spawn_watchdog(WatchdogAction::Report(Arc::new(move |e| {
        *sink.lock().unwrap() = Some((e, Instant::now()));
    })));
    b.spawn_watchdog(WatchdogAction::Report(Arc::new(|e| panic!("node 1 saw {e}"))));
    // Both beat for a while: nobody is reported.
    std::thread::sleep(Duration::from_millis(900));
    assert!(seen.lock().unwrap().is_none(), "a live peer was reported lost");
    // Node 1 dies (its session and watchdog go away).
    let died = Instant::now();
    drop(b);
    let bound = t.failure_bound();
    while seen.lock().unwrap().is_none() && died.elapsed() < bound + Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (err, at) = seen.lock().unwrap().take().expect("node 0 noticed node 1 stopped");
    assert!(matches!(&err, RuntimeError::PeersLost { nodes, me: 0, .. } if nodes == &vec![1]), "{err}");
    assert!(at.duration_since(died) <= bound, "noticed after {:?}, bound {bound:?}", at.duration_since(died));
}

#[test]
fn a_node_that_finished_is_not_lost() {
    let s = server_of(2);
    let addr = s.local_addr().to_string();
    let t = Timeouts { startup_ms: 5_000, peer_ms: 300 };
    let ib = identity(1, 2, &addr, "finish", t);
    let hb = std::thread::spawn(move || Session::start(ib));
    let a = Arc::new(Session::start(identity(0, 2, &addr, "finish", t)).unwrap());
    let b = hb.join().unwrap().unwrap();
    b.finish();
    drop(b);
    std::thread::sleep(Duration::from_millis(800));
    let mut last_ok = Instant::now();
    assert!(a.watch_once(&mut last_ok).is_none(), "a finished node counted as lost");
}

#[test]
fn a_single_process_client_addresses_every_global_device() {
    let c = common::cpu_client(3);
    assert_eq!(c.process_index(), 0);
    let global: Vec<i32> = c.global_devices().iter().map(|d| d.id).collect();
    let local: Vec<i32> = c.devices().iter().map(|d| d.id()).collect();
    assert_eq!(global, local);
    assert!(c.global_devices().iter().all(|d| d.process_index == 0));
    assert_eq!(c.replica_assignment(2).unwrap(), vec![vec![i64::from(global[0])], vec![i64::from(global[1])]]);
    assert_eq!(c.local_replicas(3), vec![0, 1, 2]);
    assert!(matches!(c.replica_assignment(4), Err(RuntimeError::CompileOptions { .. })));
}

/// Set in the child processes of the tests below: which role to play.
const ROLE: &str = "KILN_TEST_NODE_ROLE";

/// With `ROLE` set, the body of a node process that the tests below start by
/// running this test binary again: it joins the run from the environment (as
/// `kiln` does), then works until killed. Run as a plain test, it checks that
/// the test process itself is one process of no run (what the others assume).
#[test]
fn node_process() {
    let id = kiln_runtime::distributed::NodeEnv::from_env().identity().expect("identity");
    if std::env::var_os(ROLE).is_none() {
        assert!(!id.is_distributed(), "the test process has KILN_NUM_NODES set: {id:?}");
        assert!(kiln_runtime::distributed::session().is_none());
        return;
    }
    match kiln_runtime::distributed::join(&id) {
        Ok(_) => {
            println!("joined");
            std::thread::sleep(Duration::from_secs(60));
            std::process::exit(0);
        }
        Err(e) => {
            eprintln!("kiln: error: {e}");
            std::process::exit(1);
        }
    }
}

fn node(id: u32, nodes: u32, coordinator: &str, peer_ms: u64, startup_ms: u64) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "node_process", "--nocapture", "--test-threads", "1"])
        .env(ROLE, "node")
        .env("KILN_NUM_NODES", nodes.to_string())
        .env("KILN_NODE_ID", id.to_string())
        .env("KILN_COORDINATOR", coordinator)
        .env("KILN_RUN_ID", "proc")
        .env("KILN_PEER_TIMEOUT_MS", peer_ms.to_string())
        .env("KILN_STARTUP_TIMEOUT_MS", startup_ms.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

fn wait_line(child: &mut std::process::Child, want: &str) {
    use std::io::BufRead;
    let out = child.stdout.as_mut().unwrap();
    let mut lines = std::io::BufReader::new(out).lines();
    assert!(lines.any(|l| l.is_ok_and(|l| l.contains(want))), "the node never printed {want:?}");
}

#[test]
fn a_killed_process_makes_the_other_exit_naming_it_within_the_bound() {
    // Node 0 serves the store (as without a launcher); node 1 is SIGKILLed.
    let addr = free_port();
    let peer_ms = 600;
    let mut n0 = node(0, 2, &addr, peer_ms, 10_000);
    let mut n1 = node(1, 2, &addr, peer_ms, 10_000);
    wait_line(&mut n0, "joined");
    wait_line(&mut n1, "joined");
    n1.kill().unwrap();
    let killed = Instant::now();
    n1.wait().unwrap();
    let out = n0.wait_with_output().unwrap();
    let took = killed.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(kiln_runtime::distributed::EXIT_PEER_LOST), "{stderr}");
    assert!(stderr.contains("node(s) [1] stopped"), "{stderr}");
    let bound = Timeouts { startup_ms: 10_000, peer_ms }.failure_bound();
    assert!(took <= bound, "node 0 ended {took:?} after the kill, bound {bound:?}");
}

#[test]
fn a_process_losing_the_coordinator_exits_naming_it() {
    // Node 0 (the store's host) is killed: node 1 can no longer beat.
    let addr = free_port();
    let peer_ms = 600;
    let mut n0 = node(0, 2, &addr, peer_ms, 10_000);
    let mut n1 = node(1, 2, &addr, peer_ms, 10_000);
    wait_line(&mut n0, "joined");
    wait_line(&mut n1, "joined");
    n0.kill().unwrap();
    let killed = Instant::now();
    n0.wait().unwrap();
    let out = n1.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(kiln_runtime::distributed::EXIT_PEER_LOST), "{stderr}");
    assert!(stderr.contains(&format!("the coordinator {addr} stopped answering")), "{stderr}");
    let bound = Timeouts { startup_ms: 10_000, peer_ms }.failure_bound();
    assert!(killed.elapsed() <= bound, "{:?} > {bound:?}", killed.elapsed());
}

#[test]
fn a_process_whose_peer_never_starts_exits_naming_it() {
    let addr = free_port();
    let started = Instant::now();
    let out = node(0, 3, &addr, 1_000, 400).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("node(s) [1, 2] of 3 did not arrive"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}
