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
//! with the query rotated at its position. `norope` trains, assigns and probes on de-roped
//! (pre-RoPE) keys and queries instead: SAAP's observation is that the un-rotated key
//! geometry is stable across positions. `ivfC,npP,norope,all` is SAAP's k-means baseline.
//!
//! `fit` (with `norope`) ranks the lists by a routing fitted on the corpus's sampled queries
//! instead of by centroid ([`crate::fitted`]): where those queries' attention mass fell.
//! Without a sample (a corpus ingested before samples were kept) it is built, and says so, as
//! the same spec without `fit`.
//!
//! `tail` ranks the lists by how many of each query's top-k keys they are expected to hold
//! ([`IvfIndex::tail_scores`]): a list's logits for a query are modelled as a normal
//! distribution about its centroid's logit, with the variance its keys' spread about the
//! centroid gives along the query, so that a wide list whose centroid scores a little lower
//! can outrank a tight one that holds none of the largest logits. It costs one more product
//! per list (the spread), counted as scored.
//!
//! Saved bytes hold the centroids, the fitted routing and each key's list (a byte or two a
//! key), not the keys, which are in the store. In memory the index keeps the keys (rotated,
//! f32) only where its search reads them: `norope,all` probes with pre-RoPE queries and
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
    /// Ids of each list, ascending.
    lists: Vec<Vec<u32>>,
    /// With `fit`: what ranks the lists instead of the centroids.
    routing: Option<FittedRouting>,
    /// With `tail`: each list's sum over its keys of the squared difference from its
    /// centroid, per dimension `[lists, d]` (in the partition's space); empty without.
    spread: Vec<f32>,
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
    /// With `tail`, the lists' spread ([`IvfIndex::spread`]; `None` in saves written before
    /// it was kept, and without `tail`).
    spread: Option<Vec<f32>>,
}

/// What saves written before the spread was kept hold.
#[derive(Deserialize)]
struct WithoutSpread {
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
                decode::<WithoutSpread>(body).map(|old| Body {
                    centroids: old.centroids,
                    routing: old.routing,
                    assigned: old.assigned,
                    spread: None,
                })
            })
            .or_else(|_| {
                decode::<WithoutLists>(body).map(|old| Body {
                    centroids: old.centroids,
                    routing: old.routing,
                    assigned: None,
                    spread: None,
                })
            })
            .or_else(|_| {
                decode::<CentroidsOnly>(body).map(|old| Body {
                    centroids: old.centroids,
                    routing: None,
                    assigned: None,
                    spread: None,
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
        Ok(body.assigned.is_none() || keeps_keys(&built) || (spec.tail && body.spread.is_none()))
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
        // Built with `fit` but without a sample: built, and so loaded, as without `fit`.
        let built = IvfSpec {
            fit: body.routing.is_some(),
            ..*spec
        };
        let reads_keys =
            body.assigned.is_none() || keeps_keys(&built) || (spec.tail && body.spread.is_none());
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
        match body.assigned {
            Some(assigned) => index.take_lists(&assigned, len)?,
            // Assigning measures the spread too.
            None => return index.assign(keys, 0).map(|()| index),
        }
        if spec.tail {
            match body.spread {
                Some(spread) if spread.len() == index.centroids.len() => index.spread = spread,
                Some(spread) => {
                    return Err(IndexError::Corrupt(format!(
                        "{} spread floats for {} lists of {d}",
                        spread.len(),
                        spec.lists
                    )))
                }
                None => index.measure_spread(keys)?,
            }
        }
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
        let centroids_len = centroids.len();
        Ok(Self {
            spec,
            requested,
            quantizer,
            rope,
            len: 0,
            keys,
            centroids,
            lists,
            routing: None,
            spread: match spec.tail {
                true => vec![0.0; centroids_len],
                false => Vec::new(),
            },
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
            if self.spec.tail {
                let key = &space[i * d..][..d];
                add_spread(&mut self.spread, &self.centroids, list, key);
            }
        }
        self.len = first + pre_rope.len() / d;
        Ok(())
    }

    /// Measures every list's spread from the keys (pre-RoPE, ids `0..len`): for a save that
    /// kept the lists but not the spread.
    fn measure_spread(&mut self, pre_rope: &[f32]) -> Result<()> {
        let d = self.head_dim();
        let space = match self.spec.norope {
            true => pre_rope,
            false => self.rotated()?.rows(),
        };
        let mut spread = vec![0.0; self.centroids.len()];
        for (list, ids) in self.lists.iter().enumerate() {
            for &id in ids {
                add_spread(
                    &mut spread,
                    &self.centroids,
                    list,
                    &space[id as usize * d..][..d],
                );
            }
        }
        self.spread = spread;
        Ok(())
    }

    /// With `tail`: how many of the top `k` keys of each of the group's `heads` (in the
    /// partition's space) each list is expected to hold, summed over the heads. For a head
    /// `q`, list `l`'s logits are taken as normal about its centroid's (`logits[l][h]`),
    /// with variance `Σᵢ qᵢ² spreadᵢ / size` (its keys' mean squared distance from the
    /// centroid along each dimension, weighed by the query's); the threshold `t` is where
    /// the lists' expected counts above it add up to `k`, found by bisection.
    fn tail_scores(&self, heads: &[&[f32]], logits: &[Vec<f32>], k: usize) -> Vec<f32> {
        let d = self.head_dim();
        let mut scores = vec![0.0f32; self.lists.len()];
        // (keys, mean, deviation) of each list's logits.
        let mut normal: Vec<(f32, f32, f32)> = Vec::with_capacity(self.lists.len());
        let max_mode = std::env::var("KVDB_TAIL").is_ok_and(|v| v == "max");
        for (h, q) in heads.iter().enumerate() {
            let squared: Vec<f32> = q.iter().map(|x| x * x).collect();
            normal.clear();
            normal.extend(self.lists.iter().enumerate().map(|(l, ids)| {
                let size = ids.len() as f32;
                let variance = match ids.is_empty() {
                    true => 0.0,
                    false => dot(&squared, &self.spread[l * d..][..d]) / size,
                };
                (size, logits[l][h], variance.max(0.0).sqrt())
            }));
            if max_mode {
                for (score, &(n, m, s)) in scores.iter_mut().zip(&normal) {
                    let best = match n {
                        0.0 => f32::NEG_INFINITY,
                        _ => m + s * (2.0 * n.ln()).max(0.0).sqrt(),
                    };
                    *score = if h == 0 { best } else { score.max(best) };
                }
                continue;
            }
            let expected = |t: f32| {
                normal
                    .iter()
                    .map(|&(n, m, s)| n * above(t, m, s))
                    .sum::<f32>()
            };
            let (mut low, mut high) = normal.iter().filter(|&&(n, _, _)| n > 0.0).fold(
                (f32::INFINITY, f32::NEG_INFINITY),
                |(low, high), &(_, m, s)| (low.min(m - 8.0 * s), high.max(m + 8.0 * s)),
            );
            if !(low.is_finite() && high.is_finite()) {
                continue;
            }
            for _ in 0..32 {
                let middle = 0.5 * (low + high);
                match expected(middle) > k as f32 {
                    true => low = middle,
                    false => high = middle,
                }
            }
            let t = 0.5 * (low + high);
            for (score, &(n, m, s)) in scores.iter_mut().zip(&normal) {
                *score += n * above(t, m, s);
            }
        }
        scores
    }

    /// The rotated keys, which a search that re-scores or probes a RoPE'd partition reads.
    fn rotated(&self) -> Result<&FlatIndex> {
        self.keys
            .as_ref()
            .ok_or_else(|| IndexError::Corrupt("an ivf index without its rotated keys".into()))
    }
}

/// The share of a normal distribution of mean `mean` and deviation `deviation` above `t`:
/// the logistic approximation of the normal tail `1 / (1 + exp(1.5976 z + 0.070566 z³))`
/// (within 2e-4 of it), a point mass without deviation.
fn above(t: f32, mean: f32, deviation: f32) -> f32 {
    if deviation <= 0.0 {
        return f32::from(u8::from(mean > t));
    }
    let z = (t - mean) / deviation;
    1.0 / (1.0 + (z * (1.5976 + 0.070566 * z * z)).exp())
}

/// Adds `key` (in the partition's space, `d` long) to list `list`'s spread about its centroid:
/// `spread` and `centroids` are `[lists, d]`.
fn add_spread(spread: &mut [f32], centroids: &[f32], list: usize, key: &[f32]) {
    let d = key.len();
    let centroid = &centroids[list * d..][..d];
    for ((s, &x), &c) in spread[list * d..][..d].iter_mut().zip(key).zip(centroid) {
        *s += (x - c) * (x - c);
    }
}

/// Whether an index of `spec` keeps its rotated keys: unless it partitions pre-RoPE keys and
/// attends whole lists, its search rotates queries into them and re-scores them.
fn keeps_keys(spec: &IvfSpec) -> bool {
    !(spec.norope && spec.all)
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
        let heads: Vec<&[f32]> = partition.chunks_exact(d).collect();
        let logits: Vec<Vec<f32>> = self
            .centroids
            .chunks_exact(d)
            .map(|c| heads.iter().map(|q| dot(q, c)).collect())
            .collect();
        let mut scored = self.spec.lists;
        let group: Vec<f32> = match &self.routing {
            Some(routing) => routing.scores(partition, d),
            None if self.spec.tail => {
                // The spread's products, one a list.
                scored += self.spec.lists;
                self.tail_scores(&heads, &logits, params.k.max(1))
            }
            None => logits
                .iter()
                .map(|l| l.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                .collect(),
        };
        let probed = top_indices(&group, params.breadth_or(self.spec.probes));
        let ids: Vec<u32> = probed
            .iter()
            .flat_map(|&l| &self.lists[l as usize])
            .copied()
            .filter(|id| eligible.contains(id))
            .collect();
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
                    logits: logits[l].clone(),
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
        keys + (2 * self.centroids.capacity() + self.spread.capacity()) * 4 + ids * 4
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        encode(&Body {
            centroids: self.centroids.clone(),
            routing: self.routing.clone(),
            assigned: Some(self.assignments()),
            spread: self.spec.tail.then(|| self.spread.clone()),
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
        // The GPU ranks lists by centroid: `fit` and `tail` rank them otherwise.
        let by_centroid = self.routing.is_none() && !self.spec.tail;
        (self.spec.norope && self.spec.all && by_centroid).then_some(GpuRouting {
            scores: BucketScores::Centroids(&self.centroids),
            lists: &self.lists,
            probes: self.spec.probes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
    /// The body saves wrote before the spread was kept.
    #[derive(Serialize)]
    struct OldListsBody {
        centroids: Vec<f32>,
        routing: Option<FittedRouting>,
        assigned: Option<Vec<u32>>,
    }

    fn ivf_spec(spec: &str) -> Result<IvfSpec> {
        match spec.parse()? {
            IndexSpec::Ivf(s) => Ok(s),
            other => panic!("{other} is not ivf"),
        }
    }

    /// Two clusters of keys: a tight one whose centroid scores 1.0 against the query `e0`,
    /// and a wide one (spread along `e0`) whose centroid scores 0.8 but whose keys hold the
    /// largest logits. Probing one list, the centroid ranking attends the tight list and
    /// `tail` the wide one; a saved `tail` index loads to the same search, with its spread
    /// or (an older save) by measuring it from the keys.
    #[test]
    fn tail_probes_the_wide_list_that_holds_the_top_keys() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(5);
        let mut keys = vec![0f32; N * D];
        for (i, key) in keys.chunks_exact_mut(D).enumerate() {
            let tight = i < N / 2;
            key[0] = match tight {
                true => 1.0 + rng.random_range(-0.01..0.01),
                // Uniform of deviation 1: about 0.8 + 1.7 at most.
                false => 0.8 + rng.random_range(-1.73..1.73),
            };
            key[1] = if tight { 0.0 } else { 6.0 };
            for x in &mut key[2..] {
                *x = rng.random_range(-0.01..0.01);
            }
        }
        let context = BuildContext {
            rope: kvdb_tests::test_rope(RopeStyle::Halves, D),
            seed: 1,
            saap: None,
            queries: None,
        };
        let mut q = vec![0f32; D];
        q[0] = 1.0;
        let query = GroupQuery {
            queries: &q,
            position: N,
        };
        let params = SearchParams::top(10, 0..N as u32);
        let probed = |index: &IvfIndex| -> Result<(Vec<u32>, usize)> {
            let found = index.search_once(&query, &params)?;
            Ok((found.selection.ids().to_vec(), found.scored))
        };
        let wide: Vec<u32> = (N as u32 / 2..N as u32).collect();
        let by_centroid = IvfIndex::build(&ivf_spec("ivf2,np1,norope,all")?, &context, &keys)?;
        let (ids, scored) = probed(&by_centroid)?;
        assert_eq!(ids, (0..N as u32 / 2).collect::<Vec<_>>());
        assert_eq!(scored, 2);
        let spec = ivf_spec("ivf2,np1,norope,all,tail")?;
        let tail = IvfIndex::build(&spec, &context, &keys)?;
        let (ids, scored) = probed(&tail)?;
        assert_eq!(ids, wide);
        // The centroids' products and the spread's.
        assert_eq!(scored, 4);
        let body = tail.save()?;
        assert!(!IvfIndex::reads_saved_keys(&spec, &body)?);
        let stats = BuildStats::default();
        let loaded = IvfIndex::load(&spec, &context, stats.clone(), &body, N, &[])?;
        assert_eq!(probed(&loaded)?.0, wide);
        let without_spread = encode(&OldListsBody {
            centroids: tail.centroids.clone(),
            routing: None,
            assigned: Some(tail.assignments()),
        })?;
        assert!(IvfIndex::reads_saved_keys(&spec, &without_spread)?);
        let measured = IvfIndex::load(&spec, &context, stats, &without_spread, N, &keys)?;
        assert_eq!(measured.spread, tail.spread);
        assert_eq!(probed(&measured)?.0, wide);
        Ok(())
    }

    /// Saves of every version load to the same lists (older ones by assigning the keys
    /// again, which they must be given); saved lists that do not fit are refused.
    #[test]
    fn old_saves_load_and_corrupt_lists_are_refused() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(3);
        let keys: Vec<f32> = (0..N * D).map(|_| rng.random_range(-1.0..1.0)).collect();
        let context = BuildContext {
            rope: kvdb_tests::test_rope(RopeStyle::Halves, D),
            seed: 1,
            saap: None,
            queries: None,
        };
        let spec = ivf_spec("ivf8,np2,norope,all")?;
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
            encode(&Body {
                centroids: centroids.clone(),
                routing: None,
                assigned: Some(assigned),
                spread: None,
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
}
