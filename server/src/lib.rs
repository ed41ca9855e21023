//! kvdb-server: the axum HTTP API over the kvdb engine.
//!
//! A tour, in the order a request meets it:
//! - [`serve`] opens the store for writing (so other writers learn the server owns it),
//!   starts the job worker and answers on a listener until its shutdown future resolves;
//!   then it stops taking requests, closes idle connections, lets in-flight requests finish
//!   within [`Config::shutdown_grace`] (then cuts them off), and stops a running job at its
//!   next commit point (it resumes on the next start). A client must send its headers
//!   within [`Config::header_read_timeout`] and keep its body coming
//!   ([`Config::body_read_timeout`], 408), so slow or stalled clients cannot hold
//!   connections (or a shutdown) open.
//! - Every request passes the metrics layer (labelled by route template and known method
//!   only, so that made-up paths and methods add no series), the body limit (413) and the
//!   token check of its route's `Access` class, given to each method of each route: with
//!   `--token`, every method that changes something (`Write`) needs it; with `--token-all`,
//!   reads and questions (`Read`) do too; only `/health` and the static page at `/` (which
//!   holds no data and asks for the token itself) are `Open`. A path or method no route
//!   has reaches no endpoint: it is answered 404 or 405 (401 first under `--token-all`).
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
//! | `GET, DELETE /v1/corpora/{name}` | describe, delete (409 while a job or query uses it) |
//! | `POST /v1/corpora/{name}/documents` | ingest job (JSON or multipart files) |
//! | `GET, POST /v1/corpora/{name}/indexes` | list, add (job) |
//! | `DELETE /v1/corpora/{name}/indexes/{spec}` | remove (409 while a job or query uses it) |
//! | `POST /v1/corpora/{name}/query` | answer with provenance, or SSE |
//! | `GET, DELETE /v1/jobs/{id}` | status and progress, cancel |
//! | `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` | OpenAI-compatible |

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod batches;
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

use kvdb::ComputeDevice;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{delete, get, post, MethodRouter};
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tower_http::timeout::RequestBodyTimeout;
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
    /// Most questions answered together on one worker: questions on one corpus with the
    /// same options waiting for a worker go with the first of them to get one (on a GPU a
    /// batch reads the weights and the corpus once a step for all of them). 1: each alone.
    pub max_batch: usize,
    /// Largest request body in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Longest question in characters (413 beyond).
    pub max_question_chars: usize,
    /// Largest `max_tokens` (422 beyond).
    pub max_tokens: usize,
    /// Bytes of keys and values each open corpus holds in memory.
    pub ram_budget: usize,
    /// How long a client may take to send a request's headers (also how long an idle
    /// keep-alive connection stays open); then the connection is closed.
    pub header_read_timeout: Duration,
    /// How long a request body may pause between pieces before the request fails (408).
    pub body_read_timeout: Duration,
    /// How long a shutdown waits for in-flight requests (streams included) before it closes
    /// their connections; idle connections close at once.
    pub shutdown_grace: Duration,
    /// Where models run ingest's forward passes and queries' decoding (`cuda` needs a build
    /// with feature `gpu`).
    pub device: ComputeDevice,
    /// Where open corpora keep their keys and values for GPU questions.
    pub gpu_kv: kvdb::GpuKv,
}

impl Config {
    /// Defaults for a store: the models in `$KVDB_HOME/models`, no token, one generation per
    /// CPU core with 16 more queued, each question alone (no batches), 32 MiB bodies, 16K-character questions, 1024 tokens, a
    /// 1 GiB RAM tier per corpus, 20 s for headers, 30 s of body silence, a 10 s shutdown
    /// grace.
    pub fn new(store: PathBuf, models_dir: PathBuf) -> Self {
        Self {
            store,
            models_dir,
            token: None,
            device: ComputeDevice::Cpu,
            token_all: false,
            max_concurrent: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_queue: 16,
            max_batch: 1,
            max_body_bytes: 32 << 20,
            max_question_chars: 16 << 10,
            max_tokens: 1024,
            ram_budget: 1 << 30,
            header_read_timeout: Duration::from_secs(20),
            body_read_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            gpu_kv: kvdb::GpuKv::Auto,
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
/// new connections, idle ones closed, in-flight requests (streams included) finish within
/// [`Config::shutdown_grace`] (then their connections are closed), a running job stops at its
/// next commit point and is queued again for the next start.
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
    serve_connections(listener, state.clone(), async move {
        shutdown.await;
        stopping.stopping.store(true, Ordering::SeqCst);
        stopping.jobs.stop();
    })
    .await;
    // The worker must let go of the store before we return.
    state.stopping.store(true, Ordering::SeqCst);
    state.jobs.stop();
    tokio::task::spawn_blocking(move || worker.join())
        .await
        .map_err(|e| ServeError::Setup(ApiError::internal(e)))?
        .map_err(|_| ServeError::Setup(ApiError::internal("the job worker panicked")))?;
    // Requests cut off at the end of the grace stop their generations at the next token;
    // wait a moment for them to let go of the state (and so of the store).
    let released = Instant::now();
    while Arc::strong_count(&state) > 1 && released.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Accepts connections on `listener` and serves the API over HTTP/1 until `shutdown`
/// resolves; then closes the listener and idle connections, waits up to the shutdown grace
/// for the others and closes what is left.
///
/// Our own accept loop (instead of `axum::serve`) because that one neither times out
/// headers nor ever gives up on a connection at shutdown: one client sending half a header
/// could keep the server from stopping.
async fn serve_connections(
    listener: TcpListener,
    state: Shared,
    shutdown: impl Future<Output = ()>,
) {
    let config = &state.config;
    let app = RequestBodyTimeout::new(router(state.clone()), config.body_read_timeout);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout);
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            // Reaps finished connections, so the set holds only open ones.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of file descriptors and the like pass; don't spin meanwhile.
                        tracing::warn!("accepting a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let connection = http
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
                let connection = graceful.watch(connection);
                connections.spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!("connection: {e}");
                    }
                });
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(config.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "closing {} connections still open after the shutdown grace of {:?}",
            connections.len(),
            config.shutdown_grace
        );
    }
    connections.shutdown().await;
}

/// Who may call a method of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Anyone, always: `/health` and the static page at `/`.
    Open,
    /// Reads and questions: the token is needed only with `--token-all`.
    Read,
    /// Anything that changes the store or jobs: the token is needed whenever there is one.
    Write,
}

impl Access {
    /// Whether a request of this class needs the token under `config`.
    fn needs_token(self, config: &Config) -> bool {
        match (self, &config.token) {
            (_, None) | (Self::Open, _) => false,
            (Self::Read, Some(_)) => config.token_all,
            (Self::Write, Some(_)) => true,
        }
    }
}

/// One route's methods, each behind the token check of its access class. Every route is
/// built through this, so no method gets past the router without a class of its own.
fn guarded<const N: usize>(
    state: &Shared,
    methods: [(Access, MethodRouter<Shared>); N],
) -> MethodRouter<Shared> {
    methods
        .into_iter()
        .fold(MethodRouter::new(), |route, (access, method)| {
            route.merge(method.route_layer(from_fn_with_state((state.clone(), access), authorize)))
        })
}

/// The API's routes over `state`.
fn router(state: Shared) -> Router {
    use Access::{Open, Read, Write};
    let s = &state;
    Router::new()
        .route("/", guarded(s, [(Open, get(page))]))
        .route("/health", guarded(s, [(Open, get(health))]))
        .route("/metrics", guarded(s, [(Read, get(metrics_text))]))
        .route("/openapi.json", guarded(s, [(Read, get(openapi))]))
        .route(
            "/v1/corpora",
            guarded(
                s,
                [(Read, get(corpora::list)), (Write, post(corpora::create))],
            ),
        )
        .route(
            "/v1/corpora/{name}",
            guarded(
                s,
                [
                    (Read, get(corpora::describe)),
                    (Write, delete(corpora::delete)),
                ],
            ),
        )
        .route(
            "/v1/corpora/{name}/documents",
            guarded(s, [(Write, post(corpora::add_documents))]),
        )
        .route(
            "/v1/corpora/{name}/indexes",
            guarded(
                s,
                [
                    (Read, get(corpora::indexes)),
                    (Write, post(corpora::add_indexes)),
                ],
            ),
        )
        .route(
            "/v1/corpora/{name}/indexes/{spec}",
            guarded(s, [(Write, delete(corpora::remove_index))]),
        )
        // Questions take a body but only read.
        .route(
            "/v1/corpora/{name}/query",
            guarded(s, [(Read, post(query::query))]),
        )
        .route(
            "/v1/jobs/{id}",
            guarded(
                s,
                [
                    (Read, get(corpora::job)),
                    (Write, delete(corpora::cancel_job)),
                ],
            ),
        )
        .route("/v1/models", guarded(s, [(Read, get(openai::models))]))
        .route(
            "/v1/completions",
            guarded(s, [(Read, post(openai::completions))]),
        )
        .route(
            "/v1/chat/completions",
            guarded(s, [(Read, post(openai::chat_completions))]),
        )
        .fallback(no_endpoint)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(from_fn_with_state(state.clone(), track))
        .with_state(state)
}

/// 404 for a path no route has (401 first under `--token-all`: a stranger learns nothing).
async fn no_endpoint(State(state): State<Shared>, headers: HeaderMap) -> ApiError {
    refuse_stranger(&state, &headers)
        .unwrap_or_else(|| ApiError::not_found("no such endpoint: see /openapi.json"))
}

/// 405 for a method a route does not have (401 first under `--token-all`).
async fn no_method(State(state): State<Shared>, headers: HeaderMap) -> ApiError {
    refuse_stranger(&state, &headers).unwrap_or_else(|| ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: "method_not_allowed",
        message: "this endpoint does not take that method: see /openapi.json".into(),
    })
}

/// 401 when a `Read` request would need the token and lacks it.
fn refuse_stranger(state: &AppState, headers: &HeaderMap) -> Option<ApiError> {
    let token = state.config.token.as_deref()?;
    (Access::Read.needs_token(&state.config) && !bearer_matches(headers, token))
        .then(ApiError::unauthorized)
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

/// Counts requests and times them by route template and method. Only known methods and
/// matched routes name a series (others count as `other` and `unmatched`): a label taken
/// from the request as sent would let anyone create series without end.
async fn track(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = method_label(request.method());
    let started = Instant::now();
    let response = next.run(request).await;
    let m = &state.metrics;
    m.requests
        .with_label_values(&[route.as_str(), method, response.status().as_str()])
        .inc();
    m.request_seconds
        .with_label_values(&[route.as_str()])
        .observe(started.elapsed().as_secs_f64());
    response
}

/// `method`'s metrics label: its name if it is a standard method, else `other`.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// Checks the bearer token where the route's access class and the configuration ask for
/// one.
async fn authorize(
    State((state, access)): State<(Shared, Access)>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(token) = &state.config.token {
        if access.needs_token(&state.config) && !bearer_matches(request.headers(), token) {
            return ApiError::unauthorized().into_response();
        }
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
        corpora::remove_index,
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
