//! Merge attention on the CPU: one decode step of one GQA group (4 query heads, head dim 256)
//! over a corpus of 16K, 128K or 1M tokens drawn from the fitted key model, attending to a
//! dense part (sink 4 + window 2048) and k ∈ {256, 2048} retrieved keys, merged by
//! log-sum-exp (`kvdb_attention::attend`: gather the pre-RoPE keys and values,
//! rotate, score, two partials, merge, normalise), against full attention over every token.
//!
//! Full attention is given its best case: keys already rotated (as a plain KV cache holds
//! them), one partial over all of them (`logits` + `Partial::from_logits` + `finish`).
//! The retrieved ids are the exact top-k of the candidates (found once, outside the timing).
//!
//! `cargo bench -p kvdb-benches --bench merge`

use std::cell::OnceCell;

use anyhow::Result;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use kvdb_attention::{attend, logits, DenseKv, DensePolicy, Partial, RetrievalQuery};
use kvdb_benches::key_model::KeyModel;
use kvdb_benches::micro::{corpus_sizes, size_label, status, time_iters, CORPUS_SEED};
use kvdb_index::{FlatIndex, GroupQuery, KeyIndex, SearchParams, Selection};

/// Retrieved keys per step.
const BUDGETS: [usize; 2] = [256, 2048];

/// The dense part: attention sinks and the recent window.
const POLICY: DensePolicy = DensePolicy {
    sink: 4,
    window: 2048,
};

/// One corpus and the query at its last position.
struct Step {
    kv: DenseKv,
    /// The keys rotated at their positions, for full attention.
    rotated: Vec<f32>,
    /// Pre-RoPE group queries `[group, head_dim]`.
    queries: Vec<f32>,
    position: usize,
    /// The exact top-k of the candidates, per budget.
    selections: Vec<Selection>,
}

impl Step {
    fn draw(model: &KeyModel, n: usize) -> Result<Self> {
        status(&format!(
            "drawing {} tokens and their top-k ...",
            size_label(n)
        ));
        let rope = model.rope();
        let keys = model.draw_keys(n, CORPUS_SEED);
        let queries = model.draw_queries(1, CORPUS_SEED);
        let position = n - 1;
        let flat = FlatIndex::build(rope.clone(), &keys)?;
        let query = GroupQuery {
            queries: &queries,
            position,
        };
        let selections = BUDGETS
            .iter()
            .map(|&k| flat.select(&query, &SearchParams::top(k, POLICY.candidates(position))))
            .collect::<Result<Vec<_>, _>>()?;
        drop(flat);
        let mut rotated = keys.clone();
        rope.rotate_rows(&mut rotated, 0);
        Ok(Self {
            kv: DenseKv::new(keys, model.draw_values(n, CORPUS_SEED), model.head_dim)?,
            rotated,
            queries,
            position,
            selections,
        })
    }
}

fn merge(c: &mut Criterion) {
    if let Err(e) = run(c) {
        panic!("merge benches: {e:#}");
    }
}

fn run(c: &mut Criterion) -> Result<()> {
    let (model, _) = KeyModel::committed()?;
    let (d, rope, scale) = (model.head_dim, model.rope(), model.scale());
    for n in corpus_sizes() {
        let step: OnceCell<Step> = OnceCell::new();
        let step = || {
            step.get_or_init(|| {
                Step::draw(&model, n).unwrap_or_else(|e| panic!("drawing the corpus: {e:#}"))
            })
        };
        let mut group = c.benchmark_group(format!("attention/d{d}/{}", size_label(n)));
        group.sampling_mode(SamplingMode::Flat);
        for (b, k) in BUDGETS.iter().enumerate() {
            group.bench_function(format!("sink4+window2048+top{k}"), |bencher| {
                bencher.iter_custom(|iters| {
                    let step = step();
                    let query = RetrievalQuery {
                        queries: &step.queries,
                        position: step.position,
                        rope: &rope,
                        scale,
                        policy: POLICY,
                        selection: &step.selections[b],
                        estimate: None,
                    };
                    time_iters(iters, || {
                        attend(&query, &step.kv)
                            .unwrap_or_else(|e| panic!("retrieval attention: {e}"))
                    })
                })
            });
        }
        group.bench_function("full", |bencher| {
            bencher.iter_custom(|iters| {
                let step = step();
                let heads = step.queries.len() / d;
                time_iters(iters, || {
                    let mut queries = step.queries.clone();
                    rope.rotate(&mut queries, step.position);
                    let logits = logits(&queries, &step.rotated, d, scale);
                    Partial::from_logits(&logits, step.kv.values(), heads, d)
                        .unwrap_or_else(|e| panic!("full attention: {e}"))
                        .finish()
                })
            })
        });
        group.finish();
    }
    Ok(())
}

criterion_group! {
    name = benches;
    config = kvdb_benches::micro::criterion();
    targets = merge
}
criterion_main!(benches);
