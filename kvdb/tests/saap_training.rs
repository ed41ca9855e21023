//! `train_artifact` end to end on a tiny random-weight gemma3 (one global layer, two KV
//! heads): drills planted within the token budget, every retrieval head trained, progress
//! reported in order, and a clear error when the drills leave no room for the text.

mod support;

use anyhow::Result;
use kvdb::LoadedModel;
use kvdb::TrainOptions;
use kvdb::{train_artifact, SaapTraining, TrainEvent};
use kvdb_index::saap::SaapArtifact;
use kvdb_tests::gpl_text;
use support::tiny_gemma3;

fn training(tokens: usize, drills: usize) -> SaapTraining {
    SaapTraining {
        options: TrainOptions {
            centroids: 8,
            epochs: 2,
            max_samples: 512,
            seed: 5,
            ..TrainOptions::default()
        },
        tokens,
        drills,
    }
}

/// An artifact trained on the GPL text, and the events it reported, in order.
fn trained(
    model: &LoadedModel,
    training: &SaapTraining,
) -> Result<(SaapArtifact, Vec<TrainEvent>)> {
    let mut events = Vec::new();
    let artifact = train_artifact(model, &gpl_text()?, training, &mut |e| events.push(e))?;
    Ok((artifact, events))
}

/// The first event's text: tokens, windows, drills and heads.
fn text_of(events: &[TrainEvent]) -> (usize, usize, usize, usize) {
    match events.first() {
        Some(&TrainEvent::Text {
            tokens,
            windows,
            drills,
            heads,
        }) => (tokens, windows, drills, heads),
        other => panic!("the first event names the text: {other:?}"),
    }
}

/// The prefill progress rises to `tokens`, counted on across windows.
fn assert_prefill_counts_to(events: &[TrainEvent], tokens: usize) {
    let prefilled: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            TrainEvent::Prefilled(n) => Some(*n),
            _ => None,
        })
        .collect();
    assert!(prefilled.windows(2).all(|w| w[0] < w[1]), "{prefilled:?}");
    assert_eq!(prefilled.last(), Some(&tokens));
}

#[test]
fn trains_every_retrieval_head_on_the_drilled_text_within_the_budget() -> Result<()> {
    let (_file, model) = tiny_gemma3()?;
    let (artifact, events) = trained(&model, &training(6000, 12))?;

    // The text is cut to leave the drills room: the budget is filled, not overrun.
    let (tokens, windows, drills, heads) = text_of(&events);
    assert!((5000..=6000).contains(&tokens), "{tokens} tokens");
    assert_eq!((windows, drills, heads), (1, 12, 2));
    assert_eq!(artifact.tokens, tokens);
    assert_prefill_counts_to(&events, tokens);
    let epochs = events
        .iter()
        .filter(|e| matches!(e, TrainEvent::Epoch { .. }))
        .count();
    assert_eq!(epochs, 2 * 2, "two epochs for each of the two heads");

    // The global layer (the sixth) and both its KV heads, 8 buckets each, with loss curves.
    assert_eq!(artifact.layers.len(), 1);
    let (layer, heads) = &artifact.layers[0];
    assert_eq!(*layer, 5);
    assert_eq!(heads.len(), 2);
    assert!(heads.iter().all(|h| h.buckets() == 8 && h.head_dim == 32));
    assert_eq!(artifact.losses.len(), 2);
    assert!(artifact.losses.iter().all(|(_, _, l)| l.len() == 2));
    Ok(())
}

/// More tokens than the context are prefilled as several windows, the drills shared out,
/// the prefill counted on across them, and every window's queries train the heads.
#[test]
fn more_tokens_than_the_context_are_prefilled_in_windows() -> Result<()> {
    let (_file, model) = tiny_gemma3()?;
    let (artifact, events) = trained(&model, &training(12_000, 12))?;
    let (tokens, windows, _, _) = text_of(&events);
    // Two windows of at most 6,000 tokens (the context is 8,192), each filled.
    assert_eq!(windows, 2);
    assert!((10_000..=12_000).contains(&tokens), "{tokens} tokens");
    assert_eq!(artifact.tokens, tokens);
    assert_prefill_counts_to(&events, tokens);

    // Without drills the text is not repeated: windows take it on in order and stop at its
    // end, short of the five windows that 40,000 tokens would fill.
    let text = gpl_text()?;
    let whole = model.tokenizer.encode(&text, Default::default())?.len();
    let mut plain = Vec::new();
    train_artifact(&model, &text, &training(40_000, 0), &mut |e| plain.push(e))?;
    let (tokens, windows, _, _) = text_of(&plain);
    assert!(whole < 40_000 && windows < 5, "{windows} windows");
    // The text once: each window ends at a paragraph break and is encoded on its own, so
    // the count differs from the whole text's by a little at each cut.
    assert!(
        tokens.abs_diff(whole) < 500 * windows,
        "{tokens} tokens for the text's {whole}"
    );
    Ok(())
}

#[test]
fn drills_that_leave_no_room_for_the_text_are_an_error() -> Result<()> {
    let (_file, model) = tiny_gemma3()?;
    let error = train_artifact(&model, &gpl_text()?, &training(4000, 60), &mut |_| {})
        .expect_err("60 drills in 4000 tokens");
    let message = error.to_string();
    assert!(
        message.contains("60 drills take about") && message.contains("plant fewer drills"),
        "{message}"
    );
    Ok(())
}
