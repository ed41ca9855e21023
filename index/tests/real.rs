//! Every index on real keys and queries: the default model's retrieval layers over real text
//! (the GPL-3), with fixed floors. Queries come from the last quarter of the text; the sink
//! (4 tokens) and the recent window (256) are excluded from the candidates, as the engine
//! does. SAAP is trained on the first three quarters only, so its test queries are unseen.
//!
//! Needs the `faiss` feature (ivf) and the default model (`kvdb model fetch`).
#![cfg(feature = "faiss")]

mod support;

use support::{candidates, last_quarter, mass_recall};

use kvdb_index::saap::{train_head, SaapHead, TrainOptions, TrainingData};
use kvdb_index::{
    BuildContext, FlatIndex, GroupQuery, IndexSpec, KeyIndex, SearchParams, Selection,
};
use kvdb_tests::{real_kv, RealKv};
use rand::seq::index::sample;
use rand::SeedableRng;

const TOKENS: usize = 4096;
/// The top-k budget: 64 keys, ~1.7% of the eligible keys.
const K: usize = 64;

/// Measured quality of one index on one layer.
#[derive(Debug, Default, Clone, Copy)]
struct Quality {
    /// Share of the exact top-k found.
    recall_at_k: f64,
    /// Share of the eligible attention mass the selection covers (mean over heads).
    mass_recall: f64,
    /// Selected keys as a share of the eligible ones.
    selectivity: f64,
    /// Random selections of the same sizes: their mass recall.
    random_mass_recall: f64,
}

fn measure(kv: &RealKv, index: &dyn KeyIndex, k: usize) -> anyhow::Result<Quality> {
    let exact = FlatIndex::build(kv.rope.clone(), &kv.keys)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut q = Quality::default();
    let positions = last_quarter(TOKENS);
    for &p in &positions {
        let query = GroupQuery {
            queries: kv.query(p),
            position: p,
        };
        let eligible = candidates(p);
        let params = SearchParams::top(k, eligible.clone());
        let found = index.select(&query, &params)?;
        assert!(
            found.ids().iter().all(|id| eligible.contains(id)),
            "outside the candidates"
        );
        let truth = exact.select(&query, &params)?;
        let hits = found.ids().iter().filter(|&&id| truth.contains(id)).count();
        q.recall_at_k += hits as f64 / truth.len() as f64;
        let weights = kv.weights(p);
        q.mass_recall += mass_recall(&weights, found.ids(), &eligible);
        q.selectivity += found.len() as f64 / eligible.len() as f64;
        let random: Selection = sample(&mut rng, eligible.len(), found.len().min(eligible.len()))
            .into_iter()
            .map(|i| eligible.start + i as u32)
            .collect();
        q.random_mass_recall += mass_recall(&weights, random.ids(), &eligible);
    }
    let n = positions.len() as f64;
    Ok(Quality {
        recall_at_k: q.recall_at_k / n,
        mass_recall: q.mass_recall / n,
        selectivity: q.selectivity / n,
        random_mass_recall: q.random_mass_recall / n,
    })
}

fn context<'a>(kv: &RealKv, saap: Option<&'a SaapHead>) -> BuildContext<'a> {
    BuildContext {
        rope: kv.rope.clone(),
        seed: 0,
        saap,
    }
}

/// SAAP trained on the first three quarters of the layer's keys and queries.
fn train_saap(kv: &RealKv, centroids: usize) -> anyhow::Result<SaapHead> {
    let n = TOKENS * 3 / 4;
    let d = kv.head_dim;
    let options = TrainOptions {
        centroids,
        max_samples: 4096,
        epochs: 40,
        ..TrainOptions::default()
    };
    Ok(train_head(
        &TrainingData {
            keys: &kv.keys[..n * d],
            queries: &kv.queries[..n * kv.group * d],
            group: kv.group,
            rope: &kv.rope,
            scale: kv.scale,
        },
        &options,
        &mut |_| {},
    )?)
}

/// The top-k indexes find at least 90% of the exact top-k at their default parameters; the
/// bucket indexes cover at least 80% of the attention mass at no more than 5% of the keys;
/// every index covers at least twice the mass of a random selection of its size; SAAP's
/// learned routing beats routing by centroid at equal buckets.
#[test]
#[ignore = "issue 4 open: ivf top-k recall and the bucket indexes' mass floors are not met yet \
            on these keys (figures in the issue note); run with --ignored to see them"]
fn floors_on_real_keys() -> anyhow::Result<()> {
    let layers = real_kv(TOKENS)?;
    let top_k = ["ivf64,np8", "hnsw16,ef128", "lsh:L=64,K=4,min=3"];
    let buckets = ["ivf64,np3,norope,all", "ivf64,np3,all", "saap64,l3"];
    let others = [
        "hip:k64,bq1,bk2",
        "ihip:lc=64/16/4,k=1024/256/64,refresh=16/8/4",
    ];
    let mut failures = Vec::new();
    for kv in layers.iter() {
        let saap = train_saap(kv, 64)?;
        let mut results = Vec::new();
        for spec in top_k.iter().chain(&buckets).chain(&others) {
            let parsed: IndexSpec = spec.parse()?;
            let index = kvdb_index::build(&parsed, &context(kv, Some(&saap)), &kv.keys)?;
            let q = measure(kv, index.as_ref(), K)?;
            eprintln!(
                "layer {:>2} {spec:<48} recall@{K} {:.3}  mass {:.3}  selectivity {:.4}  random mass {:.3}",
                kv.layer, q.recall_at_k, q.mass_recall, q.selectivity, q.random_mass_recall
            );
            if top_k.contains(spec) && q.recall_at_k < 0.9 {
                failures.push(format!(
                    "layer {} {spec}: recall@k {:.3} < 0.9",
                    kv.layer, q.recall_at_k
                ));
            }
            if buckets.contains(spec) && (q.mass_recall < 0.8 || q.selectivity > 0.05) {
                failures.push(format!(
                    "layer {} {spec}: mass recall {:.3} at selectivity {:.4}",
                    kv.layer, q.mass_recall, q.selectivity
                ));
            }
            if q.mass_recall < 2.0 * q.random_mass_recall {
                failures.push(format!(
                    "layer {} {spec}: mass recall {:.3} < 2 × random {:.3}",
                    kv.layer, q.mass_recall, q.random_mass_recall
                ));
            }
            results.push((*spec, q));
        }
        let of = |s: &str| {
            results
                .iter()
                .find(|(spec, _)| *spec == s)
                .map(|(_, q)| *q)
                .unwrap_or_default()
        };
        let (saap_q, kmeans_q) = (of("saap64,l3"), of("ivf64,np3,norope,all"));
        if saap_q.mass_recall < kmeans_q.mass_recall {
            failures.push(format!(
                "layer {}: saap mass recall {:.3} < ivf norope all {:.3}",
                kv.layer, saap_q.mass_recall, kmeans_q.mass_recall
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Saving and loading gives identical selections, and so does adding keys after a build
/// with the partition fixed (ivf: the load of a build over the first part).
#[test]
fn save_load_and_incremental_add_on_real_keys() -> anyhow::Result<()> {
    let layers = real_kv(TOKENS)?;
    let kv = &layers[0];
    let d = kv.head_dim;
    let saap = train_saap(kv, 32)?;
    let first = TOKENS / 2;
    for spec in [
        "flat",
        "ivf32,np4",
        "ivf32,np4,norope,all",
        "lsh:L=16,K=8,min=2",
        "saap32,l4",
    ] {
        let parsed: IndexSpec = spec.parse()?;
        let ctx = context(kv, Some(&saap));
        let whole = kvdb_index::build(&parsed, &ctx, &kv.keys)?;
        let loaded = kvdb_index::load(&kvdb_index::save(whole.as_ref())?, &ctx, &kv.keys)?;
        // Built over the first half, then the second half added in two pieces…
        let mut grown = kvdb_index::build(&parsed, &ctx, &kv.keys[..first * d])?;
        let saved_half = kvdb_index::save(grown.as_ref())?;
        grown.add(&kv.keys[first * d..(first + 100) * d])?;
        grown.add(&kv.keys[(first + 100) * d..])?;
        // …equals the same partition given every key at once.
        let fixed = kvdb_index::load(&saved_half, &ctx, &kv.keys)?;
        for &p in &last_quarter(TOKENS) {
            let query = GroupQuery {
                queries: kv.query(p),
                position: p,
            };
            let params = SearchParams::top(K, candidates(p));
            let expected = whole.select(&query, &params)?;
            assert_eq!(
                loaded.select(&query, &params)?,
                expected,
                "{spec}: save → load at {p}"
            );
            assert_eq!(
                grown.select(&query, &params)?,
                fixed.select(&query, &params)?,
                "{spec}: incremental add at {p}"
            );
        }
        assert_eq!(loaded.len(), TOKENS);
        assert_eq!(grown.len(), TOKENS);
    }
    Ok(())
}
