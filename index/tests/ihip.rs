//! IhipIndex: budgets and short contexts, a planted region, attention mass recall on the
//! real model's keys, the refresh schedule of a reused searcher, save/load and errors.
//!
//! Each test draws its seed from `rand::rng()` (or `KVDB_TEST_SEED`) and names it in every
//! assertion message, so a failure can be replayed with `KVDB_TEST_SEED=<seed>`.

use std::ops::Range;

mod support;

use support::{context, mass_recalls, planted};

use kvdb_index::{
    Found, GroupQuery, IhipIndex, IhipSpec, IndexError, IndexSpec, KeyIndex, SearchParams,
    Selection,
};
use kvdb_model::RopeStyle;
use kvdb_tests::{random_vec, real_kv, seeded, test_rope};
use rand::Rng;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn ihip(spec: &str) -> Result<IndexSpec, IndexError> {
    spec.parse()
}

/// Asserts that every id is inside `eligible` and the count is what the budget rules give
/// for a final budget `k` with last chunk size `chunk`.
fn assert_budget(found: &Selection, eligible: &Range<u32>, k: usize, chunk: usize, context: &str) {
    let ids = found.ids();
    assert!(
        ids.iter().all(|id| eligible.contains(id)),
        "{context}: outside candidates"
    );
    if k >= eligible.len() {
        assert_eq!(ids.len(), eligible.len(), "{context}: every eligible id");
    } else if k < chunk {
        // Representatives of the best chunks: k of them, or every chunk when there are fewer.
        assert!(
            !ids.is_empty() && ids.len() <= k,
            "{context}: {} representatives",
            ids.len()
        );
    } else {
        assert!(ids.len() <= k, "{context}: {} ids > k {k}", ids.len());
        // The best chunks while they fit in k: less than one chunk short of it.
        assert!(ids.len() + chunk > k, "{context}: only {} ids", ids.len());
    }
}

/// How many chunks of `chunk` tokens aligned to multiples of `chunk` overlap `ids`.
fn aligned_chunks(ids: &Range<u32>, chunk: usize) -> usize {
    if ids.is_empty() {
        return 0;
    }
    let chunk = chunk as u32;
    ((ids.end - 1) / chunk - ids.start / chunk + 1) as usize
}

/// Random sizes, budgets and candidates, short contexts included: the selection keeps to
/// the budget rules and to the candidates.
#[test]
fn selections_keep_to_budgets_and_candidates() -> TestResult {
    let (seed, mut rng) = seeded();
    for case in 0..60 {
        let d = [8, 16, 64][rng.random_range(0..3)];
        let heads = rng.random_range(1..=4);
        let n = rng.random_range(1..6000);
        let spec = [
            "ihip:paper",
            "ihip:lc=64/8,k=256/64,refresh=2/1",
            "ihip:lc=32,k=16,refresh=1",
        ][rng.random_range(0..3)];
        let parsed = ihip(spec)?;
        let index = kvdb_index::build(
            &parsed,
            &context(test_rope(RopeStyle::Halves, d)),
            &random_vec(&mut rng, n * d),
        )?;
        let IndexSpec::Ihip(stages) = parsed else {
            unreachable!("an ihip spec parses to IndexSpec::Ihip")
        };
        let start = rng.random_range(0..=n as u32);
        let end = rng.random_range(start..=n as u32 + 20);
        let k = rng.random_range(0..n + 10);
        let queries = random_vec(&mut rng, heads * d);
        let query = GroupQuery {
            queries: &queries,
            position: n,
        };
        let found = index
            .searcher()
            .search(&query, &SearchParams::top(k, start..end))?;
        let context = format!("seed {seed} case {case} ({spec} n {n} k {k} {start}..{end})");
        let eligible = start..end.min(n as u32);
        let chunk = stages.chunks[stages.chunks.len() - 1];
        if k == 0 {
            assert!(found.selection.is_empty(), "{context}");
        } else {
            assert_budget(&found.selection, &eligible, k, chunk, &context);
        }
        // Each stage scores at most 2·⌈log2 c⌉ representatives in each of its chunks, which
        // lie in the eligible ids' aligned chunks of c. With k close to the eligible count
        // every stage runs over nearly everything, so this can exceed n: it is the bound,
        // not n.
        let bound: usize = stages
            .chunks
            .iter()
            .map(|&c| aligned_chunks(&eligible, c) * 2 * c.next_power_of_two().ilog2() as usize)
            .sum();
        assert!(
            found.scored <= bound,
            "{context}: scored {} > {bound}",
            found.scored
        );
    }
    Ok(())
}

/// A strongly attended run of a chunk's length is what the stages keep.
#[test]
fn finds_a_planted_region() -> TestResult {
    let (seed, mut rng) = seeded();
    let (n, d, len, k) = (16_384, 32, 256, 128);
    let at = rng.random_range(n - 5000..n - 600);
    let (keys, queries) = planted(&mut rng, n, d, at, len);
    let index = kvdb_index::build(
        &ihip("ihip:paper")?,
        &context(test_rope(RopeStyle::Halves, d)),
        &keys,
    )?;
    let query = GroupQuery {
        queries: &queries,
        position: n,
    };
    let found = index
        .searcher()
        .search(&query, &SearchParams::top(k, 4..n as u32 - 256))?;
    let hits = found
        .selection
        .ids()
        .iter()
        .filter(|&&id| (at..at + len).contains(&(id as usize)))
        .count();
    println!(
        "ihip planted run of {len} at {at}: {hits} of {} selected in it, {} scored",
        found.selection.len(),
        found.scored
    );
    assert_eq!(found.selection.len(), k, "seed {seed}");
    // Chunks of 8 overlapping the run's edges hold run tokens too and may be kept whole.
    let near = |id: u32| (at - 8..at + len + 8).contains(&(id as usize));
    assert!(
        found.selection.ids().iter().all(|&id| near(id)),
        "seed {seed}: run at {at}: {:?}",
        found.selection
    );
    assert!(hits + 16 >= k, "seed {seed}: run at {at}: {hits} in it");
    assert!(found.scored < n / 4, "seed {seed}: scored {}", found.scored);
    Ok(())
}

/// On the real model's keys, InfiniteHiP's selection of 5% of the context holds at least
/// twice the attention mass of a random selection of the same size.
#[test]
fn mass_recall_on_real_keys() -> TestResult {
    let layers = real_kv(4096)?;
    for spec in ["ihip:paper", "ihip:lc=64/8,k=4096/1024,refresh=8/4"] {
        for kv in layers.iter() {
            let k = kv.len() * 5 / 100;
            let index = kvdb_index::build(&ihip(spec)?, &context(kv.rope.clone()), &kv.keys)?;
            let (ours, exact, random) = mass_recalls(kv, index.as_ref(), k)?;
            println!(
                "{spec} layer {} k {k}: mass recall {ours:.3} (flat top-k {exact:.3}, random {random:.3})",
                kv.layer
            );
            assert!(
                ours >= 2.0 * random,
                "{spec} layer {}: recall {ours:.3} < 2 x random {random:.3}",
                kv.layer
            );
        }
    }
    Ok(())
}

/// A searcher reused over consecutive decode positions runs each stage only when it is due
/// (16/8/4 steps), scores nothing on steps where no stage is due, reuses its cached
/// selection then, and on every step where stage 0 runs selects what a fresh searcher does.
#[test]
fn reused_searcher_refreshes_stages_on_schedule() -> TestResult {
    let layers = real_kv(4096)?;
    let kv = &layers[layers.len() - 1];
    let index = kvdb_index::build(&ihip("ihip:paper")?, &context(kv.rope.clone()), &kv.keys)?;
    let k = 128;
    let first = 3300;
    let mut searcher = index.searcher();
    let mut previous: Option<Found> = None;
    let mut last_stage_only = None;
    for step in 0..=40usize {
        let position = first + step;
        let params = SearchParams::top(k, 4..position as u32 - 256);
        let query = GroupQuery {
            queries: kv.query(position),
            position,
        };
        let found = searcher.search(&query, &params)?;
        let fresh = index.searcher().search(&query, &params)?;
        let context = format!(
            "step {step}: scored {} (fresh {})",
            found.scored, fresh.scored
        );
        assert!(
            found
                .selection
                .ids()
                .iter()
                .all(|id| params.candidates.contains(id)),
            "{context}"
        );
        assert!(found.selection.len() <= k, "{context}");
        if step % 16 == 0 {
            // Stage 0 runs, so every stage does.
            assert_eq!(found, fresh, "{context}");
        } else if step % 4 != 0 {
            assert_eq!(found.scored, 0, "{context}: no stage is due");
            let previous = previous.as_ref().map(|p| &p.selection);
            assert_eq!(
                Some(&found.selection),
                previous,
                "{context}: cached selection"
            );
        } else if step % 8 != 0 {
            // Only the last stage, inside stage 1's cached chunks.
            assert!(found.scored > 0 && found.scored < fresh.scored, "{context}");
            last_stage_only = Some(found.scored);
        } else {
            // Stages 1 and 2: more than the last stage alone, less than all three.
            assert!(found.scored < fresh.scored, "{context}");
            if let Some(last) = last_stage_only {
                assert!(
                    found.scored > last,
                    "{context}: last stage alone scored {last}"
                );
            }
        }
        previous = Some(found);
    }
    // A change of budget throws the caches away.
    let position = first + 41;
    let params = SearchParams::top(2 * k, 4..position as u32 - 256);
    let query = GroupQuery {
        queries: kv.query(position),
        position,
    };
    assert_eq!(
        searcher.search(&query, &params)?,
        index.searcher().search(&query, &params)?
    );
    Ok(())
}

/// Saved and reloaded through `kvdb_index::save`/`load` (also catching up on keys added
/// since), reused searchers select identically step by step; adding in pieces equals one
/// build.
#[test]
fn save_load_and_add_give_identical_selections() -> TestResult {
    let (seed, mut rng) = seeded();
    let (n, more, d) = (5000, 900, 16);
    let rope = test_rope(RopeStyle::Interleaved, d);
    let keys = random_vec(&mut rng, (n + more) * d);
    let spec = ihip("ihip:lc=64/16/4,k=1024/256/64,refresh=4/2/1")?;
    let index = kvdb_index::build(&spec, &context(rope.clone()), &keys[..n * d])?;
    let bytes = kvdb_index::save(index.as_ref())?;
    let loaded = kvdb_index::load(&bytes, &context(rope.clone()), &keys[..n * d])?;
    assert_eq!(loaded.spec(), spec);
    assert_eq!(loaded.len(), n);
    assert_eq!(loaded.build_stats(), index.build_stats());
    let caught_up = kvdb_index::load(&bytes, &context(rope.clone()), &keys)?;
    let whole = kvdb_index::build(&spec, &context(rope.clone()), &keys)?;
    let IndexSpec::Ihip(typed) = &spec else {
        unreachable!()
    };
    let mut pieces = IhipIndex::build(typed, &context(rope), &[])?;
    for piece in keys.chunks(d * 777) {
        pieces.add(piece)?;
    }
    assert_eq!(pieces.len(), n + more);
    assert_eq!(caught_up.build_stats().added, more);
    let heads = 3;
    let k = rng.random_range(8..200);
    let searchers = vec![index.searcher(), loaded.searcher()];
    let grown = vec![whole.searcher(), caught_up.searcher(), pieces.searcher()];
    for (mut group, len) in [(searchers, n), (grown, n + more)] {
        for step in 0..12 {
            let queries = random_vec(&mut rng, heads * d);
            let position = len + step;
            let query = GroupQuery {
                queries: &queries,
                position,
            };
            let params = SearchParams::top(k, 4..(len - 100 + step) as u32);
            let founds = group
                .iter_mut()
                .map(|s| s.search(&query, &params))
                .collect::<Result<Vec<_>, _>>()?;
            for found in &founds[1..] {
                assert_eq!(found, &founds[0], "seed {seed} k {k} step {step} len {len}");
            }
        }
    }
    assert!(index.memory_bytes() >= n * d * 4);
    Ok(())
}

/// Bad shapes and specs are errors (a failed add changes nothing); empty candidates and
/// k = 0 find nothing; budgets below one chunk keep representatives.
#[test]
fn errors_and_edge_cases() -> TestResult {
    let (seed, mut rng) = seeded();
    let d = 16;
    let rope = test_rope(RopeStyle::Halves, d);
    let good = IhipSpec::final_budget(64);
    for bad in [
        IhipSpec {
            chunks: vec![],
            budgets: vec![],
            refresh: vec![],
        },
        IhipSpec {
            chunks: vec![256, 30, 8],
            ..good.clone()
        },
        IhipSpec {
            budgets: vec![8, 16, 4],
            ..good.clone()
        },
        IhipSpec {
            refresh: vec![16, 8],
            ..good.clone()
        },
        IhipSpec {
            refresh: vec![16, 0, 4],
            ..good.clone()
        },
        IhipSpec {
            chunks: vec![0, 0, 0],
            ..good.clone()
        },
    ] {
        let err = IhipIndex::build(&bad, &context(rope.clone()), &[]).expect_err("bad spec");
        assert!(matches!(err, IndexError::Spec { .. }), "{bad:?}: {err}");
    }
    let mut index = IhipIndex::build(
        &good,
        &context(rope.clone()),
        &random_vec(&mut rng, 2000 * d),
    )?;
    assert!(matches!(
        index.add(&[0.0; 17]),
        Err(IndexError::Shape {
            len: 17,
            head_dim: 16,
            ..
        })
    ));
    assert_eq!(index.len(), 2000);
    let mut searcher = index.searcher();
    let params = SearchParams::top(8, 0..2000);
    let bad = [0.0; 20];
    assert!(matches!(
        searcher.search(
            &GroupQuery {
                queries: &bad,
                position: 2000
            },
            &params
        ),
        Err(IndexError::Shape { .. })
    ));
    assert!(matches!(
        searcher.search(
            &GroupQuery {
                queries: &[],
                position: 2000
            },
            &params
        ),
        Err(IndexError::Empty { .. })
    ));
    let queries = random_vec(&mut rng, 2 * d);
    let query = GroupQuery {
        queries: &queries,
        position: 2000,
    };
    #[allow(clippy::reversed_empty_ranges)]
    for candidates in [10..10, 2000..2090, 30..20] {
        assert_eq!(
            searcher.search(&query, &SearchParams::top(8, candidates))?,
            Found::default()
        );
    }
    assert_eq!(
        searcher.search(&query, &SearchParams::top(0, 0..2000))?,
        Found::default()
    );
    // A budget covering the candidates returns them all unscored.
    let all = searcher.search(&query, &SearchParams::top(500, 1500..2000))?;
    assert_eq!(all.selection.ids(), &(1500..2000).collect::<Vec<_>>()[..]);
    assert_eq!(all.scored, 0);
    // Below one last-stage chunk (8): the representatives of the best k chunks.
    let few = index
        .searcher()
        .search(&query, &SearchParams::top(5, 4..1800))?;
    assert_eq!(few.selection.len(), 5, "seed {seed}");
    let chunks: Vec<u32> = few.selection.ids().iter().map(|id| id / 8).collect();
    assert!(
        chunks.windows(2).all(|w| w[0] != w[1]),
        "seed {seed}: one per chunk {:?}",
        few.selection
    );
    // Short context: 1796 eligible ids, k 64: stage 0 keeps half (4 chunks of 256), stage 1
    // half of those, and the last 8 chunks of 8.
    let short = index
        .searcher()
        .search(&query, &SearchParams::top(64, 4..1800))?;
    let len = short.selection.len();
    // Chunk 4..8 is clipped by the candidates: when it is kept, 7 whole chunks join it.
    assert!(len == 64 || len == 60, "seed {seed}: {len} ids");
    assert!(
        short.scored > 0 && short.scored < 1796,
        "seed {seed}: scored {}",
        short.scored
    );
    // NaN keys rank last and do not panic.
    drop(searcher);
    index.add(&[f32::NAN; 16 * 300])?;
    let found = index
        .searcher()
        .search(&query, &SearchParams::top(64, 0..2300))?;
    assert_eq!(found.selection.len(), 64);
    Ok(())
}
