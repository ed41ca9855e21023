//! Corpora, their documents and indexes, and the jobs that change them.

use std::path::PathBuf;

use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{header, StatusCode};
use axum::Json;
use kvdb::documents::{document_from_bytes, supported, SourceDocument};
use kvdb::indexes::{list_indexes, IndexInfo};
use kvdb::ingest::layer_policy;
use kvdb::store::{validate_corpus_name, CorpusManifest, StoredLayer, DEFAULT_BLOCK_SIZE};
use kvdb_index::IndexSpec;
use kvdb_model::LayerKind;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, ApiJson, ApiPath, ApiResult, ErrorBody};
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
    pub layers: Option<Vec<StoredLayer>>,
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

/// Parses index specs (400 naming the bad one).
pub(crate) fn parse_specs(specs: &[String]) -> ApiResult<Vec<IndexSpec>> {
    specs
        .iter()
        .map(|s| {
            s.parse::<IndexSpec>()
                .map_err(|e| ApiError::bad_request(e.to_string()))
        })
        .collect()
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
        let config = model.model.config();
        let layers = match body.layers {
            Some(layers) => check_layers(config, layers)?,
            None => layer_policy(config),
        };
        let _catalog = s.lock_catalog()?;
        if s.store.manifest(&body.name).is_ok() {
            return Err(ApiError::conflict(format!(
                "corpus `{}` exists already",
                body.name
            )));
        }
        let mut manifest =
            s.store
                .create_corpus(&body.name, model.record.clone(), layers, DEFAULT_BLOCK_SIZE)?;
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
    layers: Vec<StoredLayer>,
) -> ApiResult<Vec<StoredLayer>> {
    if layers.len() != config.n_layers() {
        return Err(ApiError::invalid(format!(
            "`layers` lists {} layers, the model has {}",
            layers.len(),
            config.n_layers()
        )));
    }
    for (spec, layer) in config.layers.iter().zip(&layers) {
        match (&spec.kind, layer) {
            (LayerKind::Global, StoredLayer::All) => {}
            (LayerKind::SlidingWindow { window }, StoredLayer::Last { keep })
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

/// Delete a corpus and everything it stored (409 while a job works on it).
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
        let _catalog = s.lock_catalog()?;
        let manifest = s.store.manifest(&name)?;
        if let Some(job) = s.jobs.active(&name)? {
            return Err(ApiError::conflict(format!(
                "job `{job}` is working on corpus `{name}`: cancel it (DELETE /v1/jobs/{job}) \
                 or wait for it to end"
            )));
        }
        let info = corpus_info(s, &manifest, false)?;
        s.store.delete_corpus(&name)?;
        s.invalidate(&name);
        Ok(Json(info))
    })
    .await
}

/// Append documents (JSON, or files named .txt, .md or .html as `multipart/form-data`, any
/// field name) in a background ingest job.
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
            let title = field.file_name().unwrap_or_default().to_string();
            let path = PathBuf::from(&title);
            if !supported(&path) {
                return Err(ApiError::invalid(format!(
                    "`{title}`: upload files named .txt, .md or .html"
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
        let job = s.jobs.submit(&name, Work::Ingest(documents))?;
        Ok((StatusCode::ACCEPTED, Json(job)))
    })
    .await
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
        let job = s.jobs.submit(&name, Work::Index(specs))?;
        Ok((StatusCode::ACCEPTED, Json(job)))
    })
    .await
}

fn checked_job(id: &str) -> ApiResult<()> {
    if id.is_empty() || id.len() > 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::not_found(format!("no job `{id}`")));
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
