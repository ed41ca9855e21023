//! [`IvfIndex`]: faiss's IndexIVFFlat with inner product, searched list by list.
//!
//! The partition's `C` centroids come from [`crate::kmeans`] (k-means++ seeding: faiss's
//! random seeding loses clusters) and are handed to faiss as its trained quantizer; faiss
//! assigns the keys to inverted lists by inner product. The search is ours, so that a GQA
//! group probes one set of lists and every score it computes is counted:
//!
//! 1. the group's queries are scored against the `C` centroids and the `np` lists with the
//!    best group score (maximum over the heads, as for keys) are probed;
//! 2. the probed lists' ids (read from faiss's inverted lists) restricted to the candidates
//!    are either all attended (`all`) or re-scored exactly on RoPE'd keys, keeping the top k.
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
//! Saved bytes hold the centroids (and the fitted routing) alone; loading has faiss assign the keys (which are in the
//! store) to their lists again, so the saved form does not duplicate the keys.

use std::time::Instant;

use faiss::index::ivf_flat::IVFFlatIndexImpl;
use faiss::index::NativeIndex;
use faiss::{FlatIndex as FaissFlat, Index as _};
use serde::{Deserialize, Serialize};

use crate::common::{check_add, check_query, decode, eligible, encode, top_indices};
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

/// faiss IVF-Flat with inner product; see the module documentation.
pub struct IvfIndex {
    /// As built (lists reduced when there were too few keys).
    spec: IvfSpec,
    /// As asked for.
    requested: IvfSpec,
    faiss: IVFFlatIndexImpl,
    /// The keys rotated at their ids, for exact re-scoring.
    keys: FlatIndex,
    /// The partition's centroids `[lists, d]` (in the space the partition lives in).
    centroids: Vec<f32>,
    /// Ids of each list, ascending.
    lists: Vec<Vec<u32>>,
    /// With `fit`: what ranks the lists instead of the centroids.
    routing: Option<FittedRouting>,
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
        let mut index =
            Self::with_centroids(effective, *spec, rotated, centroids, BuildStats::default())?;
        index.assign(keys, 0)?;
        if effective.fit {
            index.fit_routing(context, &mut warnings)?;
        }
        index.stats = BuildStats::finished(n, context.seed, started, warnings);
        Ok(index)
    }

    /// Rebuilds a saved index: its centroids from `body`, its keys re-assigned by faiss.
    pub fn load(
        spec: &IvfSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        keys: &[f32],
    ) -> Result<Self> {
        let body: Body = decode(body).or_else(|_| {
            decode::<CentroidsOnly>(body).map(|old| Body {
                centroids: old.centroids,
                routing: None,
            })
        })?;
        let d = context.rope.head_dim();
        if body.centroids.len() != spec.lists * d {
            return Err(IndexError::Corrupt(format!(
                "{} centroid floats for {} lists of {d}",
                body.centroids.len(),
                spec.lists
            )));
        }
        let mut rotated = FlatIndex::new(context.rope.clone());
        rotated.add(keys)?;
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
        let mut index = Self::with_centroids(built, *spec, rotated, body.centroids, stats)?;
        index.routing = body.routing;
        index.assign(keys, 0)?;
        Ok(index)
    }

    /// Fits the lists' routing on the context's query sample; without one (or without a
    /// usable one) routes by centroid, marks the spec so and says why in `warnings`.
    fn fit_routing(
        &mut self,
        context: &BuildContext<'_>,
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        let fitted = match &context.queries {
            Some(sample) => {
                FittedRouting::fit(sample, &self.keys, &self.assignments(), &self.centroids)?
            }
            None => None,
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

    /// An index over `keys` (not yet assigned) whose faiss quantizer holds `centroids`
    /// (none: nothing trained yet).
    fn with_centroids(
        spec: IvfSpec,
        requested: IvfSpec,
        keys: FlatIndex,
        centroids: Vec<f32>,
        stats: BuildStats,
    ) -> Result<Self> {
        let d = keys.head_dim();
        // Keys join the list of their nearest centroid in L2, the geometry k-means placed
        // the centroids in (by inner product, long centroids would swallow other clusters'
        // keys); lists are probed by inner product, the mean logit of a list's keys.
        let mut quantizer = FaissFlat::new_l2(d as u32)?;
        quantizer.add(&centroids)?;
        let mut faiss = IVFFlatIndexImpl::new_ip(quantizer, d as u32, spec.lists as u32)?;
        if !centroids.is_empty() {
            // The quantizer already holds `lists` centroids, so faiss skips its k-means and
            // only marks the index trained.
            faiss.train(&centroids)?;
        }
        Ok(Self {
            spec,
            requested,
            faiss,
            keys,
            centroids,
            lists: Vec::new(),
            routing: None,
            stats,
        })
    }

    /// Has faiss assign the keys from id `first` on (already in `self.keys`; `pre_rope` are
    /// the same keys before rotation) to their lists, and mirrors the lists.
    fn assign(&mut self, pre_rope: &[f32], first: usize) -> Result<()> {
        if pre_rope.is_empty() {
            return Ok(());
        }
        let d = self.head_dim();
        let space = if self.spec.norope {
            pre_rope
        } else {
            &self.keys.rows()[first * d..]
        };
        let ids: Vec<faiss::Idx> = (first..self.keys.len())
            .map(|i| faiss::Idx::new(i as u64))
            .collect();
        self.faiss.add_with_ids(space, &ids)?;
        self.lists = inverted_lists(&self.faiss, self.spec.lists)?;
        Ok(())
    }
}

/// The ids of every inverted list, each ascending.
fn inverted_lists(faiss: &IVFFlatIndexImpl, lists: usize) -> Result<Vec<Vec<u32>>> {
    // SAFETY: each list is read into a buffer of the size faiss reports for it.
    unsafe {
        let ivf = faiss_sys::faiss_IndexIVF_cast(faiss.inner_ptr());
        if ivf.is_null() {
            return Err(IndexError::FaissOutput("an index that is not IVF".into()));
        }
        (0..lists)
            .map(|list| {
                let size = faiss_sys::faiss_IndexIVF_get_list_size(ivf, list);
                let mut ids: Vec<faiss_sys::idx_t> = vec![0; size];
                if size > 0 {
                    faiss_sys::faiss_IndexIVF_invlists_get_ids(ivf, list, ids.as_mut_ptr());
                }
                let mut ids = ids
                    .into_iter()
                    .map(|id| {
                        u32::try_from(id)
                            .map_err(|_| IndexError::FaissOutput(format!("token id {id}")))
                    })
                    .collect::<Result<Vec<u32>>>()?;
                ids.sort_unstable();
                Ok(ids)
            })
            .collect()
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
        let rotated = (!self.spec.norope || !whole).then(|| self.keys.rotate_query(query));
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
        let group: Vec<f32> = match &self.routing {
            Some(routing) => routing.scores(partition, d),
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
        let mut scored = self.spec.lists;
        let selection = match &rotated {
            Some(queries) if !whole => {
                scored += ids.len();
                let best = self.keys.top_of(queries, ids.into_iter(), params.k);
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
        self.keys.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let started = Instant::now();
        let adding = check_add(keys, self.head_dim(), self.len())?;
        if self.centroids.is_empty() {
            // Built over no keys: nothing was trained yet, so this add is the build.
            let context = BuildContext {
                rope: self.keys.rope().clone(),
                seed: self.stats.seed,
                saap: None,
                queries: None,
            };
            *self = Self::build(&self.requested, &context, keys)?;
            return Ok(());
        }
        let first = self.len();
        self.keys.add(keys)?;
        self.assign(keys, first)?;
        self.stats.record_add(adding, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        let ids: usize = self.lists.iter().map(Vec::capacity).sum();
        // faiss holds a second copy of every key (in the partition's space) and its id.
        let faiss = self.len() * (self.head_dim() * 4 + 8) + self.centroids.len() * 4;
        self.keys.memory_bytes() + self.centroids.capacity() * 4 + ids * 4 + faiss
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        encode(&Body {
            centroids: self.centroids.clone(),
            routing: self.routing.clone(),
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
            probes: self.spec.probes,
        })
    }
}
