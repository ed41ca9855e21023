//! Helpers every index shares: argument checks, ranking, rotation, the saved-bytes codec.

use std::cmp::Ordering;
use std::ops::Range;
use std::time::Instant;

use kvdb_model::Rope;
use rayon::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::rows;
use crate::{BuildStats, GroupQuery, IndexError, Result};
use kvdb_simd::dot;

/// Keys rotated per rayon task.
const ROTATE_CHUNK_ROWS: usize = 1024;

/// Rows in `keys`, checked to be whole rows that still fit in u32 ids after `len` keys.
pub(crate) fn check_add(keys: &[f32], head_dim: usize, len: usize) -> Result<usize> {
    let adding = rows("keys", keys.len(), head_dim)?;
    if adding > u32::MAX as usize - len {
        return Err(IndexError::TooManyKeys { len, adding });
    }
    Ok(adding)
}

/// Heads in `query`, checked to be whole, non-empty rows.
pub(crate) fn check_query(query: &GroupQuery<'_>, head_dim: usize) -> Result<usize> {
    match rows("group queries", query.queries.len(), head_dim)? {
        0 => Err(IndexError::Empty {
            what: "group queries",
        }),
        heads => Ok(heads),
    }
}

/// `candidates` clipped to the ids of an index of `len` keys (empty when nothing is left).
pub(crate) fn eligible(candidates: &Range<u32>, len: usize) -> Range<u32> {
    let end = candidates.end.min(len.min(u32::MAX as usize) as u32);
    candidates.start..end.max(candidates.start)
}

/// The group's queries rotated to their position.
pub(crate) fn rotated_queries(rope: &Rope, query: &GroupQuery<'_>) -> Vec<f32> {
    let mut queries = query.queries.to_vec();
    rope.rotate(&mut queries, query.position);
    queries
}

/// Pre-RoPE `keys` rotated as ids `first..`, in parallel.
pub(crate) fn rotated_keys(rope: &Rope, keys: &[f32], first: usize) -> Vec<f32> {
    let mut out = keys.to_vec();
    let d = rope.head_dim();
    out.par_chunks_mut(ROTATE_CHUNK_ROWS * d)
        .enumerate()
        .for_each(|(i, chunk)| rope.rotate_rows(chunk, first + i * ROTATE_CHUNK_ROWS));
    out
}

/// The group's score of `key`: the maximum over its heads of `q_h · key` (all heads attend
/// to the same selected set, so a key counts when any head needs it). NaN ranks last.
#[inline]
pub(crate) fn group_score(queries: &[f32], key: &[f32]) -> f32 {
    let best = queries
        .chunks_exact(key.len())
        .map(|q| dot(q, key))
        .fold(f32::NEG_INFINITY, f32::max);
    if best.is_nan() {
        f32::NEG_INFINITY
    } else {
        best
    }
}

/// Best first: higher score, then lower id. `total_cmp` makes this a total order.
pub(crate) fn rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Keeps the `k` best of `scored` (in no particular order).
pub(crate) fn keep_top(scored: &mut Vec<(f32, u32)>, k: usize) {
    if k == 0 {
        scored.clear();
    } else if scored.len() > k {
        scored.select_nth_unstable_by(k - 1, rank);
        scored.truncate(k);
    }
}

/// The indices of the `k` largest of `scores`, best first (ties to the lower index).
pub(crate) fn top_indices(scores: &[f32], k: usize) -> Vec<u32> {
    let mut scored: Vec<(f32, u32)> = scores
        .iter()
        .enumerate()
        .map(|(i, &s)| (if s.is_nan() { f32::NEG_INFINITY } else { s }, i as u32))
        .collect();
    keep_top(&mut scored, k);
    scored.sort_unstable_by(rank);
    scored.into_iter().map(|(_, i)| i).collect()
}

/// Checks that the saved body of an index that saves nothing (its structure derives from
/// the keys) is empty: anything else was not written by it.
pub(crate) fn expect_empty_body(kind: &str, body: &[u8]) -> Result<()> {
    if body.is_empty() {
        Ok(())
    } else {
        Err(IndexError::Corrupt(format!(
            "a saved {kind} index has an empty body, this one has {} bytes",
            body.len()
        )))
    }
}

/// Serialises an index body.
pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    postcard::to_allocvec(value).map_err(|e| IndexError::Corrupt(format!("encoding: {e}")))
}

/// Deserialises an index body.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    postcard::from_bytes(bytes).map_err(|e| IndexError::Corrupt(format!("decoding: {e}")))
}

impl BuildStats {
    /// Stats of a build over `keys` keys that started at `started`.
    pub(crate) fn finished(
        keys: usize,
        seed: u64,
        started: Instant,
        warnings: Vec<String>,
    ) -> Self {
        Self {
            keys,
            seconds: started.elapsed().as_secs_f64(),
            added: 0,
            add_seconds: 0.0,
            warnings,
            seed,
        }
    }

    /// Records an add of `keys` keys that started at `started`.
    pub(crate) fn record_add(&mut self, keys: usize, started: Instant) {
        self.added += keys;
        self.add_seconds += started.elapsed().as_secs_f64();
    }
}

/// Each bucket's ids, ascending, from each key's saved bucket (`assigned[id]`), checked
/// against the `buckets` there are (`what` names them in the error).
pub(crate) fn buckets_of(assigned: &[u32], buckets: usize, what: &str) -> Result<Vec<Vec<u32>>> {
    if u32::try_from(assigned.len()).is_err() {
        return Err(IndexError::Corrupt(format!(
            "{} saved keys",
            assigned.len()
        )));
    }
    let mut out = vec![Vec::new(); buckets];
    for (id, &b) in assigned.iter().enumerate() {
        let bucket = out.get_mut(b as usize).ok_or_else(|| {
            IndexError::Corrupt(format!("key {id} saved in {what} {b} of {buckets}"))
        })?;
        bucket.push(id as u32);
    }
    Ok(out)
}
