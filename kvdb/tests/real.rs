//! Every index on real keys and queries: the default model's retrieval layers over real text
//! (the whole GPL-3, ~7.5K tokens), with fixed floors. Queries come from the last quarter of
//! the text; the sink (4 tokens) and the recent window (256) are excluded from the
//! candidates, as the engine does. SAAP is trained on the first three quarters only, so its
//! test queries are unseen.
//!
//! Attention on these keys is diffuse: even the exact top 5% of the candidates holds only
//! about 0.73 / 0.47 / 0.58 of their attention mass in layers 5 / 11 / 17 (printed by the
//! floors test), so the bucket indexes' absolute floor (0.8 of the mass at ≤ 5% of the keys)
//! cannot hold here for any selection; it is asserted on concentrated synthetic attention in
//! `buckets.rs`, and here the bucket indexes must stay within 5%, beat random twice over and
//! SAAP must match or beat its k-means baseline.
//!
//! Needs the default model (`kvdb model fetch`). Here rather than in kvdb-index because SAAP
//! is trained by kvdb.

use kvdb::{train_head, TrainOptions, TrainingData};
use kvdb_index::saap::SaapHead;
use kvdb_index::{
    BuildContext, FlatIndex, GroupQuery, IndexSpec, KeyIndex, QuerySample, SearchParams, Selection,
};
use kvdb_tests::{candidates, last_quarter, mass_recall, real_kv, real_kv_whole, RealKv, WINDOW};
use rand::seq::index::sample;
use rand::SeedableRng;

/// The top-k budget: 64 keys, ~0.9% of the eligible keys.
const K: usize = 64;

/// The top-k indexes at their recommended settings (README): recall@k ≥ 0.9. ivf needs to
/// probe most lists for it: the queries lie outside the keys' distribution, so centroid
/// scores rank lists poorly (RetrievalAttention reports the same of IVF on attention keys).
const TOP_K: [&str; 3] = ["ivf64,np40", "hnsw16,ef128", "lsh:L=64,K=4,min=3"];
/// SAAP and its k-means baseline at equal buckets and probes, within 5% of the keys. In
/// layer 17 SAAP only matches the baseline: at C=64, ℓ=2 it covers 0.119 of the mass against
/// 0.121 (in layers 5 and 11, 0.57 and 0.44 against 0.32 and 0.22).
const SAAP: &str = "saap128,l4";
const KMEANS: &str = "ivf128,np4,norope,all";
/// Pruning indexes at a top-64 budget.
const PRUNING: [&str; 2] = [
    "hip:k64,bq1,bk2",
    "ihip:lc=64/16/4,k=1024/256/64,refresh=16/8/4",
];

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
    /// Keys (and centroids, entry points) scored, as a share of the eligible keys.
    scored: f64,
}

fn measure(kv: &RealKv, index: &dyn KeyIndex, k: usize) -> anyhow::Result<Quality> {
    let exact = FlatIndex::build(kv.rope.clone(), &kv.keys)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut q = Quality::default();
    let positions = last_quarter(kv.len());
    for &p in &positions {
        let query = GroupQuery {
            queries: kv.query(p),
            position: p,
        };
        let eligible = candidates(p);
        let params = SearchParams::top(k, eligible.clone());
        let searched = index.searcher().search(&query, &params)?;
        q.scored += searched.scored as f64 / eligible.len() as f64;
        let found = searched.selection;
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
        scored: q.scored / n,
    })
}

fn context<'a>(kv: &RealKv, saap: Option<&'a SaapHead>) -> BuildContext<'a> {
    BuildContext {
        rope: kv.rope.clone(),
        seed: 0,
        saap,
        queries: None,
    }
}

/// Every [`QUERY_STRIDE`]th position's queries of the first three quarters (the positions
/// the test queries come from are left out), as an ingest samples them.
struct Sample {
    positions: Vec<u32>,
    queries: Vec<f32>,
}

/// The sampling stride of an ingest (kvdb's `QUERY_SAMPLE_STRIDE`).
const QUERY_STRIDE: usize = 16;

impl Sample {
    fn of(kv: &RealKv) -> Self {
        let positions: Vec<u32> = (QUERY_STRIDE - 1..kv.len() * 3 / 4)
            .step_by(QUERY_STRIDE)
            .map(|p| p as u32)
            .collect();
        let queries = positions
            .iter()
            .flat_map(|&p| kv.query(p as usize).iter().copied())
            .collect();
        Self { positions, queries }
    }

    fn context<'a>(&'a self, kv: &RealKv) -> BuildContext<'a> {
        BuildContext {
            queries: Some(QuerySample {
                queries: &self.queries,
                positions: &self.positions,
                scale: kv.scale,
                recent: WINDOW,
            }),
            ..context(kv, None)
        }
    }
}

/// SAAP trained on the first three quarters of the layer's keys and queries.
fn train_saap(kv: &RealKv, centroids: usize) -> anyhow::Result<SaapHead> {
    let n = kv.len() * 3 / 4;
    let d = kv.head_dim;
    let options = TrainOptions {
        centroids,
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

/// The top-k indexes find at least 90% of the exact top-k; the bucket indexes select at
/// most 5% of the keys; every index covers at least twice the mass of a random selection of
/// its size; SAAP's learned routing covers at least the mass of routing by centroid at equal
/// buckets. Each layer's exact top 5% is printed for scale.
#[test]
fn floors_on_real_keys() -> anyhow::Result<()> {
    let layers = real_kv_whole()?;
    let mut failures = Vec::new();
    for kv in layers.iter() {
        let exact = FlatIndex::build(kv.rope.clone(), &kv.keys)?;
        let five = (kv.len() - 260) / 20;
        let oracle = measure(kv, &exact, five)?;
        eprintln!(
            "layer {:>2} exact top 5% covers {:.3} of the mass",
            kv.layer, oracle.mass_recall
        );
        let saap = train_saap(kv, 128)?;
        let mut mass = Vec::new();
        for spec in TOP_K.iter().chain(&[SAAP, KMEANS]).chain(&PRUNING) {
            let parsed: IndexSpec = spec.parse()?;
            let index = kvdb_index::build(&parsed, &context(kv, Some(&saap)), &kv.keys)?;
            let q = measure(kv, index.as_ref(), K)?;
            eprintln!(
                "layer {:>2} {spec:<46} recall@{K} {:.3}  mass {:.3}  selectivity {:.4}  \
                 random mass {:.3}",
                kv.layer, q.recall_at_k, q.mass_recall, q.selectivity, q.random_mass_recall
            );
            let mut fail =
                |what: String| failures.push(format!("layer {} {spec}: {what}", kv.layer));
            if TOP_K.contains(spec) && q.recall_at_k < 0.9 {
                fail(format!("recall@k {:.3} < 0.9", q.recall_at_k));
            }
            if parsed.attends_whole_buckets() && q.selectivity > 0.05 {
                fail(format!("selectivity {:.4} > 0.05", q.selectivity));
            }
            if q.mass_recall < 2.0 * q.random_mass_recall {
                fail(format!(
                    "mass recall {:.3} < 2 × random {:.3}",
                    q.mass_recall, q.random_mass_recall
                ));
            }
            mass.push(q.mass_recall);
        }
        let (saap_mass, kmeans_mass) = (mass[TOP_K.len()], mass[TOP_K.len() + 1]);
        if saap_mass < kmeans_mass {
            failures.push(format!(
                "layer {}: {SAAP} mass recall {saap_mass:.3} < {KMEANS} {kmeans_mass:.3}",
                kv.layer
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Lists ranked by a routing fitted on a sample of the text's own queries (one position in
/// 16 of the first three quarters, as an ingest keeps them) cover at least the mass that
/// ranking by centroid covers at the same lists probed (within 3%: the fit is a correction
/// that a ridge pulls towards the centroids), and more over all layers and settings. They
/// attend larger lists: up to 2.2x the keys at the same lists probed (printed).
/// Measured: layer 11 at 2 of 128 lists, 0.407 of the mass against 0.149; layer 5 at 4 of
/// 256, 0.582 against 0.582 (with 2.2x the keys).
#[test]
fn fitted_routing_covers_at_least_the_centroids_mass() -> anyhow::Result<()> {
    let layers = real_kv_whole()?;
    let mut failures = Vec::new();
    let (mut fitted_total, mut centroid_total) = (0.0, 0.0);
    for kv in layers.iter() {
        let sample = Sample::of(kv);
        for (lists, probes) in [(128, 2), (128, 4), (256, 4), (256, 8)] {
            let centroid: IndexSpec = format!("ivf{lists},np{probes},norope,all").parse()?;
            let fitted: IndexSpec = format!("{centroid},fit").parse()?;
            let by_centroid = kvdb_index::build(&centroid, &sample.context(kv), &kv.keys)?;
            let by_fit = kvdb_index::build(&fitted, &sample.context(kv), &kv.keys)?;
            assert_eq!(by_fit.spec(), fitted, "built without its fit");
            let (c, f) = (
                measure(kv, by_centroid.as_ref(), K)?,
                measure(kv, by_fit.as_ref(), K)?,
            );
            eprintln!(
                "layer {:>2} {lists} lists, {probes} probed: centroid mass {:.3} at {:.4} of \
                 the keys, fit {:.3} at {:.4}",
                kv.layer, c.mass_recall, c.selectivity, f.mass_recall, f.selectivity
            );
            if f.mass_recall < 0.97 * c.mass_recall {
                failures.push(format!(
                    "layer {} {fitted}: mass {:.3} < 0.97 × by centroid {:.3}",
                    kv.layer, f.mass_recall, c.mass_recall
                ));
            }
            fitted_total += f.mass_recall;
            centroid_total += c.mass_recall;
        }
    }
    if fitted_total < 1.2 * centroid_total {
        failures.push(format!(
            "summed mass: fit {fitted_total:.3} < 1.2 × by centroid {centroid_total:.3}"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// The attention-aware graph (`qgraph16,ef32`), its shortcuts and routes from a sample of the
/// first three quarters' queries (as an ingest keeps them; the test queries come from the
/// last quarter): it scores under 8% of the eligible keys at 7.5K tokens, covers at least 5
/// times a random selection's mass in every layer, and the sample is what the query-aware
/// parts add: over the three layers it covers at least 1.1 times the mass of the same graph
/// built without it, for each of three build seeds. Measured (seed 0): mass 0.543 / 0.131 /
/// 0.139 in layers 5 / 11 / 17 (without the sample 0.526 / 0.077 / 0.099; flat's exact
/// top-64 0.614 / 0.173 / 0.289), 4.0-5.5% of the keys scored; over the three seeds the
/// sampled graph covered 1.14-1.20 times the mass without the sample (summed over the
/// layers). `QGRAPH_GRID="spec;spec"` prints other specs.
#[test]
fn qgraph_covers_more_mass_with_the_query_sample() -> anyhow::Result<()> {
    let layers = real_kv_whole()?;
    let grid = std::env::var("QGRAPH_GRID").unwrap_or_else(|_| "qgraph16,ef32".into());
    let mut failures = Vec::new();
    for spec in grid.split(';') {
        let spec: IndexSpec = spec.parse()?;
        for seed in 0..3 {
            let (mut with, mut without) = (0.0, 0.0);
            for kv in layers.iter() {
                let sample = Sample::of(kv);
                let mut sampled = sample.context(kv);
                sampled.seed = seed;
                let mut bare = context(kv, None);
                bare.seed = seed;
                let q = measure(
                    kv,
                    kvdb_index::build(&spec, &sampled, &kv.keys)?.as_ref(),
                    K,
                )?;
                let b = measure(kv, kvdb_index::build(&spec, &bare, &kv.keys)?.as_ref(), K)?;
                eprintln!(
                    "layer {:>2} {spec} seed {seed}: recall@{K} {:.3}  mass {:.3} (without the \
                     sample {:.3})  scored {:.4}  random mass {:.3}",
                    kv.layer,
                    q.recall_at_k,
                    q.mass_recall,
                    b.mass_recall,
                    q.scored,
                    q.random_mass_recall
                );
                let mut fail = |what: String| {
                    failures.push(format!("layer {} {spec} seed {seed}: {what}", kv.layer))
                };
                if q.scored > 0.08 {
                    fail(format!("scored {:.4} > 0.08", q.scored));
                }
                if q.mass_recall < 5.0 * q.random_mass_recall {
                    fail(format!(
                        "mass {:.3} < 5 × random {:.3}",
                        q.mass_recall, q.random_mass_recall
                    ));
                }
                with += q.mass_recall;
                without += b.mass_recall;
            }
            if with < 1.1 * without {
                failures.push(format!(
                    "{spec} seed {seed}: summed mass {with:.3} < 1.1 × without the sample {without:.3}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Saving and loading gives identical selections, and so does adding keys after a build
/// with the partition fixed (ivf: the load of a build over the first part).
#[test]
fn save_load_and_incremental_add_on_real_keys() -> anyhow::Result<()> {
    let layers = real_kv(4096)?;
    let kv = &layers[0];
    let d = kv.head_dim;
    let saap = train_saap(kv, 32)?;
    let sample = Sample::of(kv);
    let first = kv.len() / 2;
    for spec in [
        "flat",
        "ivf32,np4",
        "ivf32,np4,norope,all",
        "ivf32,np4,norope,all,fit",
        "lsh:L=16,K=8,min=2",
        "saap32,l4",
    ] {
        let parsed: IndexSpec = spec.parse()?;
        let ctx = BuildContext {
            saap: Some(&saap),
            ..sample.context(kv)
        };
        let whole = kvdb_index::build(&parsed, &ctx, &kv.keys)?;
        let loaded = kvdb_index::load(&kvdb_index::save(whole.as_ref())?, &ctx, &kv.keys)?;
        // Built over the first half, then the second half added in two pieces…
        let mut grown = kvdb_index::build(&parsed, &ctx, &kv.keys[..first * d])?;
        let saved_half = kvdb_index::save(grown.as_ref())?;
        grown.add(&kv.keys[first * d..(first + 100) * d])?;
        grown.add(&kv.keys[(first + 100) * d..])?;
        // …equals the same partition given every key at once.
        let fixed = kvdb_index::load(&saved_half, &ctx, &kv.keys)?;
        for &p in &last_quarter(kv.len()) {
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
        assert_eq!(loaded.len(), kv.len());
        assert_eq!(grown.len(), kv.len());
    }
    Ok(())
}
