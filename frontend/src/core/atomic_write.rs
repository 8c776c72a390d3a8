//! Writing a file so that readers see the old file or the whole new one, never
//! a part: write a temp file beside it, sync, rename over it. The one atomic
//! writer of the frontend (checkpoints, saved graphs, dumps).
//!
//! Invariants:
//! - A reader sees the old file or the whole new one. On failure the temp file
//!   is removed and the old file is untouched.
//! - What is at the path decides what is written:
//!   - nothing, or a regular file: replaced atomically;
//!   - a symbolic link (a chain of them): the write goes to the file the link
//!     finally names, atomically there, and the link stays a link;
//!   - anything else (a directory, a device such as `/dev/null`, a FIFO, a
//!     socket): refused with [`FrontendError::NotAFile`] naming the path, so a
//!     write never turns a device node or a directory entry into a regular
//!     file.
//! - The written file has the replaced file's mode, or a new file's
//!   (0o666 less the umask).
//! - Temp files are `.<name>.tmp.<pid>.<random>`, created in the target's
//!   directory exclusively (`O_CREAT | O_EXCL`, which never follows a link)
//!   with an unpredictable name (the `tempfile` crate): a link planted at a
//!   guessable name can neither be written through nor make the write fail
//!   for long. A writer killed mid-write leaves one behind, so every write
//!   first removes those of `<name>` whose process is gone (by
//!   `/proc/<pid>`, or by age where there is no `/proc`).

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::core::error::{FrontendError, Result};

/// Links followed before a chain counts as a loop (Linux's own limit).
const MAX_LINKS: usize = 40;
/// Without `/proc`, a temp file this old is a dead writer's.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// Replaces `path` with `bytes` atomically. Errors name `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let target = checked_target(path)?;
    let io = |source| FrontendError::Io { path: target.clone(), source };
    let dir = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .ok_or_else(|| io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")))?
        .to_string_lossy()
        .into_owned();
    remove_stale_temps(dir, &name);
    // Created exclusively under a random name: never through a link, never
    // shared by two threads writing one path. Dropped (and so removed) on
    // any error before the rename.
    // The file's mode: the replaced file's, else what a plain create gives
    // (0o666 less the umask), not the temp file's private 0o600.
    let existing = fs::metadata(&target).ok().filter(fs::Metadata::is_file).map(|m| m.permissions());
    let result = (|| {
        use std::os::unix::fs::PermissionsExt as _;
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}.tmp.{}.", std::process::id()))
            .rand_bytes(12)
            .permissions(fs::Permissions::from_mode(0o666))
            .tempfile_in(dir)?;
        if let Some(mode) = &existing {
            tmp.as_file().set_permissions(mode.clone())?;
        }
        tmp.write_all(bytes)?;
        tmp.as_file().sync_all()?;
        tmp.persist(&target).map(|_| ()).map_err(|e| e.error)
    })();
    result.map_err(io)
}

/// [`checked_target`], and a probe that a file can be created in the target's
/// directory (made exclusively under an unpredictable name, as a write's temp
/// file is, and removed at once): a run checks its destinations at start, so
/// a directory it cannot write fails the run before it trains rather than
/// after. Returns the path a write would replace.
pub fn check_writable(path: &Path) -> Result<PathBuf> {
    let target = checked_target(path)?;
    let dir = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    tempfile::Builder::new()
        .prefix(&format!(".{name}.probe.{}.", std::process::id()))
        .rand_bytes(12)
        .tempfile_in(dir)
        .map(drop)
        .map_err(|source| FrontendError::NotWritable { dir: dir.to_path_buf(), source })?;
    Ok(target)
}

/// Checks that `path` can be written without destroying anything: returns
/// the path to replace (the final target of a symlink chain), or
/// [`FrontendError::NotAFile`] for a directory, device, FIFO or socket and
/// for a link loop. A missing parent directory is an I/O error naming it.
pub fn checked_target(path: &Path) -> Result<PathBuf> {
    let not_a_file = |p: &Path, reason: String| FrontendError::NotAFile { path: p.to_path_buf(), reason };
    let mut target = path.to_path_buf();
    for _ in 0..=MAX_LINKS {
        let meta = match fs::symlink_metadata(&target) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let dir = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                return match fs::metadata(dir) {
                    Ok(m) if m.is_dir() => Ok(target),
                    Ok(_) => Err(not_a_file(dir, "is not a directory, so no file can be written in it".into())),
                    Err(source) => Err(FrontendError::Io { path: dir.to_path_buf(), source }),
                };
            }
            Err(source) => return Err(FrontendError::Io { path: target, source }),
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            let link = fs::read_link(&target).map_err(|source| FrontendError::Io { path: target.clone(), source })?;
            target = match target.parent() {
                Some(dir) if link.is_relative() => dir.join(link),
                _ => link,
            };
            continue;
        }
        if kind.is_file() {
            return Ok(target);
        }
        let what = if kind.is_dir() { "a directory" } else { "not a regular file (a device, FIFO or socket)" };
        let shown = if target == path { String::new() } else { format!(" (the link {} points there)", path.display()) };
        return Err(not_a_file(&target, format!("is {what}; kiln only replaces regular files{shown}")));
    }
    Err(not_a_file(path, format!("more than {MAX_LINKS} symbolic links deep (a loop?)")))
}

/// Removes `dir/.<name>.tmp.<pid>.<seq>` files whose writer is gone. Best
/// effort: a file another process removes first, or one that cannot be
/// removed, is left to the next writer.
fn remove_stale_temps(dir: &Path, name: &str) {
    let prefix = format!(".{name}.tmp.");
    let Ok(entries) = fs::read_dir(dir) else { return };
    let have_proc = Path::new("/proc/self").exists();
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else { continue };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid == std::process::id() {
            continue;
        }
        let dead = if have_proc {
            !Path::new(&format!("/proc/{pid}")).exists()
        } else {
            e.metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|m| SystemTime::now().duration_since(m).ok())
                .is_some_and(|age| age > STALE_TEMP)
        };
        if dead && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted at every name the writer used to pick
    /// (`.<name>.tmp.<pid>.<seq>`) is never written through: the victim it
    /// points at keeps its bytes, the link stays, and the write lands.
    #[test]
    fn links_planted_at_temp_names_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let target = dir.path().join("ck.safetensors");
        for seq in 0..256 {
            let planted = dir.path().join(format!(".ck.safetensors.tmp.{}.{seq}", std::process::id()));
            std::os::unix::fs::symlink(&victim, planted).unwrap();
        }
        for i in 0..8u8 {
            write_atomically(&target, &[i; 16]).unwrap();
            assert_eq!(fs::read(&target).unwrap(), [i; 16]);
        }
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        let links = fs::read_dir(dir.path()).unwrap().flatten().filter(|e| e.file_type().unwrap().is_symlink()).count();
        assert_eq!(links, 256);
    }

    /// A written file is readable as a plainly created one is (the temp
    /// file's private 0o600 once leaked into every output), and a replaced
    /// file keeps its mode.
    #[test]
    fn a_written_file_has_a_created_files_mode_or_the_replaced_ones() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        fs::write(&plain, b"x").unwrap();
        let (new, kept) = (dir.path().join("new"), dir.path().join("kept"));
        write_atomically(&new, b"a").unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&new), mode(&plain));
        fs::write(&kept, b"old").unwrap();
        fs::set_permissions(&kept, fs::Permissions::from_mode(0o640)).unwrap();
        write_atomically(&kept, b"new").unwrap();
        assert_eq!((mode(&kept), fs::read(&kept).unwrap()), (0o640, b"new".to_vec()));
    }

    #[test]
    fn writes_through_symlinks_and_refuses_what_is_not_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.bin");
        fs::write(&real, b"old").unwrap();
        let link = dir.path().join("link.bin");
        std::os::unix::fs::symlink("real.bin", &link).unwrap();
        write_atomically(&link, b"new").unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
        assert_eq!(fs::read(&real).unwrap(), b"new");

        // A dangling link creates its target.
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink("made.bin", &dangling).unwrap();
        write_atomically(&dangling, b"x").unwrap();
        assert_eq!(fs::read(dir.path().join("made.bin")).unwrap(), b"x");

        let sub = dir.path().join("sub");
        fs::create_dir(&sub).unwrap();
        let err = write_atomically(&sub, b"x").unwrap_err();
        assert!(matches!(&err, FrontendError::NotAFile { path, .. } if path == &sub), "{err}");
        assert!(sub.is_dir());

        // A FIFO of its own (never /dev/null: a regression would replace it).
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let err = write_atomically(&fifo, b"x").unwrap_err();
        assert!(matches!(&err, FrontendError::NotAFile { .. }), "{err}");
        assert!(err.to_string().contains("not a regular file"), "{err}");
        use std::os::unix::fs::FileTypeExt as _;
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());

        let looped = dir.path().join("loop");
        std::os::unix::fs::symlink("loop", &looped).unwrap();
        assert!(matches!(write_atomically(&looped, b"x"), Err(FrontendError::NotAFile { .. })));

        let err = write_atomically(&dir.path().join("missing/x.bin"), b"x").unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn temp_files_of_dead_writers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck.safetensors");
        // No process has pid u32::MAX - 1 (Linux pids stay below 2^22).
        let stale = dir.path().join(format!(".ck.safetensors.tmp.{}.0", u32::MAX - 1));
        let mine = dir.path().join(format!(".ck.safetensors.tmp.{}.999999", std::process::id()));
        let other = dir.path().join(format!(".other.tmp.{}.0", u32::MAX - 1));
        for p in [&stale, &mine, &other] {
            fs::write(p, b"partial").unwrap();
        }
        write_atomically(&target, b"whole").unwrap();
        assert!(!stale.exists(), "a dead writer's temp file is removed");
        assert!(mine.exists(), "a live writer's temp file is kept");
        assert!(other.exists(), "another file's temp files are not touched");
        assert_eq!(fs::read(&target).unwrap(), b"whole");
    }
}
