//! [`LshIndex`]: MagicPIG-style sign-random-projection hashing, candidates re-scored exactly.
//!
//! Each of `L` tables hashes a vector to a `K`-bit code, bit `b` being the sign of its inner
//! product with a random Gaussian hyperplane. Two vectors at angle `θ` agree on a bit with
//! probability `1 − θ/π`, so on a whole table with `(1 − θ/π)^K`: keys that collide with a
//! query in many tables are likely at a small angle to it. Keys colliding in at least
//! `min_collisions` tables are the candidates; they are scored exactly and the top `k` kept.

use std::collections::HashMap;
use std::time::Instant;

use kvdb_model::Rope;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;

use crate::common::{check_add, check_query, decode, eligible, encode};
use crate::key_index::{OneShot, StatelessSearch};
use crate::{
    BuildContext, BuildStats, FlatIndex, Found, GroupQuery, IndexError, IndexSpec, KeyIndex,
    LshSpec, Result, SearchParams, Searcher,
};
use kvdb_simd::dot;

/// Version of the body `save` writes.
const BODY_VERSION: u32 = 1;
/// Keys hashed per rayon task.
const HASH_CHUNK_ROWS: usize = 256;
/// Bytes a `HashMap<u32, Vec<u32>>` entry takes besides the ids: the key, the Vec header and
/// the control byte of hashbrown's table.
const BUCKET_ENTRY_BYTES: usize = 4 + 24 + 1;

/// What `save` writes.
#[derive(serde::Serialize, serde::Deserialize)]
struct Body {
    version: u32,
    /// Tables and bits per table, checked against the spec at load.
    tables: u32,
    bits: u32,
    /// The seed the hyperplanes were drawn from.
    seed: u64,
    /// A hash of the hyperplanes' bits, so that a load whose RNG draws other hyperplanes
    /// from the same seed (another `rand` version) notices instead of mixing two hashings.
    planes: u64,
    /// Every key's codes, key-major: `[len, tables]`.
    codes: Vec<u32>,
}

/// Sign-random-projection LSH over rotated keys (MagicPIG's hashing), with exact re-scoring.
///
/// - **Hashing.** `L · K` hyperplanes are drawn from a standard Gaussian seeded with the
///   spec's seed (recorded in [`BuildStats::seed`]); keys are hashed rotated at their
///   positions, queries rotated at theirs. Table `t` of a vector is the `K`-bit code whose
///   bit `b` is `h_{t,b} · x > 0`.
/// - **Buckets.** Per table a map from code to the ids of its keys, ascending (ids are added
///   in order). Adding keys only appends to buckets, so an index grown by `add` is the same
///   as one built over all its keys at once.
/// - **Collision rule: per head.** A key is a candidate when it collides with *one* query
///   head in at least `min_collisions` tables; the group's candidates are the union over
///   heads. The group's score is the maximum over its heads, so a key matters when it is
///   close to some head, and the number of tables one head shares with it is what estimates
///   that angle. Counting collisions with different heads together would admit keys halfway
///   between heads, close to none of them.
/// - **Cost.** [`Found::scored`] is the candidates re-scored plus `L · K` hyperplane products
///   per query head (each counted as a vector scored).
/// - **Save.** The body holds every key's codes, the seed and a fingerprint of the
///   hyperplanes; load regenerates the hyperplanes from the seed and refills the buckets from
///   the codes, without hashing a key again. Should the regenerated hyperplanes differ (the
///   fingerprint), load rehashes the keys and warns instead.
pub struct LshIndex {
    spec: LshSpec,
    /// The keys rotated at their ids, for hashing and exact re-scoring.
    keys: FlatIndex,
    /// Hyperplanes `[tables · bits, head_dim]`, table-major.
    planes: Vec<f32>,
    /// Per table, code → ids (ascending).
    buckets: Vec<HashMap<u32, Vec<u32>>>,
    stats: BuildStats,
}

impl std::fmt::Debug for LshIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LshIndex")
            .field("spec", &IndexSpec::Lsh(self.spec).to_string())
            .field("head_dim", &self.head_dim())
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// The `tables · bits` hyperplanes of `head_dim` drawn from `seed`.
fn draw_planes(seed: u64, planes: usize, head_dim: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..planes * head_dim)
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect()
}

/// FNV-1a over the bits of `values`.
fn fingerprint(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

impl LshIndex {
    /// Builds the index over pre-RoPE `keys` `[n, head_dim]` (ids `0..n`).
    pub fn build(spec: &LshSpec, context: &BuildContext<'_>, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        let mut index = Self::empty(spec, context.rope.clone())?;
        index.append(keys)?;
        index.stats = BuildStats::finished(index.len(), spec.seed, started, Vec::new());
        Ok(index)
    }

    /// Reopens a saved index over the pre-RoPE `keys` it covered, from the saved codes.
    pub fn load(
        spec: &LshSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        keys: &[f32],
    ) -> Result<Self> {
        let body: Body = decode(body)?;
        let mut index = Self::empty(spec, context.rope.clone())?;
        index.stats = stats;
        let (tables, bits) = (spec.tables, spec.bits);
        if body.version != BODY_VERSION {
            return Err(IndexError::Corrupt(format!(
                "lsh body version {} (this build reads {BODY_VERSION})",
                body.version
            )));
        }
        if (body.tables as usize, body.bits as usize, body.seed) != (tables, bits, spec.seed) {
            return Err(IndexError::Corrupt(format!(
                "lsh body of L={} K={} seed={} under spec {}",
                body.tables,
                body.bits,
                body.seed,
                IndexSpec::Lsh(*spec)
            )));
        }
        let n = check_add(keys, index.head_dim(), 0)?;
        if body.planes != fingerprint(&index.planes) {
            index.stats.warnings.push(format!(
                "the hyperplanes drawn from seed {} differ from the saved ones (another RNG \
                 version?): the {n} keys were hashed again",
                spec.seed
            ));
            index.append(keys)?;
            return Ok(index);
        }
        if body.codes.len() != n.saturating_mul(tables) {
            return Err(IndexError::Corrupt(format!(
                "{} lsh codes for {n} keys in {tables} tables",
                body.codes.len()
            )));
        }
        if bits < 32 && body.codes.iter().any(|&c| c >> bits != 0) {
            return Err(IndexError::Corrupt(format!(
                "an lsh code wider than {bits} bits"
            )));
        }
        index.keys.add(keys)?;
        index.fill(&body.codes, 0);
        Ok(index)
    }

    /// An index with no keys.
    fn empty(spec: &LshSpec, rope: Rope) -> Result<Self> {
        // The spec's bounds also bound the hyperplanes drawn and the codes kept per key.
        IndexSpec::Lsh(*spec).validate()?;
        let planes = draw_planes(spec.seed, spec.tables * spec.bits, rope.head_dim());
        Ok(Self {
            spec: *spec,
            keys: FlatIndex::new(rope),
            planes,
            buckets: vec![HashMap::new(); spec.tables],
            stats: BuildStats::default(),
        })
    }

    /// The codes of rotated vector `x` in every table, into `codes` (`tables` long).
    fn hash_into(&self, x: &[f32], codes: &mut [u32]) {
        let (d, bits) = (self.head_dim(), self.spec.bits);
        for (code, table) in codes.iter_mut().zip(self.planes.chunks_exact(bits * d)) {
            *code = table
                .chunks_exact(d)
                .enumerate()
                .fold(0u32, |c, (b, plane)| {
                    c | (((dot(plane, x) > 0.0) as u32) << b)
                });
        }
    }

    /// The codes of rotated `keys`, key-major `[rows, tables]`, hashed in parallel.
    fn hash_rows(&self, keys: &[f32]) -> Vec<u32> {
        let (d, tables) = (self.head_dim(), self.spec.tables);
        let mut codes = vec![0u32; keys.len() / d * tables];
        codes
            .par_chunks_mut(HASH_CHUNK_ROWS * tables)
            .zip(keys.par_chunks(HASH_CHUNK_ROWS * d))
            .for_each(|(codes, keys)| {
                for (codes, key) in codes.chunks_exact_mut(tables).zip(keys.chunks_exact(d)) {
                    self.hash_into(key, codes);
                }
            });
        codes
    }

    /// Puts the keys of ids `first..` with `codes` (key-major) into their buckets, one table
    /// per rayon task.
    fn fill(&mut self, codes: &[u32], first: usize) {
        let tables = self.spec.tables;
        self.buckets
            .par_iter_mut()
            .enumerate()
            .for_each(|(t, buckets)| {
                for (i, key_codes) in codes.chunks_exact(tables).enumerate() {
                    buckets
                        .entry(key_codes[t])
                        .or_default()
                        .push((first + i) as u32);
                }
            });
    }

    /// Adds pre-RoPE `keys`: rotates, hashes and buckets them.
    fn append(&mut self, keys: &[f32]) -> Result<usize> {
        let first = self.len();
        let adding = check_add(keys, self.head_dim(), first)?;
        if adding == 0 {
            return Ok(0);
        }
        self.keys.add(keys)?;
        let codes = self.hash_rows(&self.keys.rows()[first * self.head_dim()..]);
        self.fill(&codes, first);
        Ok(adding)
    }

    /// Every key's codes, key-major, read back from the buckets.
    fn codes(&self) -> Vec<u32> {
        let tables = self.spec.tables;
        let mut codes = vec![0u32; self.len() * tables];
        for (t, buckets) in self.buckets.iter().enumerate() {
            for (&code, ids) in buckets {
                for &id in ids {
                    codes[id as usize * tables + t] = code;
                }
            }
        }
        codes
    }
}

impl StatelessSearch for LshIndex {
    fn search_once(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Found> {
        let d = self.head_dim();
        let heads = check_query(query, d)?;
        let eligible = eligible(&params.candidates, self.len());
        let k = params.k;
        if k == 0 || eligible.is_empty() {
            return Ok(Found::default());
        }
        if k >= eligible.len() {
            return Ok(Found {
                selection: eligible.collect(),
                ..Found::default()
            });
        }
        let queries = self.keys.rotate_query(query);
        let (tables, min) = (self.spec.tables, self.spec.min_collisions);
        let start = eligible.start;
        // Collisions of the current head per eligible key, and whether a key is already a
        // candidate (of any head).
        let mut collisions = vec![0u32; eligible.len()];
        let mut chosen = vec![false; eligible.len()];
        let mut pool: Vec<u32> = Vec::new();
        let mut codes = vec![0u32; tables];
        for q in queries.chunks_exact(d) {
            self.hash_into(q, &mut codes);
            // The eligible part of each colliding bucket (buckets are sorted by id).
            let hits: Vec<&[u32]> = self
                .buckets
                .iter()
                .zip(&codes)
                .filter_map(|(buckets, code)| buckets.get(code))
                .map(|ids| {
                    let from = ids.partition_point(|&id| id < eligible.start);
                    let to = ids.partition_point(|&id| id < eligible.end);
                    &ids[from..to]
                })
                .collect();
            for &id in hits.iter().copied().flatten() {
                let i = (id - start) as usize;
                collisions[i] += 1;
                if collisions[i] == min as u32 && !chosen[i] {
                    chosen[i] = true;
                    pool.push(id);
                }
            }
            for &id in hits.iter().copied().flatten() {
                collisions[(id - start) as usize] = 0;
            }
        }
        let scored = pool.len() + heads * tables * self.spec.bits;
        Ok(Found::ranked(
            self.keys.top_of(&queries, pool.into_iter(), k),
            scored,
        ))
    }
}

impl KeyIndex for LshIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Lsh(self.spec)
    }

    fn head_dim(&self) -> usize {
        self.keys.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let started = Instant::now();
        let added = self.append(keys)?;
        self.stats.record_add(added, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        let f32s = self.keys.memory_bytes() + self.planes.capacity() * std::mem::size_of::<f32>();
        let buckets: usize = self
            .buckets
            .iter()
            .map(|b| {
                b.capacity() * BUCKET_ENTRY_BYTES
                    + b.values()
                        .map(|ids| ids.capacity() * std::mem::size_of::<u32>())
                        .sum::<usize>()
            })
            .sum();
        f32s + buckets + self.buckets.capacity() * std::mem::size_of::<HashMap<u32, Vec<u32>>>()
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        encode(&Body {
            version: BODY_VERSION,
            tables: self.spec.tables as u32,
            bits: self.spec.bits as u32,
            seed: self.spec.seed,
            planes: fingerprint(&self.planes),
            codes: self.codes(),
        })
    }
}
