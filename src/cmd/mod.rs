//! Subcommands of the `kiln` binary that live in their own files, one per
//! command; `main.rs` only names them and dispatches.

pub mod cache;
pub mod compile;
pub mod launch;
pub mod profile;

/// `--amp`: the low-precision dtype of mixed precision.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum AmpDtype {
    Bf16,
    F16,
}

impl From<AmpDtype> for kiln::DType {
    fn from(d: AmpDtype) -> kiln::DType {
        match d {
            AmpDtype::Bf16 => kiln::DType::BF16,
            AmpDtype::F16 => kiln::DType::F16,
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum GptSize {
    Tiny,
    #[value(name = "gpt2-small")]
    Gpt2Small,
}

impl GptSize {
    /// The configuration of this size (vocabulary from the text).
    pub fn config(self) -> kiln::models::gpt::GptConfig {
        match self {
            GptSize::Tiny => kiln::models::gpt::GptConfig::tiny(0),
            GptSize::Gpt2Small => kiln::models::gpt::GptConfig::gpt2_small(0),
        }
    }
}
