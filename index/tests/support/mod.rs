//! Helpers the index tests share: build contexts, the engine's candidate range, real query
//! positions, recall measures and a planted region of keys. Each test binary uses a part.
#![allow(dead_code)]

use kvdb_index::{
    BuildContext, FlatIndex, GroupQuery, IndexError, KeyIndex, SearchParams, Selection,
};
use kvdb_model::Rope;
use kvdb_tests::{candidates, last_quarter, mass_recall};
use kvdb_tests::{random_vec, RealKv};
use rand::rngs::StdRng;
use rand::Rng;

/// A build context without a SAAP head.
pub fn context(rope: Rope) -> BuildContext<'static> {
    BuildContext {
        rope,
        seed: 0,
        saap: None,
        queries: None,
    }
}

/// `count` positions drawn from the last quarter of `n` tokens.
pub fn random_positions(rng: &mut StdRng, n: usize, count: usize) -> Vec<usize> {
    (0..count).map(|_| rng.random_range(n - n / 4..n)).collect()
}

/// Mean recall@k of `index` against `exact` over real queries at `positions` and the mean
/// `Found::scored`; asserts each selection lies inside its candidates.
pub fn recall(
    index: &dyn KeyIndex,
    exact: &dyn KeyIndex,
    kv: &RealKv,
    positions: &[usize],
    k: usize,
    context: &str,
) -> Result<(f64, f64), IndexError> {
    let (mut hits, mut total, mut scored) = (0, 0, 0);
    for &position in positions {
        let query = GroupQuery {
            queries: kv.query(position),
            position,
        };
        let params = SearchParams::top(k, candidates(position));
        let found = index.searcher().search(&query, &params)?;
        let truth = exact.select(&query, &params)?;
        assert!(
            found
                .selection
                .ids()
                .iter()
                .all(|id| params.candidates.contains(id)),
            "{context}: position {position} selected outside {:?}",
            params.candidates
        );
        hits += truth
            .ids()
            .iter()
            .filter(|&&id| found.selection.contains(id))
            .count();
        total += truth.len();
        scored += found.scored;
    }
    Ok((
        hits as f64 / total.max(1) as f64,
        scored as f64 / positions.len().max(1) as f64,
    ))
}

/// Keys that score low except a run of `len` keys at `at` that score high for the query
/// returned with them (on RoPE's slowest pair, which turns by under 1 radian over 5000
/// positions, so the run keeps scoring high when it is within 5000 of the query).
pub fn planted(
    rng: &mut StdRng,
    n: usize,
    d: usize,
    at: usize,
    len: usize,
) -> (Vec<f32>, Vec<f32>) {
    let slow = d / 2 - 1; // with RopeStyle::Halves, dims (d/2 - 1, d - 1) rotate slowest
    let mut keys: Vec<f32> = random_vec(rng, n * d).iter().map(|x| 0.1 * x).collect();
    for id in at..at + len {
        keys[id * d + slow] = 10.0;
    }
    let mut queries = vec![0.0; 2 * d];
    queries[slow] = 1.0;
    for (q, r) in queries[d..].iter_mut().zip(random_vec(rng, d)) {
        *q = 0.1 * r;
    }
    (keys, queries)
}

/// The mean mass recall of `index` (fresh searchers), of flat's exact top-k and the
/// expected recall of a uniform random selection of the same size, over 32 positions of the
/// last quarter.
pub fn mass_recalls(
    kv: &RealKv,
    index: &dyn KeyIndex,
    k: usize,
) -> Result<(f64, f64, f64), IndexError> {
    let flat = FlatIndex::build(kv.rope.clone(), &kv.keys)?;
    let (mut ours, mut exact, mut random) = (0.0, 0.0, 0.0);
    let positions = last_quarter(kv.len());
    for &position in &positions {
        let eligible = candidates(position);
        let params = SearchParams::top(k, eligible.clone());
        let query = GroupQuery {
            queries: kv.query(position),
            position,
        };
        let weights = kv.weights(position);
        let found: Selection = index.select(&query, &params)?;
        ours += mass_recall(&weights, found.ids(), &eligible);
        exact += mass_recall(&weights, flat.select(&query, &params)?.ids(), &eligible);
        // A uniform random selection of the same size holds this share in expectation.
        random += found.len() as f64 / eligible.len() as f64;
    }
    let count = positions.len() as f64;
    Ok((ours / count, exact / count, random / count))
}
