//! [`IvfIndex`]: an inverted-file index over faiss's flat quantizer, searched list by list.
//!
//! The partition's `C` centroids come from [`crate::kmeans`] (k-means++ seeding: faiss's
//! random seeding loses clusters) and are held by a faiss flat index, which assigns each key
//! to the list of its nearest centroid (faiss's IndexIVFFlat assigns keys with exactly this
//! call, but also stores a copy of every key in its lists, which the search never reads).
//! The lists are ids only; the search is ours, so that a GQA group probes one set of lists
//! and every score it computes is counted:
//!
//! 1. the group's queries are scored against the `C` centroids and the `np` lists with the
//!    best group score (maximum over the heads, as for keys) are probed;
//! 2. the probed lists' ids restricted to the candidates are either all attended (`all`) or
//!    re-scored exactly on RoPE'd keys, keeping the top k.
//!
//! By default the partition is built on RoPE'd keys (each key rotated at its id) and probed
//! with the query rotated at its position. `norope` trains and assigns on de-roped (pre-RoPE)
//! keys instead: SAAP's observation is that the un-rotated key geometry is stable across
//! positions. A `norope` index that re-scores its lists (no `all`) keeps the rotated keys,
//! and ranks each list by the mean of its keys rotated at their ids against the query rotated
//! at its position: the list's mean logit with RoPE, which its de-roped centroid only
//! approximates (measured on the Debian Reference at 32K tokens: 87% of flat top-k's mass at
//! 3.6% of the keys scored against 83% at 3.8% by centroid; docs/benchmarks.md). `norope,all`
//! keeps no keys and probes by centroid with the pre-RoPE query (as the GPU routes it):
//! `ivfC,npP,norope,all` is SAAP's k-means baseline.
//!
//! `fit` (with `norope`) ranks the lists by a routing fitted on the corpus's sampled queries
//! instead of by centroid ([`crate::fitted`]): where those queries' attention mass fell.
//! Without a sample (a corpus ingested before samples were kept) it is built, and says so, as
//! the same spec without `fit`.
//!
//! `hot<N>` also takes, at every search, the N per mille of the keys that the corpus's sampled
//! queries attended most ([`crate::heavy`]), wherever their lists rank: keys that draw much
//! of most queries' attention sit in lists whose other keys may matter little to the query
//! at hand. A top-k search re-scores them with the probed lists' keys; with `all` they are
//! attended beside the whole lists (on the GPU as one more bucket that every search visits,
//! [`crate::GpuRouting::always`]). Without a sample it is built, and says so, without them.
//!
//! Saved bytes hold the centroids, the fitted routing, each key's list (a byte or two a
//! key) and the hot keys' ids, not the keys, which are in the store. In memory the index
//! keeps the keys (rotated, f32) only where its search reads them: `norope,all` probes with pre-RoPE queries and
//! attends whole lists, so it holds the centroids and the lists' ids alone (on a GPU, where
//! it routes, its memory is a few bytes a key rather than twice the keys in f32), and it
//! loads without reading the keys at all ([`crate::SavedInfo::keys_from`]): opening a
//! stored corpus for the GPU reads its index bytes, not its keys. Saves written before the
//! lists were kept load by having faiss assign the keys again.

use std::time::Instant;

use faiss::{FlatIndex as FaissFlat, Index as _};
use kvdb_model::Rope;
use serde::{Deserialize, Serialize};

use crate::common::{buckets_of, check_add, check_query, decode, eligible, encode, top_indices};
use crate::fitted::FittedRouting;
use crate::heavy::heavy_keys;
use crate::key_index::{OneShot, StatelessSearch};
use crate::kmeans::kmeans;
use crate::{
    BucketIndex, BucketScores, BuildContext, BuildStats, FlatIndex, Found, GpuRouting, GroupQuery,
    IndexError, IndexSpec, IvfSpec, KeyIndex, Result, SearchParams, Searcher, Selection,
    UnvisitedBucket,
};
use kvdb_simd::dot;

/// Fewest training keys per list: below this, k-means has too little to place a centroid
/// well and the lists are reduced (faiss itself refuses fewer than one per list and warns
/// below 39).
pub(crate) const MIN_KEYS_PER_LIST: usize = 16;

/// Lloyd iterations of the partition's k-means.
const KMEANS_ITERATIONS: usize = 20;

/// Inverted lists over faiss's flat quantizer; see the module documentation.
pub struct IvfIndex {
    /// As built (lists reduced when there were too few keys).
    spec: IvfSpec,
    /// As asked for.
    requested: IvfSpec,
    /// The centroids in a faiss flat L2 index: what assigns keys to lists.
    quantizer: FaissFlat,
    /// The layer's RoPE.
    rope: Rope,
    /// Keys indexed.
    len: usize,
    /// The keys rotated at their ids, for exact re-scoring and a RoPE'd partition; `None`
    /// where the search reads neither ([`keeps_keys`]).
    keys: Option<FlatIndex>,
    /// The partition's centroids `[lists, d]` (in the space the partition lives in).
    centroids: Vec<f32>,
    /// Each list's mean rotated key `[lists, d]`, what a `norope` index that re-scores its
    /// lists ranks them by ([`Self::ranks_by_rotated_means`]); empty otherwise.
    rotated_means: Vec<f32>,
    /// Ids of each list, ascending.
    lists: Vec<Vec<u32>>,
    /// With `fit`: what ranks the lists instead of the centroids.
    routing: Option<FittedRouting>,
    /// With `hot<N>`: the ids scored at every search beside the probed lists, ascending.
    hot: Vec<u32>,
    stats: BuildStats,
}

impl std::fmt::Debug for IvfIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IvfIndex")
            .field("spec", &self.spec)
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// What [`IvfIndex::save`] writes.
#[derive(Serialize, Deserialize)]
struct Body {
    centroids: Vec<f32>,
    routing: Option<FittedRouting>,
    /// Each key's list, by id (`None` in saves written before they were kept).
    assigned: Option<Vec<u32>>,
    /// The hot keys' ids (empty in saves written before `hot` existed).
    hot: Vec<u32>,
}

/// What saves written before `hot` existed hold.
#[derive(Deserialize)]
struct WithoutHot {
    centroids: Vec<f32>,
    routing: Option<FittedRouting>,
    assigned: Option<Vec<u32>>,
}

/// What saves written before the lists were kept hold.
#[derive(Deserialize)]
struct WithoutLists {
    centroids: Vec<f32>,
    routing: Option<FittedRouting>,
}

/// What saves written before `fit` existed hold.
#[derive(Deserialize)]
struct CentroidsOnly {
    centroids: Vec<f32>,
}

impl IvfIndex {
    /// Trains the partition on pre-RoPE `keys` (ids `0..`) and adds them.
    pub fn build(spec: &IvfSpec, context: &BuildContext<'_>, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        IndexSpec::Ivf(*spec).validate()?;
        let d = context.rope.head_dim();
        let n = check_add(keys, d, 0)?;
        let mut effective = *spec;
        let mut warnings = Vec::new();
        let most = (n / MIN_KEYS_PER_LIST).max(1);
        if spec.lists > most {
            effective.lists = most;
            // Probe the same share of the lists.
            effective.probes = (spec.probes * most).div_ceil(spec.lists).clamp(1, most);
            effective.head_probes =
                (spec.head_probes * most / spec.lists).min(most - effective.probes);
            warnings.push(format!(
                "{n} keys are too few to train {} lists (at least {MIN_KEYS_PER_LIST} keys per \
                 list): built {}",
                spec.lists,
                IndexSpec::Ivf(effective)
            ));
        }
        let mut rotated = FlatIndex::new(context.rope.clone());
        rotated.add(keys)?;
        let space = if effective.norope {
            keys
        } else {
            rotated.rows()
        };
        let centroids = kmeans(space, d, effective.lists, KMEANS_ITERATIONS, context.seed)?;
        let mut index = Self::with_centroids(
            effective,
            *spec,
            context.rope.clone(),
            Some(rotated),
            centroids,
            BuildStats::default(),
        )?;
        index.assign(keys, 0)?;
        if effective.fit {
            index.fit_routing(context, &mut warnings)?;
        }
        if effective.hot_permille > 0 {
            index.find_hot_keys(context, &mut warnings)?;
        }
        index.refresh_rotated_means();
        // Fitting read the rotated keys; a search that reads none lets them go.
        if !keeps_keys(&index.spec) {
            index.keys = None;
        }
        index.stats = BuildStats::finished(n, context.seed, started, warnings);
        Ok(index)
    }

    /// Reads a saved body, whatever version wrote it.
    fn decode_body(body: &[u8]) -> Result<Body> {
        decode::<Body>(body)
            .or_else(|_| {
                decode::<WithoutHot>(body).map(|old| Body {
                    centroids: old.centroids,
                    routing: old.routing,
                    assigned: old.assigned,
                    hot: Vec::new(),
                })
            })
            .or_else(|_| {
                decode::<WithoutLists>(body).map(|old| Body {
                    centroids: old.centroids,
                    routing: old.routing,
                    assigned: None,
                    hot: Vec::new(),
                })
            })
            .or_else(|_| {
                decode::<CentroidsOnly>(body).map(|old| Body {
                    centroids: old.centroids,
                    routing: None,
                    assigned: None,
                    hot: Vec::new(),
                })
            })
    }

    /// Whether loading the saved `body` reads the keys: when it has no lists (an older
    /// save) or its search reads them ([`keeps_keys`]).
    pub(crate) fn reads_saved_keys(spec: &IvfSpec, body: &[u8]) -> Result<bool> {
        let body = Self::decode_body(body)?;
        let built = IvfSpec {
            fit: body.routing.is_some(),
            ..*spec
        };
        Ok(body.assigned.is_none() || keeps_keys(&built))
    }

    /// Rebuilds a saved index of `len` keys: its centroids and lists from `body`. `keys`
    /// (pre-RoPE, ids `0..len`) are read where the search needs them or the save has no
    /// lists (faiss assigns them again then); else they may be empty
    /// ([`Self::reads_saved_keys`]).
    pub fn load(
        spec: &IvfSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        len: usize,
        keys: &[f32],
    ) -> Result<Self> {
        let body = Self::decode_body(body)?;
        let d = context.rope.head_dim();
        if body.centroids.len() != spec.lists * d {
            return Err(IndexError::Corrupt(format!(
                "{} centroid floats for {} lists of {d}",
                body.centroids.len(),
                spec.lists
            )));
        }
        if let Some(routing) = &body.routing {
            if routing.vectors.len() != body.centroids.len() || routing.bias.len() != spec.lists {
                return Err(IndexError::Corrupt(format!(
                    "a fitted routing of {} floats and {} biases for {} lists of {d}",
                    routing.vectors.len(),
                    routing.bias.len(),
                    spec.lists
                )));
            }
        }
        // Built with `fit` or `hot` but without a sample: built, and so loaded, as without.
        let built = IvfSpec {
            fit: body.routing.is_some(),
            hot_permille: if body.hot.is_empty() {
                0
            } else {
                spec.hot_permille
            },
            ..*spec
        };
        if (spec.hot_permille == 0 && !body.hot.is_empty())
            || !body.hot.windows(2).all(|w| w[0] < w[1])
            || body.hot.last().is_some_and(|&id| id as usize >= len)
        {
            return Err(IndexError::Corrupt(format!(
                "{} hot key ids for `{}`, or ids that are not ascending ids of the {len} keys",
                body.hot.len(),
                IndexSpec::Ivf(*spec)
            )));
        }
        let reads_keys = body.assigned.is_none() || keeps_keys(&built);
        if reads_keys && keys.len() != len * d {
            return Err(IndexError::Corrupt(format!(
                "the index covers {len} keys, {} were given",
                keys.len() / d.max(1)
            )));
        }
        let rotated = match keeps_keys(&built) {
            true => {
                let mut rotated = FlatIndex::new(context.rope.clone());
                rotated.add(keys)?;
                Some(rotated)
            }
            false => None,
        };
        let mut index = Self::with_centroids(
            built,
            *spec,
            context.rope.clone(),
            rotated,
            body.centroids,
            stats,
        )?;
        index.routing = body.routing;
        index.hot = body.hot;
        match body.assigned {
            Some(assigned) => index.take_lists(&assigned, len)?,
            None => index.assign(keys, 0)?,
        }
        index.refresh_rotated_means();
        Ok(index)
    }

    /// Fills the (empty) lists from each key's saved list, checked: one per key, each a list
    /// of the index.
    fn take_lists(&mut self, assigned: &[u32], len: usize) -> Result<()> {
        if assigned.len() != len {
            return Err(IndexError::Corrupt(format!(
                "{} saved list numbers for {len} keys",
                assigned.len()
            )));
        }
        self.lists = buckets_of(assigned, self.lists.len(), "list")?;
        self.len = len;
        Ok(())
    }

    /// Fits the lists' routing on the context's query sample; without one (or without a
    /// usable one) routes by centroid, marks the spec so and says why in `warnings`.
    fn fit_routing(
        &mut self,
        context: &BuildContext<'_>,
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        let fitted = match (&context.queries, &self.keys) {
            (Some(sample), Some(keys)) => {
                FittedRouting::fit(sample, keys, &self.assignments(), &self.centroids)?
            }
            _ => None,
        };
        match fitted {
            Some((routing, _)) => self.routing = Some(routing),
            None => {
                self.spec.fit = false;
                warnings.push(format!(
                    "no sampled queries to fit the routing on (the corpus keeps none, or none \
                     had {} keys before it): built {}",
                    crate::fitted::MIN_KEYS,
                    IndexSpec::Ivf(self.spec)
                ));
            }
        }
        Ok(())
    }

    /// Finds the hot keys on the context's query sample; without one (or without a usable
    /// one) marks the spec as built without them and says why in `warnings`.
    fn find_hot_keys(
        &mut self,
        context: &BuildContext<'_>,
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        let count = (self.len * self.spec.hot_permille).div_ceil(1000);
        self.hot = match (&context.queries, &self.keys) {
            (Some(sample), Some(keys)) => heavy_keys(sample, keys, count)?,
            _ => Vec::new(),
        };
        if self.hot.is_empty() {
            self.spec.hot_permille = 0;
            warnings.push(format!(
                "no sampled queries to find the hot keys with (the corpus keeps none, or none \
                 had {} keys before it): built {}",
                crate::fitted::MIN_KEYS,
                IndexSpec::Ivf(self.spec)
            ));
        }
        Ok(())
    }

    /// An index (over no keys yet: `keys` holds the rotated ones to come, or is `None`)
    /// whose faiss quantizer holds `centroids` (none: nothing trained yet).
    fn with_centroids(
        spec: IvfSpec,
        requested: IvfSpec,
        rope: Rope,
        keys: Option<FlatIndex>,
        centroids: Vec<f32>,
        stats: BuildStats,
    ) -> Result<Self> {
        // Keys join the list of their nearest centroid in L2, the geometry k-means placed
        // the centroids in (by inner product, long centroids would swallow other clusters'
        // keys); lists are probed by inner product, the mean logit of a list's keys.
        let mut quantizer = FaissFlat::new_l2(rope.head_dim() as u32)?;
        quantizer.add(&centroids)?;
        let lists = vec![Vec::new(); centroids.len() / rope.head_dim()];
        Ok(Self {
            spec,
            requested,
            quantizer,
            rope,
            len: 0,
            keys,
            centroids,
            rotated_means: Vec::new(),
            lists,
            routing: None,
            hot: Vec::new(),
            stats,
        })
    }

    /// Has faiss assign `pre_rope`, the keys from id `first` on (already in `self.keys`
    /// rotated, where it keeps them), to the list of their nearest centroid.
    fn assign(&mut self, pre_rope: &[f32], first: usize) -> Result<()> {
        if pre_rope.is_empty() {
            return Ok(());
        }
        let d = self.head_dim();
        let space = match (&self.keys, self.spec.norope) {
            (_, true) => pre_rope,
            (Some(keys), false) => &keys.rows()[first * d..],
            (None, false) => {
                return Err(IndexError::Corrupt(
                    "a RoPE'd partition without its rotated keys".into(),
                ))
            }
        };
        let assigned = self.quantizer.assign(space, 1)?;
        for (i, label) in assigned.labels.iter().enumerate() {
            let list = label
                .get()
                .map(|l| l as usize)
                .filter(|&l| l < self.lists.len())
                .ok_or_else(|| IndexError::FaissOutput(format!("key {} in no list", first + i)))?;
            let id = u32::try_from(first + i)
                .map_err(|_| IndexError::FaissOutput(format!("token id {}", first + i)))?;
            self.lists[list].push(id);
        }
        self.len = first + pre_rope.len() / d;
        Ok(())
    }

    /// Whether the lists are ranked by their mean rotated key: a de-roped partition whose
    /// search re-scores the probed keys (so it keeps them rotated) and has no fitted routing.
    fn ranks_by_rotated_means(&self) -> bool {
        self.spec.norope && !self.spec.all && self.routing.is_none() && self.keys.is_some()
    }

    /// Recomputes each list's mean rotated key from the rotated keys (one pass over them), or
    /// clears them where the lists are ranked otherwise.
    fn refresh_rotated_means(&mut self) {
        self.rotated_means.clear();
        if !self.ranks_by_rotated_means() {
            return;
        }
        let Some(keys) = &self.keys else { return };
        let (d, rows) = (self.head_dim(), keys.rows());
        let mut means = vec![0f32; self.lists.len() * d];
        for (mean, ids) in means.chunks_exact_mut(d).zip(&self.lists) {
            for &id in ids {
                let row = &rows[id as usize * d..(id as usize + 1) * d];
                mean.iter_mut().zip(row).for_each(|(m, x)| *m += x);
            }
            let size = ids.len().max(1) as f32;
            mean.iter_mut().for_each(|m| *m /= size);
        }
        self.rotated_means = means;
    }

    /// The rotated keys, which a search that re-scores or probes a RoPE'd partition reads.
    fn rotated(&self) -> Result<&FlatIndex> {
        self.keys
            .as_ref()
            .ok_or_else(|| IndexError::Corrupt("an ivf index without its rotated keys".into()))
    }
}

/// Whether an index of `spec` keeps its rotated keys: unless it partitions pre-RoPE keys and
/// attends whole lists, its search rotates queries into them and re-scores them.
fn keeps_keys(spec: &IvfSpec) -> bool {
    !(spec.norope && spec.all)
}

/// Adds to `probed` up to `extra` more lists: each query head's best by its own logit
/// (`logits[list][head]`) not probed yet, head by head in turn, best first. The group's
/// ranking (its best head's logit) gives a head whose logits run smaller than another's no
/// list of its own; measured on the Debian Reference, 2 such lists beside 5 cover more of
/// flat top-k's mass than 2 more by the group (docs/benchmarks.md).
fn add_head_probes(probed: &mut Vec<u32>, logits: &[Vec<f32>], extra: usize) {
    let heads = logits.first().map_or(0, Vec::len);
    if extra == 0 || heads == 0 {
        return;
    }
    // A head's best `probed + extra` lists hold `extra` that are not probed yet.
    let wanted = (probed.len() + extra).min(logits.len());
    let rankings: Vec<Vec<u32>> = (0..heads)
        .map(|h| {
            let scores: Vec<f32> = logits.iter().map(|l| l[h]).collect();
            top_indices(&scores, wanted)
        })
        .collect();
    for rank in 0..wanted {
        for ranking in &rankings {
            if probed.len() == wanted {
                return;
            }
            if !probed.contains(&ranking[rank]) {
                probed.push(ranking[rank]);
            }
        }
    }
}

impl StatelessSearch for IvfIndex {
    fn search_once(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        let d = self.head_dim();
        check_query(query, d)?;
        let eligible = eligible(&params.candidates, self.len());
        let whole = self.spec.all;
        if eligible.is_empty() || (params.k == 0 && !whole) {
            return Ok(Found::default());
        }
        // Rotated once: to probe a RoPE'd partition and to re-score keys.
        let rotated = match !self.spec.norope || !whole {
            true => Some(self.rotated()?.rotate_query(query)),
            false => None,
        };
        let partition = match &rotated {
            Some(r) if !self.spec.norope => &r[..],
            _ => query.queries,
        };
        // Each list's logit for each query head against one vector a list: its centroid (the
        // mean logit of its keys without RoPE, which the estimate of unvisited lists reads)
        // or its mean rotated key (with the rotated query: the mean logit with RoPE).
        let logits = |vectors: &[f32], queries: &[f32]| -> Vec<Vec<f32>> {
            let heads: Vec<&[f32]> = queries.chunks_exact(d).collect();
            vectors
                .chunks_exact(d)
                .map(|c| heads.iter().map(|q| dot(q, c)).collect())
                .collect()
        };
        let best_head = |l: &Vec<f32>| l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ranks_by_centroid = self.routing.is_none() && self.rotated_means.is_empty();
        let centroid_logits = match params.estimate || ranks_by_centroid {
            true => logits(&self.centroids, partition),
            false => Vec::new(),
        };
        let mean_logits = match (&self.routing, &rotated) {
            (None, Some(queries)) if !self.rotated_means.is_empty() => {
                logits(&self.rotated_means, queries)
            }
            _ => Vec::new(),
        };
        // Each list's logit for each query head where the lists are ranked by logits.
        let head_logits = match (&self.routing, mean_logits.is_empty()) {
            (Some(_), _) => &[][..],
            (None, false) => &mean_logits[..],
            (None, true) => &centroid_logits[..],
        };
        let group: Vec<f32> = match &self.routing {
            Some(routing) => routing.scores(partition, d),
            None => head_logits.iter().map(best_head).collect(),
        };
        let mut probed = top_indices(&group, params.breadth_or(self.spec.probes));
        add_head_probes(&mut probed, head_logits, self.spec.head_probes);
        let mut ids: Vec<u32> = probed
            .iter()
            .flat_map(|&l| &self.lists[l as usize])
            .copied()
            .filter(|id| eligible.contains(id))
            .collect();
        // The hot keys the probed lists do not hold (lists are ascending): re-scored with
        // the lists' keys, or with `all` attended whole beside them.
        ids.extend(self.hot.iter().copied().filter(|id| {
            eligible.contains(id)
                && !probed
                    .iter()
                    .any(|&l| self.lists[l as usize].binary_search(id).is_ok())
        }));
        let mut scored = self.spec.lists;
        let selection = match &rotated {
            Some(queries) if !whole => {
                scored += ids.len();
                let best = self.rotated()?.top_of(queries, ids.into_iter(), params.k);
                best.into_iter().map(|(_, id)| id).collect()
            }
            _ => Selection::new(ids),
        };
        let unvisited = if params.estimate {
            let mut visited = vec![false; self.spec.lists];
            for &l in &probed {
                visited[l as usize] = true;
            }
            (0..self.spec.lists)
                .filter(|&l| !visited[l] && !self.lists[l].is_empty())
                .map(|l| UnvisitedBucket {
                    bucket: l as u32,
                    size: self.lists[l].len() as u32,
                    logits: centroid_logits[l].clone(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(Found {
            selection,
            scored,
            unvisited,
        })
    }
}

impl KeyIndex for IvfIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Ivf(self.spec)
    }

    fn head_dim(&self) -> usize {
        self.rope.head_dim()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let started = Instant::now();
        let adding = check_add(keys, self.head_dim(), self.len())?;
        if self.centroids.is_empty() {
            // Built over no keys: nothing was trained yet, so this add is the build.
            let context = BuildContext {
                rope: self.rope.clone(),
                seed: self.stats.seed,
                saap: None,
                queries: None,
            };
            *self = Self::build(&self.requested, &context, keys)?;
            return Ok(());
        }
        let first = self.len();
        if let Some(rotated) = &mut self.keys {
            rotated.add(keys)?;
        }
        self.assign(keys, first)?;
        self.refresh_rotated_means();
        self.stats.record_add(adding, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        let ids: usize = self.lists.iter().map(Vec::capacity).sum();
        // The quantizer holds a second copy of the centroids.
        let keys = self.keys.as_ref().map_or(0, FlatIndex::memory_bytes);
        keys + (2 * self.centroids.capacity() + self.rotated_means.capacity()) * 4 + ids * 4
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        encode(&Body {
            centroids: self.centroids.clone(),
            routing: self.routing.clone(),
            assigned: Some(self.assignments()),
            hot: self.hot.clone(),
        })
    }

    fn as_buckets(&self) -> Option<&dyn BucketIndex> {
        Some(self)
    }
}

impl BucketIndex for IvfIndex {
    fn buckets(&self) -> usize {
        self.spec.lists
    }

    fn assignments(&self) -> Vec<u32> {
        let mut of = vec![0u32; self.len()];
        for (l, ids) in self.lists.iter().enumerate() {
            for &id in ids {
                of[id as usize] = l as u32;
            }
        }
        of
    }

    /// Routing by centroid only: the GPU's routing kernel has no per-bucket bias yet, so a
    /// fitted routing searches on the CPU.
    fn gpu_routing(&self) -> Option<GpuRouting<'_>> {
        (self.spec.norope && self.spec.all && self.routing.is_none()).then_some(GpuRouting {
            scores: BucketScores::Centroids(&self.centroids),
            lists: &self.lists,
            always: &self.hot,
            probes: self.spec.probes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::QuerySample;
    use kvdb_model::RopeStyle;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const D: usize = 8;
    const N: usize = 600;

    /// The bodies saves wrote before the lists were kept, and before `fit`.
    #[derive(Serialize)]
    struct OldBody {
        centroids: Vec<f32>,
        routing: Option<FittedRouting>,
    }
    #[derive(Serialize)]
    struct OldestBody {
        centroids: Vec<f32>,
    }
    /// The body saves wrote before `hot`.
    #[derive(Serialize)]
    struct ListsBody {
        centroids: Vec<f32>,
        routing: Option<FittedRouting>,
        assigned: Option<Vec<u32>>,
    }

    /// `N` random keys (from `seed`), a context with the test RoPE, and `spec` parsed.
    fn random_keys(seed: u64, spec: &str) -> Result<(Vec<f32>, BuildContext<'static>, IvfSpec)> {
        let mut rng = StdRng::seed_from_u64(seed);
        let keys: Vec<f32> = (0..N * D).map(|_| rng.random_range(-1.0..1.0)).collect();
        let context = BuildContext {
            rope: kvdb_tests::test_rope(RopeStyle::Halves, D),
            seed,
            saap: None,
            queries: None,
        };
        let spec = match spec.parse()? {
            IndexSpec::Ivf(s) => s,
            other => panic!("{other} is not ivf"),
        };
        Ok((keys, context, spec))
    }

    /// `index` saved and loaded again over its `N` keys.
    fn reloaded(
        index: &IvfIndex,
        spec: &IvfSpec,
        context: &BuildContext<'_>,
        keys: &[f32],
    ) -> Result<IvfIndex> {
        IvfIndex::load(
            spec,
            context,
            BuildStats::default(),
            &index.save()?,
            N,
            keys,
        )
    }

    /// Saves of every version load to the same lists (older ones by assigning the keys
    /// again, which they must be given); saved lists that do not fit are refused.
    #[test]
    fn old_saves_load_and_corrupt_lists_are_refused() -> Result<()> {
        let (keys, context, spec) = random_keys(3, "ivf8,np2,norope,all")?;
        let index = IvfIndex::build(&spec, &context, &keys)?;
        let want = index.assignments();
        let stats = BuildStats::default();
        let load = |body: &[u8], keys: &[f32]| {
            IvfIndex::load(&spec, &context, stats.clone(), body, N, keys)
        };
        let centroids = index.centroids.clone();
        let old = encode(&OldBody {
            centroids: centroids.clone(),
            routing: None,
        })?;
        let oldest = encode(&OldestBody {
            centroids: centroids.clone(),
        })?;
        for body in [&old, &oldest] {
            assert!(IvfIndex::reads_saved_keys(&spec, body)?);
            assert_eq!(load(body, &keys)?.assignments(), want);
            assert!(matches!(load(body, &[]), Err(IndexError::Corrupt(_))));
        }
        let with_lists = |assigned: Vec<u32>| {
            encode(&ListsBody {
                centroids: centroids.clone(),
                routing: None,
                assigned: Some(assigned),
            })
        };
        assert!(!IvfIndex::reads_saved_keys(
            &spec,
            &with_lists(want.clone())?
        )?);
        assert_eq!(load(&with_lists(want.clone())?, &[])?.assignments(), want);
        let mut outside = want.clone();
        outside[11] = 8;
        for body in [with_lists(want[1..].to_vec())?, with_lists(outside)?] {
            assert!(matches!(load(&body, &[]), Err(IndexError::Corrupt(_))));
        }
        Ok(())
    }

    /// `hot<N>` finds its keys on the query sample (those `heavy_keys` finds), scores them
    /// beside the probed lists (each once, counted as scored), or with `all` attends them
    /// beside the whole lists (each once, not scored) and hands them to the GPU's routing;
    /// saves and loads them, refuses saved ids that are not ascending ids of the keys, and
    /// without a sample builds without them and says so.
    #[test]
    fn hot_keys_are_scored_beside_the_probed_lists() -> Result<()> {
        let (keys, context, spec) = random_keys(9, "ivf8,np1,hot50,norope")?;
        let (_, _, plain_spec) = random_keys(9, "ivf8,np1,norope")?;
        let [whole_spec, plain_whole_spec] = ["ivf8,np1,hot50,norope,all", "ivf8,np1,norope,all"]
            .map(|s| match s.parse() {
                Ok(IndexSpec::Ivf(spec)) => spec,
                other => panic!("{s} parsed as {other:?}"),
            });
        let mut rng = StdRng::seed_from_u64(10);
        let positions: Vec<u32> = (0..40).map(|i| 100 + 12 * i).collect();
        let queries: Vec<f32> = (0..positions.len() * 2 * D)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let sample = QuerySample {
            queries: &queries,
            positions: &positions,
            scale: 0.5,
            recent: 8,
        };
        let sampled = BuildContext {
            queries: Some(sample),
            ..context.clone()
        };
        let index = IvfIndex::build(&spec, &sampled, &keys)?;
        let plain = IvfIndex::build(&plain_spec, &sampled, &keys)?;
        let whole = IvfIndex::build(&whole_spec, &sampled, &keys)?;
        let plain_whole = IvfIndex::build(&plain_whole_spec, &sampled, &keys)?;
        assert_eq!(plain.lists, index.lists, "the same partition");
        assert_eq!(whole.hot, index.hot);
        let routing = whole.gpu_routing().map(|r| (r.lists, r.always, r.probes));
        assert_eq!(routing, Some((&whole.lists[..], &index.hot[..], 1)));
        assert!(plain_whole
            .gpu_routing()
            .is_some_and(|r| r.always.is_empty()));
        assert_eq!(index.hot.len(), N * 50 / 1000);
        assert_eq!(index.hot, heavy_keys(&sample, index.rotated()?, 30)?);
        assert_eq!(index.spec(), IndexSpec::Ivf(spec));
        let loaded = reloaded(&index, &spec, &context, &keys)?;
        assert_eq!(loaded.hot, index.hot);
        let mut added = 0;
        for _ in 0..20 {
            let (queries, _) = two_heads_at_the_end(&index, &mut rng)?;
            let query = GroupQuery {
                queries: &queries,
                position: N,
            };
            // Every candidate, so that the selection is what was scored.
            let all = SearchParams::top(N, 0..N as u32);
            let (with, without) = (
                index.search_once(&query, &all)?,
                plain.search_once(&query, &all)?,
            );
            let mut want = without.selection.ids().to_vec();
            let extra: Vec<u32> = index
                .hot
                .iter()
                .copied()
                .filter(|id| !want.contains(id))
                .collect();
            added += extra.len();
            let scored = without.scored + extra.len();
            want.extend(extra);
            want.sort_unstable();
            assert_eq!(with.selection.ids(), want);
            assert_eq!(with.scored, scored);
            // With `all`: the whole probed list and the hot keys it lacks, none scored.
            let (whole_with, whole_without) = (
                whole.search_once(&query, &all)?,
                plain_whole.search_once(&query, &all)?,
            );
            let mut whole_want = whole_without.selection.ids().to_vec();
            whole_want.extend(&index.hot);
            whole_want.sort_unstable();
            whole_want.dedup();
            assert_eq!(whole_with.selection.ids(), whole_want);
            assert_eq!(whole_with.scored, whole_without.scored);
            assert_eq!(loaded.search_once(&query, &all)?, with);
            // Candidates restrict the hot keys as they do the lists' keys.
            let late = index.search_once(&query, &SearchParams::top(N, 300..N as u32))?;
            assert!(late.selection.ids().iter().all(|&id| id >= 300));
        }
        assert!(added > 0, "the hot keys were always in the probed list");
        // Saved ids that do not fit, or saved for a spec without `hot`.
        let load_with = |spec: &IvfSpec, hot: Vec<u32>| {
            let body = encode(&Body {
                centroids: index.centroids.clone(),
                routing: None,
                assigned: Some(index.assignments()),
                hot,
            })?;
            IvfIndex::load(spec, &context, BuildStats::default(), &body, N, &keys)
        };
        for (spec, hot) in [
            (&spec, vec![5, 5]),
            (&spec, vec![7, 3]),
            (&spec, vec![1, N as u32]),
            (&plain_spec, index.hot.clone()),
        ] {
            assert!(matches!(load_with(spec, hot), Err(IndexError::Corrupt(_))));
        }
        let unsampled = IvfIndex::build(&spec, &context, &keys)?;
        assert!(unsampled.hot.is_empty());
        assert_eq!(unsampled.spec(), IndexSpec::Ivf(plain_spec));
        assert!(unsampled
            .stats
            .warnings
            .iter()
            .any(|w| w.contains("hot keys")));
        Ok(())
    }

    /// A random query of two heads after the `N` keys, and the heads rotated at its position.
    fn two_heads_at_the_end(index: &IvfIndex, rng: &mut StdRng) -> Result<(Vec<f32>, Vec<f32>)> {
        let queries: Vec<f32> = (0..2 * D).map(|_| rng.random_range(-1.0..1.0)).collect();
        let rotated = index.rotated()?.rotate_query(&GroupQuery {
            queries: &queries,
            position: N,
        });
        Ok((queries, rotated))
    }

    /// The mean logit of list `list`'s keys, rotated at their ids, against the rotated
    /// query head `q`, in f64.
    fn mean_logit_with_rope(index: &IvfIndex, list: usize, q: &[f32]) -> f64 {
        let rows = index
            .rotated()
            .expect("a re-scoring index keeps its keys")
            .rows();
        let ids = &index.lists[list];
        let sum: f64 = ids
            .iter()
            .map(|&id| {
                let k = &rows[id as usize * D..(id as usize + 1) * D];
                k.iter()
                    .zip(q)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
            })
            .sum();
        sum / ids.len().max(1) as f64
    }

    /// `hp<H>` probes, beside the group's best lists, each query head's own best lists (by
    /// its mean logit with RoPE, in f64 here) not probed yet, head by head in turn; those are
    /// not always the lists the group ranks next (which `np` more would probe).
    #[test]
    fn head_probes_add_each_heads_own_best_lists() -> Result<()> {
        let (keys, context, spec) = random_keys(7, "ivf8,np1,hp2,norope")?;
        let index = IvfIndex::build(&spec, &context, &keys)?;
        let mut rng = StdRng::seed_from_u64(8);
        let mut group_differs = 0;
        for _ in 0..20 {
            let (queries, rotated) = two_heads_at_the_end(&index, &mut rng)?;
            let query = GroupQuery {
                queries: &queries,
                position: N,
            };
            // Each head's lists, best first, and the group's (its best head's logit).
            let ranked = |score: &dyn Fn(usize) -> f64| {
                let mut lists: Vec<usize> = (0..index.lists.len()).collect();
                lists.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
                lists
            };
            let head = |h: usize| {
                ranked(&|l| mean_logit_with_rope(&index, l, &rotated[h * D..(h + 1) * D]))
            };
            let heads = [head(0), head(1)];
            let group = ranked(&|l| {
                (0..2)
                    .map(|h| mean_logit_with_rope(&index, l, &rotated[h * D..(h + 1) * D]))
                    .fold(f64::NEG_INFINITY, f64::max)
            });
            let mut want = vec![group[0]];
            for rank in 0..index.lists.len() {
                for ranking in &heads {
                    if want.len() < 3 && !want.contains(&ranking[rank]) {
                        want.push(ranking[rank]);
                    }
                }
            }
            group_differs += usize::from(want[1..] != group[1..3]);
            let found = index.search_once(&query, &SearchParams::top(N, 0..N as u32))?;
            let mut got = found.selection.ids().to_vec();
            let mut expected: Vec<u32> =
                want.iter().flat_map(|&l| index.lists[l].clone()).collect();
            got.sort_unstable();
            expected.sort_unstable();
            assert_eq!(got, expected);
        }
        assert!(
            group_differs > 0,
            "the heads' lists were always the group's next"
        );
        Ok(())
    }

    /// A de-roped index that re-scores its lists probes the list whose keys, rotated at
    /// their ids, have the best mean logit against the query rotated at its position (the
    /// best head's; computed here in f64), which is not always the list of the best
    /// de-roped centroid; an index grown by `add` ranks as one loaded with all its keys.
    #[test]
    fn lists_are_ranked_by_their_mean_logit_with_rope() -> Result<()> {
        let (keys, context, spec) = random_keys(5, "ivf8,np1,norope")?;
        let mut rng = StdRng::seed_from_u64(6);
        let mut grown = IvfIndex::build(&spec, &context, &keys[..N / 2 * D])?;
        grown.add(&keys[N / 2 * D..])?;
        let loaded = reloaded(&grown, &spec, &context, &keys)?;
        assert_eq!(grown.rotated_means, loaded.rotated_means);
        let index = IvfIndex::build(&spec, &context, &keys)?;
        let mut centroid_differs = 0;
        for _ in 0..20 {
            let (queries, rotated) = two_heads_at_the_end(&index, &mut rng)?;
            let query = GroupQuery {
                queries: &queries,
                position: N,
            };
            let best = |score: &dyn Fn(usize, &[f32]) -> f64| {
                (0..index.lists.len())
                    .max_by(|&a, &b| {
                        let group = |l: usize| {
                            (0..2)
                                .map(|h| score(l, &rotated[h * D..(h + 1) * D]))
                                .fold(f64::NEG_INFINITY, f64::max)
                        };
                        group(a).total_cmp(&group(b))
                    })
                    .unwrap()
            };
            let with_rope = best(&|l, q| mean_logit_with_rope(&index, l, q));
            let by_centroid = (0..index.lists.len())
                .max_by(|&a, &b| {
                    let group = |l: usize| {
                        let c = &index.centroids[l * D..(l + 1) * D];
                        (0..2)
                            .map(|h| dot(&queries[h * D..(h + 1) * D], c))
                            .fold(f32::NEG_INFINITY, f32::max)
                    };
                    group(a).total_cmp(&group(b))
                })
                .unwrap();
            centroid_differs += usize::from(by_centroid != with_rope);
            let found = index.search_once(&query, &SearchParams::top(N, 0..N as u32))?;
            let ids = found.selection.ids().to_vec();
            assert_eq!(ids.len(), index.lists[with_rope].len());
            assert!(ids.iter().all(|id| index.lists[with_rope].contains(id)));
            let params = SearchParams::top(N, 0..N as u32);
            assert_eq!(
                grown.search_once(&query, &params)?.selection.ids(),
                loaded.search_once(&query, &params)?.selection.ids()
            );
        }
        // The test tells the two rankings apart.
        assert!(
            centroid_differs > 0,
            "every query's best list was the centroid's"
        );
        Ok(())
    }
}
