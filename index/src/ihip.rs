//! [`IhipIndex`]: InfiniteHiP's multi-stage chunk pruning, with its stages cached across
//! decode steps in the per-query searcher.
//!
//! Lee et al., "InfiniteHiP: Extending Language Model Context Up to 3 Million Tokens on a
//! Single GPU" (2025). Like HiP the index has no structure of its own: chunks are implicit
//! over token ids, so building it is storing the keys.
//!
//! # Stages
//!
//! Stage `i` (coarse to fine, `spec.chunks` 256/32/8 by default) cuts the tokens that
//! survived stage `i − 1` (stage 0: every eligible id) into chunks of `chunks[i]` tokens,
//! aligned to multiples of `chunks[i]` from id 0 and clipped to the eligible ids. Chunk sizes
//! nest (each a multiple of the next), so a kept chunk is exactly a run of the next stage's
//! chunks. Each chunk is represented by one token found by a hierarchical top-1 search inside
//! it: split the span into halves (the left gets the extra token of an odd span), score each
//! half's middle token (HiP's representative) against the query (the group's score: the
//! maximum over its heads), keep the better half, and repeat down to one token: `2·⌈log2 c⌉`
//! scores for a chunk of `c`. The chunks are ranked by their representative's score (ties to
//! the lower id) and the best are kept.
//!
//! # Budgets
//!
//! `spec.budgets` (paper: 32K/8K/2K) are the tokens each stage keeps for the spec's own final
//! budget. A search with budget `k = params.k` scales them: `b_i = budgets[i] · k /
//! budgets[last]`, so the last stage keeps `k` and the ratios stay the paper's.
//!
//! Short contexts, where a stage's budget would keep every token it sees, are scaled down
//! by one rule. With `T_i` the tokens entering stage `i`:
//!
//! * a stage other than the last keeps `max(min(b_i, ⌊T_i / 2⌋), k)` tokens — at most half
//!   of what enters it, never fewer than the final budget — rounded **up** to whole chunks:
//!   it keeps the best chunks until they hold at least that many tokens (so it never hands
//!   the next stage fewer than `k`);
//! * the last stage keeps the best chunks while they hold at most `k` tokens: rounded
//!   **down** to whole chunks, so at most `k` and more than `k − chunks[last]` ids come back
//!   (chunks are whole except where the candidates' edges clip them);
//! * a `k` below one last-stage chunk keeps the representative tokens of the best `k` chunks
//!   instead, and the earlier stages then keep at least `k · chunks[last]` tokens so that
//!   there are `k` chunks to choose from;
//! * a stage whose budget covers every token entering it keeps them all without scoring
//!   (in particular when `k` covers every eligible id, all are returned unscored).
//!
//! With the paper's ratios (each budget at most half the one before) this changes nothing
//! once the eligible ids number at least twice the first stage's budget.
//!
//! # Refresh
//!
//! A [`Searcher`] serves one query's decode steps in order and caches the chunks each stage
//! kept. Stage `i` is due when it has not run for `refresh[i]` steps (paper: 16/8/4), or
//! when an earlier stage runs this step (its cached survivors may lie outside the new ones).
//! A step runs the due stages, the first of them inside the cached survivors of the stage
//! before it; when no stage is due, the last stage's cached chunks are the selection. The
//! first step runs every stage, so a step on which stage 0 runs selects what a fresh searcher
//! would. [`Found::scored`] counts the representatives scored on this step: 0 for every
//! cached stage.
//!
//! Cached chunks are clipped to each step's eligible ids. Ids that became eligible since a
//! stage last ran (the recent window sliding past them) enter at its next refresh; keys
//! appended to the request's tail are not part of the index at all. A change of `k` or of
//! the first candidate throws the caches away and runs every stage.
//!
//! A saved InfiniteHiP index has an empty body: everything derives from the keys.

use std::ops::Range;
use std::time::Instant;

use kvdb_model::Rope;
use rayon::prelude::*;

use crate::common::{check_query, eligible, expect_empty_body, group_score, rank, rotated_queries};
use crate::hip::representative;
use crate::{
    BuildContext, BuildStats, FlatIndex, Found, GroupQuery, IhipSpec, IndexSpec, KeyIndex, Result,
    SearchParams, Searcher, Selection,
};

/// Below this many chunks in a stage one thread scores them all (a rayon task costs more
/// than the few dot products it would save).
const PARALLEL_MIN_CHUNKS: usize = 64;

/// InfiniteHiP's multi-stage pruning: each stage keeps the chunks whose hierarchical top-1
/// representative scores best, inside the chunks the previous stage kept; the stages are
/// cached per query and refreshed on their own schedules (see the module documentation for
/// budgets, short contexts and refresh).
///
/// Keys are stored rotated at their ids (as in [`FlatIndex`], which holds them), so a search
/// rotates only the group's queries.
#[derive(Clone)]
pub struct IhipIndex {
    spec: IhipSpec,
    /// The RoPE the keys were rotated with; queries are rotated with it too.
    rope: Rope,
    /// The rotated keys.
    keys: FlatIndex,
    stats: BuildStats,
}

impl std::fmt::Debug for IhipIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IhipIndex")
            .field("spec", &self.spec)
            .field("head_dim", &self.head_dim())
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// A chunk's representative: its token id and the group's score of it.
#[derive(Debug, Clone, Copy)]
struct Representative {
    score: f32,
    id: u32,
}

impl IhipIndex {
    /// Builds the index over pre-RoPE `keys` (ids `0..`). Fails on a spec that does not
    /// have one positive chunk size, budget and refresh period per stage, with chunk sizes
    /// nesting and budgets not growing, and on keys that are not whole rows.
    pub fn build(spec: &IhipSpec, context: &BuildContext<'_>, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        let mut index = Self::empty(spec, context)?;
        index.keys.add(keys)?;
        index.stats = BuildStats::finished(index.len(), context.seed, started, Vec::new());
        Ok(index)
    }

    /// Reopens a saved index over the keys it covered, keeping its `stats`. The body
    /// InfiniteHiP saves is empty; anything else is not ours.
    pub fn load(
        spec: &IhipSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        keys: &[f32],
    ) -> Result<Self> {
        expect_empty_body("ihip", body)?;
        let mut index = Self::empty(spec, context)?;
        index.keys.add(keys)?;
        index.stats = stats;
        Ok(index)
    }

    /// An index with no keys, after checking the spec (its fields are public, so a spec
    /// that did not come from the parser can reach here).
    fn empty(spec: &IhipSpec, context: &BuildContext<'_>) -> Result<Self> {
        IndexSpec::Ihip(spec.clone()).validate()?;
        Ok(Self {
            spec: spec.clone(),
            rope: context.rope.clone(),
            keys: FlatIndex::new(context.rope.clone()),
            stats: BuildStats::default(),
        })
    }

    /// Each stage's budget for a final budget of `k`: the spec's budgets scaled so that the
    /// last is `k`.
    fn budgets(&self, k: usize) -> Vec<usize> {
        let last = self.spec.budgets.last().copied().unwrap_or(1).max(1) as u128;
        self.spec
            .budgets
            .iter()
            .map(|&b| usize::try_from(b as u128 * k as u128 / last).unwrap_or(usize::MAX))
            .collect()
    }

    /// The group's score of token `id`.
    fn score(&self, queries: &[f32], id: u32) -> Representative {
        Representative {
            score: group_score(queries, self.keys.key(id)),
            id,
        }
    }

    /// The hierarchical top-1 of the non-empty span `chunk`: halve it, keep the half whose
    /// representative scores better, down to one token. Returns that token and the
    /// representatives scored to find it.
    fn top1(&self, queries: &[f32], chunk: Range<u32>) -> (Representative, usize) {
        if chunk.len() == 1 {
            return (self.score(queries, chunk.start), 1);
        }
        let (mut span, mut best, mut scored) = (chunk, None, 0);
        while span.len() > 1 {
            let mid = span.start + (span.end - span.start).div_ceil(2);
            let (left, right) = (span.start..mid, mid..span.end);
            let l = self.score(queries, representative(&left));
            let r = self.score(queries, representative(&right));
            scored += 2;
            // Ties go to the lower id, as everywhere else.
            let (kept, rep) = if rank(&(l.score, l.id), &(r.score, r.id)).is_le() {
                (left, l)
            } else {
                (right, r)
            };
            (span, best) = (kept, Some(rep));
        }
        // The loop ran (the span had two tokens or more) and ends on a one-token half, whose
        // representative is that token.
        let best = best.unwrap_or_else(|| self.score(queries, span.start));
        (best, scored)
    }

    /// Runs stage `stage` over the sorted, disjoint token ranges `input` with the final
    /// budget `k` and the stage budgets `budgets`. Returns the kept ranges, sorted, and the
    /// representatives scored.
    fn run_stage(
        &self,
        queries: &[f32],
        input: &[Range<u32>],
        stage: usize,
        budgets: &[usize],
    ) -> (Vec<Range<u32>>, usize) {
        let chunk = self.spec.chunks[stage];
        let k = budgets[budgets.len() - 1];
        let entering: usize = input.iter().map(|r| r.len()).sum();
        let last = stage + 1 == budgets.len();
        let budget = if last {
            k
        } else {
            // What the last stage needs to fill its budget: k tokens, or k whole chunks when
            // it keeps representatives.
            let last_chunk = self.spec.chunks[budgets.len() - 1];
            let need = if k < last_chunk {
                k.saturating_mul(last_chunk)
            } else {
                k
            };
            budgets[stage].min(entering / 2).max(need)
        };
        if entering <= budget {
            return (input.to_vec(), 0);
        }
        let chunks = split(input, chunk);
        let top = |c: &Range<u32>| self.top1(queries, c.clone());
        let found: Vec<(Representative, usize)> = if chunks.len() < PARALLEL_MIN_CHUNKS {
            chunks.iter().map(top).collect()
        } else {
            chunks.par_iter().map(top).collect()
        };
        let scored = found.iter().map(|(_, n)| n).sum();
        let mut ranked: Vec<(f32, u32, usize)> = found
            .iter()
            .enumerate()
            .map(|(i, (rep, _))| (rep.score, rep.id, i))
            .collect();
        ranked.sort_unstable_by(|a, b| rank(&(a.0, a.1), &(b.0, b.1)));
        let mut kept: Vec<Range<u32>> = Vec::new();
        if last && budget < chunk {
            // A budget below one chunk: the representatives of the best chunks.
            kept.extend(ranked.iter().take(budget).map(|&(_, id, _)| id..id + 1));
        } else {
            // Counting tokens rather than chunks keeps the budget exact when chunks clipped
            // at the candidates' edges are among the best.
            let mut tokens = 0;
            for &(_, _, i) in &ranked {
                let len = chunks[i].len();
                let full = if last {
                    tokens + len > budget
                } else {
                    tokens >= budget
                };
                if full {
                    break;
                }
                tokens += len;
                kept.push(chunks[i].clone());
            }
        }
        kept.sort_unstable_by_key(|r| r.start);
        (kept, scored)
    }
}

/// `ranges` cut into chunks aligned to multiples of `chunk` (ranges' ends clip them).
fn split(ranges: &[Range<u32>], chunk: usize) -> Vec<Range<u32>> {
    // A chunk size past u32 ids is one chunk per range.
    let chunk = u32::try_from(chunk).unwrap_or(u32::MAX) as u64;
    let mut out = Vec::new();
    for r in ranges {
        let mut at = r.start as u64;
        while at < r.end as u64 {
            let next = ((at / chunk + 1) * chunk).min(r.end as u64);
            out.push(at as u32..next as u32);
            at = next;
        }
    }
    out
}

/// `ranges` intersected with `eligible`, empty pieces dropped.
fn clip(ranges: &[Range<u32>], eligible: &Range<u32>) -> Vec<Range<u32>> {
    ranges
        .iter()
        .map(|r| r.start.max(eligible.start)..r.end.min(eligible.end))
        .filter(|r| !r.is_empty())
        .collect()
}

/// One stage's cache in a searcher.
#[derive(Debug, Clone, Default)]
struct Cached {
    /// The token ranges the stage kept when it last ran (`None`: it has not run).
    kept: Option<Vec<Range<u32>>>,
    /// Steps searched since it last ran.
    age: usize,
}

/// What the caches were computed for: a change of either invalidates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Basis {
    k: usize,
    first_candidate: u32,
}

/// An InfiniteHiP query's search state across its decode steps: each stage's kept chunks.
struct IhipSearcher<'a> {
    index: &'a IhipIndex,
    basis: Option<Basis>,
    stages: Vec<Cached>,
}

impl Searcher for IhipSearcher<'_> {
    fn search(&mut self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        let index = self.index;
        check_query(query, index.head_dim())?;
        // Every call is one decode step, whether or not it scores anything.
        for stage in &mut self.stages {
            stage.age = stage.age.saturating_add(1);
        }
        let eligible = eligible(&params.candidates, index.len());
        if params.k == 0 || eligible.is_empty() {
            return Ok(Found::default());
        }
        if params.k >= eligible.len() {
            return Ok(Found {
                selection: eligible.collect(),
                ..Found::default()
            });
        }
        let basis = Basis {
            k: params.k,
            first_candidate: params.candidates.start,
        };
        if self.basis != Some(basis) {
            self.basis = Some(basis);
            self.stages.iter_mut().for_each(|s| s.kept = None);
        }
        let refresh = &index.spec.refresh;
        let due = self
            .stages
            .iter()
            .zip(refresh)
            .position(|(s, &period)| s.kept.is_none() || s.age >= period);
        let mut scored = 0;
        let kept = match due {
            None => self
                .stages
                .last()
                .and_then(|s| s.kept.clone())
                .unwrap_or_default(),
            Some(first) => {
                let budgets = index.budgets(params.k);
                let queries = rotated_queries(&index.rope, query);
                let mut input = match first.checked_sub(1) {
                    None => vec![eligible.clone()],
                    Some(before) => self.stages[before]
                        .kept
                        .as_deref()
                        .unwrap_or_default()
                        .to_vec(),
                };
                for stage in first..self.stages.len() {
                    let (kept, n) =
                        index.run_stage(&queries, &clip(&input, &eligible), stage, &budgets);
                    scored += n;
                    self.stages[stage] = Cached {
                        kept: Some(kept.clone()),
                        age: 0,
                    };
                    input = kept;
                }
                input
            }
        };
        let selection: Selection = clip(&kept, &eligible).into_iter().flatten().collect();
        Ok(Found {
            selection,
            scored,
            unvisited: Vec::new(),
        })
    }
}

impl KeyIndex for IhipIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Ihip(self.spec.clone())
    }

    fn head_dim(&self) -> usize {
        self.keys.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        // Chunks are implicit over ids: adding is appending the rotated keys.
        let started = Instant::now();
        let before = self.len();
        self.keys.add(keys)?;
        self.stats.record_add(self.len() - before, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(IhipSearcher {
            index: self,
            basis: None,
            stages: vec![Cached::default(); self.spec.chunks.len()],
        })
    }

    fn memory_bytes(&self) -> usize {
        self.keys.memory_bytes()
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        // Chunks are implicit over the ids and the keys are in the store.
        Ok(Vec::new())
    }
}
