//! Corpora, their documents and indexes, and the jobs that change them.

use std::path::PathBuf;

use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{header, StatusCode};
use axum::Json;
use kvdb::store::{
    validate_corpus_name, CorpusManifest, LayerPolicy, PrefillRecord, DEFAULT_BLOCK_SIZE,
};
use kvdb::{check_specs, list_indexes, remove_index as remove_index_from, IndexInfo};
use kvdb::{document_from_bytes, is_supported_document, SourceDocument};
use kvdb_index::IndexSpec;
use kvdb_model::LayerKind;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{echo, interrupted, ApiError, ApiJson, ApiPath, ApiResult, ErrorBody};
use crate::jobs::{Job, Work};
use crate::state::AppState;
use crate::{blocking, Shared};

/// `POST /v1/corpora`: a new, empty corpus.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCorpus {
    /// 1 to 64 of `A-Z a-z 0-9 . _ -`, starting with a letter or digit.
    pub name: String,
    /// A GGUF file name in the server's model folder (default: the default model).
    #[serde(default)]
    pub model: Option<String>,
    /// Index specs (the first is the queries' default; default `flat`), built as documents
    /// arrive.
    #[serde(default)]
    pub indexes: Vec<String>,
    /// What each layer stores (default: global layers everything, sliding-window layers
    /// their window). A sliding-window layer may keep more than its window; a global layer
    /// must keep everything.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>, example = json!([{"kind": "last", "keep": 511}, {"kind": "all"}]))]
    pub layers: Option<Vec<LayerPolicy>>,
}

/// A corpus as the API describes it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CorpusInfo {
    /// Its name.
    pub name: String,
    /// The model it was ingested with.
    pub model: String,
    /// The model file's sha256.
    pub model_sha256: String,
    /// Complete documents.
    pub document_count: usize,
    /// Committed tokens (its context).
    pub tokens: usize,
    /// The model's context length.
    pub context_length: usize,
    /// Layers that retrieve (store every token).
    pub retrieval_layers: Vec<usize>,
    /// Index specs; the first is the default.
    pub indexes: Vec<String>,
    /// Bytes of stored keys and values (f16).
    pub stored_bytes: u64,
    /// The unfinished job (ingest or index) of the corpus, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// A document an interrupted ingest left part-way (ingest it again to finish it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<String>,
    /// Its documents (`GET /v1/corpora/{name}` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub documents: Option<Vec<DocumentInfo>>,
}

/// One document of a corpus.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DocumentInfo {
    /// Its number.
    pub number: usize,
    /// Its title.
    pub title: String,
    /// Its first token in the corpus's context.
    pub start: usize,
    /// One past its last token.
    pub end: usize,
    /// Its size in bytes.
    pub bytes: usize,
    /// sha256 of its content.
    pub sha256: String,
}

/// `GET /v1/corpora`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CorpusList {
    /// Every corpus, by name.
    pub corpora: Vec<CorpusInfo>,
}

/// One document of `POST /v1/corpora/{name}/documents`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewDocument {
    /// Its title (a title ending in `.html` is read as HTML, its markup stripped).
    pub title: String,
    /// Its text.
    pub text: String,
}

/// `POST /v1/corpora/{name}/documents` as JSON (or send files as `multipart/form-data`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddDocuments {
    /// Appended in this order.
    pub documents: Vec<NewDocument>,
}

/// `POST /v1/corpora/{name}/indexes`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddIndexes {
    /// Index specs, e.g. `ivf64,np40`, `hnsw16,ef128`, `lsh:L=64,K=4,min=3`.
    pub specs: Vec<String>,
}

/// `GET /v1/corpora/{name}/indexes`: each spec's indexes as saved.
#[derive(Debug, Serialize, ToSchema)]
pub struct IndexList {
    /// The first is the default.
    #[schema(value_type = Vec<Object>)]
    pub indexes: Vec<IndexInfo>,
}

const TITLE_CHARS: usize = 256;

pub(crate) fn corpus_info(
    state: &AppState,
    m: &CorpusManifest,
    with_documents: bool,
) -> ApiResult<CorpusInfo> {
    let documents = if with_documents {
        Some(
            state
                .store
                .documents(m)?
                .into_iter()
                .map(|d| DocumentInfo {
                    number: d.number,
                    title: d.title,
                    start: d.tokens.start,
                    end: d.tokens.end,
                    bytes: d.bytes,
                    sha256: d.sha256,
                })
                .collect(),
        )
    } else {
        None
    };
    Ok(CorpusInfo {
        name: m.name.clone(),
        model: m.model.name.clone(),
        model_sha256: m.model.sha256.clone(),
        document_count: m.documents,
        tokens: m.tokens,
        context_length: m.model.context_length,
        retrieval_layers: m.retrieval_layers(),
        indexes: m.indexes.clone(),
        stored_bytes: m.kv_bytes(),
        job: state.jobs.active(&m.name)?,
        interrupted: m.pending.as_ref().map(|p| p.title.clone()),
        documents,
    })
}

/// A valid corpus name from a path or body (400 otherwise).
pub(crate) fn checked_name(name: &str) -> ApiResult<()> {
    Ok(validate_corpus_name(name)?)
}

/// Parses an index spec (400 naming it and its bad token, both cut short).
pub(crate) fn parse_spec(spec: &str) -> ApiResult<IndexSpec> {
    spec.parse::<IndexSpec>().map_err(|e| ApiError::from(&e))
}

/// Parses index specs (400 naming the bad one).
pub(crate) fn parse_specs(specs: &[String]) -> ApiResult<Vec<IndexSpec>> {
    specs.iter().map(|s| parse_spec(s)).collect()
}

/// List the corpora.
#[utoipa::path(get, path = "/v1/corpora", tag = "corpora",
    responses((status = 200, body = CorpusList)))]
pub(crate) async fn list(State(state): State<Shared>) -> ApiResult<Json<CorpusList>> {
    blocking(state, |s| {
        let corpora = s
            .store
            .corpora()?
            .iter()
            .map(|m| corpus_info(s, m, false))
            .collect::<ApiResult<_>>()?;
        Ok(Json(CorpusList { corpora }))
    })
    .await
}

/// Create an empty corpus.
#[utoipa::path(post, path = "/v1/corpora", tag = "corpora", request_body = CreateCorpus,
    responses((status = 201, body = CorpusInfo), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub(crate) async fn create(
    State(state): State<Shared>,
    ApiJson(body): ApiJson<CreateCorpus>,
) -> ApiResult<(StatusCode, Json<CorpusInfo>)> {
    checked_name(&body.name)?;
    let specs = parse_specs(&body.indexes)?;
    blocking(state, move |s| {
        let model = s.models.by_name(body.model.as_deref())?;
        // The specs are saved before anything is stored to build them: each must be
        // buildable now (SAAP's artifact found), or the corpus's first ingest would fail.
        check_specs(&specs, &model.record.sha256, None)?;
        let config = model.model.config();
        let layers = match body.layers {
            Some(layers) => check_layers(config, layers)?,
            None => LayerPolicy::for_model(config),
        };
        let _catalog = s.lock_catalog()?;
        if s.store.manifest(&body.name).is_ok() {
            return Err(ApiError::conflict(format!(
                "corpus `{}` exists already",
                echo(&body.name)
            )));
        }
        let models = kvdb::LoadedModel::as_ref(&model);
        let prefill = PrefillRecord {
            device: models.device().into(),
            chunk: models.prefill_chunk(),
        };
        let mut manifest = s.store.create_corpus(
            &body.name,
            model.record.clone(),
            layers,
            DEFAULT_BLOCK_SIZE,
            prefill,
        )?;
        if !specs.is_empty() {
            // Nothing is stored yet, so naming the indexes is all there is to build.
            manifest.indexes.clear();
            for spec in &specs {
                let spec = spec.to_string();
                if !manifest.indexes.contains(&spec) {
                    manifest.indexes.push(spec);
                }
            }
            let mut batch = s.store.batch();
            batch.put_manifest(&manifest)?;
            s.store.commit(batch)?;
        }
        Ok((StatusCode::CREATED, Json(corpus_info(s, &manifest, true)?)))
    })
    .await
}

/// A layer policy the engine can honour for `config`'s layers.
fn check_layers(
    config: &kvdb_model::ModelConfig,
    layers: Vec<LayerPolicy>,
) -> ApiResult<Vec<LayerPolicy>> {
    if layers.len() != config.n_layers() {
        return Err(ApiError::invalid(format!(
            "`layers` lists {} layers, the model has {}",
            layers.len(),
            config.n_layers()
        )));
    }
    for (spec, layer) in config.layers.iter().zip(&layers) {
        match (&spec.kind, layer) {
            (LayerKind::Global, LayerPolicy::All) => {}
            (LayerKind::SlidingWindow { window }, LayerPolicy::Last { keep })
                if *keep + 1 >= *window => {}
            (kind, _) => {
                return Err(ApiError::invalid(format!(
                    "layer {} is {kind:?}: a global layer stores everything (`all`), a \
                     sliding-window layer at least its window less one (`last`)",
                    spec.index
                )))
            }
        }
    }
    Ok(layers)
}

/// Describe a corpus: model, documents, tokens, indexes, sizes.
#[utoipa::path(get, path = "/v1/corpora/{name}", tag = "corpora",
    params(("name" = String, Path, description = "The corpus")),
    responses((status = 200, body = CorpusInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub(crate) async fn describe(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<CorpusInfo>> {
    checked_name(&name)?;
    blocking(state, move |s| {
        Ok(Json(corpus_info(s, &s.store.manifest(&name)?, true)?))
    })
    .await
}

/// Delete a corpus and everything it stored (409 while a job works on it or queries run on
/// it).
#[utoipa::path(delete, path = "/v1/corpora/{name}", tag = "corpora",
    params(("name" = String, Path, description = "The corpus")),
    responses((status = 200, body = CorpusInfo), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub(crate) async fn delete(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<CorpusInfo>> {
    checked_name(&name)?;
    blocking(state, move |s| {
        // Under the catalog lock: no query can start on the corpus between the check and
        // the deletion (queries count themselves under the same lock).
        let _catalog = s.lock_catalog()?;
        let manifest = s.store.manifest(&name)?;
        s.check_idle(&name)?;
        let info = corpus_info(s, &manifest, false)?;
        s.store.delete_corpus(&name)?;
        s.invalidate(&name);
        Ok(Json(info))
    })
    .await
}

/// Append documents (JSON, or files named .txt, .md or .html, or without an extension, as
/// `multipart/form-data`, any field name) in a background ingest job.
#[utoipa::path(post, path = "/v1/corpora/{name}/documents", tag = "corpora",
    params(("name" = String, Path, description = "The corpus")),
    request_body(content(
        (AddDocuments = "application/json"),
        (Vec<u8> = "multipart/form-data")
    )),
    responses((status = 202, body = Job), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 422, body = ErrorBody)))]
pub(crate) async fn add_documents(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
    request: Request,
) -> ApiResult<(StatusCode, Json<Job>)> {
    checked_name(&name)?;
    let multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let mut uploads: Vec<(String, Vec<u8>)> = Vec::new();
    if multipart {
        let mut form = Multipart::from_request(request, &()).await?;
        while let Some(field) = form.next_field().await? {
            let Some(title) = field.file_name().map(str::to_string) else {
                return Err(ApiError::invalid(format!(
                    "part `{}` is not a file: each part must be a file with a filename \
                     (named .txt, .md or .html, or without an extension)",
                    echo(field.name().unwrap_or_default())
                )));
            };
            if !is_supported_document(&PathBuf::from(&title)) {
                return Err(ApiError::invalid(format!(
                    "`{}`: upload files named .txt, .md or .html, or without an extension (text)",
                    echo(&title)
                )));
            }
            uploads.push((title, field.bytes().await?.to_vec()));
        }
    } else {
        let ApiJson(body) = ApiJson::<AddDocuments>::from_request(request, &()).await?;
        uploads.extend(
            body.documents
                .into_iter()
                .map(|d| (d.title, d.text.into_bytes())),
        );
    }
    if uploads.is_empty() {
        return Err(ApiError::invalid("no documents given"));
    }
    blocking(state, move |s| {
        let documents = uploads
            .iter()
            .map(|(title, bytes)| {
                if title.trim().is_empty() || title.chars().count() > TITLE_CHARS {
                    return Err(ApiError::invalid(format!(
                        "a document title must have 1 to {TITLE_CHARS} characters"
                    )));
                }
                Ok(document_from_bytes(&PathBuf::from(title), bytes)?)
            })
            .collect::<ApiResult<Vec<SourceDocument>>>()?;
        let _catalog = s.lock_catalog()?;
        let manifest = s.store.manifest(&name)?;
        // Fails now, not in the job, when the corpus's model is not here.
        s.models.for_corpus(&manifest)?;
        check_finishes_pending(s, &manifest, &documents)?;
        let job = s.jobs.submit(&name, Work::Ingest(documents))?;
        Ok((StatusCode::ACCEPTED, Json(job)))
    })
    .await
}

/// 409 now, not a failed job later, when the corpus has an interrupted document (a cancelled
/// ingest left it part-way) and `documents` does not include it: the engine finishes it
/// before anything new and refuses a set without it. With a job queued or running the
/// corpus's state is in flux (a running ingest has a document part-way; a queued one may
/// finish it), and that job's own start decides.
fn check_finishes_pending(
    s: &AppState,
    manifest: &CorpusManifest,
    documents: &[SourceDocument],
) -> ApiResult<()> {
    let Some(pending) = &manifest.pending else {
        return Ok(());
    };
    if s.jobs.active(&manifest.name)?.is_some()
        || documents.iter().any(|d| d.sha256 == pending.sha256)
    {
        return Ok(());
    }
    Err(ApiError::conflict(interrupted(
        &manifest.name,
        &pending.title,
        manifest.tokens.saturating_sub(pending.start),
        pending.total,
    )))
}

/// List a corpus's indexes as saved.
#[utoipa::path(get, path = "/v1/corpora/{name}/indexes", tag = "corpora",
    params(("name" = String, Path, description = "The corpus")),
    responses((status = 200, body = IndexList), (status = 404, body = ErrorBody)))]
pub(crate) async fn indexes(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<IndexList>> {
    checked_name(&name)?;
    blocking(state, move |s| {
        let manifest = s.store.manifest(&name)?;
        Ok(Json(IndexList {
            indexes: list_indexes(&s.store, &manifest)?,
        }))
    })
    .await
}

/// Add indexes to a corpus in a background job.
#[utoipa::path(post, path = "/v1/corpora/{name}/indexes", tag = "corpora",
    params(("name" = String, Path, description = "The corpus")), request_body = AddIndexes,
    responses((status = 202, body = Job), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub(crate) async fn add_indexes(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<AddIndexes>,
) -> ApiResult<(StatusCode, Json<Job>)> {
    checked_name(&name)?;
    let specs = parse_specs(&body.specs)?;
    if specs.is_empty() {
        return Err(ApiError::invalid("no index specs given"));
    }
    blocking(state, move |s| {
        let _catalog = s.lock_catalog()?;
        let manifest = s.store.manifest(&name)?;
        s.models.for_corpus(&manifest)?;
        // Refused now (SAAP without its artifact), not as a failed job.
        check_specs(&specs, &manifest.model.sha256, None)?;
        let job = s.jobs.submit(&name, Work::Index(specs))?;
        Ok((StatusCode::ACCEPTED, Json(job)))
    })
    .await
}

/// Remove an index from a corpus: its saved data is deleted and the specs after it move up
/// (409 while a job works on the corpus or queries run on it; the only index cannot go).
#[utoipa::path(delete, path = "/v1/corpora/{name}/indexes/{spec}", tag = "corpora",
    params(("name" = String, Path, description = "The corpus"),
        ("spec" = String, Path, description = "The index spec, URL-encoded (`ivf64%2Cnp40`)")),
    responses((status = 200, body = IndexList, description = "The indexes left"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub(crate) async fn remove_index(
    State(state): State<Shared>,
    ApiPath((name, spec)): ApiPath<(String, String)>,
) -> ApiResult<Json<IndexList>> {
    checked_name(&name)?;
    blocking(state, move |s| {
        // Under the catalog lock: queries count themselves under it, so none starts (on the
        // old numbering of the corpus's saved indexes) between the check and the removal.
        let _catalog = s.lock_catalog()?;
        let manifest = s.store.manifest(&name)?;
        // A spec listed as given is removed even if it no longer parses (an older kvdb
        // saved it); anything else must parse (400) and be listed (404).
        if !manifest.indexes.contains(&spec) {
            let canonical = parse_spec(&spec)?.to_string();
            if !manifest.indexes.contains(&canonical) {
                return Err(ApiError::not_found(format!(
                    "corpus `{name}` has no index `{}` (it has: {})",
                    echo(&canonical),
                    manifest.indexes.join(", ")
                )));
            }
        }
        s.check_idle(&name)?;
        let removed = remove_index_from(&s.store, &name, &spec).map_err(|e| match e {
            // Here a missing index is the resource the request names, not a query's option.
            kvdb::Error::IndexMissing { .. } => ApiError::not_found(e.to_string()),
            e => e.into(),
        });
        // Also after a failure: the store may have changed, and a reopen costs little.
        s.invalidate(&name);
        let manifest = removed?;
        Ok(Json(IndexList {
            indexes: list_indexes(&s.store, &manifest)?,
        }))
    })
    .await
}

fn checked_job(id: &str) -> ApiResult<()> {
    if id.is_empty() || id.len() > 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::not_found(format!("no job `{}`", echo(id))));
    }
    Ok(())
}

/// A job's status and progress.
#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job")),
    responses((status = 200, body = Job), (status = 404, body = ErrorBody)))]
pub(crate) async fn job(
    State(state): State<Shared>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Job>> {
    checked_job(&id)?;
    Ok(Json(state.jobs.get(&id)?))
}

/// Cancel a job: a queued one at once, a running one at its next commit point.
#[utoipa::path(delete, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job")),
    responses((status = 200, body = Job), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub(crate) async fn cancel_job(
    State(state): State<Shared>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Job>> {
    checked_job(&id)?;
    blocking(state, move |s| Ok(Json(s.jobs.cancel(&id)?))).await
}
