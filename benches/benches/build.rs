//! Index builds of the bucket indexes' partition: `ivf256,np8,norope,all` over 128K keys of
//! head dim 128 (one layer's KV head of a Llama-3-8B-shaped corpus of 128K tokens: an ingest
//! builds 256 of these), on keys drawn from the distribution fitted to the default model's
//! real ones (`kvdb_benches::key_model`). k-means over 65,536 sampled keys is most of it.
//! `… load` reopens the saved index over the same keys, as opening a corpus does for each:
//! with OpenBLAS's thread pool, then with every product on its calling thread (what kvdb's
//! parallel loads and builds set, `kvdb_model::blas_on_calling_threads`).
//!
//! `cargo bench -p kvdb-benches --bench build` (`RAYON_NUM_THREADS=1` for one core's time).

use anyhow::Result;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use kvdb_benches::key_model::KeyModel;
use kvdb_benches::micro::{size_label, smoke_run, time_iters, CORPUS_SEED};
use kvdb_index::{BuildContext, IndexSpec};

/// The spec built: the partition GPU routing serves.
const SPEC: &str = "ivf256,np8,norope,all";

fn build(c: &mut Criterion) {
    if let Err(e) = run(c) {
        panic!("build benches: {e:#}");
    }
}

fn run(c: &mut Criterion) -> Result<()> {
    let (fit, _) = KeyModel::committed()?;
    let model = fit.at_head_dim(128)?;
    let n = if smoke_run() { 1 << 12 } else { 1 << 17 };
    let keys = model.draw_keys(n, CORPUS_SEED);
    let spec: IndexSpec = SPEC.parse()?;
    let context = BuildContext {
        rope: model.rope(),
        seed: CORPUS_SEED,
        saap: None,
        queries: None,
    };
    let mut group = c.benchmark_group(format!("build/d128/{}", size_label(n)));
    group.sampling_mode(SamplingMode::Flat).sample_size(10);
    group.bench_function(SPEC, |b| {
        b.iter_custom(|iters| {
            time_iters(iters, || {
                kvdb_index::build(&spec, &context, &keys).unwrap_or_else(|e| panic!("{SPEC}: {e}"))
            })
        })
    });
    // Opening a corpus loads every saved index over keys read back from the store.
    let built = kvdb_index::build(&spec, &context, &keys)?;
    let saved = kvdb_index::save(built.as_ref())?;
    let mut load = |name: &str| {
        group.bench_function(format!("{SPEC} load{name}"), |b| {
            b.iter_custom(|iters| {
                time_iters(iters, || {
                    kvdb_index::load(&saved, &context, &keys)
                        .unwrap_or_else(|e| panic!("{SPEC}: {e}"))
                })
            })
        });
    };
    // OpenBLAS's own thread pool first, then (for good: OpenBLAS's setting is global) every
    // product on its calling thread, as kvdb's builds and loads run them.
    load("");
    kvdb_model::blas_on_calling_threads();
    load(", BLAS on the calling thread");
    group.finish();
    Ok(())
}

criterion_group! {
    name = benches;
    config = kvdb_benches::micro::criterion();
    targets = build
}
criterion_main!(benches);
