//! A corpus's key indexes: one per spec, retrieval layer and KV head, built from the stored
//! keys, saved in the store's `index` family and brought up to date whenever the corpus grows.
//!
//! The manifest lists the corpus's specs (canonical spellings, as asked for); the first is
//! the default of queries. A corpus's first ingest names its indexes (`flat` when it names
//! none); `kvdb index add` appends more. Each saved index records how many keys it covers,
//! so an index saved before the corpus grew (or a crash between a document's commit and the
//! index update) is caught up from the stored keys when it is next updated or loaded.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use kvdb_index::saap::SaapArtifact;
use kvdb_index::{BuildContext, IndexSpec, KeyIndex};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::ingest::ModelRef;
use crate::store::{CorpusManifest, IndexKey, Kv, Store};

/// The indexes of one spec: per retrieval layer, one per KV head.
pub type IndexSet = HashMap<usize, Vec<Box<dyn KeyIndex>>>;

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

/// The SAAP artifact for `spec`: `explicit` when given, else the one registered for the model.
fn saap_artifact(
    explicit: Option<&Path>,
    manifest: &CorpusManifest,
    centroids: usize,
) -> Result<SaapArtifact> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => saap_registry_path(&manifest.model.sha256, centroids)?,
    };
    if !path.exists() {
        return Err(Error::Query(format!(
            "no SAAP artifact with {centroids} buckets for this model at {}: train one with \
             `kvdb saap train --centroids {centroids} --out FILE TEXT...` (which registers it) \
             or name one with --saap FILE",
            path.display()
        )));
    }
    let artifact = SaapArtifact::read(&path).map_err(|e| Error::Io {
        context: format!("reading {}", path.display()),
        source: e,
    })?;
    if artifact.model_sha256 != manifest.model.sha256 {
        return Err(Error::Query(format!(
            "{} was trained for another model (sha256 {})",
            path.display(),
            artifact.model_sha256
        )));
    }
    if artifact.centroids != centroids {
        return Err(Error::Query(format!(
            "{} has {} buckets, the spec asks for {centroids}",
            path.display(),
            artifact.centroids
        )));
    }
    Ok(artifact)
}

fn build_context<'a>(
    model: ModelRef<'_>,
    layer: usize,
    saap: Option<&'a kvdb_index::saap::SaapHead>,
) -> Result<BuildContext<'a>> {
    let rope = model
        .model
        .rope(layer)
        .ok_or_else(|| Error::Corrupt(format!("the model has no layer {layer}")))?;
    Ok(BuildContext {
        rope: rope.clone(),
        seed: 0,
        saap,
    })
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
pub fn update_indexes_until(
    store: &Store,
    name: &str,
    model: ModelRef<'_>,
    new: &[IndexSpec],
    saap_file: Option<&Path>,
    on_event: &mut dyn FnMut(IndexEvent<'_>) -> ControlFlow<()>,
) -> Result<Vec<IndexInfo>> {
    let stop = |manifest: &CorpusManifest| Error::Cancelled {
        corpus: manifest.name.clone(),
        tokens: manifest.tokens,
    };
    let mut manifest = store.manifest(name)?;
    crate::ingest::check_model(&manifest, model.record)?;
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
    for spec in new {
        let canonical = spec.to_string();
        if !manifest.indexes.contains(&canonical) {
            manifest.indexes.push(canonical);
        }
    }
    if manifest.indexes.len() > u16::MAX as usize {
        return Err(Error::Query("too many indexes".into()));
    }
    let n = manifest.tokens;
    let layers = manifest.retrieval_layers();
    let heads = manifest.model.n_kv_heads;
    for (number, text) in manifest.indexes.clone().iter().enumerate() {
        let spec: IndexSpec = text.parse()?;
        if on_event(IndexEvent::Started {
            spec: text,
            parts: layers.len() * heads,
        })
        .is_break()
        {
            return Err(stop(&manifest));
        }
        let artifact = match &spec {
            IndexSpec::Saap(s) => Some(saap_artifact(saap_file, &manifest, s.centroids)),
            _ => None,
        };
        let mut batch = store.batch();
        for &layer in &layers {
            for head in 0..heads {
                let key = index_key(&manifest, number, layer, head);
                let saved = store.index(key)?;
                let current = match &saved {
                    Some(bytes) => kvdb_index::saved_info(bytes)?.len == n,
                    None => false,
                };
                if !current && n > 0 {
                    let keys = store.rows(&manifest, Kv::Keys, layer, head, 0..n)?;
                    let head_artifact = match &artifact {
                        Some(Ok(a)) => Some(a.head(layer, head).ok_or_else(|| {
                            Error::Query(format!(
                                "the SAAP artifact has no head for layer {layer}, KV head {head}"
                            ))
                        })?),
                        Some(Err(e)) if saved.is_none() => return Err(Error::Query(e.to_string())),
                        _ => None,
                    };
                    let context = build_context(model, layer, head_artifact)?;
                    let index = match &saved {
                        Some(bytes) => {
                            let index = kvdb_index::load(bytes, &context, &keys)?;
                            // Lists reduced for a small corpus are rebuilt once it has grown.
                            let stats = index.build_stats();
                            if index.spec() != spec && n >= 2 * stats.keys {
                                kvdb_index::build(&spec, &context, &keys)?
                            } else {
                                index
                            }
                        }
                        None => kvdb_index::build(&spec, &context, &keys)?,
                    };
                    for warning in &index.build_stats().warnings {
                        // Warnings come mid-build; the `Part` that follows is where to stop.
                        let _ = on_event(IndexEvent::Warning {
                            spec: text,
                            message: format!("layer {layer} KV head {head}: {warning}"),
                        });
                    }
                    batch.put_index(key, &kvdb_index::save(index.as_ref())?)?;
                }
                if on_event(IndexEvent::Part {
                    spec: text,
                    layer,
                    head,
                })
                .is_break()
                {
                    return Err(stop(&manifest));
                }
            }
        }
        batch.put_manifest(&manifest)?;
        store.commit(batch)?;
    }
    list_indexes(store, &manifest)
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
pub fn load_indexes(
    store: &Store,
    manifest: &CorpusManifest,
    model: ModelRef<'_>,
    spec: &IndexSpec,
) -> Result<IndexSet> {
    let text = spec.to_string();
    let number = manifest.indexes.iter().position(|s| *s == text);
    if number.is_none() && *spec != IndexSpec::Flat {
        return Err(Error::Query(format!(
            "corpus `{}` has no index `{text}` (it has: {}); add it with `kvdb index add \
             --corpus {} {text}`",
            manifest.name,
            manifest.indexes.join(", "),
            manifest.name
        )));
    }
    let n = manifest.tokens;
    let mut set = IndexSet::new();
    for layer in manifest.retrieval_layers() {
        let mut per_head = Vec::with_capacity(manifest.model.n_kv_heads);
        for head in 0..manifest.model.n_kv_heads {
            let keys = store.rows(manifest, Kv::Keys, layer, head, 0..n)?;
            let saved = match number {
                Some(i) => store.index(index_key(manifest, i, layer, head))?,
                None => None,
            };
            let context = build_context(model, layer, None)?;
            let index = match saved {
                // Saved bytes may cover more keys than this (older) manifest: a reader
                // opened between an ingest's commit and its index update sees the newer
                // index; rebuild then, as for a missing one.
                Some(bytes) if kvdb_index::saved_info(&bytes)?.len <= n => {
                    kvdb_index::load(&bytes, &context, &keys)?
                }
                _ if matches!(spec, IndexSpec::Saap(_)) => {
                    return Err(Error::Query(format!(
                        "the saap index of layer {layer} KV head {head} is not saved for these \
                         {n} tokens yet: run `kvdb index add --corpus {} {text}`",
                        manifest.name
                    )))
                }
                _ => kvdb_index::build(spec, &context, &keys)?,
            };
            per_head.push(index);
        }
        set.insert(layer, per_head);
    }
    Ok(set)
}
