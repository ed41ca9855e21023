//! LshIndex: recall against exact search on real keys, adds equal to a build from scratch,
//! save/load, the cost it reports, shape errors.
//!
//! Each test draws its seed from `rand::rng()` (or `KVDB_TEST_SEED`) and names it in every
//! assertion message, so a failure can be replayed with `KVDB_TEST_SEED=<seed>`. The real
//! keys and queries are Gemma 3 270M's over the GPL-3 text (`kvdb_tests::real_kv`).

use std::time::Instant;

mod support;

use support::{context, random_positions, recall};

use kvdb_index::{
    FlatIndex, GroupQuery, IndexError, IndexSpec, KeyIndex, LshIndex, LshSpec, SearchParams,
};
use kvdb_model::RopeStyle;
use kvdb_tests::{random_vec, real_kv, seeded, test_rope, RealKv};
use rand::rngs::StdRng;
use rand::Rng;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The parameters the recall floor is checked at. On these keys a query and its top keys are
/// nearly orthogonal (cosine only ~0.05 above the rest), which sign projections barely
/// resolve: MagicPIG's own K=10, L=150 finds 20-40% of the top 64, and recall 0.9 takes
/// hashes so coarse that nearly every eligible key becomes a candidate. `L=64,K=5,min=2`
/// re-scores ~95% and dips below 0.9 for some seeds; this spec re-scores ~99% and stays
/// above 0.98 (see `parameter_sweep`).
const SPEC: &str = "lsh:L=64,K=4,min=3";
/// Real tokens captured.
const N: usize = 4096;
/// Keys selected: about 1.5% of the context.
const K: usize = 64;
/// Query positions averaged over, from the last quarter of the sequence.
const POSITIONS: usize = 40;
/// Attention sinks and the recent window, attended densely and so excluded from candidates.
/// Mean recall@K the index must reach against exact top-K.
const FLOOR: f64 = 0.9;

/// The floor's spec with the seed of this run.
fn spec(seed: u64) -> Result<IndexSpec, IndexError> {
    format!("{SPEC},seed={seed}").parse()
}

/// Recall@64 over 4096 real keys is at least 0.9 in every retrieval layer.
#[test]
fn real_keys_reach_the_recall_floor() -> TestResult {
    let (seed, mut rng) = seeded();
    let spec = spec(seed)?;
    for kv in real_kv(N)?.iter() {
        let started = Instant::now();
        let index = kvdb_index::build(&spec, &context(kv.rope.clone()), &kv.keys)?;
        let built = started.elapsed().as_secs_f64();
        let exact = FlatIndex::build(kv.rope.clone(), &kv.keys)?;
        let at = random_positions(&mut rng, N, POSITIONS);
        let context = format!("seed {seed} layer {}", kv.layer);
        let (recall, scored) = recall(&*index, &exact, kv, &at, K, &context)?;
        println!(
            "{SPEC} layer {}: recall@{K} {recall:.3}, scored {scored:.0} of {N}, build {built:.2}s, {} MB",
            kv.layer,
            index.memory_bytes() as f64 / 1e6
        );
        assert!(
            recall >= FLOOR,
            "{context}: recall@{K} {recall:.3} < {FLOOR}"
        );
        assert_eq!(index.build_stats().seed, seed, "{context}");
        assert_eq!(index.build_stats().keys, N, "{context}");
        assert_eq!(index.spec(), spec, "{context}");
    }
    Ok(())
}

/// Not a test: recall and keys re-scored for a grid of parameters on the real keys
/// (`cargo test --release --test lsh -- --ignored --nocapture`; `LSH_GRID="L,K,min;..."`
/// sets the grid).
#[test]
#[ignore]
fn parameter_sweep() -> TestResult {
    let (seed, mut rng) = seeded();
    let kvs = real_kv(N)?;
    let at = random_positions(&mut rng, N, POSITIONS);
    let grid: Vec<(usize, usize, usize)> = std::env::var("LSH_GRID")
        .ok()
        .map(|g| {
            g.split(';')
                .map(|t| {
                    let v: Vec<usize> = t.split(',').map(|x| x.parse().unwrap_or(1)).collect();
                    (v[0], v[1], v[2])
                })
                .collect()
        })
        .unwrap_or_else(|| {
            vec![
                (150, 10, 2),
                (256, 8, 2),
                (64, 5, 3),
                (64, 4, 4),
                (64, 5, 2),
            ]
        });
    for (tables, bits, min) in grid {
        let spec: IndexSpec = format!("lsh:L={tables},K={bits},min={min},seed={seed}").parse()?;
        let mut line = format!("{spec}:");
        for kv in kvs.iter() {
            let index = kvdb_index::build(&spec, &context(kv.rope.clone()), &kv.keys)?;
            let exact = FlatIndex::build(kv.rope.clone(), &kv.keys)?;
            let (recall, scored) = recall(&*index, &exact, kv, &at, K, "sweep")?;
            let hashing = kv.group * tables * bits;
            line += &format!(
                " layer {} recall {recall:.3} re-scored {:.0};",
                kv.layer,
                scored - hashing as f64
            );
        }
        println!("{line}");
    }
    Ok(())
}

/// Real queries (all heads of the group) at positions past `n`, over candidates `0..n`.
fn real_searches(
    kv: &RealKv,
    rng: &mut StdRng,
    n: usize,
    count: usize,
) -> Vec<(usize, SearchParams)> {
    (0..count)
        .map(|_| {
            let position = rng.random_range(n..kv.len());
            let start = rng.random_range(0..n as u32 / 2);
            (
                position,
                SearchParams::top(rng.random_range(1..200), start..n as u32),
            )
        })
        .collect()
}

/// Adding in pieces builds exactly the index a build over all keys does: the same
/// selections and the same saved bytes.
#[test]
fn adding_in_pieces_equals_one_build() -> TestResult {
    let (seed, mut rng) = seeded();
    let spec = spec(seed)?;
    let kvs = real_kv(N)?;
    let kv = &kvs[rng.random_range(0..kvs.len())];
    let (d, n) = (kv.head_dim, 3500);
    let ctx = context(kv.rope.clone());
    let whole = kvdb_index::build(&spec, &ctx, &kv.keys[..n * d])?;
    let mut pieces = kvdb_index::build(&spec, &ctx, &kv.keys[..100 * d])?;
    let mut at = 100;
    for len in [0, 1, 511, 1024, 1864] {
        pieces.add(&kv.keys[at * d..(at + len) * d])?;
        at += len;
    }
    assert_eq!((at, pieces.len()), (n, n));
    assert_eq!(pieces.build_stats().added, n - 100);
    for (position, params) in real_searches(kv, &mut rng, n, 40) {
        let query = GroupQuery {
            queries: kv.query(position),
            position,
        };
        assert_eq!(
            pieces.searcher().search(&query, &params)?,
            whole.searcher().search(&query, &params)?,
            "seed {seed} layer {}: {params:?}",
            kv.layer
        );
    }
    assert_eq!(pieces.save()?, whole.save()?, "seed {seed}: saved bodies");
    Ok(())
}

/// Saved and loaded, the index selects exactly what the original does; loaded with more
/// keys than it covered, it equals a build over all of them. Corrupt bytes are errors.
#[test]
fn save_load_gives_identical_selections() -> TestResult {
    let (seed, mut rng) = seeded();
    let spec = spec(seed)?;
    let kvs = real_kv(N)?;
    let kv = &kvs[rng.random_range(0..kvs.len())];
    let (d, n) = (kv.head_dim, 3000);
    let ctx = context(kv.rope.clone());
    let index = kvdb_index::build(&spec, &ctx, &kv.keys[..n * d])?;
    let bytes = kvdb_index::save(&*index)?;
    let started = Instant::now();
    let loaded = kvdb_index::load(&bytes, &ctx, &kv.keys[..n * d])?;
    println!(
        "saved {} KB, loaded in {:.3}s",
        bytes.len() / 1000,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(loaded.build_stats(), index.build_stats());
    assert_eq!(loaded.spec(), index.spec());
    for (position, params) in real_searches(kv, &mut rng, n, 40) {
        let query = GroupQuery {
            queries: kv.query(position),
            position,
        };
        assert_eq!(
            loaded.searcher().search(&query, &params)?,
            index.searcher().search(&query, &params)?,
            "seed {seed}: {params:?}"
        );
    }
    let caught_up = kvdb_index::load(&bytes, &ctx, &kv.keys[..(n + 500) * d])?;
    let whole = kvdb_index::build(&spec, &ctx, &kv.keys[..(n + 500) * d])?;
    for (position, params) in real_searches(kv, &mut rng, n + 500, 20) {
        let query = GroupQuery {
            queries: kv.query(position),
            position,
        };
        assert_eq!(
            caught_up.select(&query, &params)?,
            whole.select(&query, &params)?,
            "seed {seed}: caught up {params:?}"
        );
    }
    assert!(kvdb_index::load(&bytes[..bytes.len() - 5], &ctx, &kv.keys).is_err());
    assert!(kvdb_index::load(&bytes, &ctx, &kv.keys[..(n - 1) * d]).is_err());
    let IndexSpec::Lsh(lsh) = spec else {
        unreachable!()
    };
    let body = index.save()?;
    let other = LshSpec {
        seed: seed.wrapping_add(1),
        ..lsh
    };
    assert!(LshIndex::load(&other, &ctx, Default::default(), &body, &kv.keys[..n * d]).is_err());
    assert!(LshIndex::load(
        &lsh,
        &ctx,
        Default::default(),
        &body,
        &kv.keys[..(n + 1) * d]
    )
    .is_err());
    assert!(LshIndex::load(
        &lsh,
        &ctx,
        Default::default(),
        &body[..body.len() / 2],
        &kv.keys
    )
    .is_err());
    Ok(())
}

/// `scored` is the candidates re-scored plus L·K hyperplane products per query head; the
/// seed decides the hashing; small cases and bad shapes behave.
#[test]
fn cost_seed_and_edge_cases() -> TestResult {
    let (seed, mut rng) = seeded();
    let (n, d, heads) = (2000, 32, 3);
    let rope = test_rope(RopeStyle::Interleaved, d);
    let ctx = context(rope.clone());
    let keys = random_vec(&mut rng, n * d);
    let spec: IndexSpec = format!("lsh:L=16,K=6,min=2,seed={seed}").parse()?;
    let mut index = kvdb_index::build(&spec, &ctx, &keys)?;
    // One bit per table, 16 tables, 3 heads: a key misses every head in every table with
    // probability ~2^-48, so all keys are candidates and the search is exact.
    let everything: IndexSpec = format!("lsh:L=16,K=1,min=1,seed={seed}").parse()?;
    let coarse = kvdb_index::build(&everything, &ctx, &keys)?;
    let exact = FlatIndex::build(rope.clone(), &keys)?;
    let hashing = heads * 16 * 6;
    for _ in 0..20 {
        let queries = random_vec(&mut rng, heads * d);
        let query = GroupQuery {
            queries: &queries,
            position: n,
        };
        let start = rng.random_range(0..n as u32 / 2);
        let params = SearchParams::top(rng.random_range(1..50), start..n as u32 + 5);
        let found = index.searcher().search(&query, &params)?;
        let eligible = n - start as usize;
        assert!(
            (hashing..=hashing + eligible).contains(&found.scored),
            "seed {seed}: scored {}",
            found.scored
        );
        let candidates = found.scored - hashing;
        assert_eq!(
            found.selection.len(),
            params.k.min(candidates),
            "seed {seed}"
        );
        assert!(found
            .selection
            .ids()
            .iter()
            .all(|id| (start..n as u32).contains(id)));
        let all = coarse.searcher().search(&query, &params)?;
        assert_eq!(all.selection, exact.select(&query, &params)?, "seed {seed}");
        assert_eq!(all.scored, heads * 16 + eligible, "seed {seed}");
    }
    // Another seed hashes differently.
    let other: IndexSpec = format!("lsh:L=16,K=6,min=2,seed={}", seed.wrapping_add(1)).parse()?;
    assert_ne!(
        kvdb_index::build(&other, &ctx, &keys)?.save()?,
        index.save()?,
        "seed {seed}"
    );

    let queries = random_vec(&mut rng, 2 * d);
    let q = GroupQuery {
        queries: &queries,
        position: n,
    };
    assert!(index.select(&q, &SearchParams::top(0, 0..2000))?.is_empty());
    assert!(index
        .select(&q, &SearchParams::top(5, 700..700))?
        .is_empty());
    assert!(index
        .select(&q, &SearchParams::top(5, 2000..3000))?
        .is_empty());
    assert_eq!(
        index.select(&q, &SearchParams::top(50, 1990..3000))?.len(),
        10
    );
    assert!(matches!(
        index.add(&[0.0; 33]),
        Err(IndexError::Shape {
            len: 33,
            head_dim: 32,
            ..
        })
    ));
    assert_eq!(index.len(), n);
    let bad = [0.0; 40];
    let query = |queries| GroupQuery {
        queries,
        position: n,
    };
    assert!(matches!(
        index.select(&query(&bad), &SearchParams::top(5, 0..10)),
        Err(IndexError::Shape { .. })
    ));
    assert!(matches!(
        index.select(&query(&[]), &SearchParams::top(5, 0..10)),
        Err(IndexError::Empty { .. })
    ));
    // NaN keys and queries do not panic.
    index.add(&[f32::NAN; 32 * 3])?;
    let nan = [f32::NAN; 32];
    index.select(&query(&nan), &SearchParams::top(5, 0..2003))?;
    let IndexSpec::Lsh(lsh) = spec else {
        unreachable!()
    };
    for bad in [
        LshSpec { bits: 33, ..lsh },
        LshSpec {
            tables: 0,
            min_collisions: 0,
            ..lsh
        },
        LshSpec {
            min_collisions: 17,
            ..lsh
        },
    ] {
        let err = LshIndex::build(&bad, &ctx, &keys).expect_err("bad spec");
        assert!(matches!(err, IndexError::Spec { .. }), "{err}");
    }
    assert!(kvdb_index::build(&spec, &context(test_rope(RopeStyle::Halves, 0)), &[1.0]).is_err());
    assert!(index.memory_bytes() > n * d * 4);
    Ok(())
}
