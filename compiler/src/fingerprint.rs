//! The canonical structural fingerprint of a graph: the program part of the
//! compile cache's key.
//!
//! Each node's digest is SHA-256 over its op with operands left out, followed by
//! the digests of its operands (Merkle style). Node numbers never enter it, so
//! two graphs that record the same computation in a different order, or with
//! dead code in other places, fingerprint alike; tensor *values* never enter it
//! either (parameters count by position and type). The graph's fingerprint
//! covers its parameter types, its outputs' digests in order and its aliases.
//!
//! Runs after the optimization pipeline, on the program that is lowered; the
//! frontend's hit path never calls it (it keys on the raw trace's running hash).

use std::fmt;
use std::hash::{Hash, Hasher};

use sha2::{Digest, Sha256};

use crate::ir::{Graph, NodeId, Op, ValueId};

/// 32 bytes that identify a program's structure; `Display` is lowercase hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// Feeds `Hash` impls into SHA-256. Integers go in little-endian at their own
/// width, so the digest is the same on every little-endian 64-bit host.
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        // Only the full digest is used (`Sha256::finalize`).
        let d = self.0.clone().finalize();
        u64::from_le_bytes(d[..8].try_into().expect("a SHA-256 digest has 8 leading bytes"))
    }
}

/// Placeholder operand: operands are hashed through their producers' digests.
const HOLE: ValueId = ValueId { node: NodeId::HOLE, output: 0 };

/// The fingerprint of `g` (see the module docs).
pub fn fingerprint(g: &Graph) -> Fingerprint {
    let mut digests: Vec<[u8; 32]> = Vec::with_capacity(g.len());
    for (_, node) in g.nodes() {
        let mut h = ShaHasher(Sha256::new());
        let mut shell: Op = node.op.clone();
        let inputs = node.op.inputs();
        shell.map_inputs(|_| HOLE);
        shell.hash(&mut h);
        for v in inputs {
            h.write(&digests[v.node.index()]);
            h.write(&v.output.to_le_bytes());
        }
        digests.push(h.0.finalize().into());
    }
    let mut h = ShaHasher(Sha256::new());
    h.write(b"kiln-graph-v1");
    g.param_types().hash(&mut h);
    h.write(&(g.outputs().len() as u64).to_le_bytes());
    for v in g.outputs() {
        h.write(&digests[v.node.index()]);
        h.write(&v.output.to_le_bytes());
    }
    g.aliases().hash(&mut h);
    Fingerprint(h.0.finalize().into())
}

/// Changes whenever the compiler's sources change (a hash computed by the build
/// script), so executables lowered by another build of kiln are never reused
/// from a persistent cache, whatever the version number says.
pub const BUILD_FINGERPRINT: &str = env!("KILN_COMPILER_SOURCE_HASH");
