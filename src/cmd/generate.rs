//! `kiln generate hf:DIR --prompt TEXT`: text from a GPT-2 or Llama
//! directory (as `kiln train gpt2|llama --save-hf` or `transformers` writes
//! it) with its tokenizer, and `kiln generate --checkpoint FILE --prompt
//! TEXT` from a checkpoint of `kiln train gpt` (the character-level GPT, its
//! characters in the checkpoint), through `kiln::models::generate` (a
//! key/value cache, two programs whatever the lengths, sampling in the graph).

use std::path::PathBuf;

use anyhow::Context as _;
use kiln::models::generate::{generate, Decoder, Sampling};
use kiln::models::hf::{self, HfModel};
use kiln::models::text::TextTokenizer;
use kiln::models::Spelling;
use serde_json::json;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The model: `hf:DIR`, a Hugging Face GPT-2 or Llama directory.
    #[arg(value_name = "hf:DIR", required_unless_present = "checkpoint", conflicts_with = "checkpoint")]
    pub model: Option<String>,
    /// A checkpoint `kiln train gpt --checkpoint FILE` wrote.
    #[arg(long, value_name = "FILE", conflicts_with = "tokenizer")]
    pub checkpoint: Option<PathBuf>,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// The tokenizer (default: DIR/tokenizer.json).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// New tokens at most (fewer if the end-of-text token comes first, or
    /// the context is full).
    #[arg(long, default_value_t = 50)]
    pub max_new_tokens: usize,
    /// The cache's length, prompt and new tokens together (default: GPT-2's
    /// positions, 512 for Llama).
    #[arg(long)]
    pub context: Option<usize>,
    /// Softmax temperature; 0 is greedy (the argmax).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens holding P of the probability, in (0, 1].
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// The in-graph generator's seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// End with one JSON object (for scripts) instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p };
    sampling.check()?;
    if let Some(path) = &args.checkpoint {
        return from_checkpoint(args, path, &sampling);
    }
    let model_arg = args.model.as_deref().unwrap_or_default();
    let Some(dir) = model_arg.strip_prefix("hf:").filter(|d| !d.is_empty()).map(PathBuf::from) else {
        anyhow::bail!("{model_arg}: give hf:DIR, a Hugging Face GPT-2 or Llama directory");
    };
    let tok_path = args.tokenizer.clone().unwrap_or_else(|| dir.join("tokenizer.json"));
    let tokenizer = TextTokenizer::load(&tok_path).with_context(|| format!("the tokenizer {}", tok_path.display()))?;
    let (_, model) = hf::load(&dir, Spelling::Builtin)?;
    let decoder = match &model {
        HfModel::Gpt2(m) => Decoder::Gpt2(m),
        HfModel::Llama(m) => Decoder::Llama(m),
        other => anyhow::bail!(
            "{}: a {} model; generation needs a decoder (gpt2 or llama)",
            dir.display(),
            other.model_type()
        ),
    };
    let context = args.context.unwrap_or_else(|| decoder.max_context().unwrap_or(512));
    let prompt = tokenizer.encode(&args.prompt, 1, std::path::Path::new("--prompt"))?;
    kiln::manual_seed(args.seed);
    // The end of a line in the zoo's packed text.
    let stop = tokenizer.specials.sep.or(Some(tokenizer.specials.pad));
    let max_new = new_tokens(args, prompt.len(), context);
    let out = generate(decoder, &prompt, max_new, context, &sampling, stop)?;
    let text = tokenizer.decode(&out.tokens)?;
    report(args, model.model_type(), prompt.len(), context, max_new, &out, &text);
    Ok(())
}

/// `--checkpoint FILE`: the character-level GPT `kiln train gpt` saved; its
/// context is the model's window.
fn from_checkpoint(args: &GenerateArgs, path: &std::path::Path, sampling: &Sampling) -> anyhow::Result<()> {
    let (model, _params, chars) = kiln::models::generate::load_gpt_checkpoint(path)?;
    let context = args.context.unwrap_or(model.config().seq);
    let prompt: Vec<u32> = chars.encode(&args.prompt).into_iter().map(|c| c as u32).collect();
    if prompt.len() < args.prompt.chars().count() {
        eprintln!("kiln: characters of the prompt the model never saw are left out");
    }
    let max_new = new_tokens(args, prompt.len(), context);
    kiln::manual_seed(args.seed);
    let out = generate(Decoder::Gpt(&model), &prompt, max_new, context, sampling, None)?;
    let ids: Vec<i32> = out.tokens.iter().map(|&t| t as i32).collect();
    report(args, "gpt", prompt.len(), context, max_new, &out, &chars.decode(&ids));
    Ok(())
}

/// New tokens up to the context's end, said when that is fewer than asked
/// (a prompt that does not fit is the library's error).
fn new_tokens(args: &GenerateArgs, prompt: usize, context: usize) -> usize {
    let max_new = if prompt <= context { args.max_new_tokens.min(context - prompt) } else { args.max_new_tokens };
    if max_new < args.max_new_tokens {
        eprintln!(
            "kiln: at most {max_new} new tokens: the prompt's {prompt} fill the rest of the context of {context}"
        );
    }
    max_new
}

/// Prints a generation: the text (and a line of figures on stderr), or one
/// JSON object.
fn report(
    args: &GenerateArgs,
    model: &str,
    prompt_tokens: usize,
    context: usize,
    max_new: usize,
    out: &kiln::models::generate::Generated,
    text: &str,
) {
    if args.json {
        println!(
            "{}",
            json!({
                "model": model,
                "prompt_tokens": prompt_tokens,
                "new_tokens": out.tokens.len(),
                "tokens": out.tokens,
                "text": text,
                "context": context,
                "first_token_ms": out.prompt_ms,
                "decode_ms": out.decode_ms,
                "decode_tokens_per_second": out.decode_tokens_per_second,
                "max_new_tokens": max_new,
                "programs": out.programs,
            })
        );
    } else {
        // Byte-level tokenizers keep a word's leading space in its token;
        // others decode words without it.
        let gap = if model == "gpt" || text.starts_with(' ') || args.prompt.ends_with(' ') { "" } else { " " };
        println!("{}{gap}{text}", args.prompt);
        eprintln!(
            "kiln: {} new tokens; first after {:.1} ms, then {:.1} tokens/s; {} programs",
            out.tokens.len(),
            out.prompt_ms,
            out.decode_tokens_per_second,
            out.programs
        );
    }
}
