//! kvdb-index: the [`KeyIndex`] trait, its implementations and the spec strings that name
//! them.
//!
//! A key index answers one question for one KV head of one layer: which stored tokens does
//! this query group attend to most strongly? It returns a [`Selection`] of token ids; the
//! attention crate then scores those tokens exactly and merges them with the dense part
//! (attention sinks and the recent window).
//!
//! | item | job |
//! |---|---|
//! | [`IndexSpec`] | a spec string (`flat`, `ivf1024,np32`, `hnsw32,ef128`, `qgraph16,ef32`, `lsh:L=64,K=10`, `saap1024,l32`, `hip:k512,bq32,bk2`, `ihip:2k`, or a kind alone for its default: [`IndexSpec::default_of`], [`KINDS`]) parsed once; [`GRAMMAR`] |
//! | [`build`], [`load`], [`save`] | the factory: a spec and pre-RoPE keys give a `Box<dyn KeyIndex>`; saved bytes round-trip |
//! | [`KeyIndex`] | the seam: `add` keys incrementally, open a per-query [`Searcher`], memory, [`BuildStats`], `save` |
//! | [`Searcher`] | one query's search state across its decode steps (InfiniteHiP caches its stages there) |
//! | [`FlatIndex`] | exact maximum inner product search over every stored key |
//! | `IvfIndex` | inverted lists assigned by faiss's flat quantizer (feature `faiss`), top-k of the probed lists or all of them; lists ranked by centroid or (`fit`) by a routing fitted on a [`QuerySample`] |
//! | [`BuildContext`], [`QuerySample`] | what a build needs besides the keys: RoPE, seed, SAAP's trained head, the corpus's sampled queries |
//! | [`HnswIndex`] | hnsw_rs over keys augmented so that inner product becomes distance |
//! | [`QgraphIndex`] | an attention-aware graph: k-means cell neighbours plus shortcuts between the keys the corpus's sampled queries attended together (RoarGraph's projection), walked by the group's inner product |
//! | [`LshIndex`] | sign random projections in L tables of K bits, candidates re-scored |
//! | [`SaapIndex`] | SAAP: k-means buckets on de-roped keys, queries routed by a classifier kvdb trains ([`saap::SaapArtifact`]: this crate only routes with it) |
//! | [`kmeans`] | k-means++ and Lloyd in squared L2: ivf's lists and SAAP's buckets |
//! | [`HipIndex`], [`IhipIndex`] | HiP's hierarchical top-k and InfiniteHiP's multi-stage chunk pruning |
//! | [`Selection`], [`Found`] | sorted, duplicate-free token ids, with the search's cost |
//!
//! Layouts are stated once. A token id is a `u32`, the token's position in the corpus
//! context: token `i` sits at RoPE position `i`. Keys and queries are row-major f32 slices,
//! `[rows, head_dim]`: keys are handed over **pre-RoPE** and get ids `len()..` in order; the
//! queries of a [`GroupQuery`] are the pre-RoPE vectors `[group_heads, head_dim]` of one token.
//! Scores are inner products of rotated queries and keys; a GQA group's score of a key is the
//! maximum over its heads (all heads of the group attend to one selected set).
//!
//! ```
//! use kvdb_index::{BuildContext, GroupQuery, IndexSpec, SearchParams};
//! use kvdb_model::{Rope, RopeConfig, RopeScaling, RopeStyle};
//! # fn main() -> kvdb_index::Result<()> {
//! let config = RopeConfig { base: 10_000.0, style: RopeStyle::Halves, scaling: RopeScaling::None };
//! let context = BuildContext { rope: Rope::new(&config, 8, None), seed: 0, saap: None, queries: None };
//! let keys: Vec<f32> = (0..8 * 100).map(|i| (i as f32 * 0.37).sin()).collect(); // ids 0..100
//! let spec: IndexSpec = "flat".parse()?;
//! let index = kvdb_index::build(&spec, &context, &keys)?;
//! let query = GroupQuery { queries: &[1.0; 8 * 2], position: 100 }; // 2 query heads
//! let found = index.searcher().search(&query, &SearchParams::top(10, 4..90))?;
//! assert_eq!(found.selection.len(), 10);
//! assert!(found.selection.ids().iter().all(|id| (4..90).contains(id)));
//! # Ok(()) }
//! ```

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod common;
mod error;
#[cfg(feature = "faiss")]
mod fitted;
mod flat;
#[cfg(feature = "faiss")]
mod heavy;
mod hip;
mod hnsw;
mod ihip;
#[cfg(feature = "faiss")]
mod ivf;
mod key_index;
pub mod kmeans;
mod lsh;
mod qgraph;
pub mod saap;
mod selection;
mod spec;

pub use error::{IndexError, Result};
pub use flat::FlatIndex;
pub use hip::HipIndex;
pub use hnsw::HnswIndex;
pub use ihip::IhipIndex;
#[cfg(feature = "faiss")]
pub use ivf::IvfIndex;
pub use key_index::{
    BucketIndex, BucketScores, BuildContext, BuildStats, Found, GpuRouting, GroupQuery, KeyIndex,
    QuerySample, SearchParams, Searcher, UnvisitedBucket,
};
pub use lsh::LshIndex;
pub use qgraph::QgraphIndex;
pub use saap::SaapIndex;
pub use selection::Selection;
pub use spec::{
    limits, HipSpec, HnswSpec, IhipSpec, IndexSpec, IvfSpec, LshSpec, QgraphSpec, SaapSpec,
    GRAMMAR, KINDS,
};

/// Version of the bytes [`save`] writes.
const SAVED_VERSION: u32 = 1;

/// What [`save`] writes: the effective spec, how many keys the index covered, its build
/// statistics and its own body.
#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    version: u32,
    spec: String,
    len: u64,
    stats: BuildStats,
    body: Vec<u8>,
}

/// Checks, before anything is built or saved, that `spec` can be built by this build of
/// the crate: its fields within bounds ([`IndexSpec::validate`]) and its library compiled
/// in. (What a build needs besides, such as SAAP's trained artifact, is the caller's to
/// check.)
pub fn check_buildable(spec: &IndexSpec) -> Result<()> {
    spec.validate()?;
    #[cfg(not(feature = "faiss"))]
    if matches!(spec, IndexSpec::Ivf(_)) {
        return Err(no_faiss(spec));
    }
    Ok(())
}

#[cfg(not(feature = "faiss"))]
fn no_faiss(spec: &IndexSpec) -> IndexError {
    IndexError::Build {
        spec: spec.to_string(),
        reason: "this build of kvdb-index has no faiss (feature `faiss`)".into(),
    }
}

/// Builds the index `spec` names over pre-RoPE `keys` `[n, head_dim]` (ids `0..n`).
pub fn build(
    spec: &IndexSpec,
    context: &BuildContext<'_>,
    keys: &[f32],
) -> Result<Box<dyn KeyIndex>> {
    Ok(match spec {
        IndexSpec::Flat => Box::new(FlatIndex::build(context.rope.clone(), keys)?),
        #[cfg(feature = "faiss")]
        IndexSpec::Ivf(s) => Box::new(IvfIndex::build(s, context, keys)?),
        #[cfg(not(feature = "faiss"))]
        IndexSpec::Ivf(_) => return Err(no_faiss(spec)),
        IndexSpec::Hnsw(s) => Box::new(HnswIndex::build(s, context, keys)?),
        IndexSpec::Qgraph(s) => Box::new(QgraphIndex::build(s, context, keys)?),
        IndexSpec::Lsh(s) => Box::new(LshIndex::build(s, context, keys)?),
        IndexSpec::Saap(s) => Box::new(SaapIndex::build(s, context, keys)?),
        IndexSpec::Hip(s) => Box::new(HipIndex::build(s, context, keys)?),
        IndexSpec::Ihip(s) => Box::new(IhipIndex::build(s, context, keys)?),
    })
}

/// The bytes [`load`] reopens `index` from (the keys themselves are not included).
pub fn save(index: &dyn KeyIndex) -> Result<Vec<u8>> {
    common::encode(&Saved {
        version: SAVED_VERSION,
        spec: index.spec().to_string(),
        len: index.len() as u64,
        stats: index.build_stats().clone(),
        body: index.save()?,
    })
}

/// What saved index bytes describe, read without loading the index.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedInfo {
    /// The spec as built (e.g. with fewer IVF lists than asked for).
    pub spec: String,
    /// Keys the index covers.
    pub len: usize,
    /// How it was built.
    pub stats: BuildStats,
    /// The first key id [`load_from`] must be given: 0 for an index that reads the keys it
    /// covers when it loads, `len` for one that saved what its search needs (an ivf or saap
    /// index with its lists and no need of the keys themselves), which loads without them.
    pub keys_from: usize,
}

/// Describes saved index bytes.
pub fn saved_info(bytes: &[u8]) -> Result<SavedInfo> {
    let saved = open_saved(bytes)?;
    let keys_from = keys_from(&saved)?;
    Ok(SavedInfo {
        spec: saved.spec,
        len: saved.len as usize,
        stats: saved.stats,
        keys_from,
    })
}

fn open_saved(bytes: &[u8]) -> Result<Saved> {
    let saved: Saved = common::decode(bytes)?;
    if saved.version != SAVED_VERSION {
        return Err(IndexError::Corrupt(format!(
            "saved index version {} (this build reads {SAVED_VERSION})",
            saved.version
        )));
    }
    Ok(saved)
}

/// [`SavedInfo::keys_from`] of `saved`.
fn keys_from(saved: &Saved) -> Result<usize> {
    let reads_keys = match saved.spec.parse()? {
        #[cfg(feature = "faiss")]
        IndexSpec::Ivf(s) => IvfIndex::reads_saved_keys(&s, &saved.body)?,
        IndexSpec::Saap(_) => SaapIndex::reads_saved_keys(&saved.body),
        _ => true,
    };
    Ok(if reads_keys { 0 } else { saved.len as usize })
}

/// Reopens an index saved by [`save`]. `keys` are the pre-RoPE keys of ids `0..`: at least
/// the ones the index covered; any beyond them are added (an index saved before the corpus
/// grew catches up).
pub fn load(bytes: &[u8], context: &BuildContext<'_>, keys: &[f32]) -> Result<Box<dyn KeyIndex>> {
    load_from(bytes, context, 0, keys)
}

/// [`load`] given the keys of ids `first..` only: `first` is 0 or the saved index's
/// [`SavedInfo::keys_from`], so that an index that saved what it needs opens without
/// reading the keys it covers (only those added since, if any).
pub fn load_from(
    bytes: &[u8],
    context: &BuildContext<'_>,
    first: usize,
    keys: &[f32],
) -> Result<Box<dyn KeyIndex>> {
    let saved = open_saved(bytes)?;
    let needed = keys_from(&saved)?;
    if first != 0 && first != needed {
        return Err(IndexError::KeysFrom { first, needed });
    }
    let spec: IndexSpec = saved.spec.parse()?;
    let d = context.rope.head_dim();
    let len = saved.len as usize;
    // Keys of ids `first..`: those the index covered (none when it reads none), then new.
    let covered = (len - first)
        .checked_mul(d)
        .filter(|&n| n <= keys.len())
        .ok_or_else(|| {
            IndexError::Corrupt(format!(
                "the index covers {} keys, {} were given from id {first}",
                saved.len,
                keys.len() / d.max(1)
            ))
        })?;
    let (old, new) = keys.split_at(covered);
    let (stats, body) = (saved.stats, &saved.body[..]);
    let mut index: Box<dyn KeyIndex> = match &spec {
        IndexSpec::Flat => Box::new(FlatIndex::load(context.rope.clone(), stats, old)?),
        #[cfg(feature = "faiss")]
        IndexSpec::Ivf(s) => Box::new(IvfIndex::load(s, context, stats, body, len, old)?),
        #[cfg(not(feature = "faiss"))]
        IndexSpec::Ivf(_) => return Err(no_faiss(&spec)),
        IndexSpec::Hnsw(s) => Box::new(HnswIndex::load(s, context, stats, body, old)?),
        IndexSpec::Qgraph(s) => Box::new(QgraphIndex::load(s, context, stats, body, old)?),
        IndexSpec::Lsh(s) => Box::new(LshIndex::load(s, context, stats, body, old)?),
        IndexSpec::Saap(s) => Box::new(SaapIndex::load(s, context, stats, body, len, old)?),
        IndexSpec::Hip(s) => Box::new(HipIndex::load(s, context, stats, body, old)?),
        IndexSpec::Ihip(s) => Box::new(IhipIndex::load(s, context, stats, body, old)?),
    };
    if !new.is_empty() {
        index.add(new)?;
    }
    Ok(index)
}
