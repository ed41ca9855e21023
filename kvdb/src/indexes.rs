//! A corpus's key indexes: one per spec, retrieval layer and KV head, built from the stored
//! keys, saved in the store's `index` family and brought up to date whenever the corpus grows.
//!
//! The manifest lists the corpus's specs (canonical spellings, as asked for); the first is
//! the default of queries. A corpus's first ingest names its indexes (`flat` when it names
//! none); `kvdb index add` appends more. Each saved index records how many keys it covers,
//! so an index saved before the corpus grew (or a crash between a document's commit and the
//! index update) is caught up from the stored keys when it is next updated or loaded.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use kvdb_attention::DensePolicy;
use kvdb_index::saap::SaapArtifact;
use kvdb_index::{BuildContext, IndexSpec, KeyIndex, QuerySample};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::ingest::ModelRef;
use crate::store::{CorpusManifest, IndexKey, Kv, QuerySampleRows, Store};

/// The indexes of one spec over a corpus: per retrieval layer, in layer order, one per KV
/// head.
#[derive(Debug)]
pub struct IndexSet {
    layers: Vec<LayerIndexes>,
}

/// One retrieval layer's indexes.
#[derive(Debug)]
pub struct LayerIndexes {
    /// The layer.
    pub layer: usize,
    /// One index per KV head.
    pub heads: Vec<Box<dyn KeyIndex>>,
}

impl IndexSet {
    /// Retrieval layer `layer`'s indexes, one per KV head (`None` for a layer that does not
    /// retrieve).
    pub fn layer(&self, layer: usize) -> Option<&[Box<dyn KeyIndex>]> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .map(|l| l.heads.as_slice())
    }

    /// Every retrieval layer's indexes, in layer order.
    pub fn layers(&self) -> &[LayerIndexes] {
        &self.layers
    }

    /// The spec as its indexes were built (their own spelling, e.g. with defaults filled
    /// in); empty for a model without retrieval layers.
    pub fn built_spec(&self) -> String {
        self.layers
            .first()
            .and_then(|l| l.heads.first())
            .map(|i| i.spec().to_string())
            .unwrap_or_default()
    }

    /// Bytes the indexes hold in memory.
    pub fn memory_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| &l.heads)
            .map(|i| i.memory_bytes())
            .sum()
    }
}

/// What an index update reports as it goes.
#[derive(Debug, Clone)]
pub enum IndexEvent<'a> {
    /// Work on a spec begins: `parts` layer/KV-head indexes to build, catch up or check.
    Started {
        /// The spec.
        spec: &'a str,
        /// Layer/KV-head indexes.
        parts: usize,
    },
    /// One layer/KV-head index is done.
    Part {
        /// The spec.
        spec: &'a str,
        /// Its layer.
        layer: usize,
        /// Its KV head.
        head: usize,
    },
    /// A build changed something from its spec (e.g. fewer IVF lists).
    Warning {
        /// The spec.
        spec: &'a str,
        /// What and why.
        message: String,
    },
}

/// One spec's indexes, as saved.
#[derive(Debug, Clone, Serialize)]
pub struct IndexInfo {
    /// The spec as asked for.
    pub spec: String,
    /// The spec as built (the first layer/head's; e.g. fewer IVF lists on a small corpus).
    pub built: String,
    /// Layer/KV-head indexes saved.
    pub parts: usize,
    /// Keys each covers.
    pub keys: usize,
    /// Seconds their builds took, summed.
    pub build_seconds: f64,
    /// Keys added after the builds, and the seconds that took, summed.
    pub add_seconds: f64,
    /// Bytes in the store.
    pub bytes_on_disk: usize,
    /// Warnings of the builds, deduplicated.
    pub warnings: Vec<String>,
}

/// Where `kvdb saap train` registers the artifact of a model (by its sha256) and bucket count.
pub fn saap_registry_path(model_sha256: &str, centroids: usize) -> Result<PathBuf> {
    Ok(kvdb_model::fetch::models_dir()?
        .join("saap")
        .join(format!("{model_sha256}-c{centroids}.saap")))
}

/// The SAAP artifact for `spec` and where it is: `explicit` when given, else the one
/// registered for the model.
fn saap_artifact(
    explicit: Option<&Path>,
    model_sha256: &str,
    centroids: usize,
) -> Result<(PathBuf, SaapArtifact)> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => saap_registry_path(model_sha256, centroids)?,
    };
    if !path.exists() {
        return Err(Error::SaapArtifactMissing { path, centroids });
    }
    let artifact = SaapArtifact::read(&path).map_err(|e| Error::Io {
        context: format!("reading {}", path.display()),
        source: e,
    })?;
    if artifact.model_sha256 != model_sha256 {
        return Err(Error::SaapArtifactMismatch {
            problem: format!(
                "trained for another model (sha256 {})",
                artifact.model_sha256
            ),
            path,
        });
    }
    if artifact.centroids != centroids {
        return Err(Error::SaapArtifactMismatch {
            problem: format!(
                "it has {} buckets, the spec asks for {centroids}",
                artifact.centroids
            ),
            path,
        });
    }
    Ok((path, artifact))
}

fn build_context<'a>(
    model: ModelRef<'_>,
    layer: usize,
    saap: Option<&'a kvdb_index::saap::SaapHead>,
) -> Result<BuildContext<'a>> {
    let rope = model
        .model
        .rope(layer)
        .ok_or_else(|| Error::Internal(format!("the model has no layer {layer}")))?;
    Ok(BuildContext {
        rope: rope.clone(),
        seed: 0,
        saap,
        queries: None,
    })
}

/// Checks, before anything is ingested, built or saved, that every spec in `specs` can be
/// built for a corpus of the model with hash `model_sha256`: its fields within bounds, its
/// library compiled in, and for `saap` the trained artifact (`saap_file`, or the one
/// registered for the model) present and made for this model and bucket count.
pub fn check_specs(
    specs: &[IndexSpec],
    model_sha256: &str,
    saap_file: Option<&Path>,
) -> Result<()> {
    for spec in specs {
        kvdb_index::check_buildable(spec)?;
        if let IndexSpec::Saap(s) = spec {
            saap_artifact(saap_file, model_sha256, s.centroids)?;
        }
    }
    Ok(())
}

/// Brings every index of corpus `name` up to date with its tokens, after adding the specs in
/// `new` that it lacks (building them). SAAP specs use the artifact in `saap_file`, or the
/// one registered for the model. Each spec's indexes are committed in one batch with the
/// manifest that lists it.
pub fn update_indexes(
    store: &Store,
    name: &str,
    model: ModelRef<'_>,
    new: &[IndexSpec],
    saap_file: Option<&Path>,
    on_event: &mut dyn FnMut(IndexEvent<'_>),
) -> Result<Vec<IndexInfo>> {
    update_indexes_until(store, name, model, new, saap_file, &mut |event| {
        on_event(event);
        ControlFlow::Continue(())
    })
}

/// [`update_indexes`] that the caller can stop: `on_event` returning `Break` at a `Started`
/// or `Part` event stops the update with [`Error::Cancelled`]; the specs committed before it
/// stay, the one in progress is not written.
///
/// A spec joins the manifest's list in the commit that saves its built indexes, never
/// before: a spec that fails to build leaves no trace ([`Error::IndexBuild`]), so a corpus
/// is never left listing an index that every later update would fail on. A listed spec
/// with nothing saved that fails (listed by a corpus created over HTTP, or by an older
/// kvdb) is taken off the list for the same reason.
pub fn update_indexes_until(
    store: &Store,
    name: &str,
    model: ModelRef<'_>,
    new: &[IndexSpec],
    saap_file: Option<&Path>,
    on_event: &mut dyn FnMut(IndexEvent<'_>) -> ControlFlow<()>,
) -> Result<Vec<IndexInfo>> {
    let mut manifest = store.manifest(name)?;
    crate::ingest::check_model(&manifest, model.record)?;
    check_specs(new, &manifest.model.sha256, saap_file)?;
    // A corpus's first ingest names its indexes: the default `flat` gives way to them.
    let unsaved_default = match manifest.retrieval_layers().first() {
        Some(&layer) => {
            manifest.indexes == ["flat"]
                && store.index(index_key(&manifest, 0, layer, 0))?.is_none()
        }
        None => false,
    };
    if unsaved_default && !new.is_empty() {
        manifest.indexes.clear();
    }
    let mut wanted = manifest.indexes.clone();
    for spec in new {
        let canonical = spec.to_string();
        if !wanted.contains(&canonical) {
            wanted.push(canonical);
        }
    }
    if wanted.len() > u16::MAX as usize {
        return Err(Error::TooManyIndexes {
            corpus: manifest.name.clone(),
            count: wanted.len(),
            max: u16::MAX as usize,
        });
    }
    for (number, text) in wanted.iter().enumerate() {
        let listed = number < manifest.indexes.len();
        let batch = match build_spec(store, &manifest, number, text, model, saap_file, on_event) {
            Ok(batch) => batch,
            Err(e @ Error::Cancelled { .. }) => return Err(e),
            Err(source) => {
                let dropped = listed && saved_parts(store, &manifest, number)? == 0;
                if dropped {
                    remove_at(store, &mut manifest, number)?;
                }
                return Err(Error::IndexBuild {
                    corpus: manifest.name.clone(),
                    spec: text.clone(),
                    dropped,
                    source: Box::new(source),
                });
            }
        };
        let mut batch = batch;
        if !listed {
            manifest.indexes.push(text.clone());
        }
        batch.put_manifest(&manifest)?;
        store.commit(batch)?;
    }
    // Indexes are large: write the memtables out so the write-ahead log does not keep them.
    store.flush()?;
    list_indexes(store, &manifest)
}

/// Builds or catches up spec number `number` (`text`) of the corpus for every retrieval
/// layer and KV head, into a batch that is not yet committed.
fn build_spec<'s>(
    store: &'s Store,
    manifest: &CorpusManifest,
    number: usize,
    text: &str,
    model: ModelRef<'_>,
    saap_file: Option<&Path>,
    on_event: &mut dyn FnMut(IndexEvent<'_>) -> ControlFlow<()>,
) -> Result<crate::store::Batch<'s>> {
    let stop = || Error::Cancelled {
        corpus: manifest.name.clone(),
        tokens: manifest.tokens,
    };
    let n = manifest.tokens;
    let layers = manifest.retrieval_layers();
    let heads = manifest.model.n_kv_heads;
    let spec: IndexSpec = text.parse()?;
    if on_event(IndexEvent::Started {
        spec: text,
        parts: layers.len() * heads,
    })
    .is_break()
    {
        return Err(stop());
    }
    let mut artifact = match &spec {
        IndexSpec::Saap(s) => Some(saap_artifact(
            saap_file,
            &manifest.model.sha256,
            s.centroids,
        )),
        _ => None,
    };
    // A needed artifact that cannot be read fails the build with its own error.
    if let Some(Err(_)) = &artifact {
        let needed = layers
            .iter()
            .flat_map(|&layer| (0..heads).map(move |head| (layer, head)))
            .map(|(layer, head)| store.index(index_key(manifest, number, layer, head)))
            .collect::<Result<Vec<_>>>()?
            .iter()
            .any(Option::is_none);
        if needed && n > 0 {
            if let Some(Err(e)) = artifact.take() {
                return Err(e);
            }
        }
    }
    let artifact = match &artifact {
        Some(Ok((path, a))) => Some((path, a)),
        _ => None,
    };
    let parts = Parts {
        store,
        manifest,
        number,
        spec: &spec,
        model,
        artifact,
    };
    let mut batch = store.batch();
    // Builds run in parallel: faiss's products on their own threads, not OpenBLAS's pool.
    kvdb_model::blas_on_calling_threads();
    // Each build is mostly one thread's work, so every (layer, KV head) part is one task, as
    // many at once as the pool has threads: a model with few KV heads (Gemma 3's one, Qwen's
    // four) would otherwise leave most cores idle, building a layer's heads at a time. Parts
    // are built in waves of that many so that progress is reported, and a stop honoured,
    // as the parts finish, and so that at most a wave's keys are in memory at once (a part
    // reads its layer and head's keys as f32: 4 bytes a dimension and token).
    for wave in layer_heads(manifest).chunks(rayon::current_num_threads().max(1)) {
        let built = wave
            .par_iter()
            .map(|&(layer, head)| parts.build(layer, head))
            .collect::<Result<Vec<_>>>()?;
        for (&(layer, head), part) in wave.iter().zip(built) {
            if let Some(BuiltPart {
                key,
                bytes,
                warnings,
            }) = part
            {
                for warning in warnings {
                    // Warnings come mid-build; the `Part` that follows is where to stop.
                    let _ = on_event(IndexEvent::Warning {
                        spec: text,
                        message: format!("layer {layer} KV head {head}: {warning}"),
                    });
                }
                batch.put_index(key, &bytes)?;
            }
            if on_event(IndexEvent::Part {
                spec: text,
                layer,
                head,
            })
            .is_break()
            {
                return Err(stop());
            }
        }
    }
    Ok(batch)
}

/// One layer and KV head's index, built: where it is saved, its bytes and build warnings.
struct BuiltPart {
    key: IndexKey,
    bytes: Vec<u8>,
    warnings: Vec<String>,
}

/// What every layer and KV head's index of one spec is built from.
struct Parts<'a, 'm> {
    store: &'a Store,
    manifest: &'a CorpusManifest,
    /// The spec's number in the manifest.
    number: usize,
    spec: &'a IndexSpec,
    model: ModelRef<'m>,
    /// SAAP's trained heads, for a saap spec.
    artifact: Option<(&'a PathBuf, &'a SaapArtifact)>,
}

impl Parts<'_, '_> {
    /// `layer` and KV `head`'s index, built or caught up: its key, saved bytes and build
    /// warnings (`None` when the saved one is current).
    fn build(&self, layer: usize, head: usize) -> Result<Option<BuiltPart>> {
        let n = self.manifest.tokens;
        let key = index_key(self.manifest, self.number, layer, head);
        let saved = self.store.index(key)?;
        let current = match &saved {
            Some(bytes) => kvdb_index::saved_info(bytes)?.len == n,
            None => false,
        };
        if current || n == 0 {
            return Ok(None);
        }
        let keys = self
            .store
            .rows(self.manifest, Kv::Keys, layer, head, 0..n)?;
        let head_artifact = match self.artifact {
            Some((path, a)) => {
                Some(
                    a.head(layer, head)
                        .ok_or_else(|| Error::SaapArtifactMismatch {
                            path: path.clone(),
                            problem: format!("it has no head for layer {layer}, KV head {head}"),
                        })?,
                )
            }
            None => None,
        };
        let sample = if self.spec.learns_from_queries() {
            self.store.query_sample(self.manifest, layer, head)?
        } else {
            QuerySampleRows::default()
        };
        let context = BuildContext {
            queries: (!sample.positions.is_empty()).then(|| QuerySample {
                queries: &sample.queries,
                positions: &sample.positions,
                scale: self.model.model.config().attention_scale,
                recent: DensePolicy::default().window,
            }),
            ..build_context(self.model, layer, head_artifact)?
        };
        let index = match &saved {
            Some(bytes) => {
                let index = kvdb_index::load(bytes, &context, &keys)?;
                // Lists reduced for a small corpus are rebuilt once it has grown.
                let stats = index.build_stats();
                if index.spec() != *self.spec && n >= 2 * stats.keys {
                    kvdb_index::build(self.spec, &context, &keys)?
                } else {
                    index
                }
            }
            None => kvdb_index::build(self.spec, &context, &keys)?,
        };
        Ok(Some(BuiltPart {
            key,
            bytes: kvdb_index::save(index.as_ref())?,
            warnings: index.build_stats().warnings.clone(),
        }))
    }
}

/// How many layer/KV-head indexes of spec number `number` are saved.
fn saved_parts(store: &Store, manifest: &CorpusManifest, number: usize) -> Result<usize> {
    let mut parts = 0;
    for layer in manifest.retrieval_layers() {
        for head in 0..manifest.model.n_kv_heads {
            parts += usize::from(
                store
                    .index(index_key(manifest, number, layer, head))?
                    .is_some(),
            );
        }
    }
    Ok(parts)
}

/// Removes index `spec` from corpus `name`: its saved indexes are deleted and the specs after
/// it move up one place (a saved index is addressed by its spec's position), in one commit
/// with the manifest. `spec` is matched as listed or in its canonical spelling, so a spec
/// that an older kvdb saved and this one no longer parses can still be removed. The only
/// index of a corpus cannot be removed (queries need a default): add another first.
pub fn remove_index(store: &Store, name: &str, spec: &str) -> Result<CorpusManifest> {
    let mut manifest = store.manifest(name)?;
    let canonical = spec.parse::<IndexSpec>().map(|s| s.to_string());
    let Some(number) = manifest
        .indexes
        .iter()
        .position(|s| s == spec || canonical.as_ref().is_ok_and(|c| c == s))
    else {
        return Err(Error::IndexMissing {
            corpus: manifest.name.clone(),
            spec: canonical.unwrap_or_else(|_| spec.to_string()),
            available: manifest.indexes.clone(),
        });
    };
    if manifest.indexes.len() == 1 {
        return Err(Error::LastIndex {
            corpus: manifest.name.clone(),
            spec: manifest.indexes[0].clone(),
        });
    }
    remove_at(store, &mut manifest, number)?;
    Ok(manifest)
}

/// Takes spec number `number` off `manifest`'s list, deleting its saved indexes and moving
/// the later specs' up one place, in one commit.
fn remove_at(store: &Store, manifest: &mut CorpusManifest, number: usize) -> Result<()> {
    let mut batch = store.batch();
    let last = manifest.indexes.len() - 1;
    for layer in manifest.retrieval_layers() {
        for head in 0..manifest.model.n_kv_heads {
            for later in number + 1..=last {
                let from = index_key(manifest, later, layer, head);
                let to = index_key(manifest, later - 1, layer, head);
                match store.index(from)? {
                    Some(bytes) => batch.put_index(to, &bytes)?,
                    None => batch.delete_index(to)?,
                }
            }
            batch.delete_index(index_key(manifest, last, layer, head))?;
        }
    }
    manifest.indexes.remove(number);
    if manifest.indexes.is_empty() {
        // Only a failed build drops a corpus's last spec: it falls back to the default of a
        // new corpus, `flat`, which answers without anything saved.
        manifest.indexes.push(IndexSpec::Flat.to_string());
    }
    batch.put_manifest(manifest)?;
    store.commit(batch)
}

/// Every retrieval layer and KV head of `manifest`'s model, in layer order, heads within.
fn layer_heads(manifest: &CorpusManifest) -> Vec<(usize, usize)> {
    let heads = manifest.model.n_kv_heads;
    manifest
        .retrieval_layers()
        .into_iter()
        .flat_map(|layer| (0..heads).map(move |head| (layer, head)))
        .collect()
}

fn index_key(manifest: &CorpusManifest, number: usize, layer: usize, head: usize) -> IndexKey {
    IndexKey {
        corpus: manifest.id,
        index: number as u16,
        layer: layer as u16,
        head: head as u16,
    }
}

/// The corpus's indexes as saved.
pub fn list_indexes(store: &Store, manifest: &CorpusManifest) -> Result<Vec<IndexInfo>> {
    let layers = manifest.retrieval_layers();
    let heads = manifest.model.n_kv_heads;
    let mut out = Vec::new();
    for (number, spec) in manifest.indexes.iter().enumerate() {
        let mut info = IndexInfo {
            spec: spec.clone(),
            built: String::new(),
            parts: 0,
            keys: 0,
            build_seconds: 0.0,
            add_seconds: 0.0,
            bytes_on_disk: 0,
            warnings: Vec::new(),
        };
        for &layer in &layers {
            for head in 0..heads {
                let Some(bytes) = store.index(index_key(manifest, number, layer, head))? else {
                    continue;
                };
                let saved = kvdb_index::saved_info(&bytes)?;
                if info.parts == 0 {
                    info.built = saved.spec.clone();
                    info.keys = saved.len;
                }
                info.parts += 1;
                info.bytes_on_disk += bytes.len();
                info.build_seconds += saved.stats.seconds;
                info.add_seconds += saved.stats.add_seconds;
                for w in saved.stats.warnings {
                    if !info.warnings.contains(&w) {
                        info.warnings.push(w);
                    }
                }
            }
        }
        out.push(info);
    }
    Ok(out)
}

/// Loads the indexes of `spec` for every retrieval layer and KV head of the corpus (as of
/// `manifest`): from their saved bytes, caught up to the manifest's tokens; `flat`, and any
/// spec saved for none of them, is built from the stored keys (a corpus ingested before the
/// spec was added answers with a clear error instead).
pub(crate) fn load_indexes(
    store: &Store,
    manifest: &CorpusManifest,
    model: ModelRef<'_>,
    spec: &IndexSpec,
) -> Result<IndexSet> {
    let text = spec.to_string();
    let number = manifest.indexes.iter().position(|s| *s == text);
    if number.is_none() && *spec != IndexSpec::Flat {
        return Err(Error::IndexMissing {
            corpus: manifest.name.clone(),
            spec: text,
            available: manifest.indexes.clone(),
        });
    }
    let n = manifest.tokens;
    let heads = manifest.model.n_kv_heads;
    let load = |layer: usize, head: usize| -> Result<Box<dyn KeyIndex>> {
        let keys = |from: usize| store.rows(manifest, Kv::Keys, layer, head, from..n);
        let saved = match number {
            Some(i) => store.index(index_key(manifest, i, layer, head))?,
            None => None,
        };
        let context = build_context(model, layer, None)?;
        let info = saved.as_deref().map(kvdb_index::saved_info).transpose()?;
        match (saved, info) {
            // Saved bytes may cover more keys than this (older) manifest: a reader opened
            // between an ingest's commit and its index update sees the newer index; rebuild
            // then, as for a missing one. An index that saved what its search needs reads
            // only the keys added since (none, usually): opening a corpus for the GPU, whose
            // rows it uploads itself, then reads no keys for its indexes.
            (Some(bytes), Some(info)) if info.len <= n => Ok(kvdb_index::load_from(
                &bytes,
                &context,
                info.keys_from,
                &keys(info.keys_from)?,
            )?),
            _ if matches!(spec, IndexSpec::Saap(_)) => Err(Error::IndexNotSaved {
                corpus: manifest.name.clone(),
                spec: text.to_string(),
                layer,
                head,
                tokens: n,
            }),
            _ => Ok(kvdb_index::build(spec, &context, &keys(0)?)?),
        }
    };
    // Every layer and KV head's index loads on its own thread (a model with few KV heads
    // has several layers), and faiss's products on that thread, not OpenBLAS's pool.
    kvdb_model::blas_on_calling_threads();
    let mut loaded = layer_heads(manifest)
        .par_iter()
        .map(|&(layer, head)| load(layer, head))
        .collect::<Result<Vec<_>>>()?
        .into_iter();
    let layers = manifest
        .retrieval_layers()
        .into_iter()
        .map(|layer| LayerIndexes {
            layer,
            heads: loaded.by_ref().take(heads).collect(),
        })
        .collect();
    Ok(IndexSet { layers })
}
