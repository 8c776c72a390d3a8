//! The coordinator's store under attack, on loopback and without a plugin:
//! each attack of the security review (a huge `num_nodes`, half-open
//! connections past the cap, oversized values, a heartbeat for another
//! node, unauthenticated and replayed messages, no token on a non-loopback
//! bind) gets its typed refusal and leaves the server serving honest
//! clients; a run of honest nodes completes unchanged while an intruder
//! sends every malformed and unauthenticated message it can; and the wire
//! format is fuzzed (random and mutated bytes) into the decoder and into a
//! live server.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_runtime::distributed::auth::{MacKey, RunToken};
use kiln_runtime::distributed::identity::Timeouts;
use kiln_runtime::distributed::wire::{self, Op, Status, HELLO_BYTES, MAX_VALUE_BYTES};
use kiln_runtime::distributed::{
    Identity, KeyValueStore, Limits, RunScope, ServerConfig, Session, StoreServer, TcpStore, WatchdogAction,
};
use kiln_runtime::RuntimeError;
use proptest::prelude::*;

fn token() -> RunToken {
    RunToken::new("hostile-test-token-0123456789abcdef", "KILN_RUN_TOKEN").unwrap()
}

fn mac() -> MacKey {
    MacKey::new(Some(&token())).unwrap()
}

fn server_with(nodes: u32, limits: impl FnOnce(&mut Limits)) -> StoreServer {
    let mut config = ServerConfig::new(Some(token()), nodes);
    limits(&mut config.limits);
    StoreServer::bind("127.0.0.1:0", config).unwrap()
}

fn server(nodes: u32) -> StoreServer {
    server_with(nodes, |_| {})
}

fn honest(s: &StoreServer) -> TcpStore {
    TcpStore::new(&s.local_addr().to_string(), Some(&token()), Duration::from_secs(3)).unwrap()
}

/// The honest path still works: a put, a blocking get, a try-get.
fn still_serves(s: &StoreServer, key: &str) {
    let c = honest(s);
    c.put(key, b"honest").unwrap();
    assert_eq!(c.get(key, Duration::from_secs(1)).unwrap(), b"honest");
    assert_eq!(c.try_get(key).unwrap(), b"honest");
}

/// A raw connection: its challenge, or `None` if the server said BUSY.
fn connect(s: &StoreServer) -> (TcpStream, Option<[u8; 16]>) {
    let mut t = TcpStream::connect(s.local_addr()).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [0u8; HELLO_BYTES];
    t.read_exact(&mut hello).unwrap();
    let challenge = (hello[0] == 0xA5).then(|| hello[1..].try_into().unwrap());
    (t, challenge)
}

/// The status and text of the response on `t`, or `None` if the server
/// closed the connection without one.
fn response(t: &mut TcpStream) -> Option<(Status, String)> {
    let mut head = [0u8; 5];
    t.read_exact(&mut head).ok()?;
    let len = u32::from_le_bytes(head[1..5].try_into().unwrap()) as usize;
    let mut body = vec![0u8; len + 32];
    t.read_exact(&mut body).ok()?;
    Some((Status::from_u8(head[0]).unwrap(), String::from_utf8_lossy(&body[..len]).into_owned()))
}

/// Sends one request tagged with `key` on a fresh connection; its answer.
fn send(s: &StoreServer, key: &MacKey, client: [u8; 16], op: Op, k: &str, payload: &[u8]) -> (Status, String) {
    let (mut t, challenge) = connect(s);
    let (bytes, _) = wire::encode_request(key, &challenge.unwrap(), &client, &[9; 16], op, k, payload);
    t.write_all(&bytes).unwrap();
    response(&mut t).unwrap()
}

fn identity(node: u32, nodes: u32, s: &StoreServer, run: &str, peer_ms: u64) -> Identity {
    Identity {
        node_id: node,
        num_nodes: nodes,
        coordinator: Some(s.local_addr().to_string()),
        serves_store: false,
        scope: RunScope { run_id: run.into(), attempt: 0 },
        local_devices: None,
        timeouts: Timeouts { startup_ms: 10_000, peer_ms },
        token: Some(token()),
    }
}

#[test]
fn a_beat_with_a_huge_num_nodes_is_refused_at_once() {
    let s = server(2);
    let t = Instant::now();
    let beat = wire::beat_payload(0, u32::MAX, 1_000);
    let (status, text) = send(&s, &mac(), [1; 16], Op::Beat, "kiln/r/0/", &beat);
    assert_eq!(status, Status::BadRequest, "{text}");
    assert!(text.contains("4294967295") && text.contains("this run has 2"), "{text}");
    let (status, text) = send(&s, &mac(), [1; 16], Op::Beat, "kiln/r/0/", &wire::beat_payload(7, 2, 1_000));
    assert_eq!(status, Status::BadRequest, "{text}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(s.stale_nodes("kiln/r/0/", Duration::ZERO).is_empty(), "a refused beat was recorded");
    // The honest heartbeat of the same run is served.
    assert_eq!(honest(&s).beat("kiln/r/0/", 0, 2, Duration::from_secs(1)).unwrap(), Vec::<u32>::new());
    still_serves(&s, "after-huge-beat");
}

#[test]
fn half_open_connections_past_the_cap_are_closed_and_honest_clients_served() {
    let cap = 16;
    let s = server_with(2, |l| {
        l.max_connections = cap;
        l.request_timeout = Duration::from_millis(500);
    });
    // Four times the cap of connections that never send a byte.
    let held: Vec<TcpStream> = (0..4 * cap).map(|_| TcpStream::connect(s.local_addr()).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    assert!(s.open_connections() <= 2 * cap, "{} connections open", s.open_connections());
    // The oldest were closed for newer ones, each told BUSY.
    assert!(s.refusals(Status::Busy) >= (3 * cap) as u64, "{} busy", s.refusals(Status::Busy));
    let mut first = held.into_iter().next().unwrap();
    first.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut seen = Vec::new();
    first.read_to_end(&mut seen).unwrap();
    assert_eq!(seen.get(HELLO_BYTES), Some(&(Status::Busy as u8)), "{seen:?}");
    // Honest clients get in at once, half-open connections or not.
    let t = Instant::now();
    let _more: Vec<TcpStream> = (0..4 * cap).map(|_| TcpStream::connect(s.local_addr()).unwrap()).collect();
    still_serves(&s, "past-the-cap");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // A connection that stalls mid-request is closed at the request timeout.
    let (mut stall, _) = connect(&s);
    stall.write_all(&[1, 1, 0, 0]).unwrap();
    let t = Instant::now();
    let mut rest = Vec::new();
    let _ = stall.read_to_end(&mut rest);
    assert!(t.elapsed() < Duration::from_secs(2), "a stalled connection stayed open {:?}", t.elapsed());
}

#[test]
fn oversized_values_and_a_full_store_are_refused_without_growing_it() {
    let s = server_with(2, |l| l.max_store_bytes = 1 << 20);
    // A head announcing 16 MiB: refused before a byte of it is read.
    let (mut t, challenge) = connect(&s);
    let (bytes, _) = wire::encode_request(&mac(), &challenge.unwrap(), &[1; 16], &[2; 16], Op::Put, "big", &[]);
    let mut head = bytes[..wire::HEAD_BYTES].to_vec();
    head[38..42].copy_from_slice(&(16u32 << 20).to_le_bytes());
    t.write_all(&head).unwrap();
    let (status, text) = response(&mut t).unwrap();
    assert_eq!(status, Status::TooLarge, "{text}");
    // The client refuses one before sending it.
    let c = honest(&s);
    let err = c.put("big", &vec![0u8; MAX_VALUE_BYTES + 1]).unwrap_err();
    assert!(matches!(err, RuntimeError::KvRefused { refusal: Status::TooLarge, .. }), "{err}");
    // Values that fit one by one but not together: the store stops at its limit.
    let chunk = vec![7u8; 300 << 10];
    let mut refused = None;
    for i in 0..8 {
        if let Err(e) = c.put(&format!("fill/{i}"), &chunk) {
            refused = Some(e);
            break;
        }
    }
    let err = refused.expect("the store took more than its limit");
    assert!(matches!(err, RuntimeError::KvRefused { refusal: Status::Full, .. }), "{err}");
    assert!(s.bytes() <= 1 << 20, "{} bytes stored", s.bytes());
    // What is stored is still served.
    assert_eq!(c.get("fill/0", Duration::from_secs(1)).unwrap(), chunk);
}

#[test]
fn a_heartbeat_for_another_clients_node_cannot_keep_it_alive() {
    let s = server(2);
    let peer_ms = 400;
    let n1 = identity(1, 2, &s, "claim", peer_ms);
    let b = std::thread::spawn(move || Session::start(n1));
    let a = Arc::new(Session::start(identity(0, 2, &s, "claim", peer_ms)).unwrap());
    let b = Arc::new(b.join().unwrap().unwrap());
    let seen: Arc<Mutex<Option<RuntimeError>>> = Arc::default();
    let sink = seen.clone();
    a.spawn_watchdog(WatchdogAction::Report(Arc::new(move |e| *sink.lock().unwrap() = Some(e))));
    b.spawn_watchdog(WatchdogAction::Report(Arc::new(|e| panic!("node 1 saw {e}"))));
    // An impostor with the token (a second process given KILN_NODE_ID=1),
    // and one without, beat for node 1 as fast as they can.
    let prefix = RunScope { run_id: "claim".into(), attempt: 0 }.prefix();
    let impostor = honest(&s);
    let err = impostor.beat(&prefix, 1, 2, Duration::from_millis(peer_ms)).unwrap_err();
    assert!(matches!(err, RuntimeError::KvRefused { refusal: Status::NodeClaimed, .. }), "{err}");
    let outsider = TcpStore::new(
        &s.local_addr().to_string(),
        Some(&RunToken::new("not-the-run-token-xx", "T").unwrap()),
        Duration::from_secs(2),
    )
    .unwrap();
    let err = outsider.beat(&prefix, 1, 2, Duration::from_millis(peer_ms)).unwrap_err();
    assert!(matches!(err, RuntimeError::KvRefused { refusal: Status::Unauthenticated, .. }), "{err}");
    let stop = Arc::new(AtomicBool::new(false));
    let beating = {
        let (stop, prefix) = (stop.clone(), prefix.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = impostor.beat(&prefix, 1, 2, Duration::from_millis(peer_ms));
                let _ = outsider.beat(&prefix, 1, 2, Duration::from_millis(peer_ms));
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    // Node 1 dies; node 0 still notices within the bound.
    let died = Instant::now();
    drop(b);
    let bound = Timeouts { startup_ms: 10_000, peer_ms }.failure_bound();
    while seen.lock().unwrap().is_none() && died.elapsed() < bound {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    beating.join().unwrap();
    let err = seen.lock().unwrap().take().expect("the impostors kept node 1 alive");
    assert!(matches!(&err, RuntimeError::PeersLost { nodes, me: 0, .. } if nodes == &vec![1]), "{err}");
}

#[test]
fn an_unauthenticated_message_changes_nothing() {
    let s = server(2);
    let before = s.len();
    for wrong in [None, Some(RunToken::new("another-runs-token-000", "T").unwrap())] {
        let c = TcpStore::new(&s.local_addr().to_string(), wrong.as_ref(), Duration::from_secs(2)).unwrap();
        let err = c.put("planted", b"x").unwrap_err();
        assert!(matches!(err, RuntimeError::KvRefused { refusal: Status::Unauthenticated, .. }), "{err}");
        assert!(err.to_string().contains("not authenticated"), "{err}");
        let err = c.try_get("planted").unwrap_err();
        assert!(matches!(err, RuntimeError::KvRefused { refusal: Status::Unauthenticated, .. }), "{err}");
    }
    // A valid frame with its tag zeroed.
    let (mut t, challenge) = connect(&s);
    let (mut bytes, _) =
        wire::encode_request(&mac(), &challenge.unwrap(), &[1; 16], &[2; 16], Op::Put, "planted", b"x");
    let n = bytes.len();
    bytes[n - 32..].fill(0);
    t.write_all(&bytes).unwrap();
    assert_eq!(response(&mut t).unwrap().0, Status::Unauthenticated);
    // Garbage: refused as malformed.
    let (mut t, _) = connect(&s);
    t.write_all(&[0xff; 64]).unwrap();
    assert_eq!(response(&mut t).unwrap().0, Status::BadRequest);
    assert_eq!(s.len(), before, "an unauthenticated message changed the store");
    assert!(honest(&s).try_get("planted").is_err());
    still_serves(&s, "after-unauthenticated");
}

#[test]
fn a_replayed_message_is_refused() {
    let s = server(2);
    let (mut t, challenge) = connect(&s);
    let (bytes, _) = wire::encode_request(&mac(), &challenge.unwrap(), &[1; 16], &[2; 16], Op::Put, "once", b"v1");
    t.write_all(&bytes).unwrap();
    assert_eq!(response(&mut t).unwrap().0, Status::Ok);
    // The same bytes, captured and sent again on a new connection.
    let (mut t, _) = connect(&s);
    t.write_all(&bytes).unwrap();
    let (status, text) = response(&mut t).unwrap();
    assert_eq!(status, Status::Unauthenticated, "{text}");
    assert_eq!(s.refusals(Status::Unauthenticated), 1);
    still_serves(&s, "after-replay");
}

#[test]
fn no_token_on_a_non_loopback_address_is_refused() {
    let err = StoreServer::bind("0.0.0.0:0", ServerConfig::new(None, 2)).err().unwrap();
    assert!(matches!(&err, RuntimeError::MissingRunToken { coordinator } if coordinator == "0.0.0.0:0"), "{err}");
    assert!(err.to_string().contains("KILN_RUN_TOKEN_FILE"), "{err}");
    let err = TcpStore::new("10.1.2.3:7070", None, Duration::from_secs(1)).err().unwrap();
    assert!(matches!(err, RuntimeError::MissingRunToken { .. }), "{err}");
    let mut id = identity(0, 2, &server(2), "remote", 1_000);
    id.coordinator = Some("10.1.2.3:7070".into());
    id.token = None;
    assert!(matches!(Session::start(id).unwrap_err(), RuntimeError::MissingRunToken { .. }));
    // With a token it binds every interface.
    StoreServer::bind("0.0.0.0:0", ServerConfig::new(Some(token()), 2)).unwrap();
}

/// Every malformed or unauthenticated message the intruder sends, in turn.
fn intrude(s: &StoreServer, round: usize) {
    let bad = MacKey::new(None).unwrap();
    let stranger = MacKey::new(Some(&RunToken::new("an-intruders-own-token", "T").unwrap())).unwrap();
    let prefix = RunScope { run_id: "honest".into(), attempt: 0 }.prefix();
    let send_raw = |bytes: &[u8]| {
        if let Ok(mut t) = TcpStream::connect(s.local_addr()) {
            let _ = t.set_read_timeout(Some(Duration::from_secs(2)));
            let mut hello = [0u8; HELLO_BYTES];
            let _ = t.read_exact(&mut hello);
            let _ = t.write_all(bytes);
            let _ = t.shutdown(std::net::Shutdown::Write);
            let _ = response(&mut t);
        }
    };
    let forged = |key: &MacKey, op: Op, k: &str, payload: &[u8]| -> Vec<u8> {
        wire::encode_request(key, &[round as u8; 16], &[3; 16], &[4; 16], op, k, payload).0
    };
    match round % 8 {
        0 => send_raw(&[0xff; 50]),
        1 => send_raw(&forged(&bad, Op::Beat, &prefix, &wire::beat_payload(1, u32::MAX, 1))),
        2 => send_raw(&forged(&stranger, Op::Put, &format!("{prefix}rendezvous/0"), b"poison")),
        3 => send_raw(&forged(&mac(), Op::Beat, &prefix, &wire::beat_payload(2, 3, 1))),
        4 => send_raw(&forged(&bad, Op::Get, &format!("{prefix}rendezvous/1"), &u64::MAX.to_le_bytes())),
        5 => {
            let mut head = forged(&stranger, Op::Put, "x", b"")[..wire::HEAD_BYTES].to_vec();
            head[38..42].copy_from_slice(&u32::MAX.to_le_bytes());
            send_raw(&head)
        }
        6 => {
            // Half-open connections, held a moment.
            let held: Vec<_> = (0..20).filter_map(|_| TcpStream::connect(s.local_addr()).ok()).collect();
            std::thread::sleep(Duration::from_millis(20));
            drop(held);
        }
        _ => send_raw(&forged(&mac(), Op::Put, "k", b"v")[..30]),
    }
}

#[test]
fn an_honest_run_completes_unchanged_while_an_intruder_sends_everything() {
    let s = server(3);
    let stop = AtomicBool::new(false);
    let rounds = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for i in 0..2 {
            let (s, stop, rounds) = (&s, &stop, &rounds);
            scope.spawn(move || {
                let mut round = i;
                while !stop.load(Ordering::Relaxed) {
                    intrude(s, round);
                    round += 1;
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let peer_ms = 500;
        let nodes: Vec<_> = (0..3u32)
            .map(|n| {
                let id = identity(n, 3, &s, "honest", peer_ms);
                scope.spawn(move || {
                    let session = Arc::new(Session::start(id)?);
                    let lost: Arc<Mutex<Option<RuntimeError>>> = Arc::default();
                    let sink = lost.clone();
                    session.spawn_watchdog(WatchdogAction::Report(Arc::new(move |e| *sink.lock().unwrap() = Some(e))));
                    // Rendezvous: every node puts its value and reads the others'.
                    session.put(&format!("rendezvous/{n}"), format!("node {n}").as_bytes())?;
                    let mut seen = Vec::new();
                    for other in 0..3 {
                        seen.push(String::from_utf8(session.wait_for(&format!("rendezvous/{other}"))?).unwrap());
                    }
                    // Work while beating for several peer timeouts.
                    std::thread::sleep(Duration::from_millis(3 * peer_ms));
                    session.put(&format!("second/{n}"), b"")?;
                    for other in 0..3 {
                        session.wait_for(&format!("second/{other}"))?;
                    }
                    session.finish();
                    let lost = lost.lock().unwrap().take();
                    Ok::<_, RuntimeError>((seen, lost))
                })
            })
            .collect();
        for h in nodes {
            let (seen, lost) = h.join().unwrap().expect("an honest node failed");
            assert_eq!(seen, ["node 0", "node 1", "node 2"]);
            assert!(lost.is_none(), "a live node was reported: {lost:?}");
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(rounds.load(Ordering::Relaxed) >= 16, "the intruder barely ran");
    for status in [Status::BadRequest, Status::Unauthenticated, Status::TooLarge] {
        assert!(s.refusals(status) > 0, "no {status} refusal");
    }
    let c = honest(&s);
    let prefix = RunScope { run_id: "honest".into(), attempt: 0 }.prefix();
    assert_eq!(c.try_get(&format!("{prefix}rendezvous/0")).unwrap(), b"node 0");
}

/// A request the decoder accepts: `payload` cut or padded to what `op` takes.
fn valid_request(op: u8, key: &str, payload: &[u8]) -> (Vec<u8>, [u8; 16]) {
    let op = [Op::Put, Op::Get, Op::TryGet, Op::Beat][op as usize % 4];
    let mut payload = payload.to_vec();
    match op {
        Op::Put => {}
        Op::Get => payload.resize(8, 0),
        Op::TryGet => payload.clear(),
        Op::Beat => payload.resize(16, 0),
    }
    let challenge = [5u8; 16];
    (wire::encode_request(&mac(), &challenge, &[1; 16], &[2; 16], op, key, &payload).0, challenge)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random bytes into the decoder: a typed error, never a panic.
    #[test]
    fn fuzz_random_bytes_into_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = wire::decode_request(&bytes, &mac(), &[5u8; 16]);
    }

    /// A valid request with bytes changed, cut or added: only the unchanged
    /// request (with anything after it) decodes.
    #[test]
    fn fuzz_mutated_requests_into_the_decoder(
        op in 0u8..4,
        key in "[a-z/]{0,20}",
        payload in proptest::collection::vec(any::<u8>(), 0..40),
        flips in proptest::collection::vec((any::<usize>(), 1u8..=255), 0..4),
        cut in any::<usize>(),
        tail in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let (original, challenge) = valid_request(op, &key, &payload);
        let mut bytes = original.clone();
        for (at, x) in &flips {
            let i = at % bytes.len();
            bytes[i] ^= x;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        bytes.extend_from_slice(&tail);
        match wire::decode_request(&bytes, &mac(), &challenge) {
            Ok(req) => {
                prop_assert!(bytes.starts_with(&original), "a changed request decoded: {req:?}");
            }
            Err(_) => prop_assert!(!bytes.starts_with(&original)),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random and mutated bytes into a live server: every connection ends
    /// with a refusal or a valid answer within the request timeout, and the
    /// server keeps serving.
    #[test]
    fn fuzz_bytes_into_a_live_server(
        random in proptest::collection::vec(any::<u8>(), 0..200),
        flip in any::<usize>(),
    ) {
        let s = LIVE.get_or_init(|| server_with(2, |l| l.request_timeout = Duration::from_millis(300)));
        let t = Instant::now();
        let (mut c, challenge) = connect(s);
        let op = [Op::Put, Op::Get, Op::TryGet, Op::Beat][flip % 4];
        let (mut valid, _) = wire::encode_request(&mac(), &challenge.unwrap(), &[1; 16], &[2; 16], op, "fuzz", b"v");
        let i = flip % valid.len();
        valid[i] ^= 0x5a;
        let bytes = if flip % 2 == 0 { random } else { valid };
        let _ = c.write_all(&bytes);
        let _ = c.shutdown(std::net::Shutdown::Write);
        if let Some((status, text)) = response(&mut c) {
            prop_assert!(status.is_refusal(), "{status}: {text}");
        }
        prop_assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let still = honest(s).try_get("absent");
        prop_assert!(matches!(still, Err(RuntimeError::KvNotFound { .. })), "{:?}", still);
    }
}

static LIVE: std::sync::OnceLock<StoreServer> = std::sync::OnceLock::new();
