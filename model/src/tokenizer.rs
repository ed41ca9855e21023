//! Tokenizers built from GGUF metadata, reproducing llama.cpp's tokenization.
//!
//! Two models are supported, named by `tokenizer.ggml.model`:
//!
//! - `"llama"`: SentencePiece-style ([`TokenizerKind::Spm`], Gemma, Llama 1/2). Spaces become
//!   `▁` (U+2581), an optional `▁` is prefixed (`tokenizer.ggml.add_space_prefix`; Gemma 3 has
//!   it off), and adjacent pieces merge greedily: the pair whose merged piece has the highest
//!   score first, the leftmost on ties. Pieces that are not tokens fall back to `<0xXX>` byte
//!   tokens, else to the unknown token.
//! - `"gpt2"`: byte-level BPE ([`TokenizerKind::Bpe`], Llama 3, Qwen 2, SmolLM). The text is
//!   split by the pre-tokenizer regexes that `tokenizer.ggml.pre` names, every byte is mapped
//!   to GPT-2's printable stand-in character, and pairs merge by rank
//!   (`tokenizer.ggml.merges`, lowest rank first, leftmost on ties).
//!
//! Before either model runs, special tokens are cut out of the text as whole tokens, the
//! longest first (as llama.cpp does): user-defined tokens (type 4, in Gemma 3 e.g. runs of
//! spaces, newlines or tabs and HTML tags) always, control and unknown tokens (types 3 and 2,
//! e.g. `<start_of_turn>`) only when [`EncodeOptions::parse_special`] is on. As in llama.cpp,
//! tokens whose text marks the end of a turn (`</s>`, `<|eot_id|>`, ...) count as control
//! tokens whatever their type.
//!
//! ```no_run
//! # fn main() -> kvdb_model::Result<()> {
//! # let metadata = std::collections::HashMap::new();
//! use kvdb_model::{EncodeOptions, SpecialTokens, Tokenizer};
//! let tokenizer = Tokenizer::from_gguf(&metadata)?;
//! let ids = tokenizer.encode("<start_of_turn>user\nHello", EncodeOptions::default())?;
//! assert_eq!(tokenizer.decode(&ids, SpecialTokens::Render)?, "<start_of_turn>user\nHello");
//! # Ok(()) }
//! ```
//!
//! Known differences from llama.cpp: the pre-tokenizer regexes run on `fancy-regex` with
//! Rust's Unicode tables (llama.cpp hand-codes them with its own tables; they can differ on
//! unassigned code points), token attributes `lstrip`/`rstrip` (set by llama.cpp only for
//! Phi-3 and some BERT models) are not applied, special tokens of equal length are tried in id
//! order (llama.cpp's order among them is unspecified), and [`Tokenizer::decode`] does not
//! apply llama.cpp's `clean_up_tokenization_spaces` pass, so that decoding stays lossless.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, HashSet};

use candle_core::quantized::gguf_file::Value;

use crate::error::{ModelError, Result};

/// Which tokenization algorithm a vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// SentencePiece-style score-driven merging with byte fallback (`tokenizer.ggml.model =
    /// "llama"`).
    Spm,
    /// Byte-level BPE with rank-driven merges (`tokenizer.ggml.model = "gpt2"`).
    Bpe,
}

/// What [`Tokenizer::decode`] does with control tokens (`<bos>`, `<start_of_turn>`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Written out as their text (a prompt shown as the model saw it).
    Render,
    /// Left out (text for a reader).
    Skip,
}

/// How [`Tokenizer::encode`] treats a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Put the BOS token first.
    pub add_bos: bool,
    /// Put the EOS token last.
    pub add_eos: bool,
    /// Recognise control tokens written in the text (`<start_of_turn>`, `<bos>`, ...).
    /// User-defined tokens are recognised either way.
    pub parse_special: bool,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        Self {
            add_bos: false,
            add_eos: false,
            parse_special: true,
        }
    }
}

// Token attributes, as llama.cpp derives them from `tokenizer.ggml.token_type`.
const ATTR_UNKNOWN: u8 = 1 << 0;
const ATTR_UNUSED: u8 = 1 << 1;
const ATTR_NORMAL: u8 = 1 << 2;
const ATTR_CONTROL: u8 = 1 << 3;
const ATTR_USER_DEFINED: u8 = 1 << 4;
const ATTR_BYTE: u8 = 1 << 5;

/// Attributes of tokens that are cut out of the text before the model runs.
const ATTR_SPECIAL_MATCH: u8 = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN;
/// Attributes of tokens that are only matched and rendered on request.
const ATTR_SPECIAL: u8 = ATTR_CONTROL | ATTR_UNKNOWN;

/// The SentencePiece whitespace marker.
const SPM_SPACE: char = '\u{2581}';

/// Token texts that end a generation (llama.cpp's list, `llama-vocab.cpp`).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle token texts that llama.cpp treats as control tokens; the last three
/// groups (pad, repo, file separator) also end a generation.
const FIM_TEXTS: &[(&str, &[&str], bool)] = &[
    (
        "tokenizer.ggml.fim_pre_token_id",
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        "tokenizer.ggml.fim_suf_token_id",
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        "tokenizer.ggml.fim_mid_token_id",
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        "tokenizer.ggml.fim_pad_token_id",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        "tokenizer.ggml.fim_rep_token_id",
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"], true),
];

// Pre-tokenizer regexes (llama.cpp's adaptations of the tokenizer.json patterns).
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer regexes for a `tokenizer.ggml.pre` value, whether whole words that are
/// tokens skip merging, and whether BOS is added by default.
fn pre_tokenizer(pre: &str) -> Option<(Vec<&'static str>, bool, bool)> {
    let spec = match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (vec![RE_LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => (vec![RE_LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "hunyuan"
        | "solar-open" => (vec![RE_QWEN2], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            (vec![r"\p{N}", RE_GPT2], false, false)
        }
        "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais"
        | "exaone4" | "trillion" | "granite-docling" | "jina-v1-en" | "jina-v2-code"
        | "roberta-bpe" => (vec![RE_GPT2], false, false),
        "" | "default" => (
            vec![
                r"[\p{P}\$\+<=>\^~\|]+",
                RE_GPT2,
                r"\p{N}+",
                r"[0-9][0-9][0-9]",
            ],
            false,
            false,
        ),
        _ => return None,
    };
    Some(spec)
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the other
/// bytes for the code points 256, 257, ... in byte order.
fn gpt2_byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let printable = (0x21..=0x7e).contains(&byte)
            || (0xa1..=0xac).contains(&byte)
            || (0xae..=0xff).contains(&byte);
        let code = if printable {
            byte as u32
        } else {
            let code = next;
            next += 1;
            code
        };
        *slot = char::from_u32(code).unwrap_or('\u{fffd}');
    }
    table
}

/// A special token's place in the matching order: longer texts first, then lower ids.
#[derive(Debug, Clone, Copy)]
struct SpecialEntry {
    id: u32,
    rank: u32,
}

#[derive(Debug, Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    token: Option<SpecialEntry>,
}

/// A byte trie over the texts of the special tokens.
#[derive(Debug)]
struct SpecialMatcher {
    nodes: Vec<TrieNode>,
    first_byte: [bool; 256],
}

impl SpecialMatcher {
    fn new(tokens: &[String], ids: &[u32]) -> Self {
        let mut order: Vec<u32> = ids.to_vec();
        order.sort_by(|&a, &b| {
            let (la, lb) = (tokens[a as usize].len(), tokens[b as usize].len());
            lb.cmp(&la).then(a.cmp(&b))
        });
        let mut matcher = Self {
            nodes: vec![TrieNode::default()],
            first_byte: [false; 256],
        };
        for (rank, &id) in order.iter().enumerate() {
            let text = tokens[id as usize].as_bytes();
            if let Some(&b) = text.first() {
                matcher.first_byte[b as usize] = true;
            }
            let mut node = 0usize;
            for &b in text {
                let found = matcher.nodes[node]
                    .children
                    .iter()
                    .find(|&&(c, _)| c == b)
                    .map(|&(_, n)| n as usize);
                node = match found {
                    Some(n) => n,
                    None => {
                        let n = matcher.nodes.len();
                        matcher.nodes.push(TrieNode::default());
                        matcher.nodes[node].children.push((b, n as u32));
                        n
                    }
                };
            }
            matcher.nodes[node].token = Some(SpecialEntry {
                id,
                rank: rank as u32,
            });
        }
        matcher
    }

    /// Every (rank, start, length, id) of a special token occurring in `text`.
    fn candidates(
        &self,
        text: &[u8],
        attrs: &[u8],
        parse_special: bool,
    ) -> Vec<(u32, usize, usize, u32)> {
        let mut found = Vec::new();
        for start in 0..text.len() {
            if !self.first_byte[text[start] as usize] {
                continue;
            }
            let mut node = 0usize;
            for (offset, &b) in text[start..].iter().enumerate() {
                let next = self.nodes[node]
                    .children
                    .iter()
                    .find(|&&(c, _)| c == b)
                    .map(|&(_, n)| n as usize);
                let Some(next) = next else { break };
                node = next;
                if let Some(entry) = self.nodes[node].token {
                    let attr = attrs[entry.id as usize];
                    if parse_special || attr & ATTR_SPECIAL == 0 {
                        found.push((entry.rank, start, offset + 1, entry.id));
                    }
                }
            }
        }
        found
    }
}

/// A piece of the input after special tokens are cut out.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Byte-level BPE state: merge ranks and the pre-tokenizer.
#[derive(Debug)]
struct BpeModel {
    /// rank of the merge (left, right), looked up as `ranks[left][right]`.
    ranks: HashMap<String, HashMap<String, u32>>,
    regexes: Vec<fancy_regex::Regex>,
    ignore_merges: bool,
    byte_chars: [char; 256],
    /// The byte each GPT-2 stand-in character (code point below 324) decodes to.
    char_bytes: Vec<Option<u8>>,
}

impl BpeModel {
    /// Reads `tokenizer.ggml.pre` and `tokenizer.ggml.merges`; also returns whether the
    /// pre-tokenizer's models add BOS by default.
    fn from_gguf(md: &HashMap<String, Value>) -> Result<(BpeModel, bool)> {
        let pre = meta_str(md, "tokenizer.ggml.pre")?.unwrap_or("");
        let (patterns, ignore_merges, add_bos) = pre_tokenizer(pre).ok_or_else(|| {
            tok_err(format!(
                "unsupported pre-tokenizer `{pre}` (`tokenizer.ggml.pre`); kvdb supports \
                 llama-bpe/llama3, qwen2, smollm, gpt-2 and default"
            ))
        })?;
        let regexes = patterns
            .iter()
            .map(|p| {
                fancy_regex::Regex::new(p).map_err(|e| {
                    tok_err(format!("pre-tokenizer regex `{p}` does not compile: {e}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merges = meta_array(md, "tokenizer.ggml.merges")?.ok_or_else(|| {
            tok_err("GGUF metadata has no `tokenizer.ggml.merges`, which a `gpt2` tokenizer needs")
        })?;
        let mut ranks: HashMap<String, HashMap<String, u32>> = HashMap::new();
        for (rank, v) in merges.iter().enumerate() {
            let Value::String(line) = v else {
                return Err(tok_err(format!(
                    "`tokenizer.ggml.merges[{rank}]` should be a string"
                )));
            };
            // Split at the first space after the first byte, as llama.cpp does; the first
            // occurrence of a pair keeps its rank.
            let Some(pos) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            ranks
                .entry(line[..pos].to_string())
                .or_default()
                .entry(line[pos + 1..].to_string())
                .or_insert(rank as u32);
        }
        let byte_chars = gpt2_byte_chars();
        let mut char_bytes = vec![None; 324];
        for (b, c) in byte_chars.iter().enumerate() {
            if let Some(slot) = char_bytes.get_mut(*c as usize) {
                *slot = u8::try_from(b).ok();
            }
        }
        let model = BpeModel {
            ranks,
            regexes,
            ignore_merges,
            byte_chars,
            char_bytes,
        };
        Ok((model, add_bos))
    }

    fn rank(&self, left: &str, right: &str) -> Option<u32> {
        self.ranks.get(left).and_then(|m| m.get(right)).copied()
    }

    /// Splits `text` into words: each regex in turn splits every chunk into its matches and
    /// the gaps between them.
    fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let mut chunks = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(chunks.len() * 2);
            for chunk in chunks {
                let mut last = 0;
                for m in re.find_iter(chunk) {
                    let m = m.map_err(|e| {
                        ModelError::Tokenizer(format!("pre-tokenizer regex failed: {e}"))
                    })?;
                    if m.start() == m.end() {
                        continue;
                    }
                    if m.start() > last {
                        next.push(&chunk[last..m.start()]);
                    }
                    next.push(m.as_str());
                    last = m.end();
                }
                if last < chunk.len() {
                    next.push(&chunk[last..]);
                }
            }
            chunks = next;
        }
        Ok(chunks)
    }
}

/// A symbol of the merge loops: a byte range of the word, linked to its live neighbours.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

/// The UTF-8 characters of `text` as a linked list of symbols.
fn char_symbols(text: &str) -> Vec<Symbol> {
    let count = text.chars().count();
    text.char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            start,
            len: c.len_utf8(),
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == count { NONE } else { i + 1 },
        })
        .collect()
}

/// Unlinks `syms[right]` after merging it into `syms[left]`.
fn merge_symbols(syms: &mut [Symbol], left: usize, right: usize) {
    syms[left].len += syms[right].len;
    syms[right].len = 0;
    syms[left].next = syms[right].next;
    let next = syms[right].next;
    if next != NONE {
        syms[next].prev = left;
    }
}

/// A candidate merge of the adjacent symbols `left` and `right`: highest priority first,
/// then leftmost.
#[derive(Debug)]
struct Bigram<P> {
    priority: P,
    left: usize,
    right: usize,
    size: usize,
}

impl<P: Ord> PartialEq for Bigram<P> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl<P: Ord> Eq for Bigram<P> {}
impl<P: Ord> PartialOrd for Bigram<P> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<P: Ord> Ord for Bigram<P> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A SentencePiece merge priority: the merged token's score, incomparable scores equal.
#[derive(Debug, Clone, Copy)]
struct SpmScore(f32);

impl PartialEq for SpmScore {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for SpmScore {}
impl PartialOrd for SpmScore {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for SpmScore {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.partial_cmp(&other.0).unwrap_or(Ordering::Equal)
    }
}

/// Greedy bigram merging over the characters of `text`: repeatedly merges the adjacent pair
/// of highest priority (ties to the leftmost) until no pair scores, then yields the pieces
/// in order. `priority(pair, split)` scores the pair `pair[..split]` + `pair[split..]`, or
/// returns `None` where the pair may not merge.
fn bigram_merge<P: Ord>(
    text: &str,
    mut priority: impl FnMut(&str, usize) -> Option<P>,
) -> impl Iterator<Item = &str> {
    let mut syms = char_symbols(text);
    let mut heap = BinaryHeap::with_capacity(syms.len());
    let mut try_add =
        |syms: &[Symbol], heap: &mut BinaryHeap<Bigram<P>>, left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            let (a, b) = (syms[left], syms[right]);
            let size = a.len + b.len;
            if let Some(priority) = priority(&text[a.start..a.start + size], a.len) {
                heap.push(Bigram {
                    priority,
                    left,
                    right,
                    size,
                });
            }
        };
    for i in 1..syms.len() {
        try_add(&syms, &mut heap, i - 1, i);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left, b.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
            continue;
        }
        merge_symbols(&mut syms, l, r);
        try_add(&syms, &mut heap, syms[l].prev, l);
        try_add(&syms, &mut heap, l, syms[l].next);
    }
    let mut i = if syms.is_empty() { NONE } else { 0 };
    std::iter::from_fn(move || {
        if i == NONE {
            return None;
        }
        let s = syms[i];
        i = s.next;
        Some(&text[s.start..s.start + s.len])
    })
}

/// A tokenizer read from GGUF metadata; immutable and shareable between threads.
pub struct Tokenizer {
    kind: TokenizerKind,
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u8>,
    token_to_id: HashMap<String, u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    eog: HashSet<u32>,
    specials: SpecialMatcher,
    /// The byte-fallback token of every byte.
    byte_tokens: [Option<u32>; 256],
    bpe: Option<BpeModel>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("add_space_prefix", &self.add_space_prefix)
            .finish_non_exhaustive()
    }
}

fn tok_err(msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer(msg.into())
}

fn value_as_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

fn meta_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(v) => Err(tok_err(format!(
            "`{key}` should be a string, found {:?}",
            v.value_type()
        ))),
    }
}

fn meta_bool(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => match value_as_i64(v) {
            Some(x) => Ok(Some(x != 0)),
            None => Err(tok_err(format!(
                "`{key}` should be a bool, found {:?}",
                v.value_type()
            ))),
        },
    }
}

fn meta_id(md: &HashMap<String, Value>, key: &str) -> Result<Option<i64>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => match value_as_i64(v) {
            Some(x) => Ok(Some(x)),
            None => Err(tok_err(format!(
                "`{key}` should be an integer token id, found {:?}",
                v.value_type()
            ))),
        },
    }
}

fn meta_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a [Value]>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(v) => Err(tok_err(format!(
            "`{key}` should be an array, found {:?}",
            v.value_type()
        ))),
    }
}

/// Parses a `<0xXX>` byte-token text.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The algorithm named by `tokenizer.ggml.model`.
fn read_kind(md: &HashMap<String, Value>) -> Result<TokenizerKind> {
    let model = meta_str(md, "tokenizer.ggml.model")?.ok_or_else(|| {
        tok_err("GGUF metadata has no `tokenizer.ggml.model`; the file carries no tokenizer")
    })?;
    match model {
        "llama" => Ok(TokenizerKind::Spm),
        "gpt2" => Ok(TokenizerKind::Bpe),
        other => Err(tok_err(format!(
            "unsupported tokenizer model `{other}` (`tokenizer.ggml.model`); kvdb supports \
             `llama` (SentencePiece) and `gpt2` (byte-level BPE)"
        ))),
    }
}

/// Token texts, scores and attributes.
struct Vocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u8>,
}

/// Reads `tokenizer.ggml.tokens`, `scores` and `token_type`.
fn read_vocab(md: &HashMap<String, Value>) -> Result<Vocab> {
    let values = meta_array(md, "tokenizer.ggml.tokens")?.ok_or_else(|| {
        tok_err("GGUF metadata has no `tokenizer.ggml.tokens` list; the file carries no vocabulary")
    })?;
    if values.is_empty() {
        return Err(tok_err("`tokenizer.ggml.tokens` is empty"));
    }
    if values.len() > u32::MAX as usize {
        return Err(tok_err(
            "`tokenizer.ggml.tokens` has more than 2^32 entries",
        ));
    }
    let n = values.len();
    let tokens = values
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            // llama.cpp renames empty tokens so that every text maps to one id.
            Value::String(s) if s.is_empty() => Ok(format!("[EMPTY_{i}]")),
            Value::String(s) => Ok(s.clone()),
            other => Err(tok_err(format!(
                "`tokenizer.ggml.tokens[{i}]` should be a string, found {:?}",
                other.value_type()
            ))),
        })
        .collect::<Result<Vec<String>>>()?;
    let per_token = |key: &str| -> Result<Option<&[Value]>> {
        match meta_array(md, key)? {
            Some(a) if a.len() < n => Err(tok_err(format!(
                "`{key}` has {} entries for {n} tokens",
                a.len()
            ))),
            other => Ok(other.map(|a| &a[..n])),
        }
    };
    let scores = match per_token("tokenizer.ggml.scores")? {
        None => vec![0.0; n],
        Some(a) => a
            .iter()
            .map(|v| match v {
                Value::F32(x) => Ok(*x),
                Value::F64(x) => Ok(*x as f32),
                v => value_as_i64(v)
                    .map(|x| x as f32)
                    .ok_or_else(|| tok_err("`tokenizer.ggml.scores` should hold numbers")),
            })
            .collect::<Result<Vec<f32>>>()?,
    };
    let attrs = match per_token("tokenizer.ggml.token_type")? {
        None => vec![ATTR_NORMAL; n],
        Some(a) => a
            .iter()
            .map(|v| {
                let t = value_as_i64(v)
                    .ok_or_else(|| tok_err("`tokenizer.ggml.token_type` should hold integers"))?;
                Ok(match t {
                    1 => ATTR_NORMAL,
                    2 => ATTR_UNKNOWN,
                    3 => ATTR_CONTROL,
                    4 => ATTR_USER_DEFINED,
                    5 => ATTR_UNUSED,
                    6 => ATTR_BYTE,
                    _ => 0,
                })
            })
            .collect::<Result<Vec<u8>>>()?,
    };
    Ok(Vocab {
        tokens,
        scores,
        attrs,
    })
}

/// A special token id from the metadata; absent or out-of-range ids give `None`.
fn special_id(md: &HashMap<String, Value>, key: &str, n: usize) -> Result<Option<u32>> {
    Ok(meta_id(md, key)?
        .filter(|&id| id >= 0 && (id as u64) < n as u64)
        .map(|id| id as u32))
}

/// The end-of-generation set, marking look-alike tokens as control tokens on the way, in
/// llama.cpp's order: fill-in-the-middle tokens, tokens whose text ends a turn, gpt-oss
/// channel tokens (user-defined), EOS/EOT/EOM, then the gpt-oss and Gemma 4 exceptions.
fn end_of_generation(
    md: &HashMap<String, Value>,
    token_to_id: &HashMap<String, u32>,
    attrs: &mut [u8],
    eos: Option<u32>,
) -> Result<HashSet<u32>> {
    let n = attrs.len();
    let mut eog = HashSet::new();
    for &(key, texts, ends) in FIM_TEXTS {
        let id = match special_id(md, key, n)? {
            Some(id) => Some(id),
            None => {
                // llama.cpp takes the first look-alike it meets; take the lowest id.
                let found = texts
                    .iter()
                    .filter_map(|t| token_to_id.get(*t).copied())
                    .min();
                if let Some(id) = found {
                    attrs[id as usize] |= ATTR_CONTROL;
                }
                found
            }
        };
        if ends {
            eog.extend(id);
        }
    }
    for text in EOG_TEXTS {
        if let Some(&id) = token_to_id.get(*text) {
            eog.insert(id);
            attrs[id as usize] |= ATTR_CONTROL;
        }
    }
    for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(&id) = token_to_id.get(text) {
            attrs[id as usize] = ATTR_USER_DEFINED;
        }
    }
    eog.extend(eos);
    eog.extend(special_id(md, "tokenizer.ggml.eot_token_id", n)?);
    eog.extend(special_id(md, "tokenizer.ggml.eom_token_id", n)?);

    let in_eog =
        |eog: &HashSet<u32>, text: &str| token_to_id.get(text).is_some_and(|id| eog.contains(id));
    // gpt-oss and solar-open: <|end|> is not the end when <|return|>/<|call|> exist.
    let call = in_eog(&eog, "<|call|>") || in_eog(&eog, "<|calls|>");
    if call && (in_eog(&eog, "<|return|>") || in_eog(&eog, "<|flush|>")) {
        if let Some(&end) = token_to_id.get("<|end|>") {
            if eog.remove(&end) {
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
    }
    // Gemma 4 and PLaMo 2 have a normal </s>.
    if in_eog(&eog, "<|tool_response>") || in_eog(&eog, "<|plamo:eos|>") {
        if let Some(&s) = token_to_id.get("</s>") {
            if eog.remove(&s) {
                attrs[s as usize] = ATTR_NORMAL;
            }
        }
    }
    Ok(eog)
}

/// The token each byte falls back to: `<0xXX>` (SentencePiece) or the one-character token of
/// an ASCII byte (llama.cpp looks up the one-byte string; BPE vocabularies only have those).
fn byte_fallback_tokens(
    token_to_id: &HashMap<String, u32>,
    kind: TokenizerKind,
) -> [Option<u32>; 256] {
    let mut table = [None; 256];
    for (b, slot) in table.iter_mut().enumerate() {
        let hex = match kind {
            TokenizerKind::Spm => token_to_id.get(format!("<0x{b:02X}>").as_str()).copied(),
            TokenizerKind::Bpe => None,
        };
        *slot = hex.or_else(|| {
            let byte = u8::try_from(b).ok().filter(u8::is_ascii)?;
            token_to_id
                .get(char::from(byte).to_string().as_str())
                .copied()
        });
    }
    table
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's metadata (the `tokenizer.ggml.*` keys).
    ///
    /// Fails with [`ModelError::Tokenizer`] when the token list is missing, the model or
    /// pre-tokenizer is not supported, or the arrays are inconsistent.
    pub fn from_gguf(metadata: &HashMap<String, Value>) -> Result<Tokenizer> {
        let md = metadata;
        let kind = read_kind(md)?;
        let Vocab {
            tokens,
            scores,
            mut attrs,
        } = read_vocab(md)?;
        let n = tokens.len();
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }

        // llama.cpp's defaults per model, overridden by the file.
        let (bpe, mut add_bos, mut add_space_prefix) = match kind {
            TokenizerKind::Spm => (None, true, true),
            TokenizerKind::Bpe => {
                let (bpe, add_bos) = BpeModel::from_gguf(md)?;
                (Some(bpe), add_bos, false)
            }
        };
        let mut add_eos = false;
        if let Some(b) = meta_bool(md, "tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = b;
        }
        if let Some(b) = meta_bool(md, "tokenizer.ggml.add_bos_token")? {
            add_bos = b;
        }
        if let Some(b) = meta_bool(md, "tokenizer.ggml.add_eos_token")? {
            add_eos = b;
        }

        // Special ids: SentencePiece defaults as in llama.cpp; ids out of range are ignored.
        let spm = kind == TokenizerKind::Spm;
        let default = |id: u32| {
            if spm && (id as usize) < n {
                Some(id)
            } else {
                None
            }
        };
        let bos = special_id(md, "tokenizer.ggml.bos_token_id", n)?.or(default(1));
        let eos = special_id(md, "tokenizer.ggml.eos_token_id", n)?.or(default(2));
        let unk = special_id(md, "tokenizer.ggml.unknown_token_id", n)?.or(default(0));
        let eog = end_of_generation(md, &token_to_id, &mut attrs, eos)?;

        let special_ids: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & ATTR_SPECIAL_MATCH != 0)
            .collect();
        let specials = SpecialMatcher::new(&tokens, &special_ids);
        let byte_tokens = byte_fallback_tokens(&token_to_id, kind);

        Ok(Tokenizer {
            kind,
            tokens,
            scores,
            attrs,
            token_to_id,
            bos,
            eos,
            unk,
            add_bos,
            add_eos,
            add_space_prefix,
            eog,
            specials,
            byte_tokens,
            bpe,
        })
    }

    /// The options a prompt is encoded with: BOS/EOS as the GGUF file asks
    /// (`tokenizer.ggml.add_bos_token` / `add_eos_token`), special tokens parsed.
    pub fn prompt_options(&self) -> EncodeOptions {
        EncodeOptions {
            add_bos: self.add_bos,
            add_eos: self.add_eos,
            parse_special: true,
        }
    }

    /// The algorithm of this vocabulary.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The text of a token as stored in the vocabulary (with `▁` or GPT-2 byte characters).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a token given its vocabulary text (e.g. `"<end_of_turn>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The beginning-of-sequence token.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether generating `id` ends the answer: EOS and the tokens llama.cpp treats as
    /// end-of-generation (Gemma's `<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`, ...).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Tokenizes `text`.
    pub fn encode(&self, text: &str, opts: EncodeOptions) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if opts.add_bos {
            out.push(
                self.bos
                    .ok_or_else(|| tok_err("BOS requested but the vocabulary has no BOS token"))?,
            );
        }
        let fragments = self.partition(text, opts.parse_special);
        match &self.bpe {
            None => {
                let mut prev_special = true;
                let mut escaped = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Fragment::Text(t) => {
                            escaped.clear();
                            if self.add_space_prefix && prev_special {
                                escaped.push(SPM_SPACE);
                            }
                            for c in t.chars() {
                                escaped.push(if c == ' ' { SPM_SPACE } else { c });
                            }
                            self.spm_encode(&escaped, &mut out)?;
                            prev_special = false;
                        }
                    }
                }
            }
            Some(bpe) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(t) => self.bpe_encode(bpe, t, &mut out)?,
                    }
                }
            }
        }
        if opts.add_eos {
            out.push(
                self.eos
                    .ok_or_else(|| tok_err("EOS requested but the vocabulary has no EOS token"))?,
            );
        }
        Ok(out)
    }

    /// Cuts the special tokens out of `text`, longest first (llama.cpp's order: each special
    /// token in turn claims its leftmost non-overlapping occurrences in what is left).
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let bytes = text.as_bytes();
        let mut candidates = self.specials.candidates(bytes, &self.attrs, parse_special);
        if candidates.is_empty() {
            return vec![Fragment::Text(text)];
        }
        candidates.sort_unstable();
        let mut taken = vec![false; bytes.len()];
        let mut accepted: Vec<(usize, usize, u32)> = Vec::new();
        for (_, start, len, id) in candidates {
            if taken[start..start + len].iter().any(|&t| t) {
                continue;
            }
            taken[start..start + len].iter_mut().for_each(|t| *t = true);
            accepted.push((start, len, id));
        }
        accepted.sort_unstable();
        let mut fragments = Vec::with_capacity(accepted.len() * 2 + 1);
        let mut last = 0;
        for (start, len, id) in accepted {
            if start > last {
                fragments.push(Fragment::Text(&text[last..start]));
            }
            fragments.push(Fragment::Token(id));
            last = start + len;
        }
        if last < text.len() {
            fragments.push(Fragment::Text(&text[last..]));
        }
        fragments
    }

    fn push_byte_fallback(&self, byte: u8, out: &mut Vec<u32>) -> Result<()> {
        match self.byte_tokens[byte as usize].or(self.unk) {
            Some(id) => {
                out.push(id);
                Ok(())
            }
            None => Err(tok_err(format!(
                "byte 0x{byte:02X} has no token and the vocabulary has no unknown token"
            ))),
        }
    }

    /// SentencePiece merging over an escaped fragment.
    fn spm_encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let pieces = bigram_merge(text, |pair, _| {
            self.token_to_id
                .get(pair)
                .map(|&id| SpmScore(self.scores[id as usize]))
        });
        for piece in pieces {
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        self.push_byte_fallback(b, out)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Byte-level BPE over a fragment.
    fn bpe_encode(&self, bpe: &BpeModel, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut word = String::new();
        for raw in bpe.split(text)? {
            word.clear();
            for &b in raw.as_bytes() {
                word.push(bpe.byte_chars[b as usize]);
            }
            if bpe.ignore_merges {
                if let Some(&id) = self.token_to_id.get(word.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            // Lowest rank first.
            let pieces = bigram_merge(&word, |pair, split| {
                bpe.rank(&pair[..split], &pair[split..]).map(Reverse)
            });
            for piece in pieces {
                match self.token_to_id.get(piece) {
                    Some(&id) => out.push(id),
                    None => {
                        // llama.cpp keeps the bytes that are one-character tokens, drops the rest.
                        for &b in piece.as_bytes() {
                            if let Some(id) = self.byte_tokens[b as usize] {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends the bytes of one token: control and unknown tokens only if `special` renders
    /// them.
    fn append_piece(&self, id: u32, special: SpecialTokens, out: &mut Vec<u8>) -> Result<()> {
        let text = self
            .tokens
            .get(id as usize)
            .ok_or(ModelError::TokenOutOfRange {
                id,
                vocab: self.tokens.len(),
            })?;
        let attr = self.attrs[id as usize];
        if attr & ATTR_SPECIAL != 0 {
            if special == SpecialTokens::Render {
                out.extend_from_slice(text.as_bytes());
            }
        } else if attr & ATTR_USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if attr & ATTR_NORMAL != 0 {
            match &self.bpe {
                None => {
                    for c in text.chars() {
                        let c = if c == SPM_SPACE { ' ' } else { c };
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
                Some(bpe) => {
                    for c in text.chars() {
                        match bpe.char_bytes.get(c as usize).copied().flatten() {
                            Some(b) => out.push(b),
                            None => {
                                let mut buf = [0u8; 4];
                                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                }
            }
        } else if attr & ATTR_BYTE != 0 {
            match parse_byte_token(text) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(text.as_bytes()),
            }
        }
        // Unused and undefined tokens render as nothing, as in llama.cpp.
        Ok(())
    }

    /// Turns ids back into text. Control tokens (`<bos>`, `<start_of_turn>`, ...) appear only
    /// with [`SpecialTokens::Render`]; byte-fallback tokens are reassembled into characters (invalid
    /// sequences become U+FFFD). For vocabularies that add a space prefix, the space that
    /// encoding put before the first word is removed again, so decoding is lossless for text
    /// without special tokens.
    pub fn decode(&self, ids: &[u32], special: SpecialTokens) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_prefix = self.add_space_prefix && self.kind == TokenizerKind::Spm;
        for (i, &id) in ids.iter().enumerate() {
            let start = bytes.len();
            self.append_piece(id, special, &mut bytes)?;
            if strip_prefix {
                if i == 0 && Some(id) == self.bos {
                    continue;
                }
                strip_prefix = false;
                if self.attrs[id as usize] & ATTR_NORMAL != 0 && bytes.get(start) == Some(&b' ') {
                    bytes.remove(start);
                }
            }
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// A decoder for a stream of generated tokens (control tokens are not rendered).
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            pending: Vec::new(),
        }
    }
}

/// Decodes generated tokens one at a time, returning only complete UTF-8 text: the bytes of a
/// character split across byte-fallback tokens are held back until the character is whole.
///
/// ```no_run
/// # fn demo(tokenizer: &kvdb_model::Tokenizer, ids: &[u32]) -> kvdb_model::Result<()> {
/// let mut stream = tokenizer.stream_decoder();
/// for &id in ids {
///     print!("{}", stream.push(id)?);
/// }
/// print!("{}", stream.finish());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds a token and returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer
            .append_piece(id, SpecialTokens::Skip, &mut self.pending)?;
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        Some(bad) => {
                            out.push('\u{fffd}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Ends the stream: returns the held-back bytes, an incomplete character as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
