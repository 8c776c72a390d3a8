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
pub mod training;
pub mod zoo;

pub use training::{init_placement, SetupBreakdown, ENV_INIT};

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
