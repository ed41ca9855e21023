//! The [`KeyIndex`] seam, its per-query [`Searcher`] and the per-call arguments.

use std::ops::Range;

use kvdb_model::Rope;

use crate::{IndexError, IndexSpec, Result, Selection};

/// Per-call search options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchParams {
    /// The budget: at most this many ids are returned by top-k indexes (flat, ivf, hnsw,
    /// lsh, hip; ihip's last stage). Bucket indexes that attend whole buckets (`ivf…,all`,
    /// saap) ignore it: their budget is the number of buckets visited.
    pub k: usize,
    /// Only ids inside this range are eligible. The caller excludes the attention sink and
    /// the recent window this way (they are attended densely anyway); the range may reach
    /// past the index's length.
    pub candidates: Range<u32>,
    /// Bucket indexes also return the unvisited buckets' estimate inputs
    /// ([`Found::unvisited`]); off by default.
    pub estimate: bool,
    /// Overrides the built spec's search breadth for this call: lists probed (ivf `np`),
    /// buckets visited (saap `ℓ`) or the graph's candidate list (hnsw and qgraph `ef`); the other
    /// indexes have none and ignore it. Benches sweep an index's budget with it without
    /// rebuilding the index for every value.
    pub breadth: Option<usize>,
}

impl SearchParams {
    /// `k` ids from `candidates`, no estimate.
    pub fn top(k: usize, candidates: Range<u32>) -> Self {
        Self {
            k,
            candidates,
            estimate: false,
            breadth: None,
        }
    }

    /// The breadth a search uses: the override, else the spec's own `built`.
    pub fn breadth_or(&self, built: usize) -> usize {
        self.breadth.unwrap_or(built)
    }
}

/// The query of one token for the query heads of one GQA group.
#[derive(Debug, Clone, Copy)]
pub struct GroupQuery<'a> {
    /// Pre-RoPE query vectors `[group_heads, head_dim]` (the number of heads is
    /// `queries.len() / head_dim`).
    pub queries: &'a [f32],
    /// The token's position; indexes that score rotated keys rotate the queries with their
    /// RoPE at this position.
    pub position: usize,
}

impl GroupQuery<'_> {
    /// Number of query heads in the group.
    pub fn heads(&self, head_dim: usize) -> usize {
        self.queries.len().checked_div(head_dim).unwrap_or(0)
    }
}

/// A bucket a search did not visit, with what the engine needs to estimate its share of
/// the attention (RetroInfer's idea): its size, and each head's inner product with its
/// centroid (ivf) or with the mean of its rotated keys (saap).
#[derive(Debug, Clone, PartialEq)]
pub struct UnvisitedBucket {
    /// The bucket's number (see [`BucketIndex::assignments`]).
    pub bucket: u32,
    /// Keys in the bucket.
    pub size: u32,
    /// Per query head of the group, unscaled: `q_h · centroid` in the space the partition
    /// was built in (rotated for RoPE'd ivf, pre-RoPE for `norope`), or for saap the rotated
    /// query's inner product with the mean of the bucket's rotated keys (so that
    /// `size · exp(scale · logit)` is a lower bound of the bucket's mass, by Jensen).
    pub logits: Vec<f32>,
}

/// What one search found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Found {
    /// The ids to attend to.
    pub selection: Selection,
    /// Vectors whose inner product with a query was computed to find them: keys, centroids,
    /// representatives and graph distance calls alike (one per vector, not per head).
    pub scored: usize,
    /// With [`SearchParams::estimate`], the buckets left unvisited (bucket indexes only).
    pub unvisited: Vec<UnvisitedBucket>,
}

impl Found {
    /// What a top-k search found: the ids of `best` (scored ids, in any order) after scoring
    /// `scored` vectors.
    pub(crate) fn ranked(best: Vec<(f32, u32)>, scored: usize) -> Self {
        Self {
            selection: best.into_iter().map(|(_, id)| id).collect(),
            scored,
            unvisited: Vec::new(),
        }
    }
}

/// How an index was built.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BuildStats {
    /// Keys in the index when it was built (or loaded).
    pub keys: usize,
    /// Seconds the build (or load) took.
    pub seconds: f64,
    /// Keys added after the build, and the seconds those adds took.
    pub added: usize,
    /// Seconds spent in [`KeyIndex::add`] after the build.
    pub add_seconds: f64,
    /// What the build changed from its spec and why (e.g. fewer IVF lists than asked for).
    pub warnings: Vec<String>,
    /// Seeds the build drew from (k-means, hyperplanes), recorded so it can be replayed.
    pub seed: u64,
}

/// What every index build needs besides the keys.
#[derive(Debug, Clone)]
pub struct BuildContext<'a> {
    /// The layer's RoPE (keys and queries arrive pre-RoPE; ids are positions).
    pub rope: Rope,
    /// Seed for randomised builds.
    pub seed: u64,
    /// SAAP's trained centroids and classifier for this layer and KV head (saap only).
    pub saap: Option<&'a crate::saap::SaapHead>,
    /// Queries of the layer's KV head that met the keys at ingest, for indexes that learn
    /// from them (`ivf…,fit`); `None` where none were kept.
    pub queries: Option<QuerySample<'a>>,
}

/// A sample of the pre-RoPE queries of one layer's KV head (its GQA group's heads), taken
/// as the keys were made: what indexes that learn where queries look are fitted on.
#[derive(Debug, Clone, Copy)]
pub struct QuerySample<'a> {
    /// `[samples, group, head_dim]`.
    pub queries: &'a [f32],
    /// The position of each sample (its query attended the keys before it).
    pub positions: &'a [u32],
    /// Attention logits are `scale · q · k` (rotated).
    pub scale: f32,
    /// The last keys before a query that decoding attends densely anyway (its recent
    /// window): left out of the attention a sample is fitted on.
    pub recent: usize,
}

impl QuerySample<'_> {
    /// Query heads per sample; fails unless the queries are whole groups of `head_dim` rows,
    /// one per position.
    pub fn group(&self, head_dim: usize) -> Result<usize> {
        let rows = head_dim * self.positions.len();
        if rows == 0 || !self.queries.len().is_multiple_of(rows) {
            return Err(IndexError::Shape {
                what: "query sample",
                len: self.queries.len(),
                head_dim: rows.max(1),
            });
        }
        Ok(self.queries.len() / rows)
    }

    /// How many of `n` keys (ids `0..n`) sample `i`'s query may attend outside its recent
    /// window: the keys before its position but its last [`Self::recent`].
    pub(crate) fn eligible(&self, i: usize, n: usize) -> usize {
        (self.positions[i] as usize)
            .saturating_sub(self.recent)
            .min(n)
    }
}

/// An index over the pre-RoPE keys of one KV head of one layer.
///
/// Keys get consecutive ids in the order they are added, so that id = RoPE position.
/// Indexes are built by [`crate::build`] from a spec and reopened by [`crate::load`].
pub trait KeyIndex: Send + Sync + std::fmt::Debug {
    /// The spec it was built with, as effectively built (e.g. fewer IVF lists than asked
    /// for when there were too few keys to train them).
    fn spec(&self) -> IndexSpec;

    /// Length of each key and query vector.
    fn head_dim(&self) -> usize;

    /// Number of keys stored (the next id to be given out).
    fn len(&self) -> usize;

    /// Whether no key is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends pre-RoPE key rows `[rows, head_dim]`; they get ids `len()..len() + rows`.
    /// Fails, adding nothing, when `keys.len()` is not a multiple of `head_dim`.
    fn add(&mut self, keys: &[f32]) -> Result<()>;

    /// A searcher for one query: the state that lives across its decode steps.
    fn searcher(&self) -> Box<dyn Searcher + '_>;

    /// The selection of one search by a fresh searcher (for indexes whose searches keep
    /// state, the first step of a query).
    fn select(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Selection> {
        Ok(self.searcher().search(query, params)?.selection)
    }

    /// Heap bytes the index holds (its copy of the keys included).
    fn memory_bytes(&self) -> usize;

    /// How it was built.
    fn build_stats(&self) -> &BuildStats;

    /// The index as a [`BucketIndex`], for those that are one (ivf, saap).
    fn as_buckets(&self) -> Option<&dyn BucketIndex> {
        None
    }

    /// Its structure as bytes for [`crate::load`] (the keys themselves are not included:
    /// they are in the store and handed back at load time).
    fn save(&self) -> Result<Vec<u8>>;
}

/// The per-query side of an index: one searcher serves one query's decode steps, in order.
pub trait Searcher: Send {
    /// The ids (all inside `params.candidates`) the group's queries attend to most
    /// strongly. Fails when the queries are not whole, non-empty rows of `head_dim`.
    fn search(&mut self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found>;
}

/// An index whose search keeps no state between decode steps.
pub(crate) trait StatelessSearch: Send + Sync {
    /// One search.
    fn search_once(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found>;
}

/// The [`Searcher`] of a [`StatelessSearch`] index.
pub(crate) struct OneShot<'a, T: ?Sized>(pub(crate) &'a T);

impl<T: StatelessSearch + ?Sized> Searcher for OneShot<'_, T> {
    fn search(&mut self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        self.0.search_once(query, params)
    }
}

/// A bucket index (ivf, saap): every key belongs to one bucket. The engine uses this to
/// compute each bucket's mean value for the estimate of unvisited buckets, and to route on
/// the GPU where the index allows it ([`BucketIndex::gpu_routing`]).
pub trait BucketIndex: KeyIndex {
    /// Number of buckets.
    fn buckets(&self) -> usize;
    /// The bucket of every key, by id.
    fn assignments(&self) -> Vec<u32>;
    /// How the index searches, when a GPU can repeat it alone: every key of the probed
    /// buckets is selected, and the buckets probed are the best by a score the description
    /// holds (see [`BucketScores`]). `None` for any other search.
    fn gpu_routing(&self) -> Option<GpuRouting<'_>> {
        None
    }
}

/// A bucket index's search as the GPU repeats it (see [`BucketIndex::gpu_routing`]).
#[derive(Debug, Clone, Copy)]
pub struct GpuRouting<'a> {
    /// How a query scores the buckets.
    pub scores: BucketScores<'a>,
    /// Each bucket's key ids, ascending.
    pub lists: &'a [Vec<u32>],
    /// Key ids every search takes besides its buckets' (ivf's `hot<N>`), ascending; they may
    /// also be in a bucket (the GPU then attends them once, as one more visited bucket).
    pub always: &'a [u32],
    /// Buckets probed per search, unless the query asks for another breadth.
    pub probes: usize,
}

/// How a [`GpuRouting`] scores a query's buckets.
#[derive(Debug, Clone, Copy)]
pub enum BucketScores<'a> {
    /// `ivf…,norope,all`: a bucket's score is its centroid's inner product with the de-roped
    /// queries, the best over a GQA group's heads; the best buckets are probed whatever ids
    /// they hold. One centroid per bucket, `[buckets, head_dim]`.
    Centroids(&'a [f32]),
    /// saap: each query head's routing distribution (the classifier's softmax over the
    /// buckets holding keys, mixed with the geometric expert's), summed over the group; the
    /// best buckets holding a candidate are probed (see `crate::saap`).
    Classifier {
        /// The trained head (centroids, the classifier's two layers, the prior's weight).
        head: &'a crate::saap::SaapHead,
        /// Each bucket's mean rotated key `[buckets, head_dim]`: the geometric expert's.
        mean_keys: &'a [f32],
        /// The geometric expert's share of each distribution.
        share: f32,
    },
}
