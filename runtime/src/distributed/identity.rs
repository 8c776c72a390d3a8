//! Process identity: which node this process is, how many there are, where
//! the coordinator's store listens, and the timeouts that bound waiting.
//!
//! Read from the environment (`kiln launch` sets these for its children;
//! cluster launchers set them as documented in `docs/distributed.md`):
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `KILN_NUM_NODES` | processes in the run | 1 |
//! | `KILN_NODE_ID` | this process, `0..KILN_NUM_NODES` | 0 when one node; required otherwise |
//! | `KILN_COORDINATOR` | `host:port` of the store | required when several nodes |
//! | `KILN_COORDINATOR_SERVED` | `1`: a launcher runs the store; `0`: node 0 does | 0 |
//! | `KILN_RUN_ID` | names the job's keys (`[A-Za-z0-9._-]`, ≤ 64) | `run` |
//! | `KILN_ATTEMPT` | restart count; a new attempt never reads old keys | 0 |
//! | `KILN_LOCAL_DEVICES` | GPU ordinals this process drives (`0,1`) | the replica plan's |
//! | `KILN_STARTUP_TIMEOUT_MS` | how long nodes wait for each other at start | 120000 |
//! | `KILN_PEER_TIMEOUT_MS` | silence after which a node counts as dead | 10000 |
//! | `KILN_RUN_TOKEN` | the run's secret, ≥ 16 bytes ([`super::auth`]) | required unless the coordinator is loopback |
//! | `KILN_RUN_TOKEN_FILE` | a file holding the run's secret instead | |
//!
//! The parse is a function of the values ([`NodeEnv::identity`]; it reads
//! only the token file), so every refusal is unit-tested. Invariants:
//! `node_id < num_nodes`; several nodes always have a coordinator (the
//! plugin aborts the process without a store, so this is refused here,
//! before any plugin call), and a token unless that coordinator is on
//! loopback; an empty value counts as unset; a value that is not UTF-8 is an
//! error naming its variable, never read as something else.

use std::time::Duration;

use super::auth::{self, RunToken, ENV_RUN_TOKEN, ENV_RUN_TOKEN_FILE};
use super::store::RunScope;
use crate::error::{Result, RuntimeError};

pub const ENV_NUM_NODES: &str = "KILN_NUM_NODES";
pub const ENV_NODE_ID: &str = "KILN_NODE_ID";
pub const ENV_COORDINATOR: &str = "KILN_COORDINATOR";
pub const ENV_COORDINATOR_SERVED: &str = "KILN_COORDINATOR_SERVED";
/// The process id of the `kiln launch` that started this node
/// ([`crate::distributed::bind_to_launcher`]).
pub const ENV_LAUNCHER_PID: &str = "KILN_LAUNCHER_PID";
pub const ENV_RUN_ID: &str = "KILN_RUN_ID";
pub const ENV_ATTEMPT: &str = "KILN_ATTEMPT";
pub const ENV_LOCAL_DEVICES: &str = "KILN_LOCAL_DEVICES";
pub const ENV_STARTUP_TIMEOUT_MS: &str = "KILN_STARTUP_TIMEOUT_MS";
pub const ENV_PEER_TIMEOUT_MS: &str = "KILN_PEER_TIMEOUT_MS";

/// Every variable [`NodeEnv`] reads, for launchers that pass them on.
pub const ALL_VARS: &[&str] = &[
    ENV_NUM_NODES,
    ENV_NODE_ID,
    ENV_COORDINATOR,
    ENV_COORDINATOR_SERVED,
    ENV_RUN_ID,
    ENV_ATTEMPT,
    ENV_LOCAL_DEVICES,
    ENV_STARTUP_TIMEOUT_MS,
    ENV_PEER_TIMEOUT_MS,
    ENV_RUN_TOKEN,
    ENV_RUN_TOKEN_FILE,
];

/// The most nodes a run may have: far above any cluster kiln targets; it
/// only stops a typo from sizing tables by billions.
pub const MAX_NODES: u32 = 4096;

/// How long distributed waits may last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Nodes that have not all arrived by then end with `NodesMissing`.
    pub startup_ms: u64,
    /// A node silent this long counts as dead (`PeersLost`).
    pub peer_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { startup_ms: 120_000, peer_ms: 10_000 }
    }
}

impl Timeouts {
    /// How often a node beats: a quarter of the peer timeout (at least 50
    /// ms), so one late beat is never taken for a death.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis((self.peer_ms / 4).max(50))
    }

    /// The longest a surviving node runs on after a peer died: the peer
    /// timeout, one heartbeat interval to notice, and [`EXIT_GRACE`].
    pub fn failure_bound(&self) -> Duration {
        Duration::from_millis(self.peer_ms) + self.heartbeat_interval() + EXIT_GRACE
    }
}

/// After the watchdog decides to end the process, how long `exit` may take
/// (running the plugin's destructors) before the process aborts instead.
pub const EXIT_GRACE: Duration = Duration::from_secs(5);

/// Who this process is in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub node_id: u32,
    pub num_nodes: u32,
    /// `host:port` of the store; always set when `num_nodes > 1`.
    pub coordinator: Option<String>,
    /// Whether this process must start the store server (node 0, unless a
    /// launcher serves it).
    pub serves_store: bool,
    pub scope: RunScope,
    /// GPU ordinals this process drives (`visible_devices`), if given.
    pub local_devices: Option<Vec<usize>>,
    pub timeouts: Timeouts,
    /// The run's secret (`None`: a loopback coordinator without one).
    pub token: Option<RunToken>,
}

impl Identity {
    /// One process, no store: what every run was before several nodes.
    pub fn single() -> Identity {
        Identity {
            node_id: 0,
            num_nodes: 1,
            coordinator: None,
            serves_store: false,
            scope: RunScope { run_id: "run".into(), attempt: 0 },
            local_devices: None,
            timeouts: Timeouts::default(),
            token: None,
        }
    }

    pub fn is_distributed(&self) -> bool {
        self.num_nodes > 1
    }
}

/// The variables an [`Identity`] is made from, as set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeEnv {
    pub num_nodes: Option<String>,
    pub node_id: Option<String>,
    pub coordinator: Option<String>,
    pub coordinator_served: Option<String>,
    pub run_id: Option<String>,
    pub attempt: Option<String>,
    pub local_devices: Option<String>,
    pub startup_timeout_ms: Option<String>,
    pub peer_timeout_ms: Option<String>,
    pub run_token: Option<String>,
    pub run_token_file: Option<String>,
    /// The first variable whose value is not UTF-8 (refused by `identity`).
    pub not_unicode: Option<&'static str>,
}

fn set(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// What a run id may be: the store's keys are scoped by it.
pub const RUN_ID_SPELLING: &str = "1 to 64 characters of A-Z a-z 0-9 . _ -";

/// Whether `v` is a run id ([`RUN_ID_SPELLING`]): checked where the id is
/// given (`kiln launch --run-id`) and where a node reads it.
pub fn is_run_id(v: &str) -> bool {
    (1..=64).contains(&v.len()) && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

fn bad(var: &'static str, value: &str, expected: &'static str) -> RuntimeError {
    RuntimeError::BadNodeEnv { var, value: value.to_string(), expected }
}

fn parse_u64(var: &'static str, value: &str, expected: &'static str) -> Result<u64> {
    value.parse::<u64>().map_err(|_| bad(var, value, expected))
}

impl NodeEnv {
    /// Reads the variables of this process.
    pub fn from_env() -> NodeEnv {
        let mut not_unicode = None;
        let mut read = |name: &'static str| {
            crate::env::string_var(name).unwrap_or_else(|_| {
                not_unicode.get_or_insert(name);
                None
            })
        };
        let mut env = NodeEnv {
            num_nodes: read(ENV_NUM_NODES),
            node_id: read(ENV_NODE_ID),
            coordinator: read(ENV_COORDINATOR),
            coordinator_served: read(ENV_COORDINATOR_SERVED),
            run_id: read(ENV_RUN_ID),
            attempt: read(ENV_ATTEMPT),
            local_devices: read(ENV_LOCAL_DEVICES),
            startup_timeout_ms: read(ENV_STARTUP_TIMEOUT_MS),
            peer_timeout_ms: read(ENV_PEER_TIMEOUT_MS),
            run_token: read(ENV_RUN_TOKEN),
            run_token_file: read(ENV_RUN_TOKEN_FILE),
            not_unicode: None,
        };
        env.not_unicode = not_unicode;
        env
    }

    /// Checks the values and returns the identity they describe.
    pub fn identity(&self) -> Result<Identity> {
        if let Some(var) = self.not_unicode {
            return Err(RuntimeError::NonUnicodeEnv { var });
        }
        let num_nodes = match set(&self.num_nodes) {
            None => 1,
            Some(v) => match v.parse::<u32>() {
                Ok(n) if (1..=MAX_NODES).contains(&n) => n,
                _ => return Err(bad(ENV_NUM_NODES, v, "a whole number of processes from 1 to 4096")),
            },
        };
        let node_id = match set(&self.node_id) {
            None if num_nodes == 1 => 0,
            None => {
                return Err(bad(
                    ENV_NODE_ID,
                    "",
                    "this process's index, 0 to KILN_NUM_NODES-1 (required when KILN_NUM_NODES > 1)",
                ))
            }
            Some(v) => v.parse::<u32>().map_err(|_| bad(ENV_NODE_ID, v, "a whole number, 0 to KILN_NUM_NODES-1"))?,
        };
        if node_id >= num_nodes {
            return Err(RuntimeError::NodeIdOutOfRange { node_id, num_nodes });
        }
        let coordinator = match set(&self.coordinator) {
            None if num_nodes > 1 => return Err(RuntimeError::MissingCoordinator { num_nodes }),
            None => None,
            Some(v) => Some(parse_coordinator(v)?),
        };
        let token = RunToken::from_values(set(&self.run_token), set(&self.run_token_file))?;
        if let (Some(c), true) = (&coordinator, num_nodes > 1) {
            auth::require_token(c, token.as_ref())?;
        }
        let served = match set(&self.coordinator_served) {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => return Err(bad(ENV_COORDINATOR_SERVED, v, "1 (a launcher runs the store) or 0 (node 0 does)")),
        };
        let run_id = match set(&self.run_id) {
            None => "run".to_string(),
            Some(v) if is_run_id(v) => v.to_string(),
            Some(v) => return Err(bad(ENV_RUN_ID, v, RUN_ID_SPELLING)),
        };
        let attempt = match set(&self.attempt) {
            None => 0,
            Some(v) => v.parse::<u32>().map_err(|_| bad(ENV_ATTEMPT, v, "the restart count, a whole number from 0"))?,
        };
        let local_devices = match set(&self.local_devices) {
            None => None,
            Some(v) => {
                let list = v
                    .split(',')
                    .map(|p| p.trim().parse::<usize>())
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|_| bad(ENV_LOCAL_DEVICES, v, "GPU ordinals separated by commas (0,1)"))?;
                let mut sorted = list.clone();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() != list.len() {
                    return Err(bad(ENV_LOCAL_DEVICES, v, "distinct GPU ordinals"));
                }
                Some(list)
            }
        };
        let mut timeouts = Timeouts::default();
        if let Some(v) = set(&self.startup_timeout_ms) {
            timeouts.startup_ms = parse_u64(ENV_STARTUP_TIMEOUT_MS, v, "milliseconds, at least 1")?;
        }
        if let Some(v) = set(&self.peer_timeout_ms) {
            timeouts.peer_ms = parse_u64(ENV_PEER_TIMEOUT_MS, v, "milliseconds, at least 1")?;
        }
        if timeouts.startup_ms == 0 {
            return Err(bad(ENV_STARTUP_TIMEOUT_MS, "0", "milliseconds, at least 1"));
        }
        if timeouts.peer_ms == 0 {
            return Err(bad(ENV_PEER_TIMEOUT_MS, "0", "milliseconds, at least 1"));
        }
        Ok(Identity {
            node_id,
            num_nodes,
            serves_store: num_nodes > 1 && node_id == 0 && !served,
            coordinator,
            scope: RunScope { run_id, attempt },
            local_devices,
            timeouts,
            token,
        })
    }
}

/// Checks `host:port` (a name or address, `[v6]:port` included).
fn parse_coordinator(value: &str) -> Result<String> {
    let expected = "host:port, e.g. 10.0.0.1:7070 or node0:7070";
    let (host, port) = value.rsplit_once(':').ok_or_else(|| bad(ENV_COORDINATOR, value, expected))?;
    let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0);
    let host_ok = !host.is_empty() && !host.contains(char::is_whitespace);
    if !port_ok || !host_ok {
        return Err(bad(ENV_COORDINATOR, value, expected));
    }
    Ok(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> NodeEnv {
        let mut e = NodeEnv::default();
        for (k, v) in pairs {
            let slot = match *k {
                ENV_NUM_NODES => &mut e.num_nodes,
                ENV_NODE_ID => &mut e.node_id,
                ENV_COORDINATOR => &mut e.coordinator,
                ENV_COORDINATOR_SERVED => &mut e.coordinator_served,
                ENV_RUN_ID => &mut e.run_id,
                ENV_ATTEMPT => &mut e.attempt,
                ENV_LOCAL_DEVICES => &mut e.local_devices,
                ENV_STARTUP_TIMEOUT_MS => &mut e.startup_timeout_ms,
                ENV_PEER_TIMEOUT_MS => &mut e.peer_timeout_ms,
                ENV_RUN_TOKEN => &mut e.run_token,
                ENV_RUN_TOKEN_FILE => &mut e.run_token_file,
                other => panic!("unknown test variable {other}"),
            };
            *slot = Some(v.to_string());
        }
        e
    }

    #[test]
    fn unset_is_one_process_without_a_store() {
        let id = NodeEnv::default().identity().unwrap();
        assert_eq!(id, Identity::single());
        assert!(!id.is_distributed());
    }

    #[test]
    fn several_nodes_with_a_coordinator() {
        let id = env(&[
            (ENV_NUM_NODES, "3"),
            (ENV_NODE_ID, "0"),
            (ENV_COORDINATOR, "127.0.0.1:7070"),
            (ENV_RUN_ID, "job-17"),
            (ENV_ATTEMPT, "2"),
            (ENV_LOCAL_DEVICES, "1, 0"),
            (ENV_PEER_TIMEOUT_MS, "400"),
        ])
        .identity()
        .unwrap();
        assert_eq!((id.node_id, id.num_nodes), (0, 3));
        assert!(id.serves_store);
        assert_eq!(id.scope.prefix(), "kiln/job-17/2/");
        assert_eq!(id.local_devices, Some(vec![1, 0]));
        assert_eq!(id.timeouts.peer_ms, 400);
        assert_eq!(id.timeouts.heartbeat_interval(), Duration::from_millis(100));
        let served = env(&[
            (ENV_NUM_NODES, "2"),
            (ENV_NODE_ID, "0"),
            (ENV_COORDINATOR, "[::1]:9"),
            (ENV_COORDINATOR_SERVED, "1"),
        ])
        .identity()
        .unwrap();
        assert!(!served.serves_store);
    }

    #[test]
    fn several_nodes_without_a_store_are_refused_before_the_plugin() {
        let err = env(&[(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "1")]).identity().unwrap_err();
        assert!(matches!(err, RuntimeError::MissingCoordinator { num_nodes: 2 }), "{err}");
        assert!(err.to_string().contains("KILN_COORDINATOR"), "{err}");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[(ENV_NUM_NODES, "two")], ENV_NUM_NODES),
            (&[(ENV_NUM_NODES, "0")], ENV_NUM_NODES),
            (&[(ENV_NUM_NODES, "99999")], ENV_NUM_NODES),
            (&[(ENV_NUM_NODES, "2"), (ENV_COORDINATOR, "h:1")], ENV_NODE_ID),
            (&[(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "-1"), (ENV_COORDINATOR, "h:1")], ENV_NODE_ID),
            (&[(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "0"), (ENV_COORDINATOR, "host")], ENV_COORDINATOR),
            (&[(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "0"), (ENV_COORDINATOR, "host:0")], ENV_COORDINATOR),
            (&[(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "0"), (ENV_COORDINATOR, ":80")], ENV_COORDINATOR),
            (&[(ENV_RUN_ID, "a/b")], ENV_RUN_ID),
            (&[(ENV_ATTEMPT, "x")], ENV_ATTEMPT),
            (&[(ENV_LOCAL_DEVICES, "0,0")], ENV_LOCAL_DEVICES),
            (&[(ENV_LOCAL_DEVICES, "gpu0")], ENV_LOCAL_DEVICES),
            (&[(ENV_PEER_TIMEOUT_MS, "0")], ENV_PEER_TIMEOUT_MS),
            (&[(ENV_COORDINATOR_SERVED, "yes")], ENV_COORDINATOR_SERVED),
        ];
        for (pairs, var) in cases {
            let err = env(pairs).identity().unwrap_err();
            assert!(matches!(&err, RuntimeError::BadNodeEnv { var: v, .. } if v == var), "{pairs:?}: {err}");
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn a_remote_coordinator_needs_a_token() {
        let remote = [(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "1"), (ENV_COORDINATOR, "10.0.0.1:7070")];
        let err = env(&remote).identity().unwrap_err();
        assert!(
            matches!(&err, RuntimeError::MissingRunToken { coordinator } if coordinator == "10.0.0.1:7070"),
            "{err}"
        );
        let mut with = remote.to_vec();
        with.push((ENV_RUN_TOKEN, "0123456789abcdef0123"));
        assert_eq!(env(&with).identity().unwrap().token.unwrap().expose(), "0123456789abcdef0123");
        with.push((ENV_RUN_TOKEN_FILE, "/nonexistent"));
        assert!(matches!(env(&with).identity().unwrap_err(), RuntimeError::BadRunToken { .. }));
        let short = [(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "1"), (ENV_COORDINATOR, "h:1"), (ENV_RUN_TOKEN, "x")];
        assert!(matches!(env(&short).identity().unwrap_err(), RuntimeError::BadRunToken { var: ENV_RUN_TOKEN, .. }));
        let local = [(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "1"), (ENV_COORDINATOR, "127.0.0.1:7070")];
        assert_eq!(env(&local).identity().unwrap().token, None);
        let mut e = env(&local);
        e.not_unicode = Some(ENV_RUN_TOKEN);
        assert!(matches!(e.identity().unwrap_err(), RuntimeError::NonUnicodeEnv { var: ENV_RUN_TOKEN }));
    }

    #[test]
    fn node_id_must_be_below_the_node_count() {
        let err = env(&[(ENV_NUM_NODES, "2"), (ENV_NODE_ID, "3"), (ENV_COORDINATOR, "h:1")]).identity().unwrap_err();
        assert!(matches!(err, RuntimeError::NodeIdOutOfRange { node_id: 3, num_nodes: 2 }), "{err}");
        assert!(err.to_string().contains("0 to 1"), "{err}");
    }
}
