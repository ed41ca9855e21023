//! Training a SAAP artifact for a model on text: plant retrieval drills in the text, prefill
//! it through the model while capturing every retrieval layer's pre-RoPE keys and queries per
//! KV head, then train each head's partition and classifier ([`kvdb_index::saap`]).
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

use candle_core::Tensor;
use kvdb_index::saap::{train_head, Epoch, SaapArtifact, TrainOptions, TrainingData};
use kvdb_model::{AttentionBackend, AttentionInput, EncodeOptions, FullAttention, Logits};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::ingest::layer_policy;
use crate::models::LoadedModel;
use crate::store::StoredLayer;

/// A drill's question comes at least this many tokens after its fact (estimated from the
/// text's characters per token): past [`kvdb_index::saap::MIN_TRAINING_DISTANCE`] with room.
pub const DRILL_GAP_TOKENS: usize = 1536;

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

/// `text` with `drills` planted at its paragraph breaks (`"\n\n"`): each fact at a break
/// drawn at random among those followed by another at least `gap_chars` further on, its
/// question at a break drawn from those (in a text too short for that, facts anywhere and
/// questions at its end). Seeded, so the same arguments give the same text.
pub fn plant_drills(
    text: &str,
    drills: &[(String, String)],
    gap_chars: usize,
    seed: u64,
) -> String {
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
    let mut inserts: Vec<(usize, &str)> = Vec::with_capacity(2 * drills.len());
    for (fact, question) in drills {
        let at = breaks[rng.random_range(0..facts)];
        let later = breaks.partition_point(|&b| b < at + gap_chars);
        let ask = if later < breaks.len() {
            breaks[rng.random_range(later..breaks.len())]
        } else {
            text.len()
        };
        inserts.push((at, fact));
        inserts.push((ask, question));
    }
    // Stable: a fact and its question at one break keep their order.
    inserts.sort_by_key(|(at, _)| *at);
    let mut out =
        String::with_capacity(text.len() + inserts.iter().map(|(_, s)| s.len() + 2).sum::<usize>());
    let mut from = 0;
    for (at, insert) in inserts {
        out.push_str(&text[from..at]);
        out.push_str("\n\n");
        out.push_str(insert);
        from = at;
    }
    out.push_str(&text[from..]);
    out
}

/// The longest prefix of `text` ending at a paragraph break (or the whole text) that
/// encodes to at most `tokens` tokens, and its token count.
fn fitting_prefix<'t>(
    model: &LoadedModel,
    text: &'t str,
    tokens: usize,
) -> Result<(&'t str, usize)> {
    let count = |s: &str| -> Result<usize> {
        Ok(model.tokenizer.encode(s, EncodeOptions::default())?.len())
    };
    let whole = count(text)?;
    if whole <= tokens {
        return Ok((text, whole));
    }
    let breaks: Vec<usize> = text.match_indices("\n\n").map(|(i, _)| i).collect();
    // Binary search for the last break whose prefix fits (prefix lengths grow with it).
    let (mut lo, mut hi, mut fits) = (0, breaks.len(), 0);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let n = count(&text[..breaks[mid]])?;
        if n <= tokens {
            (lo, fits) = (mid + 1, n);
        } else {
            hi = mid;
        }
    }
    Ok(lo
        .checked_sub(1)
        .map_or(("", 0), |i| (&text[..breaks[i]], fits)))
}

/// The token ids to prefill: `text` as it is, or, with `drills`, cut at a paragraph break to
/// leave them room and with them planted; at most `budget` either way.
fn training_ids(
    model: &LoadedModel,
    text: &str,
    drills: &[(String, String)],
    budget: usize,
    seed: u64,
) -> Result<Vec<u32>> {
    let encode = |s: &str| model.tokenizer.encode(s, EncodeOptions::default());
    if drills.is_empty() {
        let mut ids = encode(text)?;
        ids.truncate(budget);
        return Ok(ids);
    }
    // Each drill costs its two sentences and their paragraph breaks.
    let mut drill_tokens = 0;
    for (fact, question) in drills {
        drill_tokens += encode(fact)?.len() + encode(question)?.len() + 2;
    }
    let room = budget.saturating_sub(drill_tokens);
    if room < 2 * DRILL_GAP_TOKENS {
        return Err(Error::Query(format!(
            "{} drills take about {drill_tokens} of the {budget} training tokens, leaving too \
             few for the text: plant fewer drills or train on more tokens",
            drills.len()
        )));
    }
    // The text is cut (at a paragraph break) to leave room for the drills, so none is lost.
    let (text, plain) = fitting_prefix(model, text, room)?;
    let chars_per_token = text.len() as f64 / plain.max(1) as f64;
    let gap_chars = (DRILL_GAP_TOKENS as f64 * chars_per_token).ceil() as usize;
    let mut ids = encode(&plant_drills(text, drills, gap_chars, seed))?;
    // Sentences tokenize a little differently in context: the estimate can be off by a few.
    ids.truncate(budget);
    Ok(ids)
}

/// What to train on and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaapTraining {
    /// Partition and classifier options (buckets, samples, epochs, seed, prior).
    pub options: TrainOptions,
    /// Tokens of training text prefilled, at most (and at most the model's context).
    pub tokens: usize,
    /// Retrieval drills planted in the text (0: none).
    pub drills: usize,
}

impl SaapTraining {
    /// What the needle test trains with, and what docs/benchmarks.md measured drills with:
    /// the default model's whole context (32,768 tokens) with 500 drills (about 20K of them).
    pub const DRILLED_TOKENS: usize = 32_768;
    /// See [`Self::DRILLED_TOKENS`].
    pub const DRILLS: usize = 500;
}

impl Default for SaapTraining {
    /// The index crate's default options on 16,384 tokens of the text as it is (no drills:
    /// they help questions at 128 buckets in most runs measured, not in all, and were not
    /// measured at the default 1024; see docs/benchmarks.md).
    fn default() -> Self {
        Self {
            options: TrainOptions::default(),
            tokens: 16_384,
            drills: 0,
        }
    }
}

/// Progress of [`train_artifact`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TrainEvent {
    /// The text to prefill: `tokens` tokens with `drills` drills planted in it, and the
    /// layer/KV heads that will be trained on it.
    Text {
        /// Tokens.
        tokens: usize,
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

/// One retrieval layer's captured keys and queries, per KV head.
struct Captured {
    layer: usize,
    scale: f32,
    keys: Vec<Vec<f32>>,
    queries: Vec<Vec<f32>>,
}

/// Trains a SAAP artifact for `model` on `text` (drills planted first): every retrieval
/// layer (the layers whose keys are stored whole) and KV head gets its partition and
/// classifier; the loss curves are kept in the artifact.
pub fn train_artifact(
    model: &LoadedModel,
    text: &str,
    training: &SaapTraining,
    on_event: &mut dyn FnMut(TrainEvent),
) -> Result<SaapArtifact> {
    let config = model.model.config().clone();
    let budget = training.tokens.min(config.context_length);
    let drills = drills(training.drills, training.options.seed);
    let ids = training_ids(model, text, &drills, budget, training.options.seed)?;

    let (heads, group) = (config.n_kv_heads, config.n_heads / config.n_kv_heads);
    let policy = layer_policy(&config);
    let mut captured: Vec<Captured> = (0..config.n_layers())
        .filter(|&l| policy[l] == StoredLayer::All)
        .map(|layer| Captured {
            layer,
            scale: 0.0,
            keys: vec![Vec::new(); heads],
            queries: vec![Vec::new(); heads],
        })
        .collect();
    if captured.is_empty() {
        return Err(Error::Query("the model has no retrieval layers".into()));
    }
    on_event(TrainEvent::Text {
        tokens: ids.len(),
        drills: drills.len(),
        heads: captured.len() * heads,
    });
    let mut full = FullAttention::new(&config);
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
        on_event(TrainEvent::Prefilled(done));
    }

    let options = &training.options;
    let mut artifact = SaapArtifact::new(
        &model.record.sha256,
        options.centroids,
        options.seed,
        ids.len(),
    );
    for c in &captured {
        let rope = model
            .model
            .rope(c.layer)
            .ok_or_else(|| Error::Query(format!("layer {} has no RoPE", c.layer)))?;
        let mut trained = Vec::with_capacity(heads);
        for kv_head in 0..heads {
            on_event(TrainEvent::Head {
                layer: c.layer,
                kv_head,
            });
            let data = TrainingData {
                keys: &c.keys[kv_head],
                queries: &c.queries[kv_head],
                group,
                rope,
                scale: c.scale,
            };
            let mut losses = Vec::new();
            trained.push(train_head(&data, options, &mut |epoch| {
                on_event(TrainEvent::Epoch {
                    layer: c.layer,
                    kv_head,
                    epoch,
                });
                losses.push(epoch);
            })?);
            artifact.losses.push((c.layer, kv_head, losses));
        }
        artifact.layers.push((c.layer, trained));
    }
    Ok(artifact)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let planted = plant_drills(&text, &drills, gap, 3);
        assert_eq!(planted, plant_drills(&text, &drills, gap, 3), "seeded");
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

    #[test]
    fn drills_in_a_text_without_room_are_asked_at_its_end() {
        let text = paragraphs(3);
        let drills = drills(5, 1);
        let planted = plant_drills(&text, &drills, 10_000, 1);
        let tail = &planted[planted.rfind("Paragraph 2").expect("last paragraph")..];
        for (fact, question) in &drills {
            assert!(planted.contains(fact.as_str()), "{fact}");
            assert!(tail.contains(question.as_str()), "{question} at the end");
        }
        // No drills: the text as it is.
        assert_eq!(plant_drills(&text, &[], 10, 1), text);
    }
}
