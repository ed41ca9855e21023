//! Tokenizer tests: Gemma 3 against llama.cpp goldens, byte-level BPE and SentencePiece on
//! tiny handmade vocabularies, streaming decode, and metadata errors.
//!
//! The golden files come from `scripts/reference/tokenizer_golden.py` (llama-cpp-python);
//! the Gemma 3 tests need the default model (`kvdb model fetch`, or `KVDB_MODEL=path`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use candle_core::quantized::gguf_file::{Content, Value};
use kvdb_model::{EncodeOptions, ModelError, Result, SpecialTokens, Tokenizer, TokenizerKind};

// ---------------------------------------------------------------------------------------------
// Gemma 3 (SentencePiece) against llama.cpp

fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVDB_MODEL") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").unwrap_or_default();
    Path::new(&home).join(".cache/kvdb/models/gemma-3-270m-q4_k_m.gguf")
}

fn load_gemma() -> Result<Tokenizer> {
    let path = model_path();
    if !path.exists() {
        return Err(ModelError::MissingFile { path });
    }
    let mut file = std::fs::File::open(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    let content = Content::read(&mut file).map_err(|e| ModelError::InvalidGguf {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Tokenizer::from_gguf(&content.metadata)
}

/// The Gemma 3 tokenizer, loaded once for all tests. A missing model fails the test with the
/// hint to run `kvdb model fetch`.
fn gemma() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<std::result::Result<Tokenizer, String>> = OnceLock::new();
    match TOKENIZER.get_or_init(|| load_gemma().map_err(|e| e.to_string())) {
        Ok(t) => t,
        Err(e) => panic!("cannot load the Gemma 3 tokenizer: {e}"),
    }
}

fn data_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

struct GoldenCase {
    text: String,
    label: String,
    parse_special: bool,
    ids: Vec<u32>,
    detok_special: Option<String>,
    detok_plain: Option<String>,
}

fn read_json(path: &Path) -> serde_json::Value {
    let raw = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn golden_cases() -> (serde_json::Value, Vec<GoldenCase>) {
    let golden = read_json(&data_path("tests/data/gemma3_tokenizer_golden.json"));
    let cases = golden["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let (text, label) = match c["text_file"].as_str() {
                Some(file) => {
                    let path = repo_path(file);
                    let text = std::fs::read_to_string(&path)
                        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
                    (text, file.to_string())
                }
                None => {
                    let text = c["text"].as_str().expect("text").to_string();
                    let label = format!("{text:?}");
                    (text, label)
                }
            };
            GoldenCase {
                text,
                label,
                parse_special: c["parse_special"].as_bool().expect("parse_special"),
                ids: ids_of(&c["ids"]),
                detok_special: c["detok_special"].as_str().map(str::to_string),
                detok_plain: c["detok_plain"].as_str().map(str::to_string),
            }
        })
        .collect();
    (golden, cases)
}

fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn gemma3_matches_llama_cpp_ids() -> Result<()> {
    let tok = gemma();
    let (golden, cases) = golden_cases();
    assert!(cases.len() >= 35, "golden has only {} cases", cases.len());
    let mut failures = Vec::new();
    let mut total_ids = 0;
    for case in &cases {
        let opts = EncodeOptions {
            add_bos: false,
            add_eos: false,
            parse_special: case.parse_special,
        };
        let ours = tok.encode(&case.text, opts)?;
        total_ids += case.ids.len();
        if ours != case.ids {
            let at = first_difference(&ours, &case.ids);
            let lo = at.saturating_sub(3);
            failures.push(format!(
                "{} (parse_special={}): first difference at {at}: ours {:?} vs llama.cpp {:?}",
                case.label.chars().take(80).collect::<String>(),
                case.parse_special,
                &ours[lo..ours.len().min(at + 5)],
                &case.ids[lo..case.ids.len().min(at + 5)],
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from llama.cpp (golden made from {} with sha256 {}; \
         tested model {}):\n{}",
        failures.len(),
        cases.len(),
        golden["model"],
        golden["model_sha256"],
        model_path().display(),
        failures.join("\n")
    );
    eprintln!("{} cases, {total_ids} ids match llama.cpp", cases.len());
    Ok(())
}

#[test]
fn gemma3_decode_matches_llama_cpp_and_round_trips() -> Result<()> {
    let tok = gemma();
    let (_, cases) = golden_cases();
    for case in &cases {
        // llama.cpp's own detokenization of the golden ids.
        if let Some(expected) = &case.detok_special {
            assert_eq!(
                &tok.decode(&case.ids, SpecialTokens::Render)?,
                expected,
                "{}",
                case.label
            );
        }
        if let Some(expected) = &case.detok_plain {
            assert_eq!(
                &tok.decode(&case.ids, SpecialTokens::Skip)?,
                expected,
                "{}",
                case.label
            );
        }
        // Gemma 3 has no space prefix and no normalisation: decoding with control tokens
        // rendered gives back every input exactly.
        let ids = tok.encode(
            &case.text,
            EncodeOptions {
                parse_special: case.parse_special,
                ..EncodeOptions::default()
            },
        )?;
        assert_eq!(
            tok.decode(&ids, SpecialTokens::Render)?,
            case.text,
            "{}",
            case.label
        );
    }
    Ok(())
}

#[test]
fn gemma3_plain_text_round_trips_without_special_rendering() -> Result<()> {
    let tok = gemma();
    let (_, cases) = golden_cases();
    let mut plain = 0;
    for case in cases
        .iter()
        .filter(|c| c.detok_plain.as_deref() == Some(c.text.as_str()))
    {
        let opts = EncodeOptions {
            parse_special: case.parse_special,
            ..EncodeOptions::default()
        };
        let ids = tok.encode(&case.text, opts)?;
        assert_eq!(
            tok.decode(&ids, SpecialTokens::Skip)?,
            case.text,
            "{}",
            case.label
        );
        plain += 1;
    }
    assert!(plain >= 30, "only {plain} plain-text cases");
    let gpl = std::fs::read_to_string(repo_path("tests/data/gpl-3.txt"))
        .unwrap_or_else(|e| panic!("tests/data/gpl-3.txt: {e}"));
    let ids = tok.encode(&gpl, EncodeOptions::default())?;
    assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, gpl);
    Ok(())
}

#[test]
fn gemma3_vocabulary_facts_match_llama_cpp() -> Result<()> {
    let tok = gemma();
    let (golden, _) = golden_cases();
    assert_eq!(tok.kind(), TokenizerKind::Spm);
    assert_eq!(
        tok.vocab_size() as u64,
        golden["vocab_size"].as_u64().expect("vocab_size")
    );
    assert_eq!(tok.bos_id().map(u64::from), golden["bos_id"].as_u64());
    assert_eq!(tok.eos_id().map(u64::from), golden["eos_id"].as_u64());
    let opts = tok.prompt_options();
    assert_eq!(opts.add_bos, golden["add_bos"].as_bool().expect("add_bos"));
    assert_eq!(opts.add_eos, golden["add_eos"].as_bool().expect("add_eos"));
    assert!(opts.parse_special);
    // End of generation: exactly llama.cpp's set (<eos>, <end_of_turn>, </s>).
    let eog: Vec<u32> = ids_of(&golden["eog_ids"]);
    for id in 0..tok.vocab_size() as u32 {
        assert_eq!(
            tok.is_end_of_generation(id),
            eog.contains(&id),
            "token {id} {:?}",
            tok.token(id)
        );
    }
    assert_eq!(
        tok.token_id("<end_of_turn>")
            .map(|id| tok.is_end_of_generation(id)),
        Some(true)
    );
    assert_eq!(tok.token(2), Some("<bos>"));
    assert_eq!(tok.token(u32::MAX), None);
    Ok(())
}

#[test]
fn gemma3_prompt_options_and_special_parsing() -> Result<()> {
    let tok = gemma();
    let turn = "<start_of_turn>user\nHi<end_of_turn>";
    let ids = tok.encode(turn, tok.prompt_options())?;
    let start = tok.token_id("<start_of_turn>").expect("<start_of_turn>");
    let end = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
    assert_eq!(ids.first().copied(), tok.bos_id());
    assert_eq!(ids[1], start);
    assert_eq!(ids.last().copied(), Some(end));
    assert_eq!(
        tok.decode(&ids, SpecialTokens::Render)?,
        format!("<bos>{turn}")
    );
    assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, "user\nHi");

    let literal = EncodeOptions {
        parse_special: false,
        ..EncodeOptions::default()
    };
    let ids = tok.encode(turn, literal)?;
    assert!(!ids.contains(&start) && !ids.contains(&end));
    assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, turn);
    // User-defined tokens are matched either way.
    let bold = tok.token_id("<b>").expect("<b>");
    assert!(tok.encode("<b>x</b>", literal)?.contains(&bold));

    let with_eos = EncodeOptions {
        add_bos: true,
        add_eos: true,
        parse_special: true,
    };
    let ids = tok.encode("", with_eos)?;
    assert_eq!(ids, vec![2, 1]);
    Ok(())
}

#[test]
fn gemma3_stream_decoder_holds_back_split_characters() -> Result<()> {
    let tok = gemma();
    // A private-use character has no token: four byte-fallback tokens.
    let text = "a\u{f0000}b é 日本";
    let ids = tok.encode(text, EncodeOptions::default())?;
    let bytes: Vec<u32> = (0..4).map(|i| 238 + [0xf3, 0xb0, 0x80, 0x80][i]).collect();
    assert!(
        ids.windows(4).any(|w| w == bytes.as_slice()),
        "expected <0xF3><0xB0><0x80><0x80> in {ids:?}"
    );
    let mut stream = tok.stream_decoder();
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(stream.push(id)?);
    }
    pieces.push(stream.finish());
    assert_eq!(pieces.concat(), text);
    // The three leading bytes of the private-use character come back empty.
    let held = pieces.iter().filter(|p| p.is_empty()).count();
    assert!(held >= 3, "pieces: {pieces:?}");
    assert!(
        pieces.iter().any(|p| p == "\u{f0000}"),
        "pieces: {pieces:?}"
    );

    // An incomplete character at the end comes out as U+FFFD on finish.
    let mut stream = tok.stream_decoder();
    assert_eq!(stream.push(bytes[0])?, "");
    assert_eq!(stream.push(bytes[1])?, "");
    assert_eq!(stream.finish(), "\u{fffd}");
    // An invalid byte in the middle becomes U+FFFD right away.
    let mut stream = tok.stream_decoder();
    let a = tok.encode("a", EncodeOptions::default())?;
    assert_eq!(stream.push(238 + 0x80)?, "\u{fffd}");
    assert_eq!(stream.push(a[0])?, "a");
    // Control tokens are not rendered in the stream; unknown ids are errors.
    assert_eq!(stream.push(106)?, "");
    assert!(matches!(
        stream.push(u32::MAX),
        Err(ModelError::TokenOutOfRange { .. })
    ));
    Ok(())
}

#[test]
fn gemma3_encodes_10kb_in_milliseconds() -> Result<()> {
    let tok = gemma();
    let gpl = std::fs::read_to_string(repo_path("tests/data/gpl-3.txt"))
        .unwrap_or_else(|e| panic!("tests/data/gpl-3.txt: {e}"));
    let mut cut = 10_000;
    while !gpl.is_char_boundary(cut) {
        cut += 1;
    }
    let text = &gpl[..cut];
    tok.encode(text, EncodeOptions::default())?;
    let t = Instant::now();
    let rounds = 5;
    for _ in 0..rounds {
        tok.encode(text, EncodeOptions::default())?;
    }
    let per = t.elapsed() / rounds;
    eprintln!("encoding 10 KB: {per:?}");
    // Generous bound (debug builds, busy machines); release takes a few milliseconds.
    assert!(per.as_millis() < 500, "encoding 10 KB took {per:?}");
    Ok(())
}

#[test]
fn gemma3_logits_golden_tokens_match() -> Result<()> {
    // The logits golden's prompt is BOS + the first tokens of gpl-3.txt.
    let path = data_path("tests/data/gemma3_logits_golden.json");
    if !path.exists() {
        panic!(
            "{} is missing: run scripts/reference/logits_golden.py",
            path.display()
        );
    }
    let golden = read_json(&path);
    let tok = gemma();
    let gpl = std::fs::read_to_string(repo_path("tests/data/gpl-3.txt"))
        .unwrap_or_else(|e| panic!("tests/data/gpl-3.txt: {e}"));
    let chars = golden["text_chars"].as_u64().expect("text_chars") as usize;
    let text: String = gpl.chars().take(chars).collect();
    let expected = ids_of(&golden["tokens"]);
    let mut ours = tok.encode(&text, tok.prompt_options())?;
    ours.truncate(expected.len());
    assert_eq!(ours, expected);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE on a tiny vocabulary

const TYPE_NORMAL: i32 = 1;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's byte-to-character table, written out independently of the crate.
fn gpt2_char(byte: u8) -> char {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let b = u32::from(byte);
    if printable(b) {
        return char::from(byte);
    }
    let offset = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + offset).expect("valid char")
}

/// Metadata of a `model` ("gpt2", "llama") tokenizer with these tokens and token types.
fn vocab_metadata(model: &str, tokens: Vec<String>, types: Vec<i32>) -> HashMap<String, Value> {
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String(model.into()));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    md
}

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
}

/// Ids 0..256 are the 256 byte characters (id == byte), then:
/// 256 `<|begin|>` (control, BOS), 257 `<|end|>` (control, EOS), 258 `he`, 259 `ll`,
/// 260 `llo`, 261 `hello`, 262 `Ġw`, 263 `or`, 264 `Ġwor`, 265 `Ã©` (é), 266 `<tag>`
/// (user-defined), 267 `34`, 268 `12`, 269 `45`, 270 `Ġhello`.
fn bpe_metadata(pre: &str) -> HashMap<String, Value> {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| gpt2_char(b).to_string()).collect();
    let mut types = vec![TYPE_NORMAL; 256];
    let extra = [
        ("<|begin|>", TYPE_CONTROL),
        ("<|end|>", TYPE_CONTROL),
        ("he", TYPE_NORMAL),
        ("ll", TYPE_NORMAL),
        ("llo", TYPE_NORMAL),
        ("hello", TYPE_NORMAL),
        ("Ġw", TYPE_NORMAL),
        ("or", TYPE_NORMAL),
        ("Ġwor", TYPE_NORMAL),
        ("Ã©", TYPE_NORMAL),
        ("<tag>", TYPE_USER_DEFINED),
        ("34", TYPE_NORMAL),
        ("12", TYPE_NORMAL),
        ("45", TYPE_NORMAL),
        ("Ġhello", TYPE_NORMAL),
    ];
    for (t, ty) in extra {
        tokens.push(t.to_string());
        types.push(ty);
    }
    let merges = [
        "3 4", "h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "Ã ©", "1 2", "4 5",
        "Ġ hello",
    ];
    let mut md = vocab_metadata("gpt2", tokens, types);
    md.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
    md.insert("tokenizer.ggml.merges".into(), strings(&merges));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(256));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(257));
    md
}

fn bpe(pre: &str) -> Result<Tokenizer> {
    Tokenizer::from_gguf(&bpe_metadata(pre))
}

fn plain() -> EncodeOptions {
    EncodeOptions::default()
}

/// A byte-level vocabulary trained on gpl-3.txt with merges that cross word, space and digit
/// boundaries, tokenized by llama.cpp once per pre-tokenizer
/// (`scripts/reference/bpe_golden.py`): the ids depend on exactly how each pre-tokenizer
/// splits the text.
#[test]
fn bpe_matches_llama_cpp_on_a_trained_vocabulary() -> Result<()> {
    let golden = read_json(&data_path("tests/data/bpe_tokenizer_golden.json"));
    let vocab = &golden["vocab"];
    let texts: Vec<&str> = golden["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| c.as_str().expect("case text"))
        .collect();
    let strings_of = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|s| s.as_str().expect("string").to_string())
            .collect()
    };
    let types: Vec<i32> = vocab["token_type"]
        .as_array()
        .expect("token_type")
        .iter()
        .map(|t| t.as_i64().expect("type") as i32)
        .collect();
    let mut compared = 0;
    let mut failures = Vec::new();
    for (pre, runs) in golden["pre"].as_object().expect("pre") {
        let mut md = vocab_metadata("gpt2", strings_of(&vocab["tokens"]), types.clone());
        md.insert("tokenizer.ggml.pre".to_string(), Value::String(pre.clone()));
        md.insert(
            "tokenizer.ggml.merges".to_string(),
            Value::Array(
                strings_of(&vocab["merges"])
                    .into_iter()
                    .map(Value::String)
                    .collect(),
            ),
        );
        for key in ["bos_token_id", "eos_token_id"] {
            let id = vocab[key].as_u64().expect("id") as u32;
            md.insert(format!("tokenizer.ggml.{key}"), Value::U32(id));
        }
        let tok = Tokenizer::from_gguf(&md)?;
        assert_eq!(
            tok.prompt_options().add_bos,
            runs["add_bos"].as_bool().expect("add_bos"),
            "{pre}"
        );
        for row in runs["results"].as_array().expect("results") {
            let text = texts[row["case"].as_u64().expect("case") as usize];
            let parse_special = row["parse_special"].as_bool().expect("parse_special");
            let expected = ids_of(&row["ids"]);
            let ours = tok.encode(
                text,
                EncodeOptions {
                    parse_special,
                    ..EncodeOptions::default()
                },
            )?;
            compared += 1;
            if ours != expected {
                let at = first_difference(&ours, &expected);
                failures.push(format!(
                    "{pre} {:?} (parse_special={parse_special}): at {at}: ours {:?} vs llama.cpp {:?}",
                    text.chars().take(60).collect::<String>(),
                    &ours[at.saturating_sub(2)..ours.len().min(at + 4)],
                    &expected[at.saturating_sub(2)..expected.len().min(at + 4)],
                ));
            }
            // Every byte is a token, so byte-level decoding is lossless.
            assert_eq!(tok.decode(&expected, SpecialTokens::Render)?, text, "{pre}");
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} tokenizations differ from llama.cpp:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(compared >= 400, "only {compared} tokenizations compared");
    eprintln!("{compared} BPE tokenizations match llama.cpp");
    Ok(())
}

#[test]
fn bpe_merges_by_rank() -> Result<()> {
    let tok = bpe("gpt2")?;
    assert_eq!(tok.kind(), TokenizerKind::Bpe);
    assert_eq!(tok.vocab_size(), 271);
    // "hello" merges fully; " world" → Ġwor + l + d.
    assert_eq!(
        tok.encode("hello world", plain())?,
        vec![261, 264, 108, 100]
    );
    // Equal ranks: the leftmost pair merges first.
    assert_eq!(tok.encode("lll", plain())?, vec![259, 108]);
    // "Ġ hello" is a merge only if the pre-tokenizer keeps the space with the word.
    assert_eq!(tok.encode(" hello", plain())?, vec![270]);
    // é is two bytes, merged into one token.
    assert_eq!(tok.encode("é", plain())?, vec![265]);
    assert_eq!(
        tok.decode(&[261, 264, 108, 100], SpecialTokens::Skip)?,
        "hello world"
    );
    Ok(())
}

#[test]
fn bpe_pre_tokenizer_follows_tokenizer_ggml_pre() -> Result<()> {
    // gpt2 keeps digit runs together: 34 merges first, then 12.
    assert_eq!(bpe("gpt2")?.encode("12345", plain())?, vec![268, 267, 53]);
    // llama3 splits digits in threes: 123 | 45.
    assert_eq!(
        bpe("llama-bpe")?.encode("12345", plain())?,
        vec![268, 51, 269]
    );
    // qwen2 splits every digit.
    assert_eq!(
        bpe("qwen2")?.encode("12345", plain())?,
        vec![49, 50, 51, 52, 53]
    );
    // smollm isolates digits first too.
    assert_eq!(
        bpe("smollm")?.encode("12345", plain())?,
        vec![49, 50, 51, 52, 53]
    );
    // default: punctuation runs, words, digit runs, then triples: 123 | 45.
    assert_eq!(
        bpe("default")?.encode("12345", plain())?,
        vec![268, 51, 269]
    );
    // llama3 ignores merges for words that are tokens, and keeps contractions apart.
    let l3 = bpe("llama3")?;
    assert_eq!(l3.encode(" hello", plain())?, vec![270]);
    assert_eq!(
        l3.encode("he's", plain())?,
        vec![258, u32::from(b'\''), u32::from(b's')]
    );
    // Unknown pre-tokenizers are refused by name.
    match bpe("no-such-pre") {
        Err(ModelError::Tokenizer(msg)) => assert!(msg.contains("no-such-pre"), "{msg}"),
        other => panic!("expected a tokenizer error, got {other:?}"),
    }
    Ok(())
}

#[test]
fn bpe_byte_level_round_trips_unicode() -> Result<()> {
    let tok = bpe("llama-bpe")?;
    for text in [
        "Café naïve — “quotes” 日本語 한국어 😀👍🏽 🇫🇷",
        "tabs\tand\nnewlines\r\n  double  spaces ",
        "\u{0}\u{7f}\u{80}\u{ff}\u{10ffff}",
        "",
    ] {
        let ids = tok.encode(text, plain())?;
        assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, text);
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    }
    // Each byte of an unmerged character is its own byte-character token.
    assert_eq!(
        tok.encode("日", plain())?,
        "日".bytes().map(u32::from).collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn bpe_special_tokens_only_when_parse_special() -> Result<()> {
    let tok = bpe("gpt2")?;
    assert_eq!(tok.encode("<|begin|>hello", plain())?, vec![256, 261]);
    let literal = EncodeOptions {
        parse_special: false,
        ..plain()
    };
    let ids = tok.encode("<|begin|>hello", literal)?;
    assert!(!ids.contains(&256));
    assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, "<|begin|>hello");
    // User-defined tokens are always matched and always rendered.
    assert_eq!(tok.encode("<tag>hello", literal)?, vec![266, 261]);
    assert_eq!(tok.decode(&[266, 261], SpecialTokens::Skip)?, "<tag>hello");
    // Control tokens render only on request.
    assert_eq!(tok.decode(&[256, 261, 257], SpecialTokens::Skip)?, "hello");
    assert_eq!(
        tok.decode(&[256, 261, 257], SpecialTokens::Render)?,
        "<|begin|>hello<|end|>"
    );
    Ok(())
}

#[test]
fn bpe_bos_eos_options() -> Result<()> {
    let tok = bpe("gpt2")?;
    let both = EncodeOptions {
        add_bos: true,
        add_eos: true,
        parse_special: true,
    };
    assert_eq!(tok.encode("hello", both)?, vec![256, 261, 257]);
    assert_eq!(tok.bos_id(), Some(256));
    assert_eq!(tok.eos_id(), Some(257));
    assert!(tok.is_end_of_generation(257));
    assert!(!tok.is_end_of_generation(256));
    // gpt2 adds no BOS unless the file says so; llama3 does by default.
    assert!(!tok.prompt_options().add_bos);
    assert!(bpe("llama-bpe")?.prompt_options().add_bos);
    let mut md = bpe_metadata("gpt2");
    md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
    md.insert("tokenizer.ggml.add_eos_token".into(), Value::Bool(true));
    let tok = Tokenizer::from_gguf(&md)?;
    assert_eq!(
        tok.prompt_options(),
        EncodeOptions {
            add_bos: true,
            add_eos: true,
            parse_special: true
        }
    );
    // Without a BOS token, asking for one is an error, not a panic.
    let mut md = bpe_metadata("gpt2");
    md.remove("tokenizer.ggml.bos_token_id");
    let tok = Tokenizer::from_gguf(&md)?;
    assert!(matches!(
        tok.encode("x", both),
        Err(ModelError::Tokenizer(_))
    ));
    Ok(())
}

#[test]
fn decode_rejects_unknown_ids() -> Result<()> {
    let tok = bpe("gpt2")?;
    assert!(matches!(
        tok.decode(&[1_000_000], SpecialTokens::Skip),
        Err(ModelError::TokenOutOfRange { id: 1_000_000, .. })
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// SentencePiece on a tiny vocabulary

/// 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..259 `<0x00>`..`<0xFF>`, then `▁`, `a`, `b`, `ab`, `▁ab`,
/// `c`, `bc`.
fn spm_metadata(add_space_prefix: bool) -> HashMap<String, Value> {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, TYPE_CONTROL, TYPE_CONTROL];
    let mut scores = vec![0.0f32, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (t, s) in [
        ("▁", -1.0),
        ("a", -2.0),
        ("b", -2.0),
        ("ab", -3.0),
        ("▁ab", -4.0),
        ("c", -2.0),
        ("bc", -1.5),
    ] {
        tokens.push(t.to_string());
        types.push(TYPE_NORMAL);
        scores.push(s);
    }
    let mut md = vocab_metadata("llama", tokens, types);
    md.insert(
        "tokenizer.ggml.scores".into(),
        Value::Array(scores.into_iter().map(Value::F32).collect()),
    );
    md.insert(
        "tokenizer.ggml.add_space_prefix".into(),
        Value::Bool(add_space_prefix),
    );
    md
}

#[test]
fn spm_merges_by_score_with_byte_fallback() -> Result<()> {
    let tok = Tokenizer::from_gguf(&spm_metadata(true))?;
    let (space, a, b, ab, space_ab, bc) = (259, 260, 261, 262, 263, 265);
    // Default ids for SentencePiece: <s>=1, </s>=2, BOS added by default.
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.prompt_options().add_bos);
    // " ab" with the space prefix: ▁ab.
    assert_eq!(tok.encode("ab", plain())?, vec![space_ab]);
    // "abc": bc (-1.5) beats ab (-3.0).
    assert_eq!(tok.encode("abc", plain())?, vec![space, a, bc]);
    // Unknown characters fall back to bytes: é = C3 A9.
    assert_eq!(tok.encode("é", plain())?, vec![space, 3 + 0xc3, 3 + 0xa9]);
    // The prefix space goes away again on decode, also after BOS.
    for text in ["ab", "abc é", " ab", "c  b"] {
        let ids = tok.encode(text, plain())?;
        assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, text);
        let ids = tok.encode(text, tok.prompt_options())?;
        assert_eq!(ids[0], 1);
        assert_eq!(tok.decode(&ids, SpecialTokens::Skip)?, text);
    }
    // After a control token, the next text gets a space prefix again (llama.cpp).
    assert_eq!(tok.encode("<s>ab", plain())?, vec![1, space_ab]);
    // Without the prefix.
    let tok = Tokenizer::from_gguf(&spm_metadata(false))?;
    assert_eq!(tok.encode("ab", plain())?, vec![ab]);
    assert_eq!(tok.encode("a b", plain())?, vec![a, space, b]);
    Ok(())
}

#[test]
fn spm_stream_decoder_reassembles_byte_fallback() -> Result<()> {
    let tok = Tokenizer::from_gguf(&spm_metadata(false))?;
    let text = "a😀b";
    let ids = tok.encode(text, plain())?;
    assert_eq!(ids.len(), 6, "{ids:?}");
    let mut stream = tok.stream_decoder();
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| stream.push(id))
        .collect::<Result<_>>()?;
    assert_eq!(pieces, vec!["a", "", "", "", "😀", "b"]);
    assert_eq!(stream.finish(), "");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Metadata errors

/// Asserts that `md` fails as `ModelError::Tokenizer` with a message that names `needle`.
fn assert_tokenizer_error(md: &HashMap<String, Value>, needle: &str) {
    let msg = match Tokenizer::from_gguf(md) {
        Err(ModelError::Tokenizer(msg)) => msg,
        Err(other) => panic!("expected ModelError::Tokenizer, got {other:?}"),
        Ok(t) => panic!("expected an error, got {t:?}"),
    };
    assert!(msg.contains(needle), "{msg}");
}

#[test]
fn missing_token_list_is_a_clear_error() {
    let mut md = spm_metadata(false);
    md.remove("tokenizer.ggml.tokens");
    assert_tokenizer_error(&md, "tokenizer.ggml.tokens");
}

#[test]
fn unknown_tokenizer_model_is_a_clear_error() {
    let mut md = spm_metadata(false);
    md.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
    assert_tokenizer_error(&md, "unsupported tokenizer model `bert`");
    md.remove("tokenizer.ggml.model");
    assert_tokenizer_error(&md, "tokenizer.ggml.model");
}

#[test]
fn inconsistent_metadata_is_a_clear_error() {
    let mut md = spm_metadata(false);
    md.insert(
        "tokenizer.ggml.scores".into(),
        Value::Array(vec![Value::F32(0.0)]),
    );
    assert_tokenizer_error(&md, "tokenizer.ggml.scores");

    let mut md = spm_metadata(false);
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::String("not a list".into()),
    );
    assert_tokenizer_error(&md, "tokenizer.ggml.tokens");

    let mut md = bpe_metadata("gpt2");
    md.remove("tokenizer.ggml.merges");
    assert_tokenizer_error(&md, "tokenizer.ggml.merges");
}

#[test]
fn tokenizer_is_shareable_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}
