//! FlatIndex against a brute-force f64 reference on fresh random inputs.
//!
//! Each test draws its seed from `rand::rng()` (or `KVDB_TEST_SEED`) and names it in every
//! assertion message, so a failure can be replayed with `KVDB_TEST_SEED=<seed>`.

use std::ops::Range;

use kvdb_index::{FlatIndex, GroupQuery, IndexError, KeyIndex, SearchParams, Selection};
use kvdb_model::{Rope, RopeStyle};
use kvdb_tests::{random_vec, seeded, test_rope};
use rand::Rng;

type TestResult = Result<(), IndexError>;

/// Max-over-heads scores of every key, in f64 (rotation in f32 with the same Rope).
fn reference_scores(rope: &Rope, keys: &[f32], queries: &[f32], position: usize) -> Vec<f64> {
    let d = rope.head_dim();
    let mut keys = keys.to_vec();
    rope.rotate_rows(&mut keys, 0);
    let mut queries = queries.to_vec();
    rope.rotate(&mut queries, position);
    keys.chunks_exact(d)
        .map(|k| {
            queries
                .chunks_exact(d)
                .map(|q| {
                    q.iter()
                        .zip(k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                })
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect()
}

/// Asserts that `found` is an exact top-k of `scores` over `eligible`, allowing swaps only
/// between scores equal within 1e-5 relative.
fn assert_exact_top_k(
    found: &Selection,
    scores: &[f64],
    eligible: Range<u32>,
    k: usize,
    context: &str,
) {
    let ids = found.ids();
    assert_eq!(ids.len(), k.min(eligible.len()), "{context}: count");
    assert!(
        ids.iter().all(|id| eligible.contains(id)),
        "{context}: outside candidates"
    );
    if ids.is_empty() {
        return;
    }
    let mut sorted: Vec<f64> = eligible.clone().map(|id| scores[id as usize]).collect();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let kth = sorted[ids.len() - 1];
    let scale = sorted.iter().fold(0.0f64, |m, s| m.max(s.abs())).max(1e-30);
    let tol = 1e-5 * scale;
    for id in eligible {
        let s = scores[id as usize];
        if found.contains(id) {
            assert!(
                s >= kth - tol,
                "{context}: selected {id} scores {s} < k-th {kth}"
            );
        } else {
            assert!(
                s <= kth + tol,
                "{context}: left out {id} scores {s} > k-th {kth}"
            );
        }
    }
}

/// Random shapes, positions, k and candidate ranges (some past the end) for both RoPE styles.
#[test]
fn matches_brute_force_reference() -> TestResult {
    let (seed, mut rng) = seeded();
    for case in 0..60 {
        let style = if case % 2 == 0 {
            RopeStyle::Halves
        } else {
            RopeStyle::Interleaved
        };
        let d = [8, 32, 64, 100, 128][rng.random_range(0..5)];
        let heads = rng.random_range(1..=8);
        let n = rng.random_range(1..3000);
        let rope = test_rope(style, d);
        let keys = random_vec(&mut rng, n * d);
        let queries = random_vec(&mut rng, heads * d);
        let position = n + rng.random_range(0..50);
        let start = rng.random_range(0..=n as u32);
        let end = rng.random_range(start..=n as u32 + 20);
        let k = rng.random_range(0..n + 10);

        let mut index = FlatIndex::new(rope.clone());
        index.add(&keys)?;
        let params = SearchParams {
            k,
            candidates: start..end,
            estimate: false,
            breadth: None,
        };
        let found = index.select(
            &GroupQuery {
                queries: &queries,
                position,
            },
            &params,
        )?;
        let scores = reference_scores(&rope, &keys, &queries, position);
        let context =
            format!("seed {seed} case {case} (n {n} d {d} heads {heads} k {k} {start}..{end})");
        assert_exact_top_k(&found, &scores, start..end.min(n as u32), k, &context);
    }
    Ok(())
}

/// 20 000 keys: the rayon path (chunks + merge) agrees with the reference.
#[test]
fn parallel_path_matches_reference() -> TestResult {
    let (seed, mut rng) = seeded();
    let (n, d, heads) = (20_000, 64, 4);
    let rope = test_rope(RopeStyle::Halves, d);
    let keys = random_vec(&mut rng, n * d);
    let mut index = FlatIndex::new(rope.clone());
    index.add(&keys)?;
    assert_eq!(index.len(), n);
    for (k, candidates) in [
        (1, 0..20_000),
        (100, 4..19_744),
        (2048, 0..u32::MAX),
        (5000, 9..17_000),
    ] {
        let queries = random_vec(&mut rng, heads * d);
        let position = n;
        let found = index.select(
            &GroupQuery {
                queries: &queries,
                position,
            },
            &SearchParams {
                k,
                candidates: candidates.clone(),
                estimate: false,
                breadth: None,
            },
        )?;
        let scores = reference_scores(&rope, &keys, &queries, position);
        let eligible = candidates.start..candidates.end.min(n as u32);
        assert_exact_top_k(&found, &scores, eligible, k, &format!("seed {seed} k {k}"));
    }
    Ok(())
}

/// k = 0, k past the eligible count, empty candidates and an empty index.
#[test]
fn edge_cases() -> TestResult {
    let (seed, mut rng) = seeded();
    let d = 16;
    let queries = random_vec(&mut rng, 2 * d);
    let query = GroupQuery {
        queries: &queries,
        position: 50,
    };
    let mut index = FlatIndex::new(test_rope(RopeStyle::Halves, d));
    assert!(index.is_empty());
    let all = SearchParams {
        k: 10,
        candidates: 0..u32::MAX,
        estimate: false,
        breadth: None,
    };
    assert!(
        index.select(&query, &all)?.is_empty(),
        "seed {seed}: empty index"
    );

    index.add(&random_vec(&mut rng, 40 * d))?;
    assert_eq!(index.len(), 40);
    let search = |k, candidates| index.select(&query, &SearchParams::top(k, candidates));
    assert!(search(0, 0..40)?.is_empty(), "seed {seed}: k = 0");
    assert!(
        search(5, 10..10)?.is_empty(),
        "seed {seed}: empty candidates"
    );
    assert!(
        search(5, 40..100)?.is_empty(),
        "seed {seed}: candidates past the end"
    );
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 30..20;
    assert!(
        search(5, reversed)?.is_empty(),
        "seed {seed}: reversed candidates"
    );
    let expected: Vec<u32> = (5..40).collect();
    assert_eq!(
        search(1000, 5..1000)?.ids(),
        &expected[..],
        "seed {seed}: k > n"
    );
    assert_eq!(
        search(35, 5..40)?.ids(),
        &expected[..],
        "seed {seed}: k = eligible"
    );
    assert!(index.memory_bytes() >= 40 * d * 4);
    Ok(())
}

/// Adding in several calls gives the same index as one call.
#[test]
fn add_in_pieces_equals_one_add() -> TestResult {
    let (seed, mut rng) = seeded();
    let (n, d) = (9000, 32);
    let keys = random_vec(&mut rng, n * d);
    let mut whole = FlatIndex::new(test_rope(RopeStyle::Interleaved, d));
    whole.add(&keys)?;
    let mut pieces = FlatIndex::new(test_rope(RopeStyle::Interleaved, d));
    let mut at = 0;
    for len in [0, 1, 7, 1500, 3000, 0, 4492] {
        pieces.add(&keys[at * d..(at + len) * d])?;
        at += len;
    }
    assert_eq!(at, n);
    assert_eq!(pieces.len(), n);
    for _ in 0..5 {
        let queries = random_vec(&mut rng, 3 * d);
        let query = GroupQuery {
            queries: &queries,
            position: n + 3,
        };
        let params = SearchParams {
            k: rng.random_range(1..200),
            candidates: 0..n as u32,
            estimate: false,
            breadth: None,
        };
        assert_eq!(
            whole.select(&query, &params)?,
            pieces.select(&query, &params)?,
            "seed {seed}"
        );
    }
    Ok(())
}

/// Ties are broken by the lower id; NaN keys rank last and do not panic.
#[test]
fn ties_and_nan() -> TestResult {
    let d = 8;
    let mut index = FlatIndex::new(test_rope(RopeStyle::Halves, d));
    // Zero keys all score 0 whatever the rotation.
    index.add(&[0.0; 8 * 10])?;
    index.add(&[f32::NAN; 8 * 3])?;
    let queries = [1.0; 8];
    let query = GroupQuery {
        queries: &queries,
        position: 13,
    };
    let found = index.select(
        &query,
        &SearchParams {
            k: 4,
            candidates: 2..13,
            estimate: false,
            breadth: None,
        },
    )?;
    assert_eq!(found.ids(), &[2, 3, 4, 5]);
    let found = index.select(
        &query,
        &SearchParams {
            k: 12,
            candidates: 0..13,
            estimate: false,
            breadth: None,
        },
    )?;
    assert_eq!(found.ids(), &(0..12).collect::<Vec<_>>()[..]);
    let nan_query = [f32::NAN; 8];
    let found = index.select(
        &GroupQuery {
            queries: &nan_query,
            position: 0,
        },
        &SearchParams {
            k: 2,
            candidates: 0..13,
            estimate: false,
            breadth: None,
        },
    )?;
    assert_eq!(found.len(), 2);
    Ok(())
}

/// Bad shapes are errors, and a failed add changes nothing.
#[test]
fn shape_errors_are_errors() -> TestResult {
    let d = 16;
    let mut index = FlatIndex::new(test_rope(RopeStyle::Halves, d));
    index.add(&[0.5; 16 * 3])?;
    assert!(matches!(
        index.add(&[0.0; 17]),
        Err(IndexError::Shape {
            len: 17,
            head_dim: 16,
            ..
        })
    ));
    assert_eq!(index.len(), 3);
    let params = SearchParams {
        k: 1,
        candidates: 0..3,
        estimate: false,
        breadth: None,
    };
    let bad = [0.0; 20];
    assert!(matches!(
        index.select(
            &GroupQuery {
                queries: &bad,
                position: 3
            },
            &params
        ),
        Err(IndexError::Shape { .. })
    ));
    assert!(matches!(
        index.select(
            &GroupQuery {
                queries: &[],
                position: 3
            },
            &params
        ),
        Err(IndexError::Empty { .. })
    ));
    // A RoPE of head_dim 0 makes every non-empty add an error, not a division by zero.
    let mut zero = FlatIndex::new(test_rope(RopeStyle::Halves, 0));
    assert!(zero.add(&[1.0; 4]).is_err());
    assert!(zero.add(&[]).is_err());
    assert_eq!(zero.len(), 0);
    assert!(zero
        .select(
            &GroupQuery {
                queries: &[1.0],
                position: 0
            },
            &params
        )
        .is_err());
    Ok(())
}
