//! Writing a file so that readers see the old file or the whole new one, never
//! a part: write a temp file beside it, sync, rename over it. On failure the
//! temp file is removed and the old file is untouched.

use std::fs;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{FrontendError, Result};

static SEQ: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` atomically. Errors name `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |source| FrontendError::Io { path: path.to_path_buf(), source };
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")))?;
    // Unique per process and call, so threads writing one path never share a temp file.
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        name.to_string_lossy(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(io)
}
