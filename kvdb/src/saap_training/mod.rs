//! Training a SAAP artifact for a model on text: plant retrieval drills in the text, prefill
//! it through the model (in windows of at most the model's context) while capturing every
//! retrieval layer's pre-RoPE keys and queries per KV head, then train each head's partition
//! and classifier ([`classifier`]) for [`kvdb_index::saap`] to route with.
//!
//! # Retrieval drills
//!
//! SAAP's classifier learns which buckets a query's attention mass falls in from the queries
//! of its training text. Retrieval serves one kind of query above all: a question about a
//! fact stated thousands of tokens back, answered by copying it. Prose has few of those, and
//! a classifier trained on prose alone routes such a question to the buckets prose questions
//! go to. On the default model, with 128 buckets trained on the GPL-3, one query head of
//! layer 11 put 34% of its attention on retrievable keys, as it answered a planted needle, in
//! a bucket of five digit keys that the classifier ranked 118th of 128 for the group (the
//! k-means prior alone: 11th). Drills lift it (docs/benchmarks.md, "Retrieval drills"), not
//! to every step of every answer, so they are off by default.
//!
//! A drill is a made-up fact ("The badge number of the quiet harbor is 48213.") planted at a
//! paragraph break, then asked for and answered again ("What is the badge number of the quiet
//! harbor? The badge number of the quiet harbor is 48213.") at a paragraph break at least
//! [`DRILL_GAP_TOKENS`] tokens later, so the answer's queries are training queries (their best
//! key lies that far back). Three phrasings, eight kinds of number and 144 objects; their
//! words are not those of the needle tests (no "magic number", no "door").
//!
//! Drills add training *queries*, not keys to partition: k-means runs on the keys of the
//! text alone. Planted densely enough to matter (500 drills are some 20K of a 32K-token
//! window), their keys would otherwise take most of the buckets and leave the prose of a
//! corpus few, large ones: a needle corpus attended through such a partition at 512 buckets
//! and ℓ = 12 selected 11% of its keys, through the text's own partition 3.5%
//! (docs/benchmarks.md, "Retrieval drills"). More drills than one window holds go into more
//! windows, each prefilled on its own (the text goes on where the last window stopped, and
//! starts over once it is used up), whose queries train the classifiers together.

mod classifier;

pub use classifier::{train_head, TrainOptions, TrainingData};

use classifier::{partition, train_classifier};

use candle_core::Tensor;
use kvdb_index::saap::{Epoch, SaapArtifact};
use kvdb_model::{AttentionBackend, AttentionInput, EncodeOptions, FullAttention, Logits};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::models::LoadedModel;
use crate::store::LayerPolicy;

/// A drill's question comes at least this many tokens after its fact (estimated from the
/// text's characters per token): past [`classifier::MIN_TRAINING_DISTANCE`] with room.
pub(crate) const DRILL_GAP_TOKENS: usize = 1536;

const KINDS: [&str; 8] = [
    "access code",
    "serial number",
    "locker combination",
    "account number",
    "ticket number",
    "room code",
    "badge number",
    "order number",
];
const ADJECTIVES: [&str; 12] = [
    "red", "green", "silver", "old", "small", "north", "wooden", "quiet", "yellow", "broken",
    "east", "golden",
];
const NOUNS: [&str; 12] = [
    "gate", "tower", "garden", "bridge", "window", "library", "kitchen", "harbor", "station",
    "cabinet", "market", "bakery",
];

/// One drill: the fact, and the question with its answer.
fn drill(rng: &mut StdRng) -> (String, String) {
    let kind = KINDS[rng.random_range(0..KINDS.len())];
    let adjective = ADJECTIVES[rng.random_range(0..ADJECTIVES.len())];
    let noun = NOUNS[rng.random_range(0..NOUNS.len())];
    let object = format!("{adjective} {noun}");
    let number = rng.random_range(1_000..100_000_000u32);
    match rng.random_range(0..3) {
        0 => (
            format!("The {kind} of the {object} is {number}."),
            format!("What is the {kind} of the {object}? The {kind} of the {object} is {number}."),
        ),
        1 => (
            format!("Remember: the {object} has {kind} {number}."),
            format!("Which {kind} does the {object} have? The {object} has {kind} {number}."),
        ),
        _ => (
            format!("Note the {kind} for the {object}: {number}."),
            format!("The {kind} for the {object}? It was {number}."),
        ),
    }
}

/// `count` drills, seeded.
fn drills(count: usize, seed: u64) -> Vec<(String, String)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xd7111);
    (0..count).map(|_| drill(&mut rng)).collect()
}

/// One piece of a drilled text, in order: a span of the text itself, or a planted drill
/// sentence (a fact, or a question with its answer), which goes after a paragraph break of
/// its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// A span of the text (it starts at a paragraph break, or is the text's beginning).
    Text(&'a str),
    /// A drill sentence.
    Drill(&'a str),
}

impl Piece<'_> {
    /// Its characters in the drilled text.
    fn rendered(&self) -> std::borrow::Cow<'_, str> {
        match *self {
            Piece::Text(text) => text.into(),
            Piece::Drill(sentence) => format!("\n\n{sentence}").into(),
        }
    }
}

/// `text` with `drills` planted at its paragraph breaks (`"\n\n"`): each fact at a break
/// drawn at random among those followed by another at least `gap_chars` further on, its
/// question at a break drawn from those (in a text too short for that, facts anywhere and
/// questions at its end). Seeded, so the same arguments give the same pieces. The first
/// piece is always text (perhaps empty).
pub(crate) fn plant_drills<'a>(
    text: &'a str,
    drills: &'a [(String, String)],
    gap_chars: usize,
    seed: u64,
) -> Vec<Piece<'a>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x91a7);
    let mut breaks: Vec<usize> = text.match_indices("\n\n").map(|(i, _)| i).collect();
    if breaks.is_empty() {
        breaks.push(0);
    }
    // Facts go where a question can follow `gap_chars` later (anywhere in a text too short
    // for that: their questions then go at its end).
    let last = breaks[breaks.len() - 1];
    let facts = match breaks.partition_point(|&b| b + gap_chars <= last) {
        0 => breaks.len(),
        n => n,
    };
    let mut inserts: Vec<(usize, Piece<'a>)> = Vec::with_capacity(2 * drills.len());
    for (fact, question) in drills {
        let at = breaks[rng.random_range(0..facts)];
        let later = breaks.partition_point(|&b| b < at + gap_chars);
        let ask = if later < breaks.len() {
            breaks[rng.random_range(later..breaks.len())]
        } else {
            text.len()
        };
        inserts.push((at, Piece::Drill(fact)));
        inserts.push((ask, Piece::Drill(question)));
    }
    // Stable: a fact and its question at one break keep their order.
    inserts.sort_by_key(|(at, _)| *at);
    let mut pieces = Vec::with_capacity(2 * inserts.len() + 1);
    let mut from = 0;
    for (at, insert) in inserts {
        if at > from || pieces.is_empty() {
            pieces.push(Piece::Text(&text[from..at]));
        }
        pieces.push(insert);
        from = at;
    }
    if from < text.len() || pieces.is_empty() {
        pieces.push(Piece::Text(&text[from..]));
    }
    pieces
}

/// The longest prefix of `text` ending at a paragraph break (or the whole text) that
/// encodes to at most `tokens` tokens, and its token ids.
fn fitting_prefix<'t>(
    model: &LoadedModel,
    text: &'t str,
    tokens: usize,
) -> Result<(&'t str, Vec<u32>)> {
    let encode = |s: &str| model.tokenizer.encode(s, EncodeOptions::default());
    let whole = encode(text)?;
    if whole.len() <= tokens {
        return Ok((text, whole));
    }
    let breaks: Vec<usize> = text.match_indices("\n\n").map(|(i, _)| i).collect();
    // Binary search for the last break whose prefix fits (prefix lengths grow with it).
    let (mut lo, mut hi, mut fits) = (0, breaks.len(), Vec::new());
    while lo < hi {
        let mid = (lo + hi) / 2;
        let ids = encode(&text[..breaks[mid]])?;
        if ids.len() <= tokens {
            (lo, fits) = (mid + 1, ids);
        } else {
            hi = mid;
        }
    }
    Ok(lo
        .checked_sub(1)
        .map_or(("", Vec::new()), |i| (&text[..breaks[i]], fits)))
}

/// The token ids of one window to prefill, and which of them belong to the text itself (not
/// to a drill).
struct TrainingIds {
    ids: Vec<u32>,
    from_text: Vec<bool>,
    /// Bytes of the text the window holds (the next window goes on from there).
    text_bytes: usize,
}

/// The token ids of one window to prefill: the start of `text` cut at a paragraph break to
/// fit `budget`, with `drills` planted in it (cut shorter to leave them room). Drilled pieces
/// are encoded one by one (each starts at a paragraph break, as documents do at ingest), so
/// every id is known to come from the text or from a drill.
fn training_ids(
    model: &LoadedModel,
    text: &str,
    drills: &[(String, String)],
    budget: usize,
    seed: u64,
) -> Result<TrainingIds> {
    let encode = |s: &str| model.tokenizer.encode(s, EncodeOptions::default());
    // Each drill costs its two sentences and their paragraph breaks.
    let mut drill_tokens = 0;
    for (fact, question) in drills {
        drill_tokens += encode(fact)?.len() + encode(question)?.len() + 2;
    }
    let room = budget.saturating_sub(drill_tokens);
    if !drills.is_empty() && room < 2 * DRILL_GAP_TOKENS {
        return Err(Error::TooManyDrills {
            drills: drills.len(),
            drill_tokens,
            budget,
        });
    }
    // The text is cut (at a paragraph break) to leave room for the drills, so none is lost.
    let (text, plain) = fitting_prefix(model, text, room)?;
    if drills.is_empty() {
        let from_text = vec![true; plain.len()];
        return Ok(TrainingIds {
            ids: plain,
            from_text,
            text_bytes: text.len(),
        });
    }
    let chars_per_token = text.len() as f64 / plain.len().max(1) as f64;
    let gap_chars = (DRILL_GAP_TOKENS as f64 * chars_per_token).ceil() as usize;
    let (mut ids, mut from_text) = (Vec::new(), Vec::new());
    for piece in plant_drills(text, drills, gap_chars, seed) {
        let piece_ids = encode(&piece.rendered())?;
        from_text.resize(
            from_text.len() + piece_ids.len(),
            matches!(piece, Piece::Text(_)),
        );
        ids.extend(piece_ids);
    }
    // The drill estimate counts sentences alone: the budget may still be overrun by a few.
    ids.truncate(budget);
    from_text.truncate(budget);
    Ok(TrainingIds {
        ids,
        from_text,
        text_bytes: text.len(),
    })
}

/// What to train on and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaapTraining {
    /// Partition and classifier options (buckets, samples, epochs, seed, prior).
    pub options: TrainOptions,
    /// Tokens of training text prefilled, at most: in windows of at most the model's
    /// context, each prefilled on its own.
    pub tokens: usize,
    /// Retrieval drills planted in the text (0: none).
    pub drills: usize,
}

impl SaapTraining {
    /// Drilled training as the needle measurement runs it (docs/benchmarks.md, "Retrieval
    /// drills"): `centroids` buckets, one window of the default model's whole context (32,768
    /// tokens) with 500 drills (about 20K of them), the default samples.
    pub fn drilled(centroids: usize, seed: u64) -> Self {
        Self {
            options: TrainOptions {
                centroids,
                seed,
                ..TrainOptions::default()
            },
            tokens: 32_768,
            drills: 500,
        }
    }
}

impl Default for SaapTraining {
    /// What the `saap` spec alone needs ([`kvdb_index::SaapSpec::DEFAULT`]): an artifact of
    /// its buckets, trained with drills as the needle measurement was
    /// ([`Self::drilled`], seed 0), so that `kvdb saap train` and then `--index saap` work
    /// together without options.
    fn default() -> Self {
        Self::drilled(kvdb_index::SaapSpec::DEFAULT.centroids, 0)
    }
}

/// Progress of [`train_artifact`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TrainEvent {
    /// The text to prefill: `tokens` tokens in `windows` windows (each at most the model's
    /// context) with `drills` drills planted in them, and the layer/KV heads that will be
    /// trained on it.
    Text {
        /// Tokens.
        tokens: usize,
        /// Windows prefilled one after the other.
        windows: usize,
        /// Drills planted.
        drills: usize,
        /// Layer/KV heads to train.
        heads: usize,
    },
    /// Tokens prefilled so far.
    Prefilled(usize),
    /// A layer/KV head starts training (k-means, then the classifier's targets).
    Head {
        /// The layer.
        layer: usize,
        /// The KV head.
        kv_head: usize,
    },
    /// A classifier epoch finished.
    Epoch {
        /// The layer.
        layer: usize,
        /// The KV head.
        kv_head: usize,
        /// Its losses.
        epoch: Epoch,
    },
}

/// One retrieval layer's captured keys and queries, per KV head, in one window.
struct Captured {
    layer: usize,
    scale: f32,
    keys: Vec<Vec<f32>>,
    queries: Vec<Vec<f32>>,
}

/// The windows to prefill: `training.tokens` split into equal windows of at most `context`
/// tokens, the drills shared out among them. Each window takes the text on from where the
/// last one stopped; with drills, a text used up starts over (the same text, new drills),
/// without them training stops at its end.
fn plan_windows(
    model: &LoadedModel,
    text: &str,
    training: &SaapTraining,
    context: usize,
) -> Result<Vec<TrainingIds>> {
    let count = training.tokens.div_ceil(context.max(1)).max(1);
    let budget = training.tokens.div_ceil(count);
    let drills = drills(training.drills, training.options.seed);
    let mut windows: Vec<TrainingIds> = Vec::with_capacity(count);
    let mut from = 0;
    for w in 0..count {
        if from >= text.len() {
            if drills.is_empty() {
                break;
            }
            from = 0;
        }
        let mine = &drills[w * drills.len() / count..(w + 1) * drills.len() / count];
        let seed = training.options.seed ^ (w as u64).wrapping_mul(0x9e37_79b9);
        let window = training_ids(model, &text[from..], mine, budget, seed)?;
        if window.text_bytes == 0 {
            // Not one paragraph of what is left fits: nothing more to train on.
            break;
        }
        from += window.text_bytes;
        windows.push(window);
    }
    Ok(windows)
}

/// Prefills one window through the model (a fresh cache, positions from 0), capturing the
/// pre-RoPE keys and queries of every layer in `layers`; `on_prefilled` sees the tokens done.
fn capture_window(
    model: &LoadedModel,
    ids: &[u32],
    layers: &[usize],
    on_prefilled: &mut dyn FnMut(usize),
) -> Result<Vec<Captured>> {
    let config = model.model.config();
    let (heads, group) = (config.n_kv_heads, config.n_heads / config.n_kv_heads);
    let mut captured: Vec<Captured> = layers
        .iter()
        .map(|&layer| Captured {
            layer,
            scale: 0.0,
            keys: vec![Vec::new(); heads],
            queries: vec![Vec::new(); heads],
        })
        .collect();
    let mut full = FullAttention::new(config);
    let mut record = |input: &AttentionInput<'_>| -> kvdb_model::Result<Tensor> {
        if let Some(c) = captured.iter_mut().find(|c| c.layer == input.layer.index) {
            c.scale = input.scale;
            for head in 0..heads {
                let k = input
                    .keys
                    .narrow(1, head, 1)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let q = input
                    .queries
                    .narrow(1, head * group, group)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                c.keys[head].extend(k);
                c.queries[head].extend(q);
            }
        }
        full.attend(input)
    };
    let mut done = 0;
    for chunk in ids.chunks(512) {
        model.model.forward(
            chunk,
            done,
            &mut record as &mut dyn AttentionBackend,
            &Logits::None,
        )?;
        done += chunk.len();
        on_prefilled(done);
    }
    Ok(captured)
}

/// Trains a SAAP artifact for `model` on `text` (drills planted first): every retrieval
/// layer (the layers whose keys are stored whole) and KV head gets its partition and
/// classifier; the loss curves are kept in the artifact. More tokens than the model's
/// context are prefilled as several windows, each on its own, whose queries train the
/// classifiers together. The partition is fitted to the keys of the text alone: drills add
/// training queries, not keys to partition (see the module documentation).
pub fn train_artifact(
    model: &LoadedModel,
    text: &str,
    training: &SaapTraining,
    on_event: &mut dyn FnMut(TrainEvent),
) -> Result<SaapArtifact> {
    let config = model.model.config().clone();
    let policy = LayerPolicy::for_model(&config);
    let layers: Vec<usize> = (0..config.n_layers())
        .filter(|&l| policy[l] == LayerPolicy::All)
        .collect();
    if layers.is_empty() {
        return Err(Error::NoRetrievalLayers);
    }
    let windows = plan_windows(model, text, training, config.context_length)?;
    let tokens: usize = windows.iter().map(|w| w.ids.len()).sum();
    if tokens == 0 {
        return Err(Error::EmptyInput {
            what: "training text",
            hint: "",
        });
    }
    let (heads, group) = (config.n_kv_heads, config.n_heads / config.n_kv_heads);
    on_event(TrainEvent::Text {
        tokens,
        windows: windows.len(),
        drills: training.drills,
        heads: layers.len() * heads,
    });
    let mut captured: Vec<Vec<Captured>> = Vec::with_capacity(windows.len());
    let mut done = 0;
    for window in &windows {
        captured.push(capture_window(model, &window.ids, &layers, &mut |n| {
            on_event(TrainEvent::Prefilled(done + n))
        })?);
        done += window.ids.len();
    }

    let options = &training.options;
    let mut artifact = SaapArtifact::new(
        &model.record.sha256,
        options.centroids,
        options.seed,
        tokens,
    );
    for (i, &layer) in layers.iter().enumerate() {
        let rope = model
            .model
            .rope(layer)
            .ok_or_else(|| Error::Internal(format!("layer {layer} has no RoPE")))?;
        let d = rope.head_dim();
        let mut trained = Vec::with_capacity(heads);
        for kv_head in 0..heads {
            on_event(TrainEvent::Head { layer, kv_head });
            let text_keys: Vec<f32> = windows
                .iter()
                .zip(&captured)
                .flat_map(|(window, layers)| {
                    layers[i].keys[kv_head]
                        .chunks_exact(d)
                        .zip(&window.from_text)
                        .filter(|(_, &from_text)| from_text)
                        .flat_map(|(key, _)| key)
                })
                .copied()
                .collect();
            let centroids = partition(&text_keys, d, options)?;
            let sequences: Vec<TrainingData<'_>> = captured
                .iter()
                .map(|layers| TrainingData {
                    keys: &layers[i].keys[kv_head],
                    queries: &layers[i].queries[kv_head],
                    group,
                    rope,
                    scale: layers[i].scale,
                })
                .collect();
            let mut losses = Vec::new();
            trained.push(train_classifier(
                &sequences,
                centroids,
                options,
                &mut |epoch| {
                    on_event(TrainEvent::Epoch {
                        layer,
                        kv_head,
                        epoch,
                    });
                    losses.push(epoch);
                },
            )?);
            artifact.losses.push((layer, kv_head, losses));
        }
        artifact.layers.push((layer, trained));
    }
    Ok(artifact)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The drilled text the pieces make.
    fn render(pieces: &[Piece<'_>]) -> String {
        pieces.iter().map(|p| p.rendered()).collect()
    }

    fn paragraphs(n: usize) -> String {
        (0..n)
            .map(|i| format!("Paragraph {i} says something about nothing in particular."))
            .collect::<Vec<_>>()
            .join("\n\n")
    }

    #[test]
    fn drills_are_planted_once_each_and_asked_after_the_gap() {
        let text = paragraphs(400);
        let drills = drills(40, 3);
        let gap = 2_000;
        let pieces = plant_drills(&text, &drills, gap, 3);
        assert_eq!(pieces, plant_drills(&text, &drills, gap, 3), "seeded");
        let planted = render(&pieces);
        // The pieces are the text's spans, in order, and every drill sentence once.
        let spans: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(span) => Some(*span),
                Piece::Drill(_) => None,
            })
            .collect();
        assert_eq!(spans, text);
        let sentences = pieces
            .iter()
            .filter(|p| matches!(p, Piece::Drill(_)))
            .count();
        assert_eq!(sentences, 2 * drills.len());
        let mut rest = planted.clone();
        for (fact, question) in &drills {
            // Each is its own paragraph (a question may repeat its fact inside it).
            let (fact_paragraph, question_paragraph) =
                (format!("\n\n{fact}"), format!("\n\n{question}"));
            assert_eq!(planted.matches(&fact_paragraph).count(), 1, "{fact}");
            assert_eq!(
                planted.matches(&question_paragraph).count(),
                1,
                "{question}"
            );
            let f = planted.find(&fact_paragraph).expect("fact planted");
            let q = planted.find(&question_paragraph).expect("question planted");
            // A question lands at a break at least `gap` chars of the text after its fact
            // (more in the drilled text, where other drills lie between).
            let f_end = f + fact_paragraph.len();
            assert!(q >= f_end + gap, "{fact} at {f}, asked at {q}");
            for s in [fact, question] {
                rest = rest.replacen(&format!("\n\n{s}"), "", 1);
            }
        }
        assert_eq!(rest, text, "the text itself is untouched");
    }

    /// The ids marked as the text's are the text's, the others the drills' sentences: what
    /// the partition is fitted to leaves every drill out.
    #[test]
    fn training_ids_mark_which_tokens_come_from_the_text() -> anyhow::Result<()> {
        let file = kvdb_tests::TinyModel {
            context_length: 8192,
            ..kvdb_tests::TinyModel::gemma3()
        }
        .write_temp()?;
        let model = crate::models::load_model(
            Some(file.path()),
            &kvdb_model::LoadOptions::default(),
            crate::models::ComputeDevice::Cpu,
        )?;
        let text = kvdb_tests::gpl_text()?;
        let drills = drills(12, 4);
        let TrainingIds {
            ids,
            from_text,
            text_bytes,
        } = training_ids(&model, &text, &drills, 6000, 4)?;
        assert_eq!(ids.len(), from_text.len());
        let pick = |keep: bool| -> Vec<u32> {
            ids.iter()
                .zip(&from_text)
                .filter(|(_, &t)| t == keep)
                .map(|(&id, _)| id)
                .collect()
        };
        let (text_part, drill_part) = (
            model
                .tokenizer
                .decode(&pick(true), kvdb_model::SpecialTokens::Skip)?,
            model
                .tokenizer
                .decode(&pick(false), kvdb_model::SpecialTokens::Skip)?,
        );
        for (fact, question) in &drills {
            for sentence in [fact, question] {
                assert!(
                    drill_part.contains(sentence.as_str()),
                    "{sentence} is a drill's"
                );
                assert!(
                    !text_part.contains(sentence.as_str()),
                    "{sentence} is not the text's"
                );
            }
        }
        // The text's tokens spell the prefix of the text the window says it holds, cut at a
        // paragraph break (pieces encoded on their own may gain a leading space: compare
        // without whitespace).
        assert!(text_bytes > 1000 && text[text_bytes..].starts_with("\n\n"));
        let squeeze = |s: &str| s.split_whitespace().collect::<String>();
        assert_eq!(squeeze(&text_part), squeeze(&text[..text_bytes]));
        Ok(())
    }

    #[test]
    fn drills_in_a_text_without_room_are_asked_at_its_end() {
        let text = paragraphs(3);
        let drills = drills(5, 1);
        let planted = render(&plant_drills(&text, &drills, 10_000, 1));
        let tail = &planted[planted.rfind("Paragraph 2").expect("last paragraph")..];
        for (fact, question) in &drills {
            assert!(planted.contains(fact.as_str()), "{fact}");
            assert!(tail.contains(question.as_str()), "{question} at the end");
        }
        // No drills: the text as it is.
        assert_eq!(plant_drills(&text, &[], 10, 1), [Piece::Text(&text)]);
    }
}
