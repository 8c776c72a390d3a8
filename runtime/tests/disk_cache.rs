//! The persistent compile cache against the real CPU plugin: round trips,
//! corrupt and truncated entries, read-only mode, eviction, concurrent writers.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use kiln_runtime::{CompileKey, CompileOptions, DiskCache, DiskCacheConfig, EntryInfo, ExecArg, Lookup};

fn program(scale: f32) -> String {
    format!(
        r#"
func.func public @main(%x: tensor<8xf32>) -> tensor<8xf32> {{
  %c = stablehlo.constant dense<{scale:?}> : tensor<8xf32>
  %0 = stablehlo.multiply %x, %c : tensor<8xf32>
  %1 = stablehlo.tanh %0 : tensor<8xf32>
  return %1 : tensor<8xf32>
}}
"#
    )
}

fn cache(dir: &std::path::Path, max_bytes: u64, read_only: bool) -> DiskCache {
    DiskCache::open(DiskCacheConfig { dir: dir.to_path_buf(), max_bytes, read_only }).unwrap()
}

const INFO: EntryInfo = EntryInfo { compile_time: Duration::from_millis(42) };

fn run(exe: &kiln_runtime::Executable, client: &kiln_runtime::Client, x: &[f32]) -> Vec<f32> {
    let buf = client.buffer_from_host(x, &[8], &client.devices()[0]).unwrap();
    exe.execute(&[ExecArg::Borrowed(&buf)]).unwrap()[0].to_vec::<f32>().unwrap()
}

#[test]
fn a_stored_program_loads_and_computes_the_same() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let client = cpu_client(1);
    let c = cache(dir.path(), 1 << 30, false);
    let key = CompileKey::new(b"prog-a", &client, &CompileOptions::default())?;
    assert!(matches!(c.load(&key, &client)?, Lookup::Miss));
    let exe = client.compile(&program(1.5), &CompileOptions::default())?;
    c.store(&key, &exe, INFO)?;
    let x = XorShift::new(5).vec_f32(8);
    let Lookup::Hit { exe: loaded, info } = c.load(&key, &client)? else { panic!("expected a hit") };
    assert_eq!(info, INFO);
    assert_eq!(run(&loaded, &client, &x), run(&exe, &client, &x));
    let stats = c.stats()?;
    assert_eq!(stats.entries, 1);
    assert!(stats.bytes > 0);
    assert_eq!(c.clear()?, 1);
    assert_eq!(c.stats()?.entries, 0);
    Ok(())
}

#[test]
fn keys_depend_on_program_and_options() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let one = CompileOptions::default();
    let four = CompileOptions { num_replicas: 4, ..CompileOptions::default() };
    let a = CompileKey::new(b"prog-a", &client, &one)?;
    assert_eq!(a, CompileKey::new(b"prog-a", &client, &one)?);
    assert_ne!(a, CompileKey::new(b"prog-b", &client, &one)?);
    assert_ne!(a, CompileKey::new(b"prog-a", &client, &four)?);
    Ok(())
}

#[test]
fn corrupt_and_truncated_entries_are_never_served_and_are_replaced() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let client = cpu_client(1);
    let c = cache(dir.path(), 1 << 30, false);
    let key = CompileKey::new(b"prog-c", &client, &CompileOptions::default())?;
    let exe = client.compile(&program(0.5), &CompileOptions::default())?;
    c.store(&key, &exe, INFO)?;
    let path = c.entry_path(&key);
    let good = std::fs::read(&path)?;

    let mut flipped = good.clone();
    let at = flipped.len() / 2;
    flipped[at] ^= 0x40;
    std::fs::write(&path, &flipped)?;
    match c.load(&key, &client)? {
        Lookup::Corrupt { reason, .. } => assert!(reason.contains("checksum"), "{reason}"),
        _ => panic!("a flipped byte must be reported corrupt"),
    }
    assert!(!path.exists(), "the corrupt entry is removed");

    std::fs::write(&path, &good[..good.len() - 100])?;
    match c.load(&key, &client)? {
        Lookup::Corrupt { reason, .. } => assert!(reason.contains("truncated"), "{reason}"),
        _ => panic!("a truncated entry must be reported corrupt"),
    }
    // The caller recompiles and stores: the entry is whole again.
    c.store(&key, &exe, INFO)?;
    assert!(matches!(c.load(&key, &client)?, Lookup::Hit { .. }));
    Ok(())
}

#[test]
fn read_only_mode_reads_but_never_writes_or_removes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let client = cpu_client(1);
    let key = CompileKey::new(b"prog-r", &client, &CompileOptions::default())?;
    let other = CompileKey::new(b"prog-s", &client, &CompileOptions::default())?;
    let exe = client.compile(&program(2.0), &CompileOptions::default())?;
    cache(dir.path(), 1 << 30, false).store(&key, &exe, INFO)?;

    let ro = cache(dir.path(), 1 << 30, true);
    assert!(matches!(ro.load(&key, &client)?, Lookup::Hit { .. }));
    ro.store(&other, &exe, INFO)?;
    assert!(matches!(ro.load(&other, &client)?, Lookup::Miss), "read-only stored an entry");
    assert!(ro.clear().unwrap_err().to_string().contains("read-only"));

    let path = ro.entry_path(&key);
    let mut bytes = std::fs::read(&path)?;
    let at = bytes.len() - 1;
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes)?;
    assert!(matches!(ro.load(&key, &client)?, Lookup::Corrupt { .. }));
    assert!(path.exists(), "read-only mode removed a file");
    Ok(())
}

#[test]
fn eviction_keeps_the_directory_under_its_bound_dropping_the_least_recent() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let client = cpu_client(1);
    let exe = client.compile(&program(3.0), &CompileOptions::default())?;
    let probe = cache(dir.path(), u64::MAX, false);
    let k0 = CompileKey::new(b"e0", &client, &CompileOptions::default())?;
    probe.store(&k0, &exe, INFO)?;
    let entry = probe.stats()?.bytes;
    probe.clear()?;

    // Room for two entries.
    let c = cache(dir.path(), 2 * entry + entry / 2, false);
    let keys: Vec<CompileKey> = (0..4)
        .map(|i| CompileKey::new(format!("e{i}").as_bytes(), &client, &CompileOptions::default()).unwrap())
        .collect();
    for k in &keys {
        c.store(k, &exe, INFO)?;
        // Modification times order the entries; keep them apart.
        std::thread::sleep(Duration::from_millis(20));
    }
    let stats = c.stats()?;
    assert_eq!(stats.entries, 2, "{stats:?}");
    assert!(stats.bytes <= c.config().max_bytes);
    assert!(matches!(c.load(&keys[0], &client)?, Lookup::Miss));
    assert!(matches!(c.load(&keys[3], &client)?, Lookup::Hit { .. }));
    Ok(())
}

#[test]
fn concurrent_writers_and_readers_only_ever_see_whole_entries() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let client = cpu_client(1);
    let exe = std::sync::Arc::new(client.compile(&program(0.25), &CompileOptions::default())?);
    let x = XorShift::new(11).vec_f32(8);
    let want = run(&exe, &client, &x);
    let shared = CompileKey::new(b"shared", &client, &CompileOptions::default())?;
    std::thread::scope(|s| {
        for t in 0..4 {
            let (client, exe, dir, x, want) = (client.clone(), exe.clone(), dir.path(), &x, &want);
            s.spawn(move || {
                let c = cache(dir, 1 << 30, false);
                let own = CompileKey::new(format!("own{t}").as_bytes(), &client, &CompileOptions::default()).unwrap();
                for _ in 0..10 {
                    c.store(&shared, &exe, INFO).unwrap();
                    c.store(&own, &exe, INFO).unwrap();
                    match c.load(&shared, &client).unwrap() {
                        Lookup::Hit { exe, .. } => assert_eq!(&run(&exe, &client, x), want),
                        Lookup::Miss => panic!("a stored entry went missing"),
                        Lookup::Corrupt { reason, .. } => panic!("a reader saw a partial entry: {reason}"),
                    }
                }
            });
        }
    });
    let stats = cache(dir.path(), 1 << 30, false).stats()?;
    assert_eq!(stats.entries, 5, "{stats:?}");
    let leftovers = std::fs::read_dir(dir.path())?
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(".tmp"))
        .count();
    assert_eq!(leftovers, 0, "temp files left behind");
    Ok(())
}

/// An entry that cannot be read (here a link loop at the entry's path, which
/// fails even for root, as EACCES and EIO do) is a miss and a recompile,
/// never an error that ends the run; the store after it replaces it.
#[test]
fn an_unreadable_entry_is_a_miss_and_is_replaced() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let client = cpu_client(1);
    let c = cache(dir.path(), 1 << 30, false);
    let key = CompileKey::new(b"prog-loop", &client, &CompileOptions::default())?;
    let path = c.entry_path(&key);
    let other = dir.path().join("loop-b");
    std::os::unix::fs::symlink(&other, &path)?;
    std::os::unix::fs::symlink(&path, &other)?;
    assert!(matches!(c.load(&key, &client)?, Lookup::Miss));
    let exe = client.compile(&program(0.5), &CompileOptions::default())?;
    c.store(&key, &exe, INFO)?;
    assert!(matches!(c.load(&key, &client)?, Lookup::Hit { .. }));
    Ok(())
}
