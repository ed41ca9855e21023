//! [`FlatIndex`]: exact maximum inner product search over every stored key.

use std::ops::Range;
use std::time::Instant;

use kvdb_model::Rope;
use rayon::prelude::*;

use crate::common::{
    check_add, check_query, eligible, group_score, keep_top, rotated_keys, rotated_queries,
};
use crate::key_index::{OneShot, StatelessSearch};
use crate::{BuildStats, Found, GroupQuery, IndexSpec, KeyIndex, Result, SearchParams, Searcher};

/// Keys scored per rayon task.
const CHUNK_ROWS: usize = 4096;
/// Below this many eligible keys one thread scores them all (a task costs more than it saves).
const PARALLEL_MIN_ROWS: usize = 8192;

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
    stats: BuildStats,
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
            stats: BuildStats::default(),
        }
    }

    /// An index over pre-RoPE `keys` (ids `0..`).
    pub fn build(rope: Rope, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        let mut index = Self::new(rope);
        index.add(keys)?;
        index.stats = BuildStats::finished(index.len(), 0, started, Vec::new());
        Ok(index)
    }

    /// Reopens a flat index over the pre-RoPE `keys` it covered, keeping its `stats`.
    pub(crate) fn load(rope: Rope, stats: BuildStats, keys: &[f32]) -> Result<Self> {
        let mut index = Self::new(rope);
        index.add(keys)?;
        index.stats = stats;
        Ok(index)
    }

    /// The rotated key of `id`.
    pub(crate) fn key(&self, id: u32) -> &[f32] {
        let d = self.head_dim();
        &self.keys[id as usize * d..(id as usize + 1) * d]
    }

    /// The layer's RoPE (what `ivf` saves with its lists, what `qgraph` rotates its sampled
    /// queries with).
    pub(crate) fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Every rotated key, `[len, head_dim]`.
    pub(crate) fn rows(&self) -> &[f32] {
        &self.keys
    }

    /// The group's queries rotated to their position.
    pub(crate) fn rotate_query(&self, query: &GroupQuery<'_>) -> Vec<f32> {
        rotated_queries(&self.rope, query)
    }

    /// The top `k` of the keys `ids`, unordered, scored exactly against rotated `queries`:
    /// how the approximate indexes re-score their candidates.
    pub(crate) fn top_of(
        &self,
        queries: &[f32],
        ids: impl Iterator<Item = u32>,
        k: usize,
    ) -> Vec<(f32, u32)> {
        let mut scored: Vec<(f32, u32)> = ids
            .map(|id| (group_score(queries, self.key(id)), id))
            .collect();
        keep_top(&mut scored, k);
        scored
    }

    /// The top `k` of the eligible keys for rotated `queries`, unordered.
    pub(crate) fn top_k(&self, queries: &[f32], eligible: Range<u32>, k: usize) -> Vec<(f32, u32)> {
        if eligible.len() < PARALLEL_MIN_ROWS {
            return self.top_of(queries, eligible, k);
        }
        let chunk = CHUNK_ROWS as u32;
        let chunks = eligible.len().div_ceil(CHUNK_ROWS) as u32;
        let tops: Vec<Vec<(f32, u32)>> = (0..chunks)
            .into_par_iter()
            .map(|c| {
                let start = eligible.start + c * chunk;
                let ids = start..start.saturating_add(chunk).min(eligible.end);
                self.top_of(queries, ids, k)
            })
            .collect();
        let mut merged = tops.concat();
        keep_top(&mut merged, k);
        merged
    }
}

impl StatelessSearch for FlatIndex {
    fn search_once(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        check_query(query, self.head_dim())?;
        let eligible = eligible(&params.candidates, self.len());
        if params.k == 0 || eligible.is_empty() {
            return Ok(Found::default());
        }
        if params.k >= eligible.len() {
            return Ok(Found {
                selection: eligible.collect(),
                ..Found::default()
            });
        }
        let scored = eligible.len();
        let queries = self.rotate_query(query);
        Ok(Found::ranked(
            self.top_k(&queries, eligible, params.k),
            scored,
        ))
    }
}

impl KeyIndex for FlatIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Flat
    }

    fn head_dim(&self) -> usize {
        self.rope.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len().checked_div(self.head_dim()).unwrap_or(0)
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let started = Instant::now();
        let adding = check_add(keys, self.head_dim(), self.len())?;
        let rotated = rotated_keys(&self.rope, keys, self.len());
        self.keys.extend_from_slice(&rotated);
        self.stats.record_add(adding, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<f32>()
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        // Everything a flat index holds is the keys, which the store keeps.
        Ok(Vec::new())
    }
}
