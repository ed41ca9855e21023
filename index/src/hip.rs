//! [`HipIndex`]: HiP attention's hierarchical top-k over blocks of keys.
//!
//! Lee et al., "HiP Attention: Sparse Sub-Quadratic Attention with Hierarchical Attention
//! Pruning". The index has no structure of its own: the tree is implicit over token ids, so
//! building it is storing the keys and a search walks down that implicit tree.

use std::ops::Range;
use std::time::Instant;

use kvdb_model::Rope;

use crate::common::{check_query, eligible, expect_empty_body, group_score, rank, rotated_queries};
use crate::key_index::{OneShot, StatelessSearch};
use crate::{
    BuildContext, BuildStats, FlatIndex, Found, GroupQuery, HipSpec, IndexSpec, KeyIndex, Result,
    SearchParams, Searcher,
};

/// The token that stands for the span `tokens` when a hierarchical search scores it: its
/// middle token (the lower of the two middles of an even span).
///
/// HiP scores each branch by one representative key. The first token of a branch would make
/// the left branch's representative the parent's, but it sits at the branch's edge: a peak of
/// attention in the branch is on average half a branch away from it. The middle token is at
/// most a quarter of the parent's span from any token of the branch, so a run of strongly
/// attended tokens at least a branch long always contains the representative of some branch
/// at every level. InfiniteHiP's top-1 search inside its chunks uses the same rule.
pub(crate) fn representative(tokens: &Range<u32>) -> u32 {
    tokens.start + (tokens.end - tokens.start - 1) / 2
}

/// HiP's hierarchical top-k: a selection of whole key blocks found by repeatedly halving
/// spans and keeping the branches whose representative scores best.
///
/// Keys are stored rotated at their ids (as in [`FlatIndex`], which holds them), so a search
/// rotates only the group's queries.
///
/// # Search
///
/// The eligible ids (`params.candidates` clipped to the index) are cut into blocks of
/// `bk = spec.block_k` tokens counted from the first eligible id (the last block may be
/// shorter). With `m = k / bk` (the budget `params.k` rounded **down** to whole blocks, so
/// at most `k` ids come back; a budget below one block shrinks the block to `k` tokens):
///
/// 1. `m` nodes cover the eligible blocks evenly (node `i` spans blocks
///    `i·B/m .. (i+1)·B/m` of the `B`).
/// 2. Each node spanning more than one block splits into two halves (branches; the left one
///    gets the extra block of an odd span). Every branch is scored by one representative
///    token, the **middle** token of its span, against the query: the group's score, the
///    maximum over its heads of `q_h · k` (all heads of a GQA group attend to one selected
///    set). The middle rather than the first token because it is at most a quarter of the
///    parent's span from any token of the branch, where the first token sits at its edge.
/// 3. The best `m` branches of all of them are kept and the others are dropped for good.
///    A node that is already a single block competes with its earlier score (it is not
///    scored again).
/// 4. Steps 2 and 3 repeat until every node is one block; the tokens of those `m` blocks are
///    the selection.
///
/// Each round scores at most `2m` representatives and halves the largest span, so a search
/// scores at most `2m · ⌈log2(B/m)⌉` keys: `O(k log N)` instead of flat's `N`
/// ([`Found::scored`] counts them). When the `m` blocks cover every eligible id, all of them
/// are returned unscored.
///
/// # Query blocks
///
/// `spec.block_q` only matters for prefill, where HiP lets the queries of `bq` consecutive
/// tokens share one search: the engine passes their rows together as one [`GroupQuery`]
/// (the score is the maximum over all rows) rotated at the block's last position. Decode has
/// one query token per step, so a decode search is the search of one token's group and
/// `bq` plays no part in it.
///
/// A saved HiP index has an empty body: everything derives from the keys.
#[derive(Clone)]
pub struct HipIndex {
    spec: HipSpec,
    /// The RoPE the keys were rotated with; queries are rotated with it too.
    rope: Rope,
    /// The rotated keys.
    keys: FlatIndex,
    stats: BuildStats,
}

impl std::fmt::Debug for HipIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipIndex")
            .field("spec", &self.spec)
            .field("head_dim", &self.head_dim())
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// One node (or branch) of the implicit tree: a span of key blocks and its score.
#[derive(Debug, Clone, Copy)]
struct Node {
    /// Blocks `lo..hi`, counted from the first eligible id.
    lo: u32,
    hi: u32,
    /// The group's score of `rep` (meaningful once `scored`).
    score: f32,
    /// The representative token id.
    rep: u32,
    scored: bool,
}

impl HipIndex {
    /// Builds the index over pre-RoPE `keys` (ids `0..`). Fails on a spec whose sizes are
    /// zero or whose `k` is not a whole number of key blocks, and on keys that are not whole
    /// rows of the RoPE's `head_dim`.
    pub fn build(spec: &HipSpec, context: &BuildContext<'_>, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        let mut index = Self::empty(spec, context)?;
        index.keys.add(keys)?;
        index.stats = BuildStats::finished(index.len(), context.seed, started, Vec::new());
        Ok(index)
    }

    /// Reopens a saved index over the keys it covered, keeping its `stats`. The body HiP
    /// saves is empty; anything else is not ours.
    pub fn load(
        spec: &HipSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        keys: &[f32],
    ) -> Result<Self> {
        expect_empty_body("hip", body)?;
        let mut index = Self::empty(spec, context)?;
        index.keys.add(keys)?;
        index.stats = stats;
        Ok(index)
    }

    /// An index with no keys, after checking the spec (its fields are public, so a spec
    /// that did not come from the parser can reach here).
    fn empty(spec: &HipSpec, context: &BuildContext<'_>) -> Result<Self> {
        IndexSpec::Hip(*spec).validate()?;
        Ok(Self {
            spec: *spec,
            rope: context.rope.clone(),
            keys: FlatIndex::new(context.rope.clone()),
            stats: BuildStats::default(),
        })
    }

    /// The group's score of the representative of `node`, whose blocks of `bk` tokens start
    /// at `first` and end at `end`.
    fn score(&self, queries: &[f32], node: &mut Node, first: u32, bk: u32, end: u32) {
        let tokens = block_tokens(node.lo..node.hi, first, bk, end);
        node.rep = representative(&tokens);
        node.score = group_score(queries, self.keys.key(node.rep));
        node.scored = true;
    }
}

/// The token ids of blocks `blocks` of `bk` tokens counted from `first`, clipped at `end`.
fn block_tokens(blocks: Range<u32>, first: u32, bk: u32, end: u32) -> Range<u32> {
    // Blocks lie inside the eligible ids, so these products stay below `end` (a u32) except
    // for the clipped end of the last block, which saturates before the clip.
    let lo = first + blocks.start * bk;
    let hi = first.saturating_add(blocks.end.saturating_mul(bk)).min(end);
    lo..hi
}

/// Best first by score, then by the lower representative id (a total order).
fn by_score(a: &Node, b: &Node) -> std::cmp::Ordering {
    rank(&(a.score, a.rep), &(b.score, b.rep))
}

impl StatelessSearch for HipIndex {
    fn search_once(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        check_query(query, self.head_dim())?;
        let eligible = eligible(&params.candidates, self.len());
        if params.k == 0 || eligible.is_empty() {
            return Ok(Found::default());
        }
        // Blocks never exceed the budget, so the selection never does.
        let bk = self.spec.block_k.min(params.k);
        let nodes_kept = params.k / bk;
        let blocks = eligible.len().div_ceil(bk);
        if nodes_kept >= blocks {
            return Ok(Found {
                selection: eligible.collect(),
                ..Found::default()
            });
        }
        // `nodes_kept < blocks <= u32::MAX`, so every count below fits in a u32.
        let (m, total, bk) = (nodes_kept as u64, blocks as u64, bk as u32);
        let (first, end) = (eligible.start, eligible.end);
        let queries = rotated_queries(&self.rope, query);

        let mut nodes: Vec<Node> = (0..m)
            .map(|i| Node {
                lo: (i * total / m) as u32,
                hi: ((i + 1) * total / m) as u32,
                score: f32::NEG_INFINITY,
                rep: 0,
                scored: false,
            })
            .collect();
        let mut scored = 0;
        let mut branches = Vec::with_capacity(2 * nodes.len());
        while nodes.iter().any(|n| n.hi - n.lo > 1) {
            branches.clear();
            for node in &nodes {
                let span = node.hi - node.lo;
                if span == 1 {
                    branches.push(*node);
                } else {
                    let mid = node.lo + span.div_ceil(2);
                    branches.push(Node {
                        hi: mid,
                        scored: false,
                        ..*node
                    });
                    branches.push(Node {
                        lo: mid,
                        scored: false,
                        ..*node
                    });
                }
            }
            for branch in branches.iter_mut().filter(|b| !b.scored) {
                self.score(&queries, branch, first, bk, end);
                scored += 1;
            }
            // Keep the best m; the rest are never revisited.
            let keep = nodes.len();
            if branches.len() > keep {
                branches.select_nth_unstable_by(keep - 1, by_score);
                branches.truncate(keep);
            }
            std::mem::swap(&mut nodes, &mut branches);
        }
        let selection = nodes
            .iter()
            .flat_map(|n| block_tokens(n.lo..n.hi, first, bk, end))
            .collect();
        Ok(Found {
            selection,
            scored,
            unvisited: Vec::new(),
        })
    }
}

impl KeyIndex for HipIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Hip(self.spec)
    }

    fn head_dim(&self) -> usize {
        self.keys.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        // The tree is implicit over ids: adding is appending the rotated keys.
        let started = Instant::now();
        let before = self.len();
        self.keys.add(keys)?;
        self.stats.record_add(self.len() - before, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        self.keys.memory_bytes()
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        // The tree is implicit over the ids and the keys are in the store.
        Ok(Vec::new())
    }
}
