//! Subcommands of the `kiln` binary that live in their own files, one per
//! command; `main.rs` only names them and dispatches.

pub mod cache;
pub mod compile;
pub mod devices;
pub mod generate;
pub mod launch;
pub mod memory;
pub mod plot;
pub mod profile;
pub mod runlog;
pub mod zoo;

use kiln::compiler::lower::ConstantForm;

/// A training run's evaluation and checkpoints (`kiln train gpt` and the zoo's
/// models), as `kiln::train::FitConfig` takes them.
#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// Evaluate on held-out data every N steps (always at the end).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_every: Option<u64>,
    /// Save the whole training state (weights, optimizer, generator, the
    /// run's settings) here at the end and every --checkpoint-every steps.
    /// A file already there is refused unless --resume or --overwrite.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<std::path::PathBuf>,
    /// Also save every N steps.
    #[arg(long, value_name = "N", requires = "checkpoint", value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: Option<u64>,
    /// Continue from --checkpoint FILE with the same settings: the steps it
    /// has not taken, each on the batch the saved run would have drawn.
    #[arg(long, requires = "checkpoint")]
    pub resume: bool,
    /// Replace whatever is at --checkpoint FILE.
    #[arg(long, requires = "checkpoint", conflicts_with = "resume")]
    pub overwrite: bool,
    /// With --resume: settings this run may change from the checkpoint's
    /// (comma-separated names, as the refusal names them).
    #[arg(long, value_name = "NAMES", value_delimiter = ',', requires = "resume")]
    pub override_settings: Vec<String>,
    /// Keep the training state of the evaluation with the lowest held-out
    /// loss here (replaced only by a better one).
    #[arg(long, value_name = "FILE")]
    pub keep_best: Option<std::path::PathBuf>,
}

/// The largest graph text `kiln compile`/`kiln profile` read (1 GiB: a
/// saved step of GPT-2 small is a few MB); a wrong file, or a gzip'd one
/// that expands without end, is an error, not an endless read.
pub const MAX_GRAPH_TEXT_BYTES: u64 = 1 << 30;

/// Reads a graph's text with the bound above.
pub fn read_graph_text(path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use std::io::Read as _;
    // A regular file only: a FIFO would block in open(2), a device read
    // without end.
    let mut file = kiln::input::open(path)?;
    let mut magic = Vec::with_capacity(2);
    file.by_ref().take(2).read_to_end(&mut magic).with_context(|| format!("reading {}", path.display()))?;
    // A gzip'd graph (benches/data ships them) is read through every member
    // to its end (bytes after the last member are an error, not ignored),
    // under the same limit on the text it expands to.
    let gzip = magic == kiln::input::GZIP_MAGIC;
    let head = std::io::Cursor::new(magic).chain(file);
    let mut reader: Box<dyn std::io::Read> =
        if gzip { Box::new(kiln::input::Gunzip::new(std::io::BufReader::new(head))) } else { Box::new(head) };
    let mut bytes = Vec::new();
    reader
        .by_ref()
        .take(MAX_GRAPH_TEXT_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > MAX_GRAPH_TEXT_BYTES {
        anyhow::bail!("{}: longer than the {MAX_GRAPH_TEXT_BYTES}-byte limit of a graph file", path.display());
    }
    String::from_utf8(bytes).with_context(|| format!("{}: not UTF-8 text", path.display()))
}

/// Host bytes compiling a constant costs per byte of it, when the lowering
/// writes it as a scalar broadcast ([`ConstantForm::Broadcast`]) or as
/// `dense<v>` ([`ConstantForm::Splat`]): the parsed literal, once (its
/// clones share it), and the module holds one element. Measured: splats of
/// 50, 100 and 200 MiB raised `kiln compile`'s peak RSS 1.02, 1.02 and 1.01
/// times their size above a graph without them (104 MiB), 200 splats of
/// 1 MiB 1.02 times; rounded up.
pub const SPLAT_COMPILE_COST: u64 = 2;

/// Host bytes compiling a constant written in hex ([`ConstantForm::Hex`])
/// costs per byte of it: the literal, its text (two characters a byte), the
/// buffer MLIR decodes it into, XLA's literal and the executable's copy.
/// Measured: f32 constants of 50, 100 and 200 MiB raised `kiln compile`'s
/// peak RSS 6.0 times their size each; rounded up.
pub const HEX_COMPILE_COST: u64 = 7;

/// Host bytes compiling a constant written as a list of values
/// ([`ConstantForm::List`], those under 1 MiB) costs per byte of it: its
/// text is several characters a byte and MLIR's parser holds a token per
/// value. Measured: 100 f32 lists of 1 MiB raised `kiln compile`'s peak RSS
/// 6.1 times their size, 30 pred lists of 1 MiB (seven characters a byte)
/// 10.2 times; rounded up.
pub const LIST_COMPILE_COST: u64 = 11;

/// Host bytes `kiln profile` holds per byte of the graph's parameters (their
/// random host data and its device copy) and of its outputs (their device
/// buffers; the last are copied back). Measured: a 200 MiB parameter whose
/// output is as large raised the peak RSS 3.0 times its size.
pub const PROFILE_PARAM_COST: u64 = 2;
/// See [`PROFILE_PARAM_COST`].
pub const PROFILE_OUTPUT_COST: u64 = 1;

/// [`SPLAT_COMPILE_COST`], [`HEX_COMPILE_COST`] or [`LIST_COMPILE_COST`]
/// for a constant that lowers in `form`. Peak RSS measured with
/// `/usr/bin/time -v kiln compile --json` (KILN_CACHE=off) on the XLA CPU
/// plugin, 2026-12-07, 2 cores.
pub fn compile_cost_per_byte(form: ConstantForm) -> u64 {
    match form {
        ConstantForm::Broadcast | ConstantForm::Splat => SPLAT_COMPILE_COST,
        ConstantForm::Hex => HEX_COMPILE_COST,
        ConstantForm::List => LIST_COMPILE_COST,
    }
}

/// Host memory a text graph needs before XLA sees it, checked against the
/// host limit ([`kiln::limits`]) after parsing and before compiling: each
/// constant at the cost of the form it lowers in ([`compile_cost_per_byte`]);
/// with `with_params` (`kiln profile`, which runs the graph on random
/// parameters), the parameters and outputs as well. Sizes use checked
/// arithmetic.
///
/// Every constant used to be priced at 4 times its size: four 900 MB splats
/// passed at 14.4 GB of 22.3 GB available and the process was killed at
/// 24.4 GB. Measured since, most of that was kiln's own copies of each
/// literal (one per copy of the graph and several in the rewrite pass's
/// e-graph, 7.5 times a splat), which now share one buffer.
pub fn check_graph_memory(
    graph: &kiln::compiler::ir::Graph,
    path: &std::path::Path,
    with_params: bool,
) -> kiln::Result<()> {
    use kiln::compiler::ir::{Op, TensorType};
    let constants = graph.nodes().try_fold(0u64, |acc, (_, n)| match &n.op {
        Op::Constant { literal } => {
            let factor = compile_cost_per_byte(kiln::compiler::lower::constant_form(literal));
            acc.checked_add(u64::try_from(literal.bytes().len()).ok()?.checked_mul(factor)?)
        }
        _ => Some(acc),
    });
    let sum = |types: &[TensorType], factor: u64| {
        types.iter().try_fold(0u64, |acc, t| {
            acc.checked_add(u64::try_from(t.checked_size_in_bytes()?).ok()?.checked_mul(factor)?)
        })
    };
    let run = if with_params {
        sum(&graph.param_types(), PROFILE_PARAM_COST)
            .zip(sum(&graph.output_types(), PROFILE_OUTPUT_COST))
            .and_then(|(p, o)| p.checked_add(o))
    } else {
        Some(0)
    };
    let total = constants.zip(run).and_then(|(c, r)| c.checked_add(r));
    let what = if with_params { "its constants, random parameters and outputs" } else { "its constants" };
    kiln::limits::check_host_bytes(format!("{} ({what})", path.display()), total)
}

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
