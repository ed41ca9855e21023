//! Retrieval attention, partials and merge against exact f64 attention, on fresh random
//! inputs every run.
//!
//! Each test draws its seed from `rand::rng()` (or `KVDB_TEST_SEED`) and names it in every
//! assertion message, so a failure can be replayed with `KVDB_TEST_SEED=<seed>`.

use kvdb_attention::reference::{attention_over_f64, full_attention_f64};
use kvdb_attention::{
    logits, merge, Attended, AttentionError, DenseKv, DensePolicy, KvSource, Partial, Result,
    RetrievalQuery,
};
use kvdb_index::Selection;
use kvdb_model::{Rope, RopeStyle};
use kvdb_tests::{random_vec, seeded, test_rope};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

const STYLES: [RopeStyle; 2] = [RopeStyle::Halves, RopeStyle::Interleaved];

/// Random pre-RoPE keys and values of `n` tokens.
fn random_kv(rng: &mut StdRng, n: usize, d: usize) -> Result<DenseKv> {
    DenseKv::new(random_vec(rng, n * d), random_vec(rng, n * d), d)
}

/// ‖a - b‖ / ‖b‖ (absolute error when b is zero).
fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let err: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    if norm == 0.0 {
        err.sqrt()
    } else {
        (err / norm).sqrt()
    }
}

fn rel_l2_f32(a: &[f32], b: &[f32]) -> f64 {
    rel_l2(a, &b.iter().map(|&x| x as f64).collect::<Vec<_>>())
}

/// A logit scale making attention neither uniform nor one-hot on these inputs.
fn scale_for(d: usize) -> f32 {
    4.0 / (d as f32).sqrt()
}

/// Runs retrieval attention with the given selection.
fn attend_selection(
    queries: &[f32],
    position: usize,
    rope: &Rope,
    policy: DensePolicy,
    selection: &Selection,
    kv: &dyn KvSource,
) -> Result<Attended> {
    let query = RetrievalQuery {
        queries,
        position,
        rope,
        scale: scale_for(rope.head_dim()),
        policy,
        selection,
        estimate: None,
    };
    kvdb_attention::attend(&query, kv)
}

/// (1) With every token selected, retrieval attention is full attention, for many shapes,
/// policies and both RoPE styles.
#[test]
fn all_selected_equals_full_attention() -> Result<()> {
    let (seed, mut rng) = seeded();
    let policies = [(4, 256), (0, 1), (0, 64), (2, 1), (16, 10_000), (1, 0)];
    for style in STYLES {
        for heads in [1, 4, 8] {
            for d in [64, 128, 256] {
                for (n, (sink, window)) in [1, 7, 300, 5000]
                    .into_iter()
                    .flat_map(|n| policies.map(|p| (n, p)))
                {
                    let policy = DensePolicy { sink, window };
                    let rope = test_rope(style, d);
                    let kv = random_kv(&mut rng, n, d)?;
                    let queries = random_vec(&mut rng, heads * d);
                    let position = n - 1;
                    let all: Selection = (0..n as u32).collect();
                    let got = attend_selection(&queries, position, &rope, policy, &all, &kv)?;
                    let exact = full_attention_f64(
                        &queries,
                        kv.keys(),
                        kv.values(),
                        position,
                        &rope,
                        scale_for(d),
                    )?;
                    let err = rel_l2(&got.output, &exact);
                    let context = format!(
                        "seed {seed}: {style:?} heads {heads} d {d} n {n} {policy:?}: rel err {err:e}"
                    );
                    assert!(err < 1e-5, "{context}");
                    let mut ids = got.ids.clone();
                    ids.sort_unstable();
                    assert_eq!(ids, (0..n as u32).collect::<Vec<_>>(), "{context}");
                }
            }
        }
    }
    Ok(())
}

/// Splits `ids` at random into `parts` disjoint (possibly empty) sets.
fn random_parts(rng: &mut StdRng, ids: &[u32], parts: usize) -> Vec<Vec<u32>> {
    let mut sets = vec![Vec::new(); parts];
    for &id in ids {
        sets[rng.random_range(0..parts)].push(id);
    }
    sets
}

/// The partial of rotated queries over the rows `ids` of rotated keys and values.
fn partial_over(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    ids: &[u32],
    heads: usize,
    d: usize,
    scale: f32,
) -> Result<Partial> {
    let mut k = Vec::new();
    let mut v = Vec::new();
    for &id in ids {
        let rows = id as usize * d..(id as usize + 1) * d;
        k.extend_from_slice(&keys[rows.clone()]);
        v.extend_from_slice(&values[rows]);
    }
    Partial::from_logits(&logits(q, &k, d, scale), &v, heads, d)
}

/// Merges `parts` pairwise in a random tree shape.
fn merge_random_tree(rng: &mut StdRng, mut parts: Vec<Partial>) -> Result<Partial> {
    while parts.len() > 1 {
        let i = rng.random_range(0..parts.len() - 1);
        let b = parts.remove(i + 1);
        let a = parts.remove(i);
        let merged = if rng.random() {
            merge(&a, &b)?
        } else {
            merge(&b, &a)?
        };
        parts.insert(i, merged);
    }
    parts.pop().ok_or(AttentionError::Empty { what: "parts" })
}

/// (2) Merging 3-5 disjoint parts in any order or tree shape gives the one-set partial and
/// the exact f64 attention.
#[test]
fn merge_is_order_independent() -> Result<()> {
    let (seed, mut rng) = seeded();
    for case in 0..40 {
        let heads = rng.random_range(1..=8);
        let d = [16, 64, 128][rng.random_range(0..3)];
        let n = rng.random_range(1..2000);
        let rope = test_rope(STYLES[case % 2], d);
        let scale = scale_for(d);
        let kv = random_kv(&mut rng, n, d)?;
        let queries = random_vec(&mut rng, heads * d);
        let position = n - 1;
        let mut q = queries.clone();
        rope.rotate(&mut q, position);
        let mut keys = kv.keys().to_vec();
        rope.rotate_rows(&mut keys, 0);
        let all: Vec<u32> = (0..n as u32).collect();
        let whole = partial_over(&q, &keys, kv.values(), &all, heads, d, scale)?;
        let exact = full_attention_f64(&queries, kv.keys(), kv.values(), position, &rope, scale)?;
        let context = format!("seed {seed} case {case}: heads {heads} d {d} n {n}");
        assert!(
            rel_l2(&whole.finish(), &exact) < 1e-5,
            "{context}: one set vs f64"
        );

        let count = rng.random_range(3..=5);
        let sets = random_parts(&mut rng, &all, count);
        let parts: Vec<Partial> = sets
            .iter()
            .map(|ids| partial_over(&q, &keys, kv.values(), ids, heads, d, scale))
            .collect::<Result<_>>()?;
        for order in 0..4 {
            let mut shuffled = parts.clone();
            shuffled.shuffle(&mut rng);
            let merged = if order % 2 == 0 {
                let mut acc = Partial::empty(heads, d);
                for p in &shuffled {
                    acc = merge(&acc, p)?;
                }
                acc
            } else {
                merge_random_tree(&mut rng, shuffled)?
            };
            let context = format!("{context} parts {count} order {order}");
            assert_eq!(merged.max, whole.max, "{context}: max");
            assert!(rel_l2_f32(&merged.sum, &whole.sum) < 1e-5, "{context}: sum");
            assert!(
                rel_l2_f32(&merged.finish(), &whole.finish()) < 1e-5,
                "{context}: output"
            );
            assert!(rel_l2(&merged.finish(), &exact) < 1e-5, "{context}: vs f64");
        }
    }
    Ok(())
}

/// (3) Selected ids inside the dense part (or after the query) are dropped: the result
/// equals that of the selection without them, and no id is attended twice.
#[test]
fn dense_overlap_is_dropped() -> Result<()> {
    let (seed, mut rng) = seeded();
    for case in 0..30 {
        let d = 64;
        let heads = rng.random_range(1..=4);
        let n = rng.random_range(20..1500);
        let position = rng.random_range(0..n);
        let policy = DensePolicy {
            sink: rng.random_range(0..8),
            window: rng.random_range(0..64),
        };
        let rope = test_rope(STYLES[case % 2], d);
        let kv = random_kv(&mut rng, n, d)?;
        let queries = random_vec(&mut rng, heads * d);
        let candidates = policy.candidates(position);
        let useful: Selection = (0..rng.random_range(0..50))
            .map(|_| rng.random_range(0..=position as u32))
            .filter(|id| candidates.contains(id))
            .collect();
        let dense: Vec<u32> = policy
            .dense_ranges(position)
            .into_iter()
            .flatten()
            .collect();
        let mut overlapping = useful.ids().to_vec();
        overlapping.extend(dense.iter().filter(|_| rng.random_bool(0.5)));
        overlapping.extend((position as u32 + 1..n as u32).take(5)); // future tokens
        let overlapping = Selection::new(overlapping);

        let clean = attend_selection(&queries, position, &rope, policy, &useful, &kv)?;
        let dirty = attend_selection(&queries, position, &rope, policy, &overlapping, &kv)?;
        let context = format!("seed {seed} case {case}: n {n} position {position} {policy:?}");
        assert_eq!(clean, dirty, "{context}");
        let mut expected_ids = dense.clone();
        expected_ids.extend_from_slice(useful.ids());
        assert_eq!(dirty.ids, expected_ids, "{context}");
        let mut unique = dirty.ids.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), dirty.ids.len(), "{context}: duplicates");
    }
    Ok(())
}

/// (4) With everything attended the weights sum to 1 per head and match the f64 softmax.
#[test]
fn weights_are_the_softmax() -> Result<()> {
    let (seed, mut rng) = seeded();
    for case in 0..20 {
        let d = [32, 64, 128][rng.random_range(0..3)];
        let heads = rng.random_range(1..=8);
        let n = rng.random_range(1..3000);
        let position = n - 1;
        let policy = DensePolicy {
            sink: rng.random_range(0..8),
            window: rng.random_range(0..300),
        };
        let rope = test_rope(STYLES[case % 2], d);
        let kv = random_kv(&mut rng, n, d)?;
        let queries = random_vec(&mut rng, heads * d);
        let all: Selection = (0..n as u32).collect();
        let got = attend_selection(&queries, position, &rope, policy, &all, &kv)?;
        let all_ids: Vec<u32> = (0..n as u32).collect();
        let exact = attention_over_f64(
            &queries,
            kv.keys(),
            kv.values(),
            &all_ids,
            position,
            &rope,
            scale_for(d),
        )?;
        let context = format!("seed {seed} case {case}: heads {heads} d {d} n {n} {policy:?}");
        assert_eq!(got.weights.len(), heads * n, "{context}");
        for h in 0..heads {
            let row = &got.weights[h * n..(h + 1) * n];
            let total: f64 = row.iter().map(|&w| w as f64).sum();
            assert!(
                (total - 1.0).abs() < 1e-5,
                "{context}: head {h} sums to {total}"
            );
            for (&w, &id) in row.iter().zip(&got.ids) {
                let e = exact.weights[h * n + id as usize];
                assert!(
                    (w as f64 - e).abs() <= 1e-5 * e + 1e-9,
                    "{context}: head {h} id {id}: {w} vs {e}"
                );
            }
        }
    }
    Ok(())
}

/// (5) An empty selection is dense-only attention: the f64 reference over the dense ids, and
/// the same as a selection of dense ids only.
#[test]
fn empty_selection_is_dense_only() -> Result<()> {
    let (seed, mut rng) = seeded();
    for case in 0..30 {
        let d = [64, 128][case % 2];
        let heads = rng.random_range(1..=8);
        let n = rng.random_range(1..2000);
        let position = rng.random_range(0..n);
        let policy = DensePolicy {
            sink: rng.random_range(0..10),
            window: rng.random_range(0..200),
        };
        let rope = test_rope(STYLES[case % 2], d);
        let kv = random_kv(&mut rng, n, d)?;
        let queries = random_vec(&mut rng, heads * d);
        let got = attend_selection(
            &queries,
            position,
            &rope,
            policy,
            &Selection::default(),
            &kv,
        )?;
        let dense: Vec<u32> = policy
            .dense_ranges(position)
            .into_iter()
            .flatten()
            .collect();
        let context = format!("seed {seed} case {case}: n {n} position {position} {policy:?}");
        assert_eq!(got.ids, dense, "{context}");
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        kv.gather(&dense, &mut keys, &mut values)?;
        let exact = attention_over_f64(
            &queries,
            &keys,
            &values,
            &dense,
            position,
            &rope,
            scale_for(d),
        )?;
        if dense.is_empty() {
            assert!(
                got.output.iter().all(|&x| x == 0.0),
                "{context}: no token, zero output"
            );
        } else {
            let err = rel_l2(&got.output, &exact.output);
            assert!(err < 1e-5, "{context}: rel err {err:e}");
        }
        let dense_only = Selection::new(dense.clone());
        assert_eq!(
            attend_selection(&queries, position, &rope, policy, &dense_only, &kv)?,
            got,
            "{context}"
        );
    }
    Ok(())
}

/// A source that returns the wrong number of rows.
struct Short;

impl KvSource for Short {
    fn gather(&self, ids: &[u32], keys: &mut Vec<f32>, values: &mut Vec<f32>) -> Result<()> {
        keys.extend(std::iter::repeat_n(0.0, ids.len()));
        values.extend(std::iter::repeat_n(0.0, ids.len()));
        Ok(())
    }
}

/// (6) Bad shapes and ids beyond the source are errors, not panics.
#[test]
fn errors_not_panics() -> Result<()> {
    let d = 8;
    let rope = test_rope(RopeStyle::Halves, d);
    let kv = DenseKv::new(vec![0.1; 10 * d], vec![0.2; 10 * d], d)?;
    let policy = DensePolicy { sink: 2, window: 3 };
    let none = Selection::default();
    let queries = [0.3; 16];

    assert!(matches!(
        attend_selection(&queries[..9], 5, &rope, policy, &none, &kv),
        Err(AttentionError::Shape { .. })
    ));
    assert!(matches!(
        attend_selection(&[], 5, &rope, policy, &none, &kv),
        Err(AttentionError::Empty { .. })
    ));
    // The dense part reaches past the source.
    assert!(matches!(
        attend_selection(&queries, 12, &rope, policy, &none, &kv),
        Err(AttentionError::IdOutOfRange { id: 10, len: 10 })
    ));
    // A selected id past the source (but not past the position).
    let far = Selection::new(vec![3, 40]);
    let big = DensePolicy { sink: 0, window: 1 };
    assert!(matches!(
        attend_selection(&queries, 50, &rope, big, &far, &kv),
        Err(AttentionError::IdOutOfRange { .. })
    ));
    assert!(matches!(
        attend_selection(&queries, u32::MAX as usize, &rope, policy, &none, &kv),
        Err(AttentionError::Position { .. })
    ));
    assert!(matches!(
        attend_selection(&queries, 5, &rope, policy, &none, &Short),
        Err(AttentionError::Length { .. })
    ));
    let zero = self::test_rope(RopeStyle::Halves, 0);
    assert!(attend_selection(&queries, 5, &zero, policy, &none, &kv).is_err());

    assert!(DenseKv::new(vec![0.0; 9], vec![0.0; 9], 8).is_err());
    assert!(DenseKv::new(vec![0.0; 16], vec![0.0; 8], 8).is_err());
    assert!(DenseKv::new(vec![], vec![], 0).is_err());
    let mut tail = DenseKv::new(vec![], vec![], 8)?;
    assert!(tail.push(&[0.0; 8], &[0.0; 7]).is_err());
    tail.push(&[0.0; 16], &[0.0; 16])?;
    assert_eq!(tail.len(), 2);
    let (mut k, mut v) = (Vec::new(), Vec::new());
    assert!(tail.gather(&[0, 2], &mut k, &mut v).is_err());
    assert!(
        k.is_empty() && v.is_empty(),
        "a failed gather appends nothing"
    );

    assert!(full_attention_f64(&queries, kv.keys(), kv.values(), 10, &rope, 1.0).is_err());
    assert!(attention_over_f64(&queries, &[0.0; 8], &[0.0; 8], &[0, 1], 3, &rope, 1.0).is_err());
    Ok(())
}
