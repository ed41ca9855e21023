//! [`HnswIndex`]: maximum inner product search on an hnsw_rs graph over augmented keys.
//!
//! HNSW finds nearest neighbours by a metric; attention wants the keys of largest inner
//! product, which is not a metric. The standard augmentation turns one into the other: with
//! `R` at least the largest key norm, every rotated key `k` is stored as `[k, √(R² − |k|²)]`
//! (all stored vectors then have norm `R`) and every rotated query as `[q, 0]`, so
//!
//! ```text
//! |[q, 0] − [k, √(R² − |k|²)]|² = |q|² + R² − 2 q·k
//! ```
//!
//! and for one query the L2 order is exactly the inner-product order, largest first.

use std::cell::Cell;
use std::path::Path;
use std::time::Instant;

use hnsw_rs::api::AnnT;
use hnsw_rs::hnsw::Point;
use hnsw_rs::hnswio::{HnswIo, ReloadOptions};
use hnsw_rs::prelude::{Distance, FilterT, Hnsw};
use kvdb_model::Rope;
use kvdb_simd::squared_l2;
use rayon::prelude::*;

use crate::common::{check_add, check_query, decode, eligible, encode};
use crate::key_index::{OneShot, StatelessSearch};
use crate::{
    BuildContext, BuildStats, FlatIndex, Found, GroupQuery, HnswSpec, IndexError, IndexSpec,
    KeyIndex, Result, SearchParams, Searcher,
};

/// The augmentation radius is this many times the largest key norm seen when it is set, so
/// that later keys a little longer than every earlier one do not force a rebuild.
const RADIUS_HEADROOM: f64 = 1.2;
/// Layers hnsw_rs supports (its `NB_LAYER_MAX`); asking for more is clipped to this anyway.
const MAX_LAYERS: usize = 16;
/// hnsw_rs draws node levels from an RNG it seeds with this constant for every new graph; it
/// is recorded in [`BuildStats::seed`] because it is what makes the build reproducible.
const HNSW_RS_LEVEL_SEED: u64 = 397;
/// Version of the body `save` writes (2: with the graph; 1: the radius alone, the graph
/// rebuilt at every load).
const BODY_VERSION: u32 = 2;
/// The base name of hnsw_rs's dump files in the folder a save or load writes them to.
const DUMP_NAME: &str = "graph";
/// A filtered graph search walks through ineligible nodes to reach eligible ones; when fewer
/// than one key in this many is eligible, an exact scan of the eligible keys is the better
/// (and exact) search.
const SPARSE_ELIGIBLE: usize = 8;
/// Heap bytes of one neighbour link in hnsw_rs: an `Arc<PointWithOrder>` (a 16-byte Arc
/// header, a pointer and an f32, padded to 32) plus the pointer in the neighbour list.
const LINK_BYTES: usize = 32 + 8;
/// Heap bytes of one node's neighbour lists besides the links: the `Arc<RwLock<..>>` (header,
/// lock, outer Vec) and hnsw_rs's 16 per-layer `Vec` headers, allocated for every node.
const NODE_LISTS_BYTES: usize = 16 + 8 + 24 + MAX_LAYERS * 24;

thread_local! {
    /// Distance evaluations made on this thread, read before and after a search to count
    /// its cost. Per thread, so concurrent searches on other threads do not add to it.
    static DISTANCES: Cell<usize> = const { Cell::new(0) };
}

/// Squared L2 distance that counts its calls (see [`DISTANCES`]).
///
/// Squared rather than plain L2: same order, no square root. Never NaN, because hnsw_rs
/// panics when it compares a NaN distance: a NaN (from a NaN query) becomes +∞.
#[derive(Debug, Clone, Copy, Default)]
struct CountingL2;

impl Distance<f32> for CountingL2 {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        DISTANCES.with(|c| c.set(c.get() + 1));
        let d = squared_l2(a, b);
        if d.is_nan() {
            f32::INFINITY
        } else {
            d
        }
    }
}

/// Runs `f` and counts the distances it evaluated on this thread.
fn counting<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = DISTANCES.with(Cell::get);
    let out = f();
    (out, DISTANCES.with(Cell::get).wrapping_sub(before))
}

/// `|key|²` in f64, or `None` when the key has a non-finite value (such keys stay out of the
/// graph: their augmentation is undefined and their score is NaN or infinite).
fn squared_norm(key: &[f32]) -> Option<f64> {
    let s: f64 = key.iter().map(|&x| x as f64 * x as f64).sum();
    s.is_finite().then_some(s)
}

/// What `save` writes. The graph itself is not stored: it is a deterministic
/// function of the keys and the radius (see [`HnswIndex`]), so load rebuilds it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Body {
    version: u32,
    /// The augmentation radius the graph was built with.
    radius: f64,
    /// hnsw_rs's dump of the graph: its graph file and its data file (the augmented keys).
    graph: Vec<u8>,
    data: Vec<u8>,
}

/// What saves of [`BODY_VERSION`] 1 hold.
#[derive(serde::Deserialize)]
struct RadiusOnly {
    version: u32,
    radius: f64,
}

/// Maximum inner product search on an [hnsw_rs](hnsw_rs) graph over augmented keys.
///
/// - **Augmentation.** Keys are rotated at their positions and stored as
///   `[k, √(R² − |k|²)]`, queries as `[q, 0]` (see the module docs), so that the graph's L2
///   nearest neighbours of one query are its largest inner products.
/// - **Norms.** `R` is 1.2 times the largest key norm when it is set. A
///   later key longer than `R` would get no valid augmentation (and silently rank wrong), so
///   such an `add` sets `R` anew from all keys and rebuilds the graph, and says so in
///   [`BuildStats::warnings`]. The headroom makes rebuilds rare: each one grows `R` by ≥ 1.2×.
/// - **GQA.** Each query head of the group searches the graph (`ef = max(ef_search, k)`) and
///   contributes its `ef` nearest; the union is re-scored exactly with the group's score (the
///   maximum over heads) and the top `k` kept. A key is in the exact top-k of the group only
///   if it is in the top-k of some head, which that head's search looks for.
/// - **Candidates.** The graph search is filtered to `params.candidates` (hnsw_rs's
///   [`FilterT`]); when few keys are eligible (fewer than `max(2k, heads · ef)`, or under one
///   in 8) the eligible keys are scanned exactly instead, which is then both
///   cheaper and exact. A graph search that finds fewer than `k` keys also falls back.
/// - **Determinism, save and load.** Keys are inserted one at a time in id order. hnsw_rs
///   seeds its level generator with a constant for every new graph, and its sequential
///   insertion is otherwise deterministic (its parallel insertion is not: thread races), so
///   the graph is a function of the keys and `R` alone. The price is a single-threaded
///   graph build (rotation and norms use rayon): parallelism belongs across heads and
///   layers, whose indexes are independent. [`KeyIndex::save`] stores `R` and hnsw_rs's dump
///   of the graph (its links and augmented keys, about the keys' f32 size again), so that
///   opening a corpus reads the graph instead of building it again (85 s for 30K tokens of
///   the default model on 2 cores); saves that hold `R` alone (version 1) re-insert the
///   keys, which gives the same graph. One thing a dump does not keep is the level
///   generator's state: a reloaded graph restarts it, so keys added after a reopen get other
///   levels than the same `add` before the save would have given them, and the two graphs
///   answer nearly, not exactly, alike (the `hnsw` tests bound how nearly).
/// - **Cost.** [`Found::scored`] counts every distance the graph searches evaluated (the
///   distance counts its calls) plus the keys re-scored.
pub struct HnswIndex {
    spec: HnswSpec,
    /// The keys rotated at their ids, for exact re-scoring and rebuilds.
    keys: FlatIndex,
    /// The augmentation radius `R`.
    radius: f64,
    /// The largest norm of a finite key.
    max_norm: f64,
    graph: Hnsw<'static, f32, CountingL2>,
    stats: BuildStats,
}

impl std::fmt::Debug for HnswIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HnswIndex")
            .field("spec", &IndexSpec::Hnsw(self.spec).to_string())
            .field("head_dim", &self.head_dim())
            .field("len", &self.len())
            .field("radius", &self.radius)
            .field("graph_nodes", &self.graph.get_nb_point())
            .finish_non_exhaustive()
    }
}

impl HnswIndex {
    /// Builds the index over pre-RoPE `keys` `[n, head_dim]` (ids `0..n`).
    pub fn build(spec: &HnswSpec, context: &BuildContext<'_>, keys: &[f32]) -> Result<Self> {
        let started = Instant::now();
        let mut index = Self::empty(spec, context.rope.clone(), 0.0)?;
        let warnings = index.append(keys)?;
        index.stats = BuildStats::finished(index.len(), HNSW_RS_LEVEL_SEED, started, warnings);
        Ok(index)
    }

    /// Reopens a saved index over the pre-RoPE `keys` it covered: its graph as saved, or,
    /// for a save without one (version 1) or keys that do not fit it, rebuilt with the saved
    /// radius (which gives the same graph as before the save).
    pub fn load(
        spec: &HnswSpec,
        context: &BuildContext<'_>,
        stats: BuildStats,
        body: &[u8],
        keys: &[f32],
    ) -> Result<Self> {
        let (radius, dump) = match decode::<Body>(body) {
            Ok(b) if b.version == BODY_VERSION => (b.radius, Some((b.graph, b.data))),
            _ => match decode::<RadiusOnly>(body)? {
                b if b.version == 1 => (b.radius, None),
                b => {
                    return Err(IndexError::Corrupt(format!(
                        "hnsw body version {} (this build reads 1 and {BODY_VERSION})",
                        b.version
                    )))
                }
            },
        };
        if !(radius.is_finite() && radius >= 0.0) {
            return Err(IndexError::Corrupt(format!("hnsw radius {radius}")));
        }
        let mut index = Self::empty(spec, context.rope.clone(), radius)?;
        if let Some((graph, data)) = dump {
            index.keys.add(keys)?;
            // The longest key and how many keys the graph holds (the finite ones).
            let (longest, finite) = index
                .keys
                .rows()
                .par_chunks_exact(index.head_dim())
                .map(|k| squared_norm(k).map_or((0.0, 0), |s| (s.sqrt(), 1)))
                .reduce(|| (0.0, 0), |a, b| (a.0.max(b.0), a.1 + b.1));
            let graph = load_graph(&graph, &data)?;
            // A graph over other keys than these (a store edited by hand) is not used: the
            // keys are inserted again, as for a save without a graph.
            if longest <= radius && graph.get_nb_point() == finite {
                index.max_norm = longest;
                index.graph = graph;
                index.stats = stats;
                return Ok(index);
            }
            index = Self::empty(spec, context.rope.clone(), radius)?;
        }
        index.stats = stats;
        // Keys longer than the saved radius can only come from different keys than were
        // saved; the index then rebuilds (and says so) rather than mis-ranking.
        let warnings = index.append(keys)?;
        index.stats.warnings.extend(warnings);
        Ok(index)
    }

    /// An index with no keys and augmentation radius `radius`.
    fn empty(spec: &HnswSpec, rope: Rope, radius: f64) -> Result<Self> {
        // The fields are public, so a spec that did not come from the parser can reach here
        // (hnsw_rs exits the process on too many links).
        IndexSpec::Hnsw(*spec).validate()?;
        Ok(Self {
            graph: Self::new_graph(spec, 0),
            spec: *spec,
            keys: FlatIndex::new(rope),
            radius,
            max_norm: 0.0,
            stats: BuildStats::default(),
        })
    }

    fn new_graph(spec: &HnswSpec, expected: usize) -> Hnsw<'static, f32, CountingL2> {
        Hnsw::new(
            spec.m,
            expected.max(1),
            MAX_LAYERS,
            spec.ef_construction,
            CountingL2,
        )
    }

    /// Adds pre-RoPE `keys`, growing the radius and rebuilding the graph when one is longer
    /// than it; returns what the stats should warn about.
    fn append(&mut self, keys: &[f32]) -> Result<Vec<String>> {
        let d = self.head_dim();
        let first = self.len();
        let adding = check_add(keys, d, first)?;
        let mut warnings = Vec::new();
        if adding == 0 {
            return Ok(warnings);
        }
        self.keys.add(keys)?;
        let norms: Vec<Option<f64>> = self.keys.rows()[first * d..]
            .par_chunks_exact(d)
            .map(squared_norm)
            .collect();
        let skipped = norms.iter().filter(|n| n.is_none()).count();
        if skipped > 0 {
            warnings.push(format!(
                "{skipped} keys with non-finite values are left out of the graph (only exact \
                 scans of few candidates see them)"
            ));
        }
        let longest = norms.iter().flatten().fold(0.0f64, |m, &s| m.max(s.sqrt()));
        self.max_norm = self.max_norm.max(longest);
        if longest > self.radius {
            let radius = RADIUS_HEADROOM * self.max_norm;
            if self.graph.get_nb_point() > 0 {
                warnings.push(format!(
                    "a key of norm {longest:.4} exceeded the augmentation radius {:.4}: the graph \
                     was rebuilt over {} keys with radius {radius:.4}",
                    self.radius,
                    self.len()
                ));
            }
            self.radius = radius;
            self.graph = Self::new_graph(&self.spec, self.len());
            self.insert(0);
        } else {
            self.insert(first);
        }
        Ok(warnings)
    }

    /// Inserts the keys from id `first` on into the graph, one at a time in id order (see
    /// the type's docs for why not in parallel).
    fn insert(&self, first: usize) {
        let d = self.head_dim();
        let r2 = self.radius * self.radius;
        let mut augmented = vec![0.0f32; d + 1];
        for (id, key) in self.keys.rows().chunks_exact(d).enumerate().skip(first) {
            let Some(s) = squared_norm(key) else {
                continue;
            };
            augmented[..d].copy_from_slice(key);
            augmented[d] = (r2 - s).max(0.0).sqrt() as f32;
            self.graph.insert_slice((&augmented, id));
        }
    }

    /// Heap bytes of the graph, from hnsw_rs's layout: per node its augmented vector, the
    /// `Arc<Point>`, its slot in the layer table and its neighbour lists; per link an
    /// `Arc<PointWithOrder>` and a pointer. Walks every node (O(nodes)).
    fn graph_bytes(&self) -> usize {
        let points = self.graph.get_point_indexation();
        let mut bytes = 0;
        if self.graph.get_nb_point() == 0 {
            return bytes;
        }
        for layer in 0..=points.get_max_level_observed() as usize {
            for point in points.get_layer_iterator(layer) {
                let links: usize = point.get_neighborhood_id().iter().map(Vec::len).sum();
                bytes += std::mem::size_of_val(point.get_v())
                    + 16
                    + std::mem::size_of::<Point<'static, f32>>()
                    + std::mem::size_of::<usize>()
                    + NODE_LISTS_BYTES
                    + links * LINK_BYTES;
            }
        }
        bytes
    }
}

/// hnsw_rs's dump of `graph` (it writes files only): its graph file and its data file.
fn dump_graph(graph: &Hnsw<'static, f32, CountingL2>) -> Result<(Vec<u8>, Vec<u8>)> {
    let failed = |e: &dyn std::fmt::Display| IndexError::GraphFiles(e.to_string());
    let dir = tempfile::tempdir().map_err(|e| failed(&e))?;
    let name = graph
        .file_dump(dir.path(), DUMP_NAME)
        .map_err(|e| failed(&e))?;
    let read = |ext: &str| std::fs::read(dump_path(dir.path(), &name, ext)).map_err(|e| failed(&e));
    Ok((read("graph")?, read("data")?))
}

/// A graph from hnsw_rs's dump files' bytes ([`dump_graph`]).
fn load_graph(graph: &[u8], data: &[u8]) -> Result<Hnsw<'static, f32, CountingL2>> {
    let corrupt = |e: &dyn std::fmt::Display| IndexError::Corrupt(format!("hnsw graph: {e}"));
    let files = |e: &dyn std::fmt::Display| IndexError::GraphFiles(e.to_string());
    let dir = tempfile::tempdir().map_err(|e| files(&e))?;
    let write = |ext: &str, bytes: &[u8]| {
        std::fs::write(dump_path(dir.path(), DUMP_NAME, ext), bytes).map_err(|e| files(&e))
    };
    write("graph", graph)?;
    write("data", data)?;
    let io = HnswIo::new_with_options(dir.path(), DUMP_NAME, ReloadOptions::new(false));
    // hnsw_rs asserts on what it reads (magic numbers, dimensions) instead of failing: a
    // damaged save must be an error, not a crash.
    let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        io.load_hnsw_with_dist::<f32, CountingL2>(CountingL2)
    }))
    .map_err(|_| corrupt(&"hnsw_rs stopped reading it"))?
    .map_err(|e| corrupt(&e))?;
    // Safety: without a data map (`ReloadOptions::new(false)` above: no mmap) hnsw_rs reads
    // every point's data into vectors the graph owns, so the graph borrows nothing from `io`
    // or the files, whatever lifetime its type names.
    Ok(unsafe {
        std::mem::transmute::<Hnsw<'_, f32, CountingL2>, Hnsw<'static, f32, CountingL2>>(loaded)
    })
}

/// Where hnsw_rs's dump file `ext` ("graph" or "data") of base name `name` is in `dir`.
fn dump_path(dir: &Path, name: &str, ext: &str) -> std::path::PathBuf {
    dir.join(format!("{name}.hnsw.{ext}"))
}

impl StatelessSearch for HnswIndex {
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
        let ef = params.breadth_or(self.spec.ef_search).max(k);
        let exact = |queries: &[f32], scored: usize| {
            let best = self.keys.top_of(queries, eligible.clone(), k);
            Found::ranked(best, scored + eligible.len())
        };
        let few = eligible.len() <= (2 * k).max(heads.saturating_mul(ef));
        if few || eligible.len().saturating_mul(SPARSE_ELIGIBLE) < self.len() {
            return Ok(exact(&queries, 0));
        }

        let inside = |id: &usize| eligible.contains(&(*id as u32));
        let filter: Option<&dyn FilterT> = if eligible.len() == self.len() {
            None
        } else {
            Some(&inside)
        };
        let mut pool: Vec<u32> = Vec::with_capacity(heads * ef);
        let mut distances = 0;
        let mut augmented = vec![0.0f32; d + 1];
        for q in queries.chunks_exact(d) {
            augmented[..d].copy_from_slice(q);
            let (near, evaluated) =
                counting(|| self.graph.search_filter(&augmented, ef, ef, filter));
            distances += evaluated;
            pool.extend(near.iter().map(|n| n.d_id as u32));
        }
        pool.sort_unstable();
        pool.dedup();
        // hnsw_rs filters its results already; this keeps the promise whatever it does.
        pool.retain(|id| eligible.contains(id));
        if pool.len() < k {
            return Ok(exact(&queries, distances));
        }
        let scored = distances + pool.len();
        Ok(Found::ranked(
            self.keys.top_of(&queries, pool.into_iter(), k),
            scored,
        ))
    }
}

impl KeyIndex for HnswIndex {
    fn spec(&self) -> IndexSpec {
        IndexSpec::Hnsw(self.spec)
    }

    fn head_dim(&self) -> usize {
        self.keys.head_dim()
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn add(&mut self, keys: &[f32]) -> Result<()> {
        let started = Instant::now();
        let before = self.len();
        let warnings = self.append(keys)?;
        self.stats.warnings.extend(warnings);
        self.stats.record_add(self.len() - before, started);
        Ok(())
    }

    fn searcher(&self) -> Box<dyn Searcher + '_> {
        Box::new(OneShot(self))
    }

    fn memory_bytes(&self) -> usize {
        self.keys.memory_bytes() + self.graph_bytes()
    }

    fn build_stats(&self) -> &BuildStats {
        &self.stats
    }

    fn save(&self) -> Result<Vec<u8>> {
        let (graph, data) = dump_graph(&self.graph)?;
        encode(&Body {
            version: BODY_VERSION,
            radius: self.radius,
            graph,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvdb_model::RopeStyle;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const D: usize = 16;
    const N: usize = 400;

    fn context() -> BuildContext<'static> {
        BuildContext {
            rope: kvdb_tests::test_rope(RopeStyle::Halves, D),
            seed: 0,
            saap: None,
            queries: None,
        }
    }

    /// The ids of the 10 best keys for 20 random queries (a search at each).
    fn selections(index: &HnswIndex, rng: &mut StdRng) -> Result<Vec<Vec<u32>>> {
        (0..20)
            .map(|_| {
                let queries: Vec<f32> = (0..D).map(|_| rng.random_range(-1.0..1.0)).collect();
                let query = GroupQuery {
                    queries: &queries,
                    position: N,
                };
                Ok(index
                    .select(&query, &SearchParams::top(10, 0..N as u32))?
                    .ids()
                    .to_vec())
            })
            .collect()
    }

    /// A save holds the graph, which loads to the same searches; a save of version 1 (the
    /// radius alone) loads by inserting the keys again, to the same searches; keys that do
    /// not fit the saved graph are inserted again; a damaged graph is an error, not a panic.
    #[test]
    fn saved_graphs_load_and_damaged_ones_are_errors() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(9);
        let keys: Vec<f32> = (0..N * D).map(|_| rng.random_range(-1.0..1.0)).collect();
        let spec = HnswSpec {
            m: 8,
            ef_search: 32,
            ef_construction: 64,
        };
        let context = context();
        let index = HnswIndex::build(&spec, &context, &keys)?;
        let want = selections(&index, &mut StdRng::seed_from_u64(1))?;
        let stats = BuildStats::default();
        let load =
            |body: &[u8], keys: &[f32]| HnswIndex::load(&spec, &context, stats.clone(), body, keys);
        let saved = index.save()?;
        let body: Body = decode(&saved)?;
        assert!(body.graph.len() > N && body.data.len() >= N * (D + 1) * 4);
        let loaded = load(&saved, &keys)?;
        assert_eq!(loaded.graph.get_nb_point(), N);
        assert!(loaded.stats.warnings.is_empty());
        assert_eq!(selections(&loaded, &mut StdRng::seed_from_u64(1))?, want);

        #[derive(serde::Serialize)]
        struct Version1 {
            version: u32,
            radius: f64,
        }
        let old = encode(&Version1 {
            version: 1,
            radius: index.radius,
        })?;
        assert_eq!(
            selections(&load(&old, &keys)?, &mut StdRng::seed_from_u64(1))?,
            want
        );

        // Twice as long keys do not fit the saved radius: inserted again, with a new one.
        let longer: Vec<f32> = keys.iter().map(|k| 2.0 * k).collect();
        let rebuilt = load(&saved, &longer)?;
        assert!(rebuilt.radius > index.radius && rebuilt.graph.get_nb_point() == N);

        let damaged = |at: usize| {
            let mut graph = body.graph.clone();
            graph[at] ^= 0x5a;
            encode(&Body {
                graph,
                data: body.data.clone(),
                ..body
            })
        };
        for at in [0, 1] {
            assert!(matches!(
                load(&damaged(at)?, &keys),
                Err(IndexError::Corrupt(_))
            ));
        }
        let mut future = body;
        future.version = 3;
        assert!(matches!(
            load(&encode(&future)?, &keys),
            Err(IndexError::Corrupt(_))
        ));
        Ok(())
    }
}
