//! `kiln launch` end to end on loopback: every child gets its identity and
//! the coordinator, and one failing child ends the others (SIGTERM, then
//! SIGKILL after the grace period) with the launcher exiting non-zero within
//! a bounded time.

use std::path::Path;
use std::time::{Duration, Instant};

use assert_cmd::Command;

fn kiln() -> Command {
    let mut cmd = Command::cargo_bin("kiln").expect("the kiln binary is built");
    cmd.env_remove("PJRT_DEVICE");
    cmd
}

fn alive(pid: &str) -> bool {
    // A zombie still has /proc/<pid>; its state is Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|state| state != "Z"))
        .unwrap_or(false)
}

#[test]
fn children_get_their_identity_and_the_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"printf %s "$KILN_RUN_TOKEN" > "$OUT/token$KILN_NODE_ID"; echo "$KILN_NODE_ID $KILN_NUM_NODES $KILN_COORDINATOR $KILN_COORDINATOR_SERVED $KILN_RUN_ID $KILN_ATTEMPT ${KILN_LOCAL_DEVICES-none}" > "$OUT/node$KILN_NODE_ID""#;
    let out = kiln()
        .args(["launch", "--nodes", "3", "--run-id", "t1", "--attempt", "2", "--", "sh", "-c", script])
        .env("OUT", dir.path())
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for n in 0..3 {
        let line = std::fs::read_to_string(dir.path().join(format!("node{n}"))).unwrap();
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f[0], n.to_string());
        assert_eq!(f[1], "3");
        assert!(f[2].starts_with("127.0.0.1:") && !f[2].ends_with(":0"), "{line}");
        assert_eq!(&f[3..], ["1", "t1", "2", "none"], "{line}");
    }
    // Every child gets the launch's token: 32 random bytes as hex.
    let token = |n: usize| std::fs::read_to_string(dir.path().join(format!("token{n}"))).unwrap();
    let first = token(0);
    assert!(first.len() == 64 && first.bytes().all(|b| b.is_ascii_hexdigit()), "{first:?}");
    assert!((1..3).all(|n| token(n) == first));
    // GPUs: each process gets its own ordinals.
    let out = kiln()
        .args(["launch", "--nodes", "2", "--gpus-per-node", "2", "--", "sh", "-c", script])
        .env("OUT", dir.path())
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    assert!(out.status.success());
    let gpus = |n: usize| std::fs::read_to_string(dir.path().join(format!("node{n}"))).unwrap();
    assert!(gpus(0).trim_end().ends_with(" 0,1"), "{}", gpus(0));
    assert!(gpus(1).trim_end().ends_with(" 2,3"), "{}", gpus(1));
    // A new launch, a new token.
    assert_ne!(token(0), first);
}

#[test]
fn a_failing_child_ends_the_others_and_the_launch() {
    let dir = tempfile::tempdir().unwrap();
    // Node 1 records its pid and sleeps (ignoring SIGTERM, so only SIGKILL
    // after the grace period ends it); node 0 fails once node 1 is up.
    let script = r#"
        if [ "$KILN_NODE_ID" = 1 ]; then
            trap '' TERM
            echo $$ > "$OUT/pid.tmp" && mv "$OUT/pid.tmp" "$OUT/pid1"
            sleep 60 & wait
        else
            while [ ! -f "$OUT/pid1" ]; do sleep 0.02; done
            exit 1
        fi"#;
    let started = Instant::now();
    let out = kiln()
        .args(["launch", "--nodes", "2", "--grace-ms", "500", "--", "sh", "-c", script])
        .env("OUT", dir.path())
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("node 0 exited with status 1"), "{stderr}");
    // 500 ms grace plus polling; far below the sleeper's 60 s.
    assert!(took < Duration::from_secs(10), "the launch took {took:?}");
    let pid = std::fs::read_to_string(dir.path().join("pid1")).unwrap();
    assert!(!alive(pid.trim()), "node 1 (pid {}) is still running", pid.trim());
}

#[test]
fn a_child_killed_by_a_signal_is_reported_by_name() {
    let out = kiln()
        .args([
            "launch",
            "--nodes",
            "2",
            "--grace-ms",
            "200",
            "--",
            "sh",
            "-c",
            r#"if [ "$KILN_NODE_ID" = 1 ]; then kill -9 $$; else exec sleep 60; fi"#,
        ])
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
    assert!(stderr.contains("node 1 exited with signal 9 (SIGKILL)"), "{stderr}");
}

#[test]
fn a_command_that_cannot_start_is_an_error_naming_it() {
    let out = kiln()
        .args(["launch", "--nodes", "2", "--", "/nonexistent/kiln-test-binary"])
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("starting node 0: /nonexistent/kiln-test-binary"), "{stderr}");
    assert!(!Path::new("/nonexistent").exists());
}

#[test]
fn a_failed_attempt_is_restarted_as_the_next_attempt() {
    let dir = tempfile::tempdir().unwrap();
    // Attempt 0: node 1 fails. Attempt 1: both succeed.
    let script = r#"
        echo "$KILN_ATTEMPT" >> "$OUT/attempts$KILN_NODE_ID"
        if [ "$KILN_ATTEMPT" = 0 ] && [ "$KILN_NODE_ID" = 1 ]; then
            while [ ! -s "$OUT/attempts0" ]; do sleep 0.02; done
            exit 3
        fi
        if [ "$KILN_ATTEMPT" = 0 ]; then exec sleep 30; fi"#;
    let out = kiln()
        .args(["launch", "--nodes", "2", "--restarts", "2", "--grace-ms", "300", "--", "sh", "-c", script])
        .env("OUT", dir.path())
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("node 1 exited with status 3"), "{stderr}");
    assert!(stderr.contains("restarting every node as attempt 1 (1 restart(s) left)"), "{stderr}");
    for n in 0..2 {
        let seen = std::fs::read_to_string(dir.path().join(format!("attempts{n}"))).unwrap();
        assert_eq!(seen, "0\n1\n", "node {n}");
    }
    // Without restarts the failure is final.
    let out = kiln()
        .args(["launch", "--nodes", "2", "--grace-ms", "300", "--", "sh", "-c", script])
        .env("OUT", dir.path())
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
}

#[test]
fn bad_identities_are_refused_before_training() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("KILN_NUM_NODES", "2"), ("KILN_NODE_ID", "0")], "KILN_NUM_NODES=2 needs a key-value store"),
        (
            &[("KILN_NUM_NODES", "2"), ("KILN_NODE_ID", "5"), ("KILN_COORDINATOR", "h:1")],
            "KILN_NODE_ID=5 is out of range",
        ),
        (
            &[("KILN_NUM_NODES", "2"), ("KILN_NODE_ID", "0"), ("KILN_COORDINATOR", "127.0.0.1:1")],
            "the cpu PJRT plugin cannot join a run of 2 nodes",
        ),
        (
            &[("KILN_NUM_NODES", "2"), ("KILN_NODE_ID", "0"), ("KILN_COORDINATOR", "10.0.0.1:7070")],
            "is not on loopback and the run has no token",
        ),
    ];
    for (vars, want) in cases {
        let mut cmd = kiln();
        cmd.args(["train", "mlp", "--max-steps", "1"]).env("KILN_CACHE", "off");
        for (k, v) in *vars {
            cmd.env(k, v);
        }
        let out = cmd.timeout(Duration::from_secs(60)).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(want), "{vars:?}: {stderr}");
    }
}

/// GPU and node counts no host has are refused before any child starts
/// (`--gpus-per-node 18446744073709551615` once panicked with `capacity
/// overflow` listing the ordinals; 0 gave every child an empty
/// `KILN_LOCAL_DEVICES`; a billion nodes would start a billion processes).
#[test]
fn gpu_and_node_counts_out_of_range_are_refused_before_starting_anything() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let script = format!("touch {}", marker.display());
    for (args, says) in [
        (&["--nodes", "1", "--gpus-per-node", "18446744073709551615"][..], "--gpus-per-node 18446744073709551615"),
        (&["--nodes", "2", "--gpus-per-node", "1025"][..], "1024"),
        (&["--nodes", "1", "--gpus-per-node", "0"][..], "--gpus-per-node 0"),
        (&["--nodes", "4097"][..], "--nodes 4097"),
    ] {
        let out = kiln()
            .arg("launch")
            .args(args)
            .args(["--", "sh", "-c", &script])
            .timeout(Duration::from_secs(30))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(says) && !err.contains("panicked"), "{args:?}: {err}");
        assert!(!marker.exists(), "{args:?}: a child started");
    }
}

/// A restarted attempt continues from the checkpoint an earlier attempt of
/// the run saved: without `--resume` (which the first attempt cannot pass,
/// having nothing to resume) a file already there is refused, which made
/// `--restarts` with `--checkpoint` fail on every restart.
#[test]
fn a_restarted_attempt_resumes_from_the_checkpoint_of_an_earlier_one() {
    let dir = tempfile::tempdir().unwrap();
    let kiln_bin = assert_cmd::cargo::cargo_bin("kiln");
    // Both attempts run the same command (a resumed run must have the saved
    // run's settings); attempt 0 is killed once its first checkpoint is on
    // disk, attempt 1 runs to the end.
    let script = format!(
        r#"train() {{ {k} train mlp --epochs 1 --max-steps 1000 --batch 16 --hidden 16 --checkpoint-every 4 --checkpoint "$OUT/c.safetensors" --json; }}
        if [ "$KILN_ATTEMPT" = 0 ]; then
            train > /dev/null & node=$!
            while [ ! -f "$OUT/c.safetensors" ]; do sleep 0.01; done
            kill -9 $node; exit 1
        fi
        train > "$OUT/attempt1.json""#,
        k = kiln_bin.display()
    );
    let out = kiln()
        .args(["launch", "--nodes", "1", "--restarts", "1", "--", "sh", "-c", &script])
        .env("OUT", dir.path())
        .env("KILN_CACHE", "off")
        .timeout(Duration::from_secs(120))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("attempt 1 resumes from"), "{stderr}");
    assert!(stderr.contains("which an earlier attempt of this run saved"), "{stderr}");
    let last = std::fs::read_to_string(dir.path().join("attempt1.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert_eq!(v["steps"], 1000, "{v}");
}

/// A run id that the children would refuse is refused where it is given, and
/// an attempt counter that would wrap to 0 (reusing attempt 0's keys) is
/// refused before anything starts.
#[test]
fn bad_run_ids_and_wrapping_attempts_are_refused_at_the_launcher() {
    let out = kiln().args(["launch", "--nodes", "1", "--run-id", "a/b c", "--", "true"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--run-id") && err.contains("not a run id"), "{err}");
    let out = kiln()
        .args(["launch", "--nodes", "1", "--attempt", "4294967295", "--restarts", "1", "--", "false"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("wrap to 0"), "{err}");
    assert!(!err.contains("processes, store at"), "nothing may start: {err}");
}

/// A launcher killed with SIGKILL cannot pass the signal on: its nodes once
/// kept running. A `kiln` node asks the kernel for SIGKILL when its
/// launcher dies (a parent-death signal).
#[test]
fn nodes_die_with_a_launcher_killed_by_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    // The node is `kiln` itself (exec keeps the launcher its parent).
    let script = r#"echo $$ > "$OUT/pid.tmp" && mv "$OUT/pid.tmp" "$OUT/pid"
        exec "$KILN" train mlp --epochs 50 2> "$OUT/err""#;
    let mut launcher = std::process::Command::new(assert_cmd::cargo::cargo_bin("kiln"))
        .args(["launch", "--nodes", "1", "--", "sh", "-c", script])
        .env("OUT", dir.path())
        .env("KILN", assert_cmd::cargo::cargo_bin("kiln"))
        .env("KILN_LOG", "kiln_runtime=debug")
        .env("KILN_CACHE", "off")
        .env_remove("PJRT_DEVICE")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let bound = || std::fs::read_to_string(dir.path().join("err")).is_ok_and(|e| e.contains("dies with its launcher"));
    while !bound() && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(bound(), "the node never bound itself to the launcher");
    let pid = std::fs::read_to_string(dir.path().join("pid")).unwrap();
    assert!(alive(pid.trim()), "the node ended before the launcher was killed");
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let t = Instant::now();
    while alive(pid.trim()) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(pid.trim()), "node (pid {}) outlived its launcher", pid.trim());
}

/// A node whose launcher is already gone stops at once instead of running
/// unwatched; one started through another process of the launch is fine.
#[test]
fn a_node_whose_launcher_is_gone_stops() {
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let out = kiln()
        .env("KILN_LAUNCHER_PID", dead.to_string())
        .args(["train", "mlp", "--max-steps", "1"])
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(kiln::runtime::distributed::EXIT_PEER_LOST), "{stderr}");
    assert!(
        stderr.contains(&format!("the kiln launch that started this node (process {dead}) has exited")),
        "{stderr}"
    );
    let out = kiln().env("KILN_LAUNCHER_PID", "banana").args(["train", "mlp", "--max-steps", "1"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("KILN_LAUNCHER_PID=\"banana\""));
}

/// Node 0 finished and node 1 hung: the launcher waited forever. A node
/// still running `--straggler-s` after another finished is stopped and
/// named, and the launch fails.
#[test]
fn a_node_that_outlives_a_finished_one_is_stopped_and_named() {
    let script = r#"if [ "$KILN_NODE_ID" = 1 ]; then trap '' TERM; sleep 60 & wait; fi"#;
    let started = Instant::now();
    let out = kiln()
        .args(["launch", "--nodes", "2", "--straggler-s", "1", "--grace-ms", "300", "--", "sh", "-c", script])
        .timeout(Duration::from_secs(40))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("node(s) 1 still running 1 s after node 0 finished"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
}
