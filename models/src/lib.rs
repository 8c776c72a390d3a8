//! kiln's model zoo: transformers written against kiln's public API the way a
//! user ports them, with the Hugging Face architectures' structure.
//!
//! Every model can be spelled two ways ([`Spelling`]), as Hugging Face's
//! `attn_implementation` chooses between `"eager"` and `"sdpa"`: with plain
//! tensor ops where kiln has a built-in call (attention as `q kᵀ`, a mask and
//! a softmax; norms from means and `rsqrt`; the loss from `log_softmax`), or
//! with the built-in calls. The two compute the same function; kiln's
//! compiler finds the fast form of the plain one (`docs/composites.md`), and
//! the tests hold both to the same losses.
//!
//! Invariant: a model's parameters are made in a fixed order from its
//! `ParamStore`'s seed, whatever the spelling, so both spellings start from
//! the same weights.

pub mod bert;
pub mod generate;
pub mod gpt;
pub mod gpt2;
pub mod hf;
pub mod llama;
pub mod mlp;
pub mod t5;
pub mod text;
pub mod trainer;
pub mod training;
pub mod zoo;

pub use training::{init_placement, SetupBreakdown, ENV_INIT};

/// Several documents packed into each row of a decoder's batch: the
/// document of every token (`segments`, `[b, t]` i32, counting from 0 in
/// each row) and its position within its document (`positions`, `[b, t]`
/// i32). A packed decoder attends within a token's document only and numbers
/// positions from each document's start, so a packed row computes what its
/// documents would alone.
pub struct Packing {
    pub segments: kiln_frontend::Tensor,
    pub positions: kiln_frontend::Tensor,
}

/// A batch tensor from `data`: the rows of every replica of the run, each
/// replica's `shape[0]` rows after the previous one's (`data` holds
/// `global replicas × shape` values). Each replica of this process gets its
/// own rows; under a mesh the rows are split over its `data` axis. With one
/// replica and no mesh it is `Tensor::from_vec(data, shape)`.
pub(crate) fn batch_rows<T: kiln_frontend::Element + Clone>(
    data: &[T],
    shape: Vec<usize>,
) -> kiln_frontend::Result<kiln_frontend::Tensor> {
    let global = kiln_frontend::replicas::global_replicas()?;
    let local = kiln_frontend::replicas::local_replica_indices()?;
    let chunk: usize = shape.iter().product();
    if data.len() != chunk * global {
        let reason = format!("{} values for {global} replica(s) of {shape:?}", data.len());
        return Err(kiln_frontend::FrontendError::InvalidArgument { op: "batch", reason });
    }
    let shards = local.iter().map(|&g| data[g * chunk..(g + 1) * chunk].to_vec()).collect();
    let t = kiln_frontend::replicas::from_shards(shards, shape)?;
    kiln_frontend::shard::shard_batch(&t)?;
    Ok(t)
}

impl Packing {
    /// The packing of rows of `t` tokens where `ends[i]` says token `i` (of
    /// the flattened batch: `b` rows for each replica of the run) ends its
    /// document (an end-of-text token). Each replica gets its own `b` rows.
    pub fn from_ends(ends: &[bool], b: usize, t: usize) -> kiln_frontend::Result<Packing> {
        let (mut seg, mut pos) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for row in ends.chunks(t.max(1)) {
            let (mut s, mut p) = (0i32, 0i32);
            for &end in row {
                seg.push(s);
                pos.push(p);
                p += 1;
                if end {
                    s += 1;
                    p = 0;
                }
            }
        }
        Ok(Packing { segments: batch_rows(&seg, vec![b, t])?, positions: batch_rows(&pos, vec![b, t])? })
    }

    /// `[b, 1, t, t]`: whether query `i` and key `j` are in one document.
    pub(crate) fn same_document(&self) -> kiln_frontend::Result<kiln_frontend::Tensor> {
        let (b, t) = (self.segments.dims()[0], self.segments.dims()[1]);
        let q = self.segments.reshape([b, 1, t, 1])?.broadcast_to([b, 1, t, t])?;
        let k = self.segments.reshape([b, 1, 1, t])?.broadcast_to([b, 1, t, t])?;
        q.eq(&k)
    }
}

/// How a model spells the parts kiln has built-in calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Spelling {
    /// Plain tensor ops, as a port of the PyTorch or JAX code writes them.
    Plain,
    /// kiln's built-in calls (`nn::attention`, `nn::LayerNorm`, `nn::RmsNorm`,
    /// `nn::lm_head_cross_entropy`).
    Builtin,
}

impl Spelling {
    pub const ALL: [Spelling; 2] = [Spelling::Plain, Spelling::Builtin];

    pub fn name(self) -> &'static str {
        match self {
            Spelling::Plain => "plain",
            Spelling::Builtin => "builtin",
        }
    }
}
