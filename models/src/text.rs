//! Text for the model zoo: a tokenizer (a `tokenizer.json`, or WordPiece,
//! byte-level BPE or Unigram trained on the user's own text, nothing
//! downloaded), the text's lines split into training and held-out parts, and
//! the batches each kind of model learns from: causal LM (the lines packed
//! into one stream), masked LM (BERT's 15% with 80/10/10), span corruption
//! (T5's sentinels).
//!
//! Variable-length batches are padded to a *bucket*: the smallest of a few
//! lengths (powers of two from 8, and the longest allowed) that holds the
//! batch's longest line, so a run compiles at most one program per bucket
//! (per pair of buckets for T5's input and target) however the lengths vary.
//!
//! Invariants: every id a batch holds is below the model's vocabulary (the
//! tokenizer's vocabulary is checked against it before any batch is made);
//! batches depend only on the seed and the step, never on timing.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use kiln_frontend::{FrontendError, Result, Tensor};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::unigram::{Unigram, UnigramTrainerBuilder};
use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainerBuilder};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::{AddedToken, Tokenizer};

/// The largest text file read (the tokenizer trains on all of it in memory).
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// Which tokenizer to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// BERT's: whitespace and punctuation words split into `##` pieces.
    WordPiece,
    /// GPT-2's and RoBERTa's: byte-level BPE (every byte has a token, so no
    /// text is unknown).
    Bpe,
    /// T5's and Llama's family: a Unigram language model over pieces.
    Unigram,
}

/// `--tokenizer`: a `tokenizer.json` to load, or `bpe:N`, `wordpiece:N`,
/// `unigram:N` to train one of `N` tokens on the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSpec {
    File(PathBuf),
    Train { kind: TokenizerKind, vocab: usize },
}

impl FromStr for TokenizerSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let kinds =
            [("bpe", TokenizerKind::Bpe), ("wordpiece", TokenizerKind::WordPiece), ("unigram", TokenizerKind::Unigram)];
        for (name, kind) in kinds {
            if let Some(n) = s.strip_prefix(name).and_then(|r| r.strip_prefix(':')) {
                let vocab: usize = n.parse().map_err(|_| format!("{s}: {name}:N takes a vocabulary size N"))?;
                if vocab < MIN_TRAINED_VOCAB {
                    return Err(format!("{s}: a trained vocabulary needs at least {MIN_TRAINED_VOCAB} tokens"));
                }
                return Ok(TokenizerSpec::Train { kind, vocab });
            }
        }
        if s.is_empty() {
            return Err("an empty --tokenizer: give a tokenizer.json or bpe:N, wordpiece:N, unigram:N".into());
        }
        Ok(TokenizerSpec::File(PathBuf::from(s)))
    }
}

/// The smallest vocabulary `bpe:N`, `wordpiece:N`, `unigram:N` accept.
pub const MIN_TRAINED_VOCAB: usize = 16;

/// The special tokens a batch needs, by id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Specials {
    pub pad: u32,
    /// BERT's `[CLS]` or RoBERTa's `<s>`: a sequence's first token.
    pub cls: Option<u32>,
    /// `[SEP]` or `</s>`: a sequence's last token (and T5's end).
    pub sep: Option<u32>,
    /// `[MASK]` or `<mask>`.
    pub mask: Option<u32>,
    pub unk: Option<u32>,
}

/// A tokenizer with its special tokens found.
pub struct TextTokenizer {
    inner: Tokenizer,
    pub specials: Specials,
    /// Where it came from, for messages.
    pub source: String,
}

fn find(t: &Tokenizer, names: &[&str]) -> Option<u32> {
    names.iter().find_map(|n| t.token_to_id(n))
}

const PAD: &[&str] = &["[PAD]", "<pad>", "<|endoftext|>", "</s>"];
const CLS: &[&str] = &["[CLS]", "<s>", "<|endoftext|>"];
const SEP: &[&str] = &["[SEP]", "</s>", "<|endoftext|>"];
const MASK: &[&str] = &["[MASK]", "<mask>"];
const UNK: &[&str] = &["[UNK]", "<unk>"];

impl TextTokenizer {
    fn with_specials(inner: Tokenizer, source: String) -> Result<TextTokenizer> {
        let Some(pad) = find(&inner, PAD) else {
            let reason = format!("{source} has no padding token (one of {PAD:?})");
            return Err(FrontendError::InvalidArgument { op: "tokenizer", reason });
        };
        let specials = Specials {
            pad,
            cls: find(&inner, CLS),
            sep: find(&inner, SEP),
            mask: find(&inner, MASK),
            unk: find(&inner, UNK),
        };
        Ok(TextTokenizer { inner, specials, source })
    }

    /// A `tokenizer.json` (as `tokenizers` and `transformers` save it).
    pub fn load(path: &Path) -> Result<TextTokenizer> {
        kiln_frontend::input::open(path)?; // a regular file (a FIFO would block)
        let inner = Tokenizer::from_file(path)
            .map_err(|e| FrontendError::Data { path: path.into(), reason: format!("not a tokenizer.json: {e}") })?;
        TextTokenizer::with_specials(inner, path.display().to_string())
    }

    /// A tokenizer of `kind` with about `vocab` tokens trained on `lines`,
    /// with the special tokens its family uses.
    pub fn train(kind: TokenizerKind, vocab: usize, lines: &[String]) -> Result<TextTokenizer> {
        let fail = |e: tokenizers::Error| FrontendError::InvalidArgument {
            op: "tokenizer",
            reason: format!("training a {kind:?} tokenizer of {vocab} tokens: {e}"),
        };
        let specials = |names: &[&str]| names.iter().map(|n| AddedToken::from(n.to_string(), true)).collect::<Vec<_>>();
        let mut inner;
        let mut trainer: TrainerWrapper = match kind {
            TokenizerKind::WordPiece => {
                inner = Tokenizer::new(WordPiece::default());
                inner.with_pre_tokenizer(Some(Whitespace {}));
                WordPieceTrainerBuilder::default()
                    .vocab_size(vocab)
                    .show_progress(false)
                    .special_tokens(specials(&["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
                    .build()
                    .into()
            }
            TokenizerKind::Bpe => {
                inner = Tokenizer::new(BPE::default());
                inner.with_pre_tokenizer(Some(ByteLevel::default()));
                inner.with_decoder(Some(ByteLevel::default()));
                BpeTrainerBuilder::new()
                    .vocab_size(vocab)
                    .show_progress(false)
                    .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                    .special_tokens(specials(&["<pad>", "<s>", "</s>", "<unk>", "<mask>"]))
                    .build()
                    .into()
            }
            TokenizerKind::Unigram => {
                inner = Tokenizer::new(Unigram::default());
                inner.with_pre_tokenizer(Some(Whitespace {}));
                UnigramTrainerBuilder::default()
                    .vocab_size(u32::try_from(vocab).unwrap_or(u32::MAX))
                    .show_progress(false)
                    .special_tokens(specials(&["<pad>", "<s>", "</s>", "<unk>", "<mask>"]))
                    .unk_token(Some("<unk>".into()))
                    .build()
                    .map_err(|e| FrontendError::InvalidArgument { op: "tokenizer", reason: e.to_string() })?
                    .into()
            }
        };
        inner.train(&mut trainer, lines.iter()).map_err(fail)?;
        TextTokenizer::with_specials(inner, format!("{kind:?} trained on the text ({vocab} tokens asked)"))
    }

    /// The tokens the tokenizer can produce (special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// `text`'s ids (no special tokens added); `line` (1-based) names it in
    /// an error. A line with text that maps to no token at all is an error.
    pub fn encode(&self, text: &str, line: usize, path: &Path) -> Result<Vec<u32>> {
        let bad = |reason: String| FrontendError::Data { path: path.into(), reason: format!("line {line}: {reason}") };
        let enc = self.inner.encode(text, false).map_err(|e| bad(format!("the tokenizer failed: {e}")))?;
        let ids = enc.get_ids().to_vec();
        if ids.is_empty() && !text.trim().is_empty() {
            return Err(bad(format!("{} maps none of this line's text to a token", self.source)));
        }
        Ok(ids)
    }

    /// The text of `ids` (special tokens left out).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| FrontendError::InvalidArgument { op: "tokenizer", reason: format!("decoding: {e}") })
    }

    /// The tokenizer as `tokenizer.json` text.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| FrontendError::InvalidArgument { op: "tokenizer", reason: e.to_string() })
    }

    /// A tokenizer from `tokenizer.json` text (`source` names it in messages).
    pub fn from_json(json: &str, source: String) -> Result<TextTokenizer> {
        let inner = json.parse::<Tokenizer>().map_err(|e| FrontendError::InvalidArgument {
            op: "tokenizer",
            reason: format!("{source}: not a tokenizer.json: {e}"),
        })?;
        TextTokenizer::with_specials(inner, source)
    }

    /// Writes the tokenizer as a `tokenizer.json`, atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = self
            .inner
            .to_string(true)
            .map_err(|e| FrontendError::InvalidArgument { op: "tokenizer", reason: e.to_string() })?;
        kiln_frontend::atomic_write::write_atomically(path, text.as_bytes())
    }
}

/// A text's lines with their (1-based) line numbers.
pub type Lines = Vec<(usize, String)>;

/// The non-blank lines of the text file `path`, with their line numbers.
pub fn read_lines(path: &Path) -> Result<Lines> {
    use std::io::Read as _;
    let io = |source| FrontendError::Io { path: path.into(), source };
    let file = kiln_frontend::input::open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_TEXT_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        let reason = format!("longer than the {MAX_TEXT_BYTES}-byte limit");
        return Err(FrontendError::Data { path: path.into(), reason });
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| FrontendError::Data { path: path.into(), reason: format!("not UTF-8 text: {e}") })?;
    let lines: Vec<(usize, String)> =
        text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).map(|(i, l)| (i + 1, l.to_string())).collect();
    if lines.len() < 2 {
        let reason =
            format!("{} non-blank line(s): training needs at least 2 (one is held out for validation)", lines.len());
        return Err(FrontendError::Data { path: path.into(), reason });
    }
    Ok(lines)
}

/// The lines split into training and held-out parts: every tenth line (at
/// least one) is held out.
pub fn split(lines: Lines) -> (Lines, Lines) {
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for (i, l) in lines.into_iter().enumerate() {
        if i % 10 == 9 {
            held.push(l);
        } else {
            train.push(l);
        }
    }
    if held.is_empty() {
        held.extend(train.pop());
    }
    (train, held)
}

/// A small deterministic generator (SplitMix64): batches from the seed and
/// the step only.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6a09_e667_f3bc_c909)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The lengths batches are padded to: powers of two from 8 below `max`, and
/// `max`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets(pub Vec<usize>);

impl Buckets {
    pub fn up_to(max: usize) -> Buckets {
        let mut b: Vec<usize> =
            std::iter::successors(Some(8usize), |l| l.checked_mul(2)).take_while(|&l| l < max).collect();
        b.push(max);
        Buckets(b)
    }

    /// The smallest bucket that holds `len` (the largest if none does: the
    /// caller truncates to it).
    pub fn fit(&self, len: usize) -> usize {
        self.0.iter().copied().find(|&b| b >= len).unwrap_or_else(|| self.0.last().copied().unwrap_or(len))
    }
}

/// Ids as an i32 batch tensor of `dims` a replica (`ids` holds every
/// replica's rows: [`crate::batch_rows`]).
fn ids_tensor(ids: &[u32], dims: &[usize]) -> Result<Tensor> {
    crate::batch_rows(&ids.iter().map(|&i| i as i32).collect::<Vec<i32>>(), dims.to_vec())
}

/// The rows a batch draws for `b` a replica: `b` for each replica of the run.
fn all_rows(b: usize) -> Result<usize> {
    Ok(b * kiln_frontend::replicas::global_replicas()?)
}

/// A next-token batch: `ids [b, seq]` and `targets [b · seq]`, windows of
/// the packed lines with the documents each row holds (`packing`: a line's
/// end token ends its document).
pub struct CausalBatch {
    pub ids: Tensor,
    pub targets: Tensor,
    pub packing: crate::Packing,
}

/// A masked-LM batch padded to its bucket: ids, token types, mask `[b, len]`,
/// labels and weights `[b · len]` (weight 1 where a token was chosen).
pub struct MlmBatch {
    pub ids: Tensor,
    pub types: Tensor,
    pub mask: Tensor,
    pub labels: Tensor,
    pub weights: Tensor,
    pub len: usize,
}

/// A span-corruption batch: the corrupted input and the target (sentinels and
/// the spans they replaced), each padded to its bucket, with their masks.
pub struct SpanBatch {
    pub input_ids: Tensor,
    pub input_mask: Tensor,
    pub labels: Tensor,
    pub label_mask: Tensor,
    pub lens: (usize, usize),
}

/// A classification batch padded to its bucket: ids, token types, mask `[b,
/// len]` and the class of each row `[b]`.
pub struct ClassBatch {
    pub ids: Tensor,
    pub types: Tensor,
    pub mask: Tensor,
    pub labels: Tensor,
    pub len: usize,
}

/// `label<TAB>text` lines split: the class names (`classes` when given,
/// else the labels seen, sorted) and each line's class id with its text. A
/// line without a tab, with an empty label or text, or with a label outside
/// `classes` is an error naming it.
pub fn labelled(lines: Lines, classes: Option<&[String]>, path: &Path) -> Result<(Vec<String>, Vec<u32>, Lines)> {
    let bad =
        |n: usize, reason: String| FrontendError::Data { path: path.into(), reason: format!("line {n}: {reason}") };
    let mut split = Vec::with_capacity(lines.len());
    for (n, line) in lines {
        let Some((label, text)) = line.split_once('\t') else {
            return Err(bad(n, "no tab: a labelled line is `label<TAB>text`".into()));
        };
        let (label, text) = (label.trim(), text.trim());
        if label.is_empty() || text.is_empty() {
            return Err(bad(n, "an empty label or text: a labelled line is `label<TAB>text`".into()));
        }
        split.push((n, label.to_string(), text.to_string()));
    }
    let names: Vec<String> = match classes {
        Some(c) => c.to_vec(),
        None => {
            let set: std::collections::BTreeSet<&str> = split.iter().map(|(_, l, _)| l.as_str()).collect();
            set.into_iter().map(str::to_string).collect()
        }
    };
    if names.len() < 2 {
        let reason = format!("{} class(es) ({names:?}): classification needs at least 2", names.len());
        return Err(FrontendError::Data { path: path.into(), reason });
    }
    let mut ids = Vec::with_capacity(split.len());
    let mut texts = Vec::with_capacity(split.len());
    for (n, label, text) in split {
        let Some(id) = names.iter().position(|c| *c == label) else {
            return Err(bad(n, format!("label {label:?} is not one of the model's classes {names:?}")));
        };
        ids.push(id as u32);
        texts.push((n, text));
    }
    Ok((names, ids, texts))
}

/// `source<TAB>target` lines split: each line's number, source and
/// target. A line without a tab, or with an empty side, is an error naming it.
pub fn pairs(lines: Lines, path: &Path) -> Result<Vec<(usize, String, String)>> {
    lines
        .into_iter()
        .map(|(n, line)| {
            let bad = |reason: &str| FrontendError::Data { path: path.into(), reason: format!("line {n}: {reason}") };
            let (a, b) = line.split_once('\t').ok_or_else(|| bad("no tab: a pair is `source<TAB>target`"))?;
            let (a, b) = (a.trim(), b.trim());
            if a.is_empty() || b.is_empty() {
                return Err(bad("an empty source or target: a pair is `source<TAB>target`"));
            }
            Ok((n, a.to_string(), b.to_string()))
        })
        .collect()
}

/// The training (or held-out) text as token ids, per line, ready to batch.
pub struct Corpus {
    pub lines: Vec<Vec<u32>>,
    /// Each line's class (classification data).
    pub classes: Vec<u32>,
    /// Each line's target (sequence-to-sequence data).
    pub targets: Vec<Vec<u32>>,
}

impl Corpus {
    /// Tokenizes `lines`, refusing ids at or above `vocab` (a tokenizer larger
    /// than the model's vocabulary).
    pub fn new(tok: &TextTokenizer, lines: &[(usize, String)], vocab: usize, path: &Path) -> Result<Corpus> {
        let mut out = Vec::with_capacity(lines.len());
        for (n, line) in lines {
            let ids = tok.encode(line, *n, path)?;
            if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                let reason =
                    format!("line {n}: token id {bad} of {} is outside the model's vocabulary of {vocab}", tok.source);
                return Err(FrontendError::Data { path: path.into(), reason });
            }
            out.push(ids);
        }
        Ok(Corpus { lines: out, classes: Vec::new(), targets: Vec::new() })
    }

    /// A sequence-to-sequence batch of `b` random pairs: each source and
    /// target followed by `eos` (truncated to the largest bucket), each side
    /// padded with `pad` to its own bucket.
    pub fn pairs(&self, per: usize, buckets: &Buckets, eos: u32, pad: u32, rng: &mut Rng) -> Result<SpanBatch> {
        let b = all_rows(per)?;
        let max = buckets.fit(usize::MAX);
        let picked: Vec<usize> = (0..b).map(|_| rng.below(self.lines.len())).collect();
        let side = |rows: &[Vec<u32>]| -> Result<(Tensor, Tensor, usize)> {
            let rows: Vec<Vec<u32>> = picked
                .iter()
                .map(|&i| {
                    let mut r: Vec<u32> =
                        rows.get(i).map_or(&[][..], Vec::as_slice).iter().take(max - 1).copied().collect();
                    r.push(eos);
                    r
                })
                .collect();
            let len = buckets.fit(rows.iter().map(Vec::len).max().unwrap_or(1));
            let (mut ids, mut mask) = (vec![pad; b * len], vec![0u32; b * len]);
            for (i, r) in rows.iter().enumerate() {
                for (j, &t) in r.iter().enumerate() {
                    ids[i * len + j] = t;
                    mask[i * len + j] = 1;
                }
            }
            Ok((ids_tensor(&ids, &[per, len])?, ids_tensor(&mask, &[per, len])?, len))
        };
        let (input_ids, input_mask, li) = side(&self.lines)?;
        let (labels, label_mask, lt) = side(&self.targets)?;
        Ok(SpanBatch { input_ids, input_mask, labels, label_mask, lens: (li, lt) })
    }

    /// A classification batch of `b` random lines, each `cls + line + sep`
    /// (truncated to the largest bucket), padded with `pad` to the bucket of
    /// the longest, with the lines' classes.
    pub fn classify(&self, per: usize, buckets: &Buckets, sp: &Specials, rng: &mut Rng) -> Result<ClassBatch> {
        let b = all_rows(per)?;
        let max = buckets.fit(usize::MAX);
        let (cls, sep) = (sp.cls.unwrap_or(sp.pad), sp.sep.unwrap_or(sp.pad));
        let picked: Vec<usize> = (0..b).map(|_| rng.below(self.lines.len())).collect();
        let rows: Vec<Vec<u32>> = picked
            .iter()
            .map(|&i| {
                let mut r = vec![cls];
                r.extend(self.lines[i].iter().take(max.saturating_sub(2)));
                r.push(sep);
                r
            })
            .collect();
        let len = buckets.fit(rows.iter().map(Vec::len).max().unwrap_or(1));
        let (mut ids, mut mask) = (vec![sp.pad; b * len], vec![0u32; b * len]);
        for (i, r) in rows.iter().enumerate() {
            for (j, &t) in r.iter().enumerate() {
                ids[i * len + j] = t;
                mask[i * len + j] = 1;
            }
        }
        let labels: Vec<u32> = picked.iter().map(|&i| self.classes.get(i).copied().unwrap_or(0)).collect();
        Ok(ClassBatch {
            ids: ids_tensor(&ids, &[per, len])?,
            types: ids_tensor(&vec![0u32; b * len], &[per, len])?,
            mask: ids_tensor(&mask, &[per, len])?,
            labels: ids_tensor(&labels, &[per])?,
            len,
        })
    }

    pub fn tokens(&self) -> usize {
        self.lines.iter().map(Vec::len).sum()
    }

    /// The lines packed into one stream, each followed by `eos`.
    fn stream(&self, eos: u32) -> Vec<u32> {
        let mut s = Vec::with_capacity(self.tokens() + self.lines.len());
        for l in &self.lines {
            s.extend_from_slice(l);
            s.push(eos);
        }
        s
    }

    /// A causal batch of `b` windows of `seq + 1` tokens at random offsets
    /// of the packed stream (lines separated by `eos`), each row's documents
    /// kept apart by its packing.
    pub fn causal(&self, per: usize, seq: usize, eos: u32, rng: &mut Rng, path: &Path) -> Result<CausalBatch> {
        let b = all_rows(per)?;
        let stream = self.stream(eos);
        if stream.len() <= seq + 1 {
            let reason = format!("{} tokens, fewer than one sequence of {} (--seq + 1)", stream.len(), seq + 1);
            return Err(FrontendError::Data { path: path.into(), reason });
        }
        let (mut ids, mut targets) = (Vec::with_capacity(b * seq), Vec::with_capacity(b * seq));
        for _ in 0..b {
            let at = rng.below(stream.len() - seq);
            ids.extend_from_slice(&stream[at..at + seq]);
            targets.extend_from_slice(&stream[at + 1..at + seq + 1]);
        }
        let ends: Vec<bool> = ids.iter().map(|&t| t == eos).collect();
        Ok(CausalBatch {
            ids: ids_tensor(&ids, &[per, seq])?,
            targets: ids_tensor(&targets, &[per * seq])?,
            packing: crate::Packing::from_ends(&ends, per, seq)?,
        })
    }

    /// A masked-LM batch of `b` random lines, each `cls + line + sep`
    /// (truncated to the largest bucket), padded with `pad` to the bucket of
    /// the longest; 15% of the real tokens chosen (at least one a batch), of
    /// them 80% replaced by `mask`, 10% by a random token below `vocab`, 10%
    /// kept.
    pub fn mlm(&self, per: usize, buckets: &Buckets, sp: &Specials, vocab: usize, rng: &mut Rng) -> Result<MlmBatch> {
        let b = all_rows(per)?;
        let max = buckets.fit(usize::MAX);
        let (cls, sep) = (sp.cls.unwrap_or(sp.pad), sp.sep.unwrap_or(sp.pad));
        let mask_id = sp.mask.unwrap_or(sp.pad);
        let rows: Vec<Vec<u32>> = (0..b)
            .map(|_| {
                let line = &self.lines[rng.below(self.lines.len())];
                let mut r = vec![cls];
                r.extend(line.iter().take(max.saturating_sub(2)));
                r.push(sep);
                r
            })
            .collect();
        let len = buckets.fit(rows.iter().map(Vec::len).max().unwrap_or(1));
        let n = b * len;
        let (mut ids, mut mask, mut labels, mut weights) =
            (vec![sp.pad; n], vec![0u32; n], vec![0u32; n], vec![0f32; n]);
        for (i, r) in rows.iter().enumerate() {
            for (j, &t) in r.iter().enumerate() {
                let k = i * len + j;
                ids[k] = t;
                mask[k] = 1;
                // The first and last tokens are cls and sep: never chosen.
                if j == 0 || j + 1 == r.len() || rng.unit() >= 0.15 {
                    continue;
                }
                labels[k] = t;
                weights[k] = 1.0;
                let u = rng.unit();
                ids[k] = if u < 0.8 {
                    mask_id
                } else if u < 0.9 {
                    rng.below(vocab) as u32
                } else {
                    t
                };
            }
        }
        if !weights.iter().any(|&w| w > 0.0) {
            // At least one prediction a batch (row 0's first real token, or
            // its cls if the line is empty): the loss is a mean over them.
            let k = usize::from(rows[0].len() > 2);
            labels[k] = ids[k];
            weights[k] = 1.0;
            ids[k] = mask_id;
        }
        Ok(MlmBatch {
            ids: ids_tensor(&ids, &[per, len])?,
            types: ids_tensor(&vec![0u32; b * len], &[per, len])?,
            mask: ids_tensor(&mask, &[per, len])?,
            labels: ids_tensor(&labels, &[per * len])?,
            weights: crate::batch_rows(&weights, vec![per * len])?,
            len,
        })
    }

    /// A span-corruption batch of `b` random lines (truncated to the largest
    /// bucket less one): about 15% of each line's tokens, in spans of about 3,
    /// replaced in the input by sentinels `vocab - 1`, `vocab - 2`, ...; the
    /// target is each sentinel followed by its span, then `eos`.
    pub fn spans(
        &self,
        per: usize,
        buckets: &Buckets,
        eos: u32,
        pad: u32,
        vocab: usize,
        rng: &mut Rng,
    ) -> Result<SpanBatch> {
        let b = all_rows(per)?;
        let max = buckets.fit(usize::MAX);
        let (mut inputs, mut targets) = (Vec::with_capacity(b), Vec::with_capacity(b));
        for _ in 0..b {
            let line: Vec<u32> = self.lines[rng.below(self.lines.len())].iter().take(max - 1).copied().collect();
            let noise = ((line.len() as f64 * 0.15).round() as usize).max(1).min(line.len().max(1));
            let spans = noise.div_ceil(3).clamp(1, SENTINELS);
            let mut starts: Vec<usize> = (0..spans).map(|_| rng.below(line.len().max(1))).collect();
            starts.sort_unstable();
            starts.dedup();
            let (mut input, mut target, mut at, mut sentinel) = (Vec::new(), Vec::new(), 0usize, 0usize);
            for s in starts {
                if s < at {
                    continue;
                }
                let end = (s + 3).min(line.len());
                let id = (vocab - 1 - sentinel) as u32;
                input.extend_from_slice(&line[at..s]);
                input.push(id);
                target.push(id);
                target.extend_from_slice(&line[s..end]);
                at = end;
                sentinel += 1;
            }
            input.extend_from_slice(&line[at.min(line.len())..]);
            input.push(eos);
            target.push(eos);
            target.truncate(max);
            inputs.push(input);
            targets.push(target);
        }
        let pad_to = |rows: &[Vec<u32>]| -> Result<(Tensor, Tensor, usize)> {
            let len = buckets.fit(rows.iter().map(Vec::len).max().unwrap_or(1));
            let (mut ids, mut mask) = (vec![pad; b * len], vec![0u32; b * len]);
            for (i, r) in rows.iter().enumerate() {
                for (j, &t) in r.iter().take(len).enumerate() {
                    ids[i * len + j] = t;
                    mask[i * len + j] = 1;
                }
            }
            Ok((ids_tensor(&ids, &[per, len])?, ids_tensor(&mask, &[per, len])?, len))
        };
        let (input_ids, input_mask, li) = pad_to(&inputs)?;
        let (labels, label_mask, lt) = pad_to(&targets)?;
        Ok(SpanBatch { input_ids, input_mask, labels, label_mask, lens: (li, lt) })
    }
}

/// How many sentinel tokens T5's span corruption reserves at the top of the
/// vocabulary when kiln sizes the model (Hugging Face's T5 has 100).
pub const SENTINELS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_every_length_up_to_the_largest() {
        let b = Buckets::up_to(40);
        assert_eq!(b.0, vec![8, 16, 32, 40]);
        assert_eq!((b.fit(1), b.fit(8), b.fit(9), b.fit(33), b.fit(41)), (8, 8, 16, 40, 40));
        assert_eq!(Buckets::up_to(5).0, vec![5]);
    }

    #[test]
    fn a_trained_tokenizer_is_the_same_every_time() {
        let lines: Vec<String> = (0..200)
            .map(|i| format!("word{} and other{} words, sometimes {} unusual", i % 13, i % 7, ["very", "quite"][i % 2]))
            .collect();
        // BPE only: `tokenizers`' WordPiece and Unigram trainers break ties
        // in hash-map order, so two trainings on the same text can differ
        // (WordPiece: 5 of 5 did on another text; Unigram here, in the ids of
        // equal-scored pieces). Runs that must repeat pass a tokenizer.json,
        // and a checkpoint keeps the one its run used.
        for kind in [TokenizerKind::Bpe] {
            let vocab = |t: &TextTokenizer| {
                t.inner.get_vocab(true).into_iter().collect::<std::collections::BTreeMap<String, u32>>()
            };
            let first = TextTokenizer::train(kind, 120, &lines).unwrap();
            for _ in 0..4 {
                assert_eq!(vocab(&TextTokenizer::train(kind, 120, &lines).unwrap()), vocab(&first), "{kind:?}");
            }
            let ids = first.encode("word3 and other5 words", 1, Path::new("t")).unwrap();
            assert_eq!(first.decode(&ids).unwrap().split_whitespace().count(), 4, "{kind:?}");
        }
    }

    #[test]
    fn tokenizer_specs_parse_and_refuse() {
        assert_eq!("bpe:300".parse(), Ok(TokenizerSpec::Train { kind: TokenizerKind::Bpe, vocab: 300 }));
        assert_eq!("tok.json".parse(), Ok(TokenizerSpec::File("tok.json".into())));
        assert!("wordpiece:x".parse::<TokenizerSpec>().unwrap_err().contains("vocabulary size"));
        assert!("unigram:3".parse::<TokenizerSpec>().unwrap_err().contains("at least 16"));
    }
}
