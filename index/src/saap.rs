//! SAAP: asymmetric partitions. Keys are partitioned by k-means on their **de-roped**
//! (pre-RoPE) vectors, and queries are routed to partitions by a small trained classifier
//! instead of by their distance to the centroids: keys and queries live in different
//! geometries, so the partition a query needs is learned, not measured.
//!
//! Per retrieval layer and KV head, a [`SaapHead`] holds
//! - `C` centroids from k-means (k-means++ seeding, Lloyd iterations, squared L2) on the
//!   de-roped keys of the training text;
//! - a query classifier: `Linear(d, h) → ReLU → Linear(h, C)` (a batch norm folded into the
//!   first layer), trained by kvdb (`kvdb::train_head`, `kvdb saap train`) with candle to
//!   route each training query to the share of its attention mass each bucket receives.
//!   This crate only routes with it: two matrix-vector products in plain f32.
//!
//! One addition of ours, on by default (kvdb's `TrainOptions::prior`): the classifier's logits get
//! the k-means routing score `scale · q·c_b` added (a fixed input, not trained), so the MLP
//! learns a correction to centroid routing instead of routing from scratch. On the default
//! model over the GPL-3 (C = 128) it lowered the validation KL from 0.231 / 0.177 / 0.131 to
//! 0.201 / 0.130 / 0.082 in layers 5 / 11 / 17; with too little training text a pure
//! classifier cannot route to key content it never saw (a planted needle, say), and the
//! prior keeps the geometry in the score.
//!
//! At search time every query head of a GQA group routes its query to a distribution over
//! the buckets the corpus holds keys in, the group sums the heads' distributions, and the top
//! ℓ of the buckets that hold candidates are visited (a partition trained on other text
//! leaves many buckets empty in a given corpus: they cost no visit); every key in a visited
//! bucket (inside the candidates) is attended. A head's distribution is the classifier's
//! softmax output (renormalised over those buckets), mixed half and half
//! ([`GEOMETRY_SHARE`]) with a second addition of ours, the **geometric expert**: the softmax
//! of each bucket's mean attention logit over the corpus's keys in it,
//! `scale · q_rot · mean(k_rot)`, query and keys RoPE'd at their positions. The index keeps
//! every bucket's sum of rotated keys up to date as keys are added, so the expert costs `C`
//! inner products. Why: the classifier learns which buckets questions of its training text
//! wanted, and a distinctive key of a new corpus (a planted needle's digit, alone in a
//! bucket such lookups rarely reached in training) gets next to nothing from it, however well
//! it matches; the expert scores the corpus's own keys, so such a key brings its own score. On
//! the default model, with drilled artifacts of 256 buckets, `kvdb ask` copied a planted
//! needle's seven digits at ℓ = 10 for two artifact seeds of four by the classifier alone and
//! for all four with the expert mixed in, attending fewer keys; on the GPL-3 the mixture held
//! about the classifier's attention mass (0.628 / 0.459 / 0.190 against 0.629 / 0.456 / 0.196
//! in layers 5 / 11 / 17) at 4.1 / 3.9 / 3.0% of the keys against 4.8 / 4.3 / 4.1%
//! (docs/benchmarks.md, "The geometric expert"). A head trained without the prior routes by
//! its classifier alone. The batch norm is folded into the first layer after training, so
//! inference is two matrix-vector products in plain f32 plus the expert's `C`.
//!
//! A [`SaapArtifact`] (one per model, written by `kvdb saap train`) holds the heads of every
//! retrieval layer; a [`SaapIndex`] assigns a corpus's keys to its head's centroids and keeps a
//! copy of the head in its saved bytes, so a corpus does not depend on the artifact file.

use std::path::Path;
use std::time::Instant;

use kvdb_model::Rope;
use serde::{Deserialize, Serialize};

use crate::common::{
    buckets_of, check_add, check_query, decode, eligible, encode, rotated_keys, rotated_queries,
    top_indices,
};
use crate::key_index::{OneShot, StatelessSearch};
use crate::kmeans::nearest;
use crate::{
    BucketIndex, BucketScores, BuildContext, BuildStats, Found, GpuRouting, GroupQuery, IndexError,
    IndexSpec, KeyIndex, Result, SaapSpec, SearchParams, Searcher, Selection, UnvisitedBucket,
};
use kvdb_simd::dot;

/// Version of the artifact file format.
/// 2: heads carry the weight of the geometric prior.
const ARTIFACT_VERSION: u32 = 2;

/// The geometric expert's share of a query head's routing distribution (see the module
/// documentation); the classifier has the rest.
pub const GEOMETRY_SHARE: f32 = 0.5;

/// The geometric expert's share for `head`: none for a head trained without the prior.
fn geometry_share(head: &SaapHead) -> f32 {
    if head.prior == 0.0 {
        return 0.0;
    }
    GEOMETRY_SHARE
}

/// One layer/KV head's trained partition and query classifier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaapHead {
    /// Vector length.
    pub head_dim: usize,
    /// k-means centroids of de-roped keys `[C, d]`.
    pub centroids: Vec<f32>,
    /// First layer with the batch norm folded in, `[h, d]` and `[h]` (h hidden units).
    pub w1: Vec<f32>,
    /// Its bias.
    pub b1: Vec<f32>,
    /// Second layer `[C, h]` and `[C]`.
    pub w2: Vec<f32>,
    /// Its bias.
    pub b2: Vec<f32>,
    /// Weight of the geometric prior added to the classifier's logits: bucket `b` gets
    /// `prior · q·c_b` on top of the MLP's output (0 turns it off).
    pub prior: f32,
}

impl SaapHead {
    /// Number of buckets.
    pub fn buckets(&self) -> usize {
        self.centroids.len() / self.head_dim.max(1)
    }

    /// Checks the shapes agree (an artifact read from disk may not).
    fn check(&self) -> Result<()> {
        let (d, c, h) = (self.head_dim, self.buckets(), self.b1.len());
        let ok = d > 0
            && c > 0
            && self.centroids.len() == c * d
            && self.w1.len() == h * d
            && self.w2.len() == c * h
            && self.b2.len() == c;
        if ok {
            Ok(())
        } else {
            Err(IndexError::Corrupt(
                "saap head of inconsistent shape".into(),
            ))
        }
    }

    /// The classifier's softmax output for one de-roped query.
    pub fn route(&self, query: &[f32]) -> Vec<f32> {
        softmax(&self.logits(query))
    }

    /// The classifier's logits (prior included) for one de-roped query.
    fn logits(&self, query: &[f32]) -> Vec<f32> {
        let d = self.head_dim;
        let hidden: Vec<f32> = self
            .w1
            .chunks_exact(d)
            .zip(&self.b1)
            .map(|(w, b)| (dot(w, query) + b).max(0.0))
            .collect();
        self.w2
            .chunks_exact(hidden.len())
            .zip(&self.b2)
            .zip(self.centroids.chunks_exact(d))
            .map(|((w, b), c)| dot(w, &hidden) + b + self.prior * dot(query, c))
            .collect()
    }

    /// The bucket of each de-roped key: its nearest centroid (squared L2, as k-means).
    pub fn assign(&self, keys: &[f32]) -> Result<Vec<u32>> {
        nearest(&self.centroids, keys, self.head_dim)
    }
}

/// Softmax of `logits`; all zeros when every logit is −∞ (nothing to route to).
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return vec![0.0; logits.len()];
    }
    let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

/// One epoch's losses (mean KL per sample, in nats).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Epoch {
    /// The epoch, from 1.
    pub epoch: usize,
    /// On the training samples.
    pub train: f64,
    /// On the held-out samples (a tenth).
    pub validation: f64,
}

/// The trained SAAP heads of every retrieval layer of one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaapArtifact {
    /// File format version.
    pub version: u32,
    /// sha256 of the model file the heads were trained on.
    pub model_sha256: String,
    /// Buckets per head.
    pub centroids: usize,
    /// Seed of the training.
    pub seed: u64,
    /// Tokens of training text.
    pub tokens: usize,
    /// `(layer, heads by KV head)`.
    pub layers: Vec<(usize, Vec<SaapHead>)>,
    /// The loss curve of every head: `(layer, KV head, epochs)`.
    pub losses: Vec<(usize, usize, Vec<Epoch>)>,
}

impl SaapArtifact {
    /// An empty artifact for `model_sha256`.
    pub fn new(model_sha256: &str, centroids: usize, seed: u64, tokens: usize) -> Self {
        Self {
            version: ARTIFACT_VERSION,
            model_sha256: model_sha256.to_string(),
            centroids,
            seed,
            tokens,
            layers: Vec::new(),
            losses: Vec::new(),
        }
    }

    /// The head of `layer` and `kv_head`.
    pub fn head(&self, layer: usize, kv_head: usize) -> Option<&SaapHead> {
        self.layers
            .iter()
            .find(|(l, _)| *l == layer)
            .and_then(|(_, heads)| heads.get(kv_head))
    }

    /// Its bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        encode(self)
    }

    /// Reads an artifact from bytes, checking its version and shapes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let artifact: Self = decode(bytes)?;
        if artifact.version != ARTIFACT_VERSION {
            return Err(IndexError::Corrupt(format!(
                "saap artifact version {} (this build reads {ARTIFACT_VERSION})",
                artifact.version
            )));
        }
        for (_, heads) in &artifact.layers {
            for head in heads {
                head.check()?;
            }
        }
        Ok(artifact)
    }

    /// Writes it to `path` (through a temporary file, so a crash leaves no half file).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let bytes = self.to_bytes().map_err(std::io::Error::other)?;
        let tmp = path.with_extension("saap.tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(tmp, path)
    }

    /// Reads it from `path`.
    pub fn read(path: &Path) -> std::io::Result<Self> {
        Self::from_bytes(&std::fs::read(path)?).map_err(std::io::Error::other)
    }
}

/// A corpus's keys in the buckets of a trained [`SaapHead`]; see the module documentation.
#[derive(Debug)]
pub struct SaapIndex {
    spec: SaapSpec,
    head: SaapHead,
    /// Bucket of every key, by id.
    assigned: Vec<u32>,
    /// Ids of each bucket, ascending.
    buckets: Vec<Vec<u32>>,
    /// The layer's RoPE: the geometric expert scores rotated keys.
    rope: Rope,
    /// Sum of each bucket's rotated keys `[C, d]`, in f64 so that many adds do not drift.
    rotated_sums: Vec<f64>,
    /// Each bucket's mean rotated key `[C, d]` (zero for an empty bucket): derivable from
    /// `rotated_sums` and the bucket sizes, kept in f32 so that each search scores the means
    /// with the f32 kernel instead of dividing C f64 sums per query head.
    mean_keys: Vec<f32>,
    stats: BuildStats,
}

impl SaapIndex {
    /// Assigns pre-RoPE `keys` (ids `0..`) to the buckets of the context's trained head.
    pub fn build(spec: &SaapSpec, context: &BuildContext<'_>, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        let head = context.saap.ok_or_else(|| IndexError::Build {
            spec: IndexSpec::Saap(*spec).to_string(),
            reason: "saap needs a trained artifact for this model (`kvdb saap train`)".into(),
        })?;
        let mut index = Self::with_head(spec, head.clone(), context)?;
        index.add(keys)?;
        index.stats = BuildStats::finished(index.len(), context.seed, started, Vec::new());
        Ok(index)
    }

    fn with_head(spec: &SaapSpec, head: SaapHead, context: &BuildContext<'_>) -> Result<Self> {
        IndexSpec::Saap(*spec).validate()?;
        head.check()?;
        let error = |reason: String| IndexError::Build {
            spec: IndexSpec::Saap(*spec).to_string(),
            reason,
        };
        if head.head_dim != context.rope.head_dim() {
            return Err(error(format!(
                "the artifact's heads have dimension {}, the layer {}",
                head.head_dim,
                context.rope.head_dim()
            )));
        }
        if head.buckets() != spec.centroids {
            return Err(error(format!(
                "the artifact was trained with {} buckets",
                head.buckets()
            )));
        }
        let (c, d) = (head.buckets(), head.head_dim);
        Ok(Self {
            spec: *spec,
            buckets: vec![Vec::new(); c],
            head,
            assigned: Vec::new(),
            rope: context.rope.clone(),
            rotated_sums: vec![0.0; c * d],
            mean_keys: vec![0.0; c * d],
            stats: BuildStats::default(),
        })
    }

    /// One query head's routing distribution over the buckets the corpus holds keys in
    /// (`rotated`: the query RoPE'd at its position): the classifier's output mixed with the
    /// geometric expert's (see the module documentation), and `q_rot · m_b` per bucket
    /// (0 for an empty one), which the unretrieved-mass estimate reuses.
    fn route(&self, query: &[f32], rotated: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mean_scores: Vec<f32> = self
            .mean_keys
            .chunks_exact(self.head_dim())
            .map(|mean| dot(rotated, mean))
            .collect();
        let held = |b: usize| !self.buckets[b].is_empty();
        let masked = |logits: Vec<f32>| -> Vec<f32> {
            let logits = logits
                .into_iter()
                .enumerate()
                .map(|(b, l)| if held(b) { l } else { f32::NEG_INFINITY })
                .collect::<Vec<_>>();
            softmax(&logits)
        };
        let classifier = masked(self.head.logits(query));
        let share = geometry_share(&self.head);
        let routed = if share == 0.0 {
            classifier
        } else {
            let geometric = masked(mean_scores.iter().map(|s| self.head.prior * s).collect());
            classifier
                .iter()
                .zip(&geometric)
                .map(|(c, g)| (1.0 - share) * c + share * g)
                .collect()
        };
        (routed, mean_scores)
    }

    /// Reopens a saved index of `len` keys: its head from `body`, and its buckets and their
    /// rotated key sums too where the save holds them; else `keys` (pre-RoPE, ids `0..len`)
    /// are assigned again ([`Self::reads_saved_keys`]), and may be empty otherwise.
    pub fn load(
        spec: &SaapSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        len: usize,
        keys: &[f32],
    ) -> Result<Self> {
        let mut index = match decode::<SavedBuckets>(body) {
            Ok(saved) => {
                let mut index = Self::with_head(spec, saved.head, context)?;
                index.take_buckets(saved.assigned, saved.rotated_sums, len)?;
                index
            }
            Err(_) => {
                // Saved before the buckets were kept: the head alone.
                let head: SaapHead = decode(body)?;
                let mut index = Self::with_head(spec, head, context)?;
                if keys.len() != len * index.head_dim() {
                    return Err(IndexError::Corrupt(format!(
                        "the index covers {len} keys, {} were given",
                        keys.len() / index.head_dim()
                    )));
                }
                index.add(keys)?;
                index
            }
        };
        index.stats = stats;
        Ok(index)
    }

    /// Whether loading the saved `body` reads the keys: only a save from before the
    /// buckets were kept does.
    pub(crate) fn reads_saved_keys(body: &[u8]) -> bool {
        decode::<SavedBuckets>(body).is_err()
    }

    /// Fills the (empty) buckets from each key's saved bucket and the buckets' rotated key
    /// sums, checked against the head's shape, and derives their mean keys.
    fn take_buckets(&mut self, assigned: Vec<u32>, sums: Vec<f64>, len: usize) -> Result<()> {
        let (c, d) = (self.spec.centroids, self.head_dim());
        if assigned.len() != len || sums.len() != c * d {
            return Err(IndexError::Corrupt(format!(
                "{} saved buckets for {len} keys and {} key sums for {c} buckets of {d}",
                assigned.len(),
                sums.len()
            )));
        }
        self.buckets = buckets_of(&assigned, c, "bucket")?;
        self.rotated_sums = sums;
        for b in 0..c {
            self.update_mean(b);
        }
        self.assigned = assigned;
        Ok(())
    }

    /// Bucket `b`'s mean rotated key from its sum and size.
    fn update_mean(&mut self, b: usize) {
        let d = self.head_dim();
        let n = self.buckets[b].len() as f64;
        let sum = &self.rotated_sums[b * d..(b + 1) * d];
        let mean = &mut self.mean_keys[b * d..(b + 1) * d];
        match n > 0.0 {
            true => mean
                .iter_mut()
                .zip(sum)
                .for_each(|(m, &s)| *m = (s / n) as f32),
            false => mean.fill(0.0),
        }
    }
}

/// What [`SaapIndex`] saves: its head, each key's bucket and the buckets' rotated key sums
/// (so that it loads without the keys).
#[derive(Serialize, Deserialize)]
struct SavedBuckets {
    head: SaapHead,
    assigned: Vec<u32>,
    rotated_sums: Vec<f64>,
}

impl StatelessSearch for SaapIndex {
    fn search_once(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        let d = self.head_dim();
        check_query(query, d)?;
        let eligible = eligible(&params.candidates, self.len());
        if eligible.is_empty() {
            return Ok(Found::default());
        }
        let c = self.spec.centroids;
        // The group's heads sum their routing distributions.
        let rotated = rotated_queries(&self.rope, query);
        let mut summed = vec![0f32; c];
        let mut mean_scores = Vec::new();
        for (q, rotated) in query.queries.chunks_exact(d).zip(rotated.chunks_exact(d)) {
            let (routed, scores) = self.route(q, rotated);
            summed.iter_mut().zip(routed).for_each(|(s, p)| *s += p);
            mean_scores.push(scores);
        }
        // A bucket holding none of the eligible keys (k-means trained on other text leaves
        // many empty in a given corpus) would spend one of the ℓ visits on nothing.
        let visited: Vec<u32> = top_indices(&summed, c)
            .into_iter()
            .filter(|&b| {
                // Ids are ascending: the first at or past the range's start decides.
                let ids = &self.buckets[b as usize];
                ids.get(ids.partition_point(|&id| id < eligible.start))
                    .is_some_and(|id| eligible.contains(id))
            })
            .take(params.breadth_or(self.spec.probes))
            .collect();
        let ids: Vec<u32> = visited
            .iter()
            .flat_map(|&b| &self.buckets[b as usize])
            .copied()
            .filter(|id| eligible.contains(id))
            .collect();
        let unvisited = if params.estimate {
            let mut seen = vec![false; c];
            visited.iter().for_each(|&b| seen[b as usize] = true);
            (0..c)
                .filter(|&b| !seen[b] && !self.buckets[b].is_empty())
                .map(|b| UnvisitedBucket {
                    bucket: b as u32,
                    size: self.buckets[b].len() as u32,
                    logits: mean_scores.iter().map(|scores| scores[b]).collect(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(Found {
            selection: Selection::new(ids),
            // The classifier's C outputs play the part of C centroid scores.
            scored: c,
            unvisited,
        })
    }
}

impl KeyIndex for SaapIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Saap(self.spec)
    }

    fn head_dim(&self) -> usize {
        self.head.head_dim
    }

    fn len(&self) -> usize {
        self.assigned.len()
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let started = Instant::now();
        let adding = check_add(keys, self.head_dim(), self.len())?;
        let first = self.len();
        let d = self.head_dim();
        let assigned = self.head.assign(keys)?;
        let rotated = rotated_keys(&self.rope, keys, first);
        for ((i, &b), key) in assigned.iter().enumerate().zip(rotated.chunks_exact(d)) {
            let b = b as usize;
            self.buckets[b].push((first + i) as u32);
            let sum = &mut self.rotated_sums[b * d..(b + 1) * d];
            sum.iter_mut().zip(key).for_each(|(s, &k)| *s += k as f64);
        }
        let mut touched = assigned.clone();
        touched.sort_unstable();
        touched.dedup();
        for b in touched.into_iter().map(|b| b as usize) {
            self.update_mean(b);
        }
        self.assigned.extend(assigned);
        self.stats.record_add(adding, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        let head = self.head.centroids.capacity()
            + self.head.w1.capacity()
            + self.head.b1.capacity()
            + self.head.w2.capacity()
            + self.head.b2.capacity();
        let ids: usize = self.buckets.iter().map(Vec::capacity).sum();
        (head + ids + self.assigned.capacity() + self.mean_keys.capacity()) * 4
            + self.rotated_sums.capacity() * 8
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        encode(&SavedBuckets {
            head: self.head.clone(),
            assigned: self.assigned.clone(),
            rotated_sums: self.rotated_sums.clone(),
        })
    }

    fn as_buckets(&self) -> Option<&dyn BucketIndex> {
        Some(self)
    }
}

impl BucketIndex for SaapIndex {
    fn buckets(&self) -> usize {
        self.spec.centroids
    }

    fn assignments(&self) -> Vec<u32> {
        self.assigned.clone()
    }

    fn gpu_routing(&self) -> Option<GpuRouting<'_>> {
        Some(GpuRouting {
            scores: BucketScores::Classifier {
                head: &self.head,
                mean_keys: &self.mean_keys,
                share: geometry_share(&self.head),
            },
            lists: &self.buckets,
            always: &[],
            probes: self.spec.probes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvdb_model::{RopeConfig, RopeScaling, RopeStyle};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::HashSet;

    const D: usize = 8;
    const HIDDEN_TEST: usize = 16;
    const SCALE: f32 = 0.35;

    fn rope() -> Rope {
        let config = RopeConfig {
            base: 10_000.0,
            style: RopeStyle::Halves,
            scaling: RopeScaling::None,
        };
        Rope::new(&config, D, None)
    }

    fn uniform(rng: &mut StdRng, n: usize, bound: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-bound..bound)).collect()
    }

    /// A head of `c` random centroids with a random (untrained) classifier.
    fn random_head(rng: &mut StdRng, c: usize) -> SaapHead {
        SaapHead {
            head_dim: D,
            centroids: uniform(rng, c * D, 1.0),
            w1: uniform(rng, HIDDEN_TEST * D, 0.5),
            b1: uniform(rng, HIDDEN_TEST, 0.1),
            w2: uniform(rng, c * HIDDEN_TEST, 0.5),
            b2: uniform(rng, c, 0.5),
            prior: SCALE,
        }
    }

    fn built(head: &SaapHead, keys: &[f32], built_over: usize) -> Result<SaapIndex> {
        let context = BuildContext {
            rope: rope(),
            seed: 0,
            saap: Some(head),
            queries: None,
        };
        let spec = SaapSpec {
            centroids: head.buckets(),
            probes: 2,
        };
        let mut index = SaapIndex::build(&spec, &context, &keys[..built_over * D])?;
        index.add(&keys[built_over * D..])?;
        Ok(index)
    }

    /// Buckets of [`random_index`]'s head.
    const BUCKETS: usize = 8;

    /// A random head of [`BUCKETS`] buckets and `n` random keys, the index built over the
    /// first `built_over` and added the rest; the generator goes on for the test's queries.
    fn random_index(
        seed: u64,
        n: usize,
        built_over: usize,
    ) -> Result<(StdRng, SaapHead, Vec<f32>, SaapIndex)> {
        let mut rng = StdRng::seed_from_u64(seed);
        let head = random_head(&mut rng, BUCKETS);
        let keys = uniform(&mut rng, n * D, 1.0);
        let index = built(&head, &keys, built_over)?;
        Ok((rng, head, keys, index))
    }

    /// Softmax in f64 over the buckets `held` marks; 0 elsewhere.
    fn masked_softmax(logits: &[f64], held: &[bool]) -> Vec<f64> {
        let max = logits
            .iter()
            .zip(held)
            .filter(|(_, &h)| h)
            .map(|(l, _)| *l)
            .fold(f64::NEG_INFINITY, f64::max);
        let exp: Vec<f64> = logits
            .iter()
            .zip(held)
            .map(|(l, &h)| if h { (l - max).exp() } else { 0.0 })
            .collect();
        let sum: f64 = exp.iter().sum();
        exp.iter().map(|e| e / sum).collect()
    }

    fn dot64(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    /// The group's routing score per bucket, recomputed in f64 from the definition: per
    /// query head, the classifier's softmax (MLP + centroid prior) mixed, by
    /// [`GEOMETRY_SHARE`], with the softmax of `scale · q_rot · mean(k_rot)` over the
    /// bucket's keys, both over the buckets that hold keys; summed over the heads.
    fn reference_routing(
        head: &SaapHead,
        keys: &[f32],
        queries: &[f32],
        position: usize,
    ) -> Vec<f64> {
        let (c, rope) = (head.buckets(), rope());
        let assigned = head.assign(keys).expect("keys of whole rows");
        let mut sums = vec![vec![0f64; D]; c];
        let mut counts = vec![0usize; c];
        for (j, key) in keys.chunks_exact(D).enumerate() {
            let mut k = key.to_vec();
            rope.rotate(&mut k, j);
            let b = assigned[j] as usize;
            sums[b]
                .iter_mut()
                .zip(&k)
                .for_each(|(s, x)| *s += *x as f64);
            counts[b] += 1;
        }
        let held: Vec<bool> = counts.iter().map(|&n| n > 0).collect();
        let mut routed = vec![0f64; c];
        for q in queries.chunks_exact(D) {
            let hidden: Vec<f64> = head
                .w1
                .chunks_exact(D)
                .zip(&head.b1)
                .map(|(w, b)| (dot64(w, q) + *b as f64).max(0.0))
                .collect();
            let classifier: Vec<f64> = (0..c)
                .map(|b| {
                    let w = &head.w2[b * HIDDEN_TEST..(b + 1) * HIDDEN_TEST];
                    let mlp: f64 = w.iter().zip(&hidden).map(|(w, h)| *w as f64 * h).sum();
                    let centroid = &head.centroids[b * D..(b + 1) * D];
                    mlp + head.b2[b] as f64 + SCALE as f64 * dot64(q, centroid)
                })
                .collect();
            let mut q_rot = q.to_vec();
            rope.rotate(&mut q_rot, position);
            let geometric: Vec<f64> = (0..c)
                .map(|b| {
                    let n = counts[b].max(1) as f64;
                    let mean: f64 = sums[b]
                        .iter()
                        .zip(&q_rot)
                        .map(|(s, x)| s / n * *x as f64)
                        .sum();
                    SCALE as f64 * mean
                })
                .collect();
            let (p, g) = (
                masked_softmax(&classifier, &held),
                masked_softmax(&geometric, &held),
            );
            for b in 0..c {
                let share = GEOMETRY_SHARE as f64;
                routed[b] += (1.0 - share) * p[b] + share * g[b];
            }
        }
        routed
    }

    /// The buckets a search visited: those of the keys it selected.
    fn visited(
        index: &SaapIndex,
        keys: &[f32],
        queries: &[f32],
        position: usize,
    ) -> Result<HashSet<u32>> {
        let assigned = index.head.assign(keys)?;
        let found = index.search_once(
            &GroupQuery { queries, position },
            &SearchParams::top(0, 0..index.len() as u32),
        )?;
        Ok(found
            .selection
            .ids()
            .iter()
            .map(|&id| assigned[id as usize])
            .collect())
    }

    /// Searches visit the ℓ buckets with the highest group routing score, computed from its
    /// definition in f64, on an index built over part of the keys and added the rest (the
    /// buckets' mean rotated keys kept up to date).
    #[test]
    fn searches_visit_the_top_buckets_of_the_mixed_routing() -> Result<()> {
        let (c, n, group) = (BUCKETS, 600, 2);
        let (mut rng, head, keys, index) = random_index(3, n, n / 3)?;
        let mut compared = 0;
        for _ in 0..40 {
            let queries: Vec<f32> = uniform(&mut rng, group * D, 4.0);
            let reference = reference_routing(&head, &keys, &queries, n);
            let mut ranked: Vec<usize> = (0..c).collect();
            ranked.sort_by(|&a, &b| reference[b].total_cmp(&reference[a]));
            if reference[ranked[1]] - reference[ranked[2]] < 1e-4 {
                continue; // a near tie at the cut, which f32 rounding may break either way
            }
            let expected: HashSet<u32> = ranked[..2].iter().map(|&b| b as u32).collect();
            assert_eq!(
                visited(&index, &keys, &queries, n)?,
                expected,
                "{reference:?}"
            );
            compared += 1;
        }
        assert!(compared > 30, "only {compared} queries without a near tie");
        Ok(())
    }

    /// The estimate's inputs for an unvisited bucket: its size and, per query head, the
    /// rotated query's inner product with the mean of the bucket's rotated keys, recomputed
    /// in f64 from the keys.
    #[test]
    fn unvisited_buckets_carry_their_mean_rotated_key_logit() -> Result<()> {
        let (c, n, group) = (BUCKETS, 300, 2);
        let (mut rng, head, keys, index) = random_index(5, n, n / 2)?;
        let queries = uniform(&mut rng, group * D, 2.0);
        let found = index.search_once(
            &GroupQuery {
                queries: &queries,
                position: n,
            },
            &SearchParams {
                estimate: true,
                ..SearchParams::top(0, 0..n as u32)
            },
        )?;
        let rope = rope();
        let assigned = head.assign(&keys)?;
        assert_eq!(found.unvisited.len(), c - 2, "every bucket holds keys here");
        for bucket in &found.unvisited {
            let members: Vec<usize> = (0..n).filter(|&j| assigned[j] == bucket.bucket).collect();
            assert_eq!(bucket.size as usize, members.len());
            let mut mean = [0f64; D];
            for &j in &members {
                let mut k = keys[j * D..(j + 1) * D].to_vec();
                rope.rotate(&mut k, j);
                mean.iter_mut()
                    .zip(&k)
                    .for_each(|(m, x)| *m += *x as f64 / members.len() as f64);
            }
            for (q, &logit) in queries.chunks_exact(D).zip(&bucket.logits) {
                let mut q_rot = q.to_vec();
                rope.rotate(&mut q_rot, n);
                let expected: f64 = mean.iter().zip(&q_rot).map(|(m, x)| m * *x as f64).sum();
                assert!(
                    (logit as f64 - expected).abs() < 1e-4,
                    "bucket {}: {logit} against {expected}",
                    bucket.bucket
                );
            }
        }
        Ok(())
    }

    /// A key that the classifier never routes to (its bucket's bias far below the others)
    /// is still visited when it alone matches the query: the geometric expert scores the
    /// corpus's own keys. A head trained without the prior routes by its classifier alone.
    #[test]
    fn the_geometric_expert_finds_what_the_classifier_buries() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(4);
        let (c, n) = (8, 400);
        let mut head = random_head(&mut rng, c);
        head.w2.iter_mut().for_each(|w| *w = 0.0);
        head.b2.iter_mut().for_each(|b| *b = 0.0);
        let mut keys = uniform(&mut rng, n * D, 0.2);
        // The needle: one key, at the centroid of bucket 5 pushed further out, alone there.
        let needle = 123;
        for (i, x) in head.centroids[5 * D..6 * D].iter_mut().enumerate() {
            *x = if i % 2 == 0 { 6.0 } else { -6.0 };
        }
        keys[needle * D..(needle + 1) * D].copy_from_slice(&head.centroids[5 * D..6 * D]);
        head.b2[5] = -1000.0;
        let index = built(&head, &keys, n)?;
        assert_eq!(
            index.buckets[5],
            vec![needle as u32],
            "the needle is alone in bucket 5"
        );
        // A query that scores the needle highest: the needle itself, asked at its position
        // (only the difference of positions enters the rotated scores).
        let query = keys[needle * D..(needle + 1) * D].to_vec();
        let spec = SaapSpec {
            centroids: c,
            probes: 1,
        };
        let one = |head: &SaapHead| -> Result<HashSet<u32>> {
            let mut index = built(head, &keys, n)?;
            index.spec = spec;
            visited(&index, &keys, &query, needle)
        };
        assert_eq!(one(&head)?, [5].into());
        head.prior = 0.0;
        assert_ne!(one(&head)?, [5].into());
        Ok(())
    }

    /// A save from before the buckets were kept (the head alone) loads by assigning the keys
    /// again; saved buckets that do not fit the head or the key count are refused.
    #[test]
    fn old_saves_load_and_corrupt_buckets_are_refused() -> Result<()> {
        let (_, head, keys, index) = random_index(5, 300, 120)?;
        let context = BuildContext {
            rope: rope(),
            seed: 0,
            saap: None,
            queries: None,
        };
        let (spec, stats) = (index.spec, BuildStats::default());
        let old = SaapIndex::load(&spec, &context, stats.clone(), &encode(&head)?, 300, &keys)?;
        assert_eq!(old.assigned, index.assigned);
        assert_eq!(old.mean_keys, index.mean_keys);
        // The head alone, and no keys given: refused, not an empty index.
        assert!(
            SaapIndex::load(&spec, &context, stats.clone(), &encode(&head)?, 300, &[]).is_err()
        );
        let corrupt = |assigned: Vec<u32>, rotated_sums: Vec<f64>| {
            let body = encode(&SavedBuckets {
                head: head.clone(),
                assigned,
                rotated_sums,
            })?;
            SaapIndex::load(&spec, &context, stats.clone(), &body, 300, &[])
        };
        let sums = index.rotated_sums.clone();
        let mut outside = index.assigned.clone();
        outside[7] = BUCKETS as u32;
        for bad in [
            corrupt(index.assigned[..299].to_vec(), sums.clone()),
            corrupt(outside, sums.clone()),
            corrupt(index.assigned.clone(), sums[1..].to_vec()),
        ] {
            assert!(matches!(bad, Err(IndexError::Corrupt(_))), "{bad:?}");
        }
        let fine = corrupt(index.assigned.clone(), sums)?;
        assert_eq!(
            (fine.assigned, fine.mean_keys),
            (index.assigned, index.mean_keys)
        );
        Ok(())
    }
}
