//! [`FlatIndex`]: exact maximum inner product search over every stored key.

use std::cmp::Ordering;
use std::ops::Range;

use kvdb_model::Rope;
use rayon::prelude::*;

use crate::error::rows;
use crate::kernel::dot;
use crate::{GroupQuery, IndexError, KeyIndex, Result, SearchParams, Selection};

/// Keys scored per rayon task.
const CHUNK_ROWS: usize = 4096;
/// Below this many eligible keys one thread scores them all (a task costs more than it saves).
const PARALLEL_MIN_ROWS: usize = 8192;
/// Keys rotated per rayon task in [`FlatIndex::add`].
const ROTATE_CHUNK_ROWS: usize = 1024;

/// Exact maximum inner product search: every eligible key is scored.
///
/// Keys are stored rotated at their positions (ids) as f32 `[len, head_dim]`, so a search
/// rotates only the queries. The score of key `j` for a GQA group is the **maximum** over the
/// group's heads of `q_h · k_j`: all heads of the group attend to the same selected set, so a
/// key enters it when it is among the strongest for *any* head; a sum or mean of the heads'
/// scores would let heads that ignore a key outvote the one head that needs it.
#[derive(Clone)]
pub struct FlatIndex {
    rope: Rope,
    keys: Vec<f32>,
}

impl std::fmt::Debug for FlatIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatIndex")
            .field("head_dim", &self.head_dim())
            .field("len", &self.len())
            .field("rope_style", &self.rope.style())
            .finish_non_exhaustive()
    }
}

impl FlatIndex {
    /// An empty index whose keys and queries are rotated by `rope` (`head_dim` comes from it).
    pub fn new(rope: Rope) -> Self {
        Self {
            rope,
            keys: Vec::new(),
        }
    }

    /// The top `k` of the keys with ids in `ids` (ranked by [`rank`]), unordered.
    fn top_in(&self, queries: &[f32], ids: Range<u32>, k: usize) -> Vec<(f32, u32)> {
        let d = self.head_dim();
        let rows = &self.keys[ids.start as usize * d..ids.end as usize * d];
        let mut scored: Vec<(f32, u32)> = rows
            .chunks_exact(d)
            .zip(ids)
            .map(|(key, id)| {
                let best = queries
                    .chunks_exact(d)
                    .map(|q| dot(q, key))
                    .fold(f32::NEG_INFINITY, f32::max);
                // A NaN key (all heads NaN) ranks last instead of crowding out real keys.
                (
                    if best.is_nan() {
                        f32::NEG_INFINITY
                    } else {
                        best
                    },
                    id,
                )
            })
            .collect();
        keep_top(&mut scored, k);
        scored
    }
}

/// Best first: higher score, then lower id. `total_cmp` makes this a total order.
fn rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Keeps the `k` best of `scored` (in no particular order).
fn keep_top(scored: &mut Vec<(f32, u32)>, k: usize) {
    if k == 0 {
        scored.clear();
    } else if scored.len() > k {
        scored.select_nth_unstable_by(k - 1, rank);
        scored.truncate(k);
    }
}

impl KeyIndex for FlatIndex {
    fn head_dim(&self) -> usize {
        self.rope.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len().checked_div(self.head_dim()).unwrap_or(0)
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let d = self.head_dim();
        let adding = rows("keys", keys.len(), d)?;
        let len = self.len();
        if adding > u32::MAX as usize - len {
            return Err(IndexError::TooManyKeys { len, adding });
        }
        let old = self.keys.len();
        self.keys.extend_from_slice(keys);
        let rope = &self.rope;
        self.keys[old..]
            .par_chunks_mut(ROTATE_CHUNK_ROWS * d)
            .enumerate()
            .for_each(|(i, chunk)| rope.rotate_rows(chunk, len + i * ROTATE_CHUNK_ROWS));
        Ok(())
    }

    fn search(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Selection> {
        let d = self.head_dim();
        if rows("group queries", query.queries.len(), d)? == 0 {
            return Err(IndexError::Empty {
                what: "group queries",
            });
        }
        // `len() <= u32::MAX` (checked in `add`).
        let end = params.candidates.end.min(self.len() as u32);
        let eligible = params.candidates.start..end.max(params.candidates.start);
        if params.k == 0 || eligible.is_empty() {
            return Ok(Selection::default());
        }
        if params.k >= eligible.len() {
            return Ok(eligible.collect());
        }
        let mut queries = query.queries.to_vec();
        self.rope.rotate(&mut queries, query.position);

        let best = if eligible.len() < PARALLEL_MIN_ROWS {
            self.top_in(&queries, eligible, params.k)
        } else {
            let chunk = CHUNK_ROWS as u32;
            let chunks = eligible.len().div_ceil(CHUNK_ROWS) as u32;
            let tops: Vec<Vec<(f32, u32)>> = (0..chunks)
                .into_par_iter()
                .map(|c| {
                    let start = eligible.start + c * chunk;
                    let ids = start..start.saturating_add(chunk).min(eligible.end);
                    self.top_in(&queries, ids, params.k)
                })
                .collect();
            let mut merged = tops.concat();
            keep_top(&mut merged, params.k);
            merged
        };
        Ok(best.into_iter().map(|(_, id)| id).collect())
    }

    fn memory_bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<f32>()
    }
}
