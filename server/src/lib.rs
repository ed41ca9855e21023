//! kvdb-server: the axum HTTP API over the kvdb engine.
//!
//! A tour, in the order a request meets it:
//! - [`serve`] opens the store for writing (so other writers learn the server owns it),
//!   starts the job worker and answers on a listener until its shutdown future resolves;
//!   then it stops taking requests, lets in-flight ones finish, and stops a running job at
//!   its next commit point (it resumes on the next start).
//! - Every request passes the metrics layer, the token check (`--token`: write endpoints;
//!   `--token-all`: everything but `/health` and the static page at `/`, which holds no
//!   data and asks for the token itself) and the body limit (413).
//! - [`corpora`](crate::corpora) creates, describes and deletes corpora and queues ingest
//!   and index jobs, which [`jobs`](crate::jobs) runs one at a time in the background.
//! - [`query`](crate::query) answers questions through a bounded worker pool (429 past its
//!   queue) on blocking threads, as JSON or server-sent events; [`openai`](crate::openai)
//!   wraps the same path in OpenAI's shapes.
//! - Errors are one type, [`ApiError`], answered as `{"error": {"code", "message"}}`.
//!
//! | endpoint | what |
//! |---|---|
//! | `GET /health` | liveness, never needs a token |
//! | `GET /metrics` | Prometheus text |
//! | `GET /openapi.json` | this API, generated from the handlers' types |
//! | `GET, POST /v1/corpora` | list, create |
//! | `GET, DELETE /v1/corpora/{name}` | describe, delete (409 while a job works on it) |
//! | `POST /v1/corpora/{name}/documents` | ingest job (JSON or multipart files) |
//! | `GET, POST /v1/corpora/{name}/indexes` | list, add (job) |
//! | `POST /v1/corpora/{name}/query` | answer with provenance, or SSE |
//! | `GET, DELETE /v1/jobs/{id}` | status and progress, cancel |
//! | `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` | OpenAI-compatible |

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod corpora;
mod error;
mod jobs;
mod metrics;
mod models;
mod openai;
mod query;
mod state;

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use utoipa::{OpenApi, ToSchema};

pub use corpora::{
    AddDocuments, AddIndexes, CorpusInfo, CorpusList, CreateCorpus, DocumentInfo, IndexList,
    NewDocument,
};
pub use error::{ApiError, ErrorBody, ErrorDetail};
pub use jobs::{Job, JobKind, JobStatus, Progress};
pub use openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatMessage, ChatRequest, Completion,
    CompletionChoice, CompletionRequest, Content, ContentPart, KvdbExtra, ModelCard, ModelList,
    Prompt, Usage,
};
pub use query::{QueryAnswer, QueryRequest, Sampling, StopStrings};

use state::AppState;

/// The state handlers share.
type Shared = Arc<AppState>;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The store's folder (created when absent).
    pub store: PathBuf,
    /// Where model files are found by name (`$KVDB_HOME/models`).
    pub models_dir: PathBuf,
    /// The bearer token write endpoints need (`None`: open).
    pub token: Option<String>,
    /// Whether every endpoint but `/health` needs the token.
    pub token_all: bool,
    /// Generations running at once.
    pub max_concurrent: usize,
    /// Queries waiting for a worker before the server answers 429.
    pub max_queue: usize,
    /// Largest request body in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Longest question in characters (413 beyond).
    pub max_question_chars: usize,
    /// Largest `max_tokens` (422 beyond).
    pub max_tokens: usize,
    /// Bytes of keys and values each open corpus holds in memory.
    pub ram_budget: usize,
}

impl Config {
    /// Defaults for a store: the models in `$KVDB_HOME/models`, no token, one generation per
    /// CPU core with 16 more queued, 32 MiB bodies, 16K-character questions, 1024 tokens, a
    /// 1 GiB RAM tier per corpus.
    pub fn new(store: PathBuf, models_dir: PathBuf) -> Self {
        Self {
            store,
            models_dir,
            token: None,
            token_all: false,
            max_concurrent: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_queue: 16,
            max_body_bytes: 32 << 20,
            max_question_chars: 16 << 10,
            max_tokens: 1024,
            ram_budget: 1 << 30,
        }
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store could not be opened or claimed.
    #[error(transparent)]
    Store(#[from] kvdb::Error),
    /// Setting up failed (job records, metrics).
    #[error("starting the server: {0}")]
    Setup(ApiError),
    /// The listener failed.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves the API on `listener` until `shutdown` resolves, then shuts down gracefully: no
/// new connections, in-flight requests (streams included) finish, a running job stops at
/// its next commit point and is queued again for the next start.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr = listener.local_addr()?;
    let path = config.store.clone();
    let (store, jobs) = tokio::task::spawn_blocking(move || -> Result<_, ServeError> {
        let mut store = kvdb::store::Store::open(&path, kvdb::store::Access::Write)?;
        store.claim(&format!(
            "a kvdb server (pid {}, http://{addr})",
            std::process::id()
        ))?;
        let jobs = jobs::Jobs::load(&path).map_err(ServeError::Setup)?;
        Ok((store, jobs))
    })
    .await
    .map_err(|e| ServeError::Setup(ApiError::internal(e)))??;
    let state = Arc::new(AppState::new(config, store, jobs).map_err(ServeError::Setup)?);
    let worker = {
        let state = state.clone();
        std::thread::Builder::new()
            .name("kvdb-jobs".into())
            .spawn(move || jobs::worker(state))?
    };
    let stopping = state.clone();
    let result = axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(async move {
            shutdown.await;
            stopping.stopping.store(true, Ordering::SeqCst);
            stopping.jobs.stop();
        })
        .await;
    // Also when serving failed: the worker must let go of the store before we return.
    state.stopping.store(true, Ordering::SeqCst);
    state.jobs.stop();
    tokio::task::spawn_blocking(move || worker.join())
        .await
        .map_err(|e| ServeError::Setup(ApiError::internal(e)))?
        .map_err(|_| ServeError::Setup(ApiError::internal("the job worker panicked")))?;
    Ok(result?)
}

/// The API's routes over `state`.
fn router(state: Shared) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .route("/v1/corpora", get(corpora::list).post(corpora::create))
        .route(
            "/v1/corpora/{name}",
            get(corpora::describe).delete(corpora::delete),
        )
        .route("/v1/corpora/{name}/documents", post(corpora::add_documents))
        .route(
            "/v1/corpora/{name}/indexes",
            get(corpora::indexes).post(corpora::add_indexes),
        )
        .route("/v1/corpora/{name}/query", post(query::query))
        .route(
            "/v1/jobs/{id}",
            get(corpora::job).delete(corpora::cancel_job),
        )
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .fallback(|| async { ApiError::not_found("no such endpoint: see /openapi.json") })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                code: "method_not_allowed",
                message: "this endpoint does not take that method: see /openapi.json".into(),
            }
        })
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(from_fn_with_state(state.clone(), authorize))
        .layer(from_fn_with_state(state.clone(), track))
        .with_state(state)
}

/// Runs blocking work (the store, model loads, corpus opens) off the async executor.
async fn blocking<T: Send + 'static>(
    state: Shared,
    f: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || f(&state))
        .await
        .map_err(ApiError::internal)?
}

/// Counts requests and times them by route.
async fn track(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = request.method().clone();
    let started = Instant::now();
    let response = next.run(request).await;
    let m = &state.metrics;
    m.requests
        .with_label_values(&[route.as_str(), method.as_str(), response.status().as_str()])
        .inc();
    m.request_seconds
        .with_label_values(&[route.as_str()])
        .observe(started.elapsed().as_secs_f64());
    response
}

/// Endpoints that take a body but only read: questions.
fn reads_only(path: &str) -> bool {
    path.ends_with("/query") || path == "/v1/completions" || path == "/v1/chat/completions"
}

/// Checks the bearer token where the configuration asks for one.
async fn authorize(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let Some(token) = &state.config.token else {
        return next.run(request).await;
    };
    let path = request.uri().path();
    let open = path == "/health" || path == "/";
    let write = !matches!(*request.method(), Method::GET | Method::HEAD) && !reads_only(path);
    if !open && (state.config.token_all || write) && !bearer_matches(request.headers(), token) {
        return ApiError::unauthorized().into_response();
    }
    next.run(request).await
}

/// Compares the request's bearer token with `token` in constant time (over digests, so the
/// length does not leak either).
fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let given = Sha256::digest(given.as_bytes());
    let expected = Sha256::digest(token.as_bytes());
    given.as_slice().ct_eq(expected.as_slice()).into()
}

/// `GET /health`.
#[derive(Debug, Serialize, ToSchema)]
struct Health {
    /// `ok`.
    status: &'static str,
    /// The server's version.
    version: &'static str,
}

/// Liveness.
#[utoipa::path(get, path = "/health", tag = "server", responses((status = 200, body = Health)))]
async fn health() -> Json<Health> {
    Json(Health {
        status: "ok",
        version: env!("CARGO_PKG_VERSION"),
    })
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "server",
    responses((status = 200, content_type = "text/plain", body = String)))]
async fn metrics_text(State(state): State<Shared>) -> Result<Response, ApiError> {
    let m = &state.metrics;
    for (name, open) in state.open_corpora() {
        let tier = open.corpus.tier_stats();
        m.tier_bytes
            .with_label_values(&[name.as_str()])
            .set(tier.resident_bytes as i64);
        m.index_bytes
            .with_label_values(&[name.as_str()])
            .set(open.corpus.index_bytes() as i64);
    }
    let text = m.render().map_err(ApiError::internal)?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// The API description.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "kvdb",
        description = "An LLM's KV cache for a document corpus, queried with attention as \
            retrieval. With `--token`, write endpoints need `Authorization: Bearer <token>`; \
            with `--token-all`, every endpoint but `/health` does."
    ),
    paths(
        health,
        metrics_text,
        corpora::list,
        corpora::create,
        corpora::describe,
        corpora::delete,
        corpora::add_documents,
        corpora::indexes,
        corpora::add_indexes,
        corpora::job,
        corpora::cancel_job,
        query::query,
        openai::models,
        openai::completions,
        openai::chat_completions
    )
)]
struct ApiDoc;

/// `GET /openapi.json`.
async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// `GET /`: the web page.
async fn page() -> Html<&'static str> {
    Html(include_str!("../web/index.html"))
}
