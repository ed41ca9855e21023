//! One search per index type, at 16K, 128K and 1M keys and head dims 128 and 256, on keys
//! and queries drawn from the distribution fitted to the default model's real ones
//! (`kvdb_benches::key_model`).
//!
//! Each iteration opens a fresh searcher (InfiniteHiP: every stage runs, as on a query's
//! first decode step) and searches with the next of 64 group queries (4 query heads) at
//! position `n`, over the candidates the engine's default dense part leaves (sink 4,
//! window 256), with the engine's default budget k = 64 (hip and ihip are given the same;
//! saap attends its whole buckets). Indexes are loaded from the on-disk cache or built and
//! saved there (status lines on stderr); a size whose build would exceed
//! `KVDB_BENCH_BUILD_LIMIT` seconds (default 600), estimated from the next smaller size's
//! recorded build, is skipped with a status line.
//!
//! `cargo bench -p kvdb-benches --bench search [-- FILTER]`, e.g. `-- search/d256/16K`.

use std::cell::OnceCell;

use anyhow::Result;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use kvdb::{train_head, TrainOptions, TrainingData};
use kvdb_attention::DensePolicy;
use kvdb_benches::key_model::KeyModel;
use kvdb_benches::micro::{
    corpus_sizes, size_label, smoke_run, status, time_iters, IndexCache, CORPUS_SEED,
};
use kvdb_index::saap::SaapHead;
use kvdb_index::{GroupQuery, IndexSpec, KeyIndex, SaapSpec, SearchParams};

/// One spec per index type.
const SPECS: [&str; 7] = [
    "flat",
    "ivf1024,np32",
    "hnsw16,ef128",
    "lsh:L=64,K=10",
    "saap1024,l32",
    "hip:k64,bq1,bk2",
    "ihip:lc=256/32/8,k=1024/256/64,refresh=16/8/4",
];

/// Head dimensions: the fitted model's 256 and 128 derived from it.
const HEAD_DIMS: [usize; 2] = [128, 256];

/// The budget of the top-k indexes (the engine's default `--k`).
const K: usize = 64;

/// Group queries cycled through by the iterations.
const QUERIES: usize = 64;

/// SAAP's training text: this many tokens drawn with another seed than the corpus (an
/// artifact is trained once per model, on other text than the corpora it serves).
const SAAP_TOKENS: usize = 32_768;
const SAAP_SMOKE_TOKENS: usize = 2048;
const TRAINING_SEED: u64 = CORPUS_SEED + 1;

/// SAAP's head for `spec`, trained on keys and queries drawn from `model`.
fn train_saap(model: &KeyModel, spec: &SaapSpec) -> Result<SaapHead> {
    let smoke = smoke_run();
    let tokens = if smoke {
        SAAP_SMOKE_TOKENS
    } else {
        SAAP_TOKENS
    };
    let options = TrainOptions {
        centroids: spec.centroids,
        epochs: if smoke {
            1
        } else {
            TrainOptions::default().epochs
        },
        seed: CORPUS_SEED,
        ..TrainOptions::default()
    };
    status(&format!(
        "training saap ({} buckets, {} epochs) on {} drawn tokens, d {} ...",
        options.centroids,
        options.epochs,
        size_label(tokens),
        model.head_dim
    ));
    let rope = model.rope();
    let head = train_head(
        &TrainingData {
            keys: &model.draw_keys(tokens, TRAINING_SEED),
            queries: &model.draw_queries(tokens, TRAINING_SEED),
            group: model.group,
            rope: &rope,
            scale: model.scale(),
        },
        &options,
        &mut |e| {
            status(&format!(
                "saap epoch {}/{}: train KL {:.4}, validation KL {:.4}",
                e.epoch, options.epochs, e.train, e.validation
            ))
        },
    )?;
    Ok(head)
}

/// Queries whose searches [`describe`] averages.
const DESCRIBED: usize = 8;

/// Prints what a search of `index` costs besides time: vectors scored and ids selected, the
/// mean over the group `queries` at position `n`.
fn describe(
    index: &dyn KeyIndex,
    queries: &[f32],
    n: usize,
    params: &SearchParams,
) -> kvdb_index::Result<()> {
    let width = queries.len() / DESCRIBED;
    let (mut scored, mut selected) = (0, 0);
    for rows in queries.chunks_exact(width) {
        let query = GroupQuery {
            queries: rows,
            position: n,
        };
        let found = index.searcher().search(&query, params)?;
        scored += found.scored;
        selected += found.selection.len();
    }
    status(&format!(
        "{} over {} keys: a search scores {} vectors and selects {} ids (mean of {DESCRIBED})",
        index.spec(),
        size_label(n),
        scored / DESCRIBED,
        selected / DESCRIBED
    ));
    Ok(())
}

fn search(c: &mut Criterion) {
    if let Err(e) = run(c) {
        panic!("search benches: {e:#}");
    }
}

fn run(c: &mut Criterion) -> Result<()> {
    let (fit, fit_bytes) = KeyModel::committed()?;
    let cache = IndexCache::new(&fit_bytes)?;
    let sizes = corpus_sizes();
    let specs = SPECS
        .iter()
        .map(|s| s.parse())
        .collect::<Result<Vec<IndexSpec>, _>>()?;
    for d in HEAD_DIMS {
        let model = fit.at_head_dim(d)?;
        let rope = model.rope();
        // Trained once per head dimension, when a saap index is first built.
        let saap_head: OnceCell<SaapHead> = OnceCell::new();
        let saap = |spec: &SaapSpec| -> Result<&SaapHead> {
            if let Some(head) = saap_head.get() {
                return Ok(head);
            }
            let head = train_saap(&model, spec)?;
            Ok(saap_head.get_or_init(|| head))
        };
        let queries = model.draw_queries(QUERIES, CORPUS_SEED);
        let width = model.group * d;
        for (i, &n) in sizes.iter().enumerate() {
            let keys: OnceCell<Vec<f32>> = OnceCell::new();
            let params = SearchParams::top(K, DensePolicy::default().candidates(n));
            let mut group = c.benchmark_group(format!("search/d{d}/{}", size_label(n)));
            group.sampling_mode(SamplingMode::Flat);
            for spec in &specs {
                if let Some(reason) = cache.skip_reason(spec, n, d, &sizes[..i]) {
                    status(&reason);
                    continue;
                }
                let mut index = None;
                group.bench_function(spec.to_string(), |b| {
                    b.iter_custom(|iters| {
                        let index = index.get_or_insert_with(|| {
                            let keys = keys.get_or_init(|| model.draw_keys(n, CORPUS_SEED));
                            let index = cache
                                .load_or_build(spec, &rope, keys, &saap)
                                .unwrap_or_else(|e| panic!("{spec}: {e:#}"));
                            describe(index.as_ref(), &queries[..DESCRIBED * width], n, &params)
                                .unwrap_or_else(|e| panic!("{spec}: {e}"));
                            index
                        });
                        let mut rows = queries.chunks_exact(width).cycle();
                        time_iters(iters, || {
                            let query = GroupQuery {
                                queries: rows.next().unwrap_or_default(),
                                position: n,
                            };
                            index
                                .searcher()
                                .search(&query, &params)
                                .unwrap_or_else(|e| panic!("{spec}: {e}"))
                        })
                    })
                });
            }
            group.finish();
        }
    }
    Ok(())
}

criterion_group! {
    name = benches;
    config = kvdb_benches::micro::criterion();
    targets = search
}
criterion_main!(benches);
