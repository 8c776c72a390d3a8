//! Data loading: Fashion-MNIST's IDX files and shape-stable batching.
//!
//! Batches keep one shape for the whole run, so the step compiles once: either
//! the last partial batch is dropped (`drop_last`) or it is padded to the batch
//! size with rows of weight 0 (`PadToBatch`), which losses and metrics honour.
//!
//! Invariants:
//! - Every batch of a run has one shape (dropped or padded last batch), so
//!   the step compiles once.
//! - A malformed or hostile IDX file is an error naming the path, never a
//!   panic or an allocation its header alone asked for (sizes are checked
//!   against `core::limits` before the body is read).
//! - A gzip'd IDX file is read through every member to its end
//!   (`core::input::Gunzip`): one made with `cat a.gz b.gz` is read whole,
//!   and bytes after its last member are an error naming the path.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::api::nn::HostRng;
use crate::core::error::{FrontendError, Result};
use crate::core::input::Gunzip;
use crate::core::tensor::Tensor;
use crate::engine::context;
use crate::engine::executor::Backend;

/// Where Debian's `dataset-fashion-mnist` puts the files.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Images as `u8` pixels and labels.
#[derive(Clone, Debug)]
pub struct ImageSet {
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
    pub rows: usize,
    pub cols: usize,
}

impl ImageSet {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    pub fn pixels(&self) -> usize {
        self.rows * self.cols
    }
}

/// The Fashion-MNIST train and test splits.
#[derive(Clone, Debug)]
pub struct FashionMnist {
    pub train: Arc<ImageSet>,
    pub test: Arc<ImageSet>,
}

impl FashionMnist {
    /// Loads the four gzip'd IDX files from `dir`.
    pub fn load(dir: impl AsRef<Path>) -> Result<FashionMnist> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(FrontendError::Data {
                path: dir.to_path_buf(),
                reason: "no such directory: install Fashion-MNIST with `apt-get install dataset-fashion-mnist`".into(),
            });
        }
        let set = |prefix: &str| -> Result<ImageSet> {
            let (images, rows, cols) = read_idx_images(&dir.join(format!("{prefix}-images-idx3-ubyte.gz")))?;
            let labels = read_idx_labels(&dir.join(format!("{prefix}-labels-idx1-ubyte.gz")))?;
            if labels.len().checked_mul(rows * cols) != Some(images.len()) {
                return Err(FrontendError::Data {
                    path: dir.join(prefix),
                    reason: format!("{} labels for {} images", labels.len(), images.len() / (rows * cols)),
                });
            }
            Ok(ImageSet { images, labels, rows, cols })
        };
        Ok(FashionMnist { train: Arc::new(set("train")?), test: Arc::new(set("t10k")?) })
    }
}

/// Opens a gzip'd file (a regular file: [`crate::core::input::open`]) for
/// streaming reads of every member of it ([`Gunzip`]: bytes after the last
/// member are an error naming the file).
fn open_gz(path: &Path) -> Result<Gunzip<BufReader<File>>> {
    Ok(Gunzip::new(BufReader::new(crate::core::input::open(path)?)))
}

/// Reads exactly `len` bytes (an IDX header or body): fewer is a truncated
/// file. Reads through `take`, so nothing past `len` is decompressed.
fn read_exact_from(r: &mut impl Read, len: usize, path: &Path, what: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    r.take(len as u64)
        .read_to_end(&mut out)
        .map_err(|source| FrontendError::Io { path: path.to_path_buf(), source })?;
    if out.len() != len {
        return Err(FrontendError::Data {
            path: path.into(),
            reason: format!("truncated {what}: {} of {len} bytes", out.len()),
        });
    }
    Ok(out)
}

/// Fails unless `r` is at its end (the header's sizes must match the file).
fn expect_end(r: &mut impl Read, path: &Path, header: &str) -> Result<()> {
    let mut extra = [0u8; 1];
    match r.read(&mut extra) {
        Ok(0) => Ok(()),
        Ok(_) => Err(FrontendError::Data {
            path: path.into(),
            reason: format!("header says {header}, the file holds more bytes"),
        }),
        Err(source) => Err(FrontendError::Io { path: path.to_path_buf(), source }),
    }
}

fn be_u32(bytes: &[u8], at: usize) -> usize {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize
}

/// Parses an IDX3 `u8` image file: magic `0x00000803`, count, rows, cols.
///
/// The header is read first; its sizes are multiplied with checked
/// arithmetic, must be non-zero and fit in host memory
/// ([`crate::core::limits`]) before the body is read, and the body is read
/// through a bound, so a hostile header or a decompression bomb is an error
/// naming the file, never an abort.
pub fn read_idx_images(path: &Path) -> Result<(Vec<u8>, usize, usize)> {
    parse_idx_images(&mut open_gz(path)?, path)
}

/// [`read_idx_images`] on any reader of the decompressed bytes (the fuzz
/// target feeds it raw bytes).
pub fn parse_idx_images(r: &mut impl Read, path: &Path) -> Result<(Vec<u8>, usize, usize)> {
    let head = read_exact_from(r, 16, path, "IDX3 header")?;
    let magic = be_u32(&head, 0);
    if magic != 0x0803 {
        return Err(FrontendError::Data { path: path.into(), reason: format!("bad IDX3 magic {magic:#010x}") });
    }
    let (n, rows, cols) = (be_u32(&head, 4), be_u32(&head, 8), be_u32(&head, 12));
    let header = format!("{n}x{rows}x{cols} bytes");
    if n == 0 || rows == 0 || cols == 0 {
        return Err(FrontendError::Data {
            path: path.into(),
            reason: format!("header says {n} images of {rows}x{cols} pixels: an IDX3 image file needs at least one image of at least 1x1"),
        });
    }
    let len = n.checked_mul(rows).and_then(|x| x.checked_mul(cols));
    crate::core::limits::check_host_bytes(
        format!("{} ({header})", path.display()),
        len.and_then(|l| u64::try_from(l).ok()),
    )?;
    let body = read_exact_from(r, len.unwrap_or(0), path, &format!("IDX3 body (header says {header})"))?;
    expect_end(r, path, &header)?;
    Ok((body, rows, cols))
}

/// Parses an IDX1 `u8` label file: magic `0x00000801`, count.
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    parse_idx_labels(&mut open_gz(path)?, path)
}

/// [`read_idx_labels`] on any reader of the decompressed bytes.
pub fn parse_idx_labels(r: &mut impl Read, path: &Path) -> Result<Vec<u8>> {
    let head = read_exact_from(r, 8, path, "IDX1 header")?;
    let magic = be_u32(&head, 0);
    if magic != 0x0801 {
        return Err(FrontendError::Data { path: path.into(), reason: format!("bad IDX1 magic {magic:#010x}") });
    }
    let n = be_u32(&head, 4);
    if n == 0 {
        return Err(FrontendError::Data { path: PathBuf::from(path), reason: "header says 0 labels".into() });
    }
    crate::core::limits::check_host_bytes(format!("{} ({n} labels)", path.display()), u64::try_from(n).ok())?;
    let body = read_exact_from(r, n, path, &format!("IDX1 body (header says {n} labels)"))?;
    expect_end(r, path, &format!("{n} labels"))?;
    Ok(body)
}

/// What to do with the last partial batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LastBatch {
    /// Drop it (training).
    Drop,
    /// Pad it to the batch size with weight-0 rows (evaluation).
    Pad,
}

/// One batch of example indices; `weights[i]` is 0 for padding rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub indices: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Splits `0..n` into batches of `batch_size`, shuffled by `seed` when given.
pub fn batches(n: usize, batch_size: usize, shuffle_seed: Option<u64>, last: LastBatch) -> Vec<Batch> {
    let order = match shuffle_seed {
        Some(seed) => HostRng::new(seed).permutation(n),
        None => (0..n).collect(),
    };
    let mut out = Vec::new();
    for chunk in order.chunks(batch_size.max(1)) {
        if chunk.len() == batch_size {
            out.push(Batch { indices: chunk.to_vec(), weights: vec![1.0; batch_size] });
        } else if last == LastBatch::Pad {
            let mut indices = chunk.to_vec();
            let mut weights = vec![1.0; chunk.len()];
            indices.resize(batch_size, chunk[0]);
            weights.resize(batch_size, 0.0);
            out.push(Batch { indices, weights });
        }
    }
    out
}

/// The distributed sampler: `batches` of `batch_per_replica × replicas`
/// examples, each split into `replicas` contiguous shards, so step `k` gives
/// replica `r` its own `batch_per_replica` examples. Shards are disjoint,
/// every replica gets the same number of batches, and the global batches are
/// exactly those one replica with `batch_per_replica × replicas` would see (so
/// the all-reduced mean gradient equals that replica's gradient).
pub fn replica_batches(
    n: usize,
    batch_per_replica: usize,
    replicas: usize,
    shuffle_seed: Option<u64>,
    last: LastBatch,
) -> Vec<Vec<Batch>> {
    let b = batch_per_replica.max(1);
    batches(n, b * replicas.max(1), shuffle_seed, last)
        .into_iter()
        .map(|g| {
            g.indices
                .chunks(b)
                .zip(g.weights.chunks(b))
                .map(|(i, w)| Batch { indices: i.to_vec(), weights: w.to_vec() })
                .collect()
        })
        .collect()
}

/// One step's shards as tensors holding replica `r`'s images and labels on
/// replica `r` (`[b, pixels]` f32 and `[b]` s32 per replica).
pub fn image_shards(set: &ImageSet, shards: &[Batch]) -> Result<(Tensor, Tensor)> {
    let b = shards.first().map_or(0, |s| s.indices.len());
    let (xs, ys): (Vec<_>, Vec<_>) = shards.iter().map(|s| host_batch(set, s)).unzip();
    Ok((
        crate::engine::replicas::from_shards(xs, [b, set.pixels()])?.with_name("images"),
        crate::engine::replicas::from_shards(ys, [b])?.with_name("labels"),
    ))
}

/// Pixels in `[0, 1]` and labels of `batch`, on the host.
fn host_batch(set: &ImageSet, batch: &Batch) -> (Vec<f32>, Vec<i32>) {
    let p = set.pixels();
    let mut x = Vec::with_capacity(batch.indices.len() * p);
    let mut y = Vec::with_capacity(batch.indices.len());
    for &i in &batch.indices {
        x.extend(set.images[i * p..(i + 1) * p].iter().map(|&v| f32::from(v) / 255.0));
        y.push(i32::from(set.labels[i]));
    }
    (x, y)
}

/// Images of `batch` as `[b, pixels]` f32 in `[0, 1]` and labels as `[b]` s32.
pub fn image_batch(set: &ImageSet, batch: &Batch) -> Result<(Tensor, Tensor)> {
    let (x, y) = host_batch(set, batch);
    let b = batch.indices.len();
    Ok((Tensor::from_vec(x, [b, set.pixels()])?.with_name("images"), Tensor::from_vec(y, [b])?.with_name("labels")))
}

/// One step's uploaded images and labels, one buffer pair per replica.
type Uploaded = kiln_runtime::Result<(Vec<kiln_runtime::Buffer>, Vec<kiln_runtime::Buffer>)>;

/// Host-to-device prefetch: a worker thread assembles the next steps' batches
/// and uploads them while the current step runs, up to `depth` steps ahead.
/// Each step is one batch per replica (see [`replica_batches`]; one replica:
/// one batch), uploaded to that replica's device. With the reference backend
/// (no device) batches are built on the caller's thread.
pub struct Prefetcher {
    set: Arc<ImageSet>,
    steps: std::vec::IntoIter<Vec<Batch>>,
    rx: Option<Receiver<Uploaded>>,
    worker: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Prefetches single-replica `batches`.
    pub fn new(set: Arc<ImageSet>, batches: Vec<Batch>, depth: usize) -> Result<Prefetcher> {
        Prefetcher::sharded(set, batches.into_iter().map(|b| vec![b]).collect(), depth)
    }

    /// Prefetches `steps[k][r]`: step `k`'s batch for replica `r`; every step
    /// has one batch per replica of this thread's steps.
    pub fn sharded(set: Arc<ImageSet>, steps: Vec<Vec<Batch>>, depth: usize) -> Result<Prefetcher> {
        let replicas = crate::engine::replicas::num_replicas()?;
        if let Some(bad) = steps.iter().find(|s| s.len() != replicas) {
            let expected = format!("{replicas} replicas (one batch per replica in each step)");
            return Err(FrontendError::Count { op: "prefetch", what: "batches", expected, got: bad.len() });
        }
        if context::backend() != Backend::Pjrt {
            return Ok(Prefetcher { set, steps: steps.into_iter(), rx: None, worker: None });
        }
        let client = context::with(|c| c.client())?;
        // XLA's default device assignment runs replica r on the client's r-th
        // device; the runtime checks every argument's device before running.
        let devices: Vec<_> = client.devices().into_iter().take(replicas).collect();
        let (tx, rx) = sync_channel::<Uploaded>(depth.max(1));
        let worker_set = set.clone();
        let todo = steps.clone();
        let worker = std::thread::Builder::new()
            .name("kiln-prefetch".into())
            .spawn(move || {
                for step in &todo {
                    let up = step
                        .iter()
                        .zip(&devices)
                        .map(|(b, device)| {
                            let (x, y) = host_batch(&worker_set, b);
                            let n = b.indices.len();
                            let xb = client.buffer_from_host(&x, &[n, worker_set.pixels()], device)?;
                            Ok((xb, client.buffer_from_host(&y, &[n], device)?))
                        })
                        .collect::<kiln_runtime::Result<Vec<_>>>()
                        .map(|pairs| pairs.into_iter().unzip());
                    // The receiver hung up: the loop stopped early.
                    if tx.send(up).is_err() {
                        return;
                    }
                }
            })
            .map_err(|source| FrontendError::Io { path: "kiln-prefetch thread".into(), source })?;
        Ok(Prefetcher { set, steps: steps.into_iter(), rx: Some(rx), worker: Some(worker) })
    }
}

impl Iterator for Prefetcher {
    /// The step's batches (one per replica), its images and its labels.
    type Item = Result<(Vec<Batch>, Tensor, Tensor)>;

    fn next(&mut self) -> Option<Self::Item> {
        let step = self.steps.next()?;
        let Some(rx) = &self.rx else {
            return Some(image_shards(&self.set, &step).map(|(x, y)| (step, x, y)));
        };
        let up = match rx.recv() {
            Ok(up) => up,
            Err(_) => {
                return Some(Err(FrontendError::InvalidArgument {
                    op: "prefetch",
                    reason: "the prefetch thread stopped".into(),
                }))
            }
        };
        Some(up.map_err(FrontendError::from).and_then(|(xs, ys)| {
            let bytes =
                xs.iter().chain(&ys).map(|b| b.on_device_size_in_bytes()).sum::<kiln_runtime::Result<usize>>()?;
            crate::core::metrics::update(|m| m.host_to_device_bytes += bytes as u64);
            Ok((
                step,
                Tensor::from_replica_buffers(xs)?.with_name("images"),
                Tensor::from_replica_buffers(ys)?.with_name("labels"),
            ))
        }))
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Hang up first so a worker blocked on a full channel finishes.
        self.rx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_last_keeps_full_batches_only() {
        let b = batches(10, 4, Some(1), LastBatch::Drop);
        assert_eq!(b.len(), 2);
        let mut seen: Vec<usize> = b.iter().flat_map(|b| b.indices.clone()).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 8);
    }

    #[test]
    fn pad_covers_everything_once_with_weight() {
        let b = batches(10, 4, None, LastBatch::Pad);
        assert_eq!(b.len(), 3);
        assert_eq!(b[2].weights, vec![1.0, 1.0, 0.0, 0.0]);
        let total: f32 = b.iter().flat_map(|b| b.weights.clone()).sum();
        assert_eq!(total, 10.0);
    }

    #[test]
    fn shuffle_is_seeded() {
        assert_eq!(batches(100, 10, Some(7), LastBatch::Drop), batches(100, 10, Some(7), LastBatch::Drop));
        assert_ne!(batches(100, 10, Some(7), LastBatch::Drop), batches(100, 10, Some(8), LastBatch::Drop));
    }
}
