//! Reading a file a user names as input: a graph's text, `--text`, the IDX
//! files of a dataset, a checkpoint.
//!
//! Invariants:
//! - Only a regular file (or a symbolic link to one) is opened ([`open`]).
//!   Anything else is refused with [`FrontendError::NotARegularFile`] naming
//!   the path and what it is, before `open(2)`: a FIFO blocks there until a
//!   writer comes (forever, for a mistaken path), a device reads without end
//!   (`/dev/zero`) or waits on a terminal, a directory or socket cannot be
//!   read. The opened file is checked again (the path could change between
//!   the two). Every reader of a user-named input opens it here.
//! - A gzip'd input is read to its end: every member of it, in order (a file
//!   `cat a.gz b.gz` made is one valid gzip file, RFC 1952 section 2.2), and
//!   bytes after a member that do not start another one are an error naming
//!   the file ([`Gunzip`]), never silently ignored. How much it expands to
//!   is bounded by its caller, which reads it through `take`.

use std::fs::{File, FileType};
use std::io::{self, BufRead, Read};
use std::path::Path;

use flate2::bufread::GzDecoder;

use crate::core::error::{FrontendError, Result};

/// Opens `path` for reading if it is a regular file (following symbolic
/// links); errors name the path.
pub fn open(path: &Path) -> Result<File> {
    let io = |source| FrontendError::Io { path: path.to_path_buf(), source };
    let regular = |kind: FileType| match not_regular(kind) {
        Some(kind) => Err(FrontendError::NotARegularFile { path: path.to_path_buf(), kind }),
        None => Ok(()),
    };
    regular(std::fs::metadata(path).map_err(io)?.file_type())?;
    let file = File::open(path).map_err(io)?;
    regular(file.metadata().map_err(io)?.file_type())?;
    Ok(file)
}

/// What a file that is not a regular file is, for errors; `None` for a
/// regular file.
fn not_regular(kind: FileType) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt as _;
    if kind.is_file() {
        None
    } else if kind.is_dir() {
        Some("a directory")
    } else if kind.is_fifo() {
        Some("a FIFO")
    } else if kind.is_socket() {
        Some("a socket")
    } else if kind.is_char_device() {
        Some("a character device")
    } else if kind.is_block_device() {
        Some("a block device")
    } else {
        Some("not a file kiln can read")
    }
}

/// The two bytes every gzip member starts with.
pub const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The decompressed bytes of every member of a gzip stream, in order.
///
/// After a member ends, the next bytes must be the end of the input or
/// another member; anything else is an [`io::ErrorKind::InvalidData`] error
/// saying what follows which member (the caller adds the path). A corrupt
/// member is flate2's error, as it is for one member.
pub struct Gunzip<R: BufRead> {
    /// The member being read; `None` once the input is read to its end.
    member: Option<GzDecoder<R>>,
    /// How many members have started (1-based number of `member`).
    started: usize,
}

impl<R: BufRead> Gunzip<R> {
    /// Reads `input` from its first member (which must start at its first
    /// byte: flate2 refuses it otherwise).
    pub fn new(input: R) -> Gunzip<R> {
        Gunzip { member: Some(GzDecoder::new(input)), started: 1 }
    }
}

impl<R: BufRead> Read for Gunzip<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let Some(member) = self.member.as_mut() else { return Ok(0) };
            let n = member.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            // The member is read whole (its CRC and length checked): the end
            // of the input, or another member, or an error.
            let Some(member) = self.member.take() else { return Ok(0) };
            let mut input = member.into_inner();
            let next = input.fill_buf()?;
            if next.is_empty() {
                return Ok(0);
            }
            if next[0] != GZIP_MAGIC[0] || next.get(1).is_some_and(|&b| b != GZIP_MAGIC[1]) {
                let shown: Vec<String> = next.iter().take(4).map(|b| format!("{b:#04x}")).collect();
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "bytes after gzip member {} are not a gzip member (they start {}): trailing data is \
                         refused, not ignored",
                        self.started,
                        shown.join(" ")
                    ),
                ));
            }
            self.started += 1;
            self.member = Some(GzDecoder::new(input));
        }
    }
}

#[cfg(test)]
mod tests {
    // Test helpers may unwrap (the workspace denies it in library code).
    #![allow(clippy::unwrap_used)]

    use std::io::Write as _;

    use super::*;

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn gunzip(bytes: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        Gunzip::new(bytes).read_to_end(&mut out)?;
        Ok(out)
    }

    /// A FIFO with no writer, a socket, a directory and a device are refused
    /// by what they are, and the FIFO quickly: `open(2)` would block on it.
    #[test]
    fn only_regular_files_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let (tx, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || tx.send(open(&path).map(|_| ()).map_err(|e| e.to_string())));
        let got = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("open returned instead of blocking");
        assert_eq!(
            got.unwrap_err(),
            format!("{}: is a FIFO, not a regular file (kiln reads its inputs from regular files)", fifo.display())
        );

        let socket = dir.path().join("socket");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        for (path, kind) in [
            (socket.as_path(), "a socket"),
            (dir.path(), "a directory"),
            (Path::new("/dev/zero"), "a character device"),
            (link.as_path(), "a FIFO"),
        ] {
            match open(path) {
                Err(FrontendError::NotARegularFile { path: p, kind: k }) => assert_eq!((p.as_path(), k), (path, kind)),
                other => panic!("{}: {other:?}", path.display()),
            }
        }
        let file = dir.path().join("file");
        std::fs::write(&file, b"ok").unwrap();
        let mut text = String::new();
        open(&file).unwrap().read_to_string(&mut text).unwrap();
        assert_eq!(text, "ok");
        assert!(matches!(open(&dir.path().join("missing")), Err(FrontendError::Io { .. })));
    }

    #[test]
    fn every_member_is_read_in_order() {
        let mut cat = gz(b"first ");
        cat.extend(gz(b""));
        cat.extend(gz(b"second"));
        assert_eq!(gunzip(&cat).unwrap(), b"first second");
        assert_eq!(gunzip(&gz(b"one")).unwrap(), b"one");
    }

    #[test]
    fn bytes_after_the_last_member_are_an_error() {
        for tail in [&b"garbage"[..], &[0u8; 512], &[0x1f, 0x00], &[0x1f], &[0x1f, 0x8b, 8, 0]] {
            let mut bytes = gz(b"first");
            bytes.extend(gz(b"second"));
            bytes.extend_from_slice(tail);
            let err = gunzip(&bytes).unwrap_err();
            if tail.len() > 1 && tail[..2] != GZIP_MAGIC {
                assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{tail:?}: {err}");
                assert!(err.to_string().contains("bytes after gzip member 2 are not a gzip member"), "{err}");
            }
        }
        let err = gunzip(&[gz(b"x"), b"ABCDEF".to_vec()].concat()).unwrap_err();
        assert!(err.to_string().contains("(they start 0x41 0x42 0x43 0x44)"), "{err}");
    }
}
