//! Subcommands of the `kiln` binary that live in their own files, one per
//! command; `main.rs` only names them and dispatches.

pub mod cache;
pub mod compile;
pub mod launch;
pub mod memory;
pub mod plot;
pub mod profile;
pub mod runlog;

/// The largest graph text `kiln compile`/`kiln profile` read (1 GiB: a
/// saved step of GPT-2 small is a few MB); `/dev/zero` or a wrong file is an
/// error, not an endless read.
pub const MAX_GRAPH_TEXT_BYTES: u64 = 1 << 30;

/// Reads a graph's text with the bound above.
pub fn read_graph_text(path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use std::io::Read as _;
    let mut file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut magic = Vec::with_capacity(2);
    file.by_ref().take(2).read_to_end(&mut magic).with_context(|| format!("reading {}", path.display()))?;
    // A gzip'd graph (benches/data ships them) is read through the decoder,
    // under the same limit on the text it expands to.
    let gzip = magic == [0x1f, 0x8b];
    let head = std::io::Cursor::new(magic).chain(file);
    let mut reader: Box<dyn std::io::Read> =
        if gzip { Box::new(flate2::read::GzDecoder::new(head)) } else { Box::new(head) };
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

/// Host memory a text graph needs before XLA sees it, checked against the
/// host limit ([`kiln::limits`]): each constant is held about four times
/// (the parsed literal, the StableHLO text, XLA's literal and the compiled
/// program); with `with_params`, every parameter once more (`kiln profile`
/// fills them with random data). Sizes use checked arithmetic.
pub fn check_graph_memory(
    graph: &kiln::compiler::ir::Graph,
    path: &std::path::Path,
    with_params: bool,
) -> kiln::Result<()> {
    use kiln::compiler::ir::Op;
    let constants = graph.nodes().try_fold(0u64, |acc, (_, n)| match &n.op {
        Op::Constant { literal } => acc.checked_add(u64::try_from(literal.bytes().len()).ok()?.checked_mul(4)?),
        _ => Some(acc),
    });
    let params = if with_params {
        graph
            .param_types()
            .iter()
            .try_fold(0u64, |acc, t| acc.checked_add(u64::try_from(t.checked_size_in_bytes()?).ok()?))
    } else {
        Some(0)
    };
    let total = constants.zip(params).and_then(|(c, p)| c.checked_add(p));
    let what = if with_params { "its constants and random parameters" } else { "its constants" };
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
