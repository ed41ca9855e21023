//! One error type for every handler: a status, a stable machine-readable code and a message,
//! answered as `{"error": {"code": ..., "message": ...}}`. Engine errors map here once;
//! internal failures are logged and answered with a generic message (their text can name
//! files and store internals). Messages repeat user input (names, specs, titles, ids) only
//! through [`echo`], and no message is longer than [`MAX_MESSAGE_BYTES`], so that a client
//! sending 100 KB of name does not get 100 KB back.

use std::error::Error as StdError;

use axum::extract::multipart::{MultipartError, MultipartRejection};
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The body of every error answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong, for programs (`code`) and people (`message`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable code: `bad_request`, `unauthorized`, `not_found`, `method_not_allowed`,
    /// `request_timeout`, `conflict`, `payload_too_large`, `unsupported_media_type`,
    /// `invalid_request`, `overloaded`, `unavailable` or `internal`.
    pub code: String,
    /// What to do about it.
    pub message: String,
}

/// An error answer: status, code and message.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The stable code.
    pub code: &'static str,
    /// The message.
    pub message: String,
}

/// Characters of one piece of user input that an error message repeats.
const ECHO_CHARS: usize = 64;

/// The longest message an error answers with, in bytes (longer ones are cut): a backstop for
/// text that embeds user input the handlers did not [`echo`] (a serde error naming an unknown
/// field, say).
pub(crate) const MAX_MESSAGE_BYTES: usize = 4096;

/// User input as an error message repeats it: whole when it is short, else its first
/// [`ECHO_CHARS`] characters and its length (`abc…(102400 bytes)`), so that the client can
/// still tell which input it was.
pub(crate) fn echo(input: &str) -> String {
    cut(input, input.char_indices().nth(ECHO_CHARS).map(|(i, _)| i))
}

/// `text` up to byte `at` (a char boundary) with a note of its length, or all of it.
fn cut(text: &str, at: Option<usize>) -> String {
    match at {
        Some(at) if at < text.len() => format!("{}…({} bytes)", &text[..at], text.len()),
        _ => text.to_string(),
    }
}

/// `message` cut to at most about `max` bytes.
fn bounded(message: String, max: usize) -> String {
    if message.len() <= max {
        return message;
    }
    let at = (0..=max).rev().find(|&i| message.is_char_boundary(i));
    cut(&message, at)
}

/// Bytes of axum's rejection text kept: serde's messages are short unless they quote the
/// input (an unknown field's name, say).
const REJECTION_BYTES: usize = 512;

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: bounded(message.into(), MAX_MESSAGE_BYTES),
        }
    }

    /// 400: the request cannot be read (malformed JSON, a bad index spec or corpus name).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 401: a bearer token is needed and was missing or wrong.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this endpoint needs `Authorization: Bearer <token>` with the server's token",
        )
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 409: the request conflicts with the state (a running ingest, an existing corpus).
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 408: the request's body stopped arriving (the server's body read timeout).
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", message)
    }

    /// 413: a body, question or document set over the server's limits.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    /// 422: well-formed but unusable values (limits, unknown models, empty questions).
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
    }

    /// 429: the query queue is full.
    pub fn overloaded(limit: usize) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
            format!("{limit} queries are running or queued, the server's limit: retry later"),
        )
    }

    /// 503: the server is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    /// 500: logged with its details, answered without them.
    pub fn internal(details: impl std::fmt::Display) -> Self {
        tracing::error!("internal error: {details}");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the server failed to handle this request; its log has the details",
        )
    }

    /// The body this error answers with.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message.clone(),
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<kvdb::Error> for ApiError {
    fn from(e: kvdb::Error) -> Self {
        use kvdb::Error as E;
        // Variants that carry user input are answered with that input cut short (`echo`).
        match &e {
            E::CorpusMissing { name, available } => Self::not_found(
                E::CorpusMissing {
                    name: echo(name),
                    available: available.clone(),
                }
                .to_string(),
            ),
            E::InvalidCorpusName { name } => {
                Self::bad_request(E::InvalidCorpusName { name: echo(name) }.to_string())
            }
            E::Interrupted {
                corpus,
                title,
                done,
                total,
            } => Self::conflict(interrupted(corpus, title, *done, *total)),
            E::ModelMismatch { .. } | E::Cancelled { .. } | E::LastIndex { .. } => {
                Self::conflict(e.to_string())
            }
            // The engine's text names no way to add an index; a server client adds it here.
            E::IndexMissing {
                corpus,
                spec,
                available,
            } => Self::invalid(format!(
                "{}; add it with `POST /v1/corpora/{corpus}/indexes` and \
                 {{\"specs\": [\"{}\"]}} (a background job)",
                E::IndexMissing {
                    corpus: corpus.clone(),
                    spec: echo(spec),
                    available: available.clone(),
                },
                echo(spec)
            )),
            E::Document { path, reason } => {
                Self::invalid(format!("{}: {reason}", echo(&path.display().to_string())))
            }
            // The engine's text points at the CLI's `--device cpu`; a client can only ask
            // without the option.
            E::NotOnGpu { what } => Self::invalid(format!(
                "{what} is not available on this server's GPU yet: ask without it"
            )),
            // Likewise: the engine's text names CLI options a client does not have.
            E::FullAttentionFromHost { corpus } => Self::invalid(format!(
                "full attention reads every key of corpus `{}`, which this server's GPU reads \
                 from host memory: ask with an index",
                echo(corpus)
            )),
            E::NotBucketIndex { spec } => {
                Self::invalid(E::NotBucketIndex { spec: echo(spec) }.to_string())
            }
            E::EmptyInput { .. }
            | E::TemplatePlaceholder
            | E::TooLongForContext { .. }
            | E::ContextOverflow { .. }
            | E::IndexBuild { .. }
            | E::SaapArtifactMissing { .. }
            | E::SaapArtifactMismatch { .. }
            | E::TooManyIndexes { .. }
            | E::TooManyDrills { .. }
            | E::SaapTraining(_)
            | E::NoRetrievalLayers
            | E::CorpusEmpty { .. }
            | E::IndexNotSaved { .. } => Self::invalid(e.to_string()),
            // Nobody is listening any more; said as nginx says it, for the log.
            E::Abandoned => Self::new(
                StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
                "client_closed_request",
                e.to_string(),
            ),
            E::Index(spec @ kvdb_index::IndexError::Spec { .. }) => Self::from(spec),
            // The server's GPU (or host) cannot hold the corpus: not the request's fault.
            E::StoreBusy { .. }
            | E::StoreOwned { .. }
            | E::GpuMemory { .. }
            | E::HostMemory { .. }
            | E::GpuCacheTooSmall { .. }
            | E::GpuCacheMemory { .. } => Self::unavailable(e.to_string()),
            _ => Self::internal(e),
        }
    }
}

impl From<&kvdb_index::IndexError> for ApiError {
    /// A spec that does not parse is a bad request naming the spec and the bad token, both
    /// cut short; other index errors are internal.
    fn from(e: &kvdb_index::IndexError) -> Self {
        match e {
            kvdb_index::IndexError::Spec {
                spec,
                token,
                problem,
            } => Self::bad_request(
                kvdb_index::IndexError::Spec {
                    spec: echo(spec),
                    token: echo(token),
                    problem: problem.clone(),
                }
                .to_string(),
            ),
            e => Self::internal(e),
        }
    }
}

/// What to do about corpus `corpus`'s interrupted document `title` (`done` of `total`
/// tokens stored) over HTTP.
pub(crate) fn interrupted(corpus: &str, title: &str, done: usize, total: usize) -> String {
    format!(
        "corpus `{corpus}` has an interrupted document `{}` ({done} of {total} tokens stored): \
         send it again (the same content, alone or among other documents) to \
         POST /v1/corpora/{corpus}/documents to finish it",
        echo(title)
    )
}

/// Keeps axum's status for a rejected body (400 syntax, 413 size, 415 type, 422 data) and
/// answers it in the API's error shape; a body that stopped arriving (the server's body
/// read timeout, somewhere in `error`'s sources) is 408.
fn rejection(status: StatusCode, message: String, error: &(dyn StdError + 'static)) -> ApiError {
    if timed_out(error) {
        return ApiError::request_timeout(
            "the request body stopped arriving (the server's body read timeout): send it again",
        );
    }
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
        s if s.is_server_error() => return ApiError::internal(message),
        _ => "bad_request",
    };
    ApiError::new(status, code, bounded(message, REJECTION_BYTES))
}

/// Whether `error` or one of its sources is the body read timeout's.
fn timed_out(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        next = e.source();
    }
    false
}

impl From<kvdb::OptionError> for ApiError {
    /// An option outside what generation accepts (its text names the option, the range and
    /// the number given, all short).
    fn from(e: kvdb::OptionError) -> Self {
        Self::invalid(e.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        rejection(r.status(), r.body_text(), &r)
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        rejection(r.status(), r.body_text(), &r)
    }
}

impl From<MultipartRejection> for ApiError {
    fn from(r: MultipartRejection) -> Self {
        rejection(r.status(), r.body_text(), &r)
    }
}

impl From<MultipartError> for ApiError {
    fn from(r: MultipartError) -> Self {
        rejection(r.status(), r.body_text(), &r)
    }
}

/// The result of a handler.
pub(crate) type ApiResult<T> = Result<T, ApiError>;

/// `axum::Json` whose rejections answer in the API's error shape.
#[derive(Debug, axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub(crate) struct ApiJson<T>(pub(crate) T);

/// `axum::extract::Path` whose rejections answer in the API's error shape.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub(crate) struct ApiPath<T>(pub(crate) T);

#[cfg(test)]
mod tests {
    use super::*;
    use kvdb::Error as E;

    fn status(e: E) -> u16 {
        ApiError::from(e).status.as_u16()
    }

    /// What the user can fix is a 4xx naming it; what only a kvdb developer can fix is a 500
    /// that says nothing of the internals.
    #[test]
    fn user_errors_are_4xx_and_bugs_are_500() {
        let user = [
            E::EmptyInput {
                what: "question",
                hint: "",
            },
            E::TemplatePlaceholder,
            E::TooLongForContext {
                what: "question",
                tokens: 9,
                corpus_tokens: 100,
                context: 105,
                room: 4,
            },
            E::NotBucketIndex {
                spec: "flat".into(),
            },
            E::SaapArtifactMissing {
                path: "/x".into(),
                centroids: 64,
            },
            E::TooManyIndexes {
                corpus: "c".into(),
                count: 70_000,
                max: 65_535,
            },
            E::SaapTraining("only 3 training queries have their best key 1024+ tokens back".into()),
        ];
        for e in user {
            let text = e.to_string();
            let api = ApiError::from(e);
            assert_eq!(api.status.as_u16(), 422, "{text}");
            assert_eq!(api.message, text);
        }
        for e in [
            E::CorpusEmpty { corpus: "c".into() },
            E::IndexNotSaved {
                corpus: "c".into(),
                spec: "saap64".into(),
                layer: 1,
                head: 0,
                tokens: 10,
            },
        ] {
            assert_eq!(status(e), 422);
        }
        assert_eq!(status(E::Abandoned), 499);
        let gpu = ApiError::from(E::NotOnGpu {
            what: "estimating unvisited buckets (`estimate`)",
        });
        assert_eq!(gpu.status.as_u16(), 422);
        assert!(
            gpu.message.contains("`estimate`") && gpu.message.contains("ask without it"),
            "{}",
            gpu.message
        );
        let too_big = E::GpuMemory {
            corpus: "c".into(),
            needed: 2 << 30,
            free: 1 << 30,
        };
        assert_eq!(status(too_big), 503);
        let host_too_small = E::HostMemory {
            corpus: "c".into(),
            layers: 28,
            pinned: 20,
            needed: 2 << 30,
            available: 3 << 30,
            reserve: 2 << 30,
        };
        assert_eq!(status(host_too_small), 503);
        let small_caches = E::GpuCacheTooSmall {
            corpus: "c".into(),
            layer: 3,
            needed: 900,
            slots: 800,
        };
        assert_eq!(status(small_caches), 503);
        let no_cache_memory = E::GpuCacheMemory {
            corpus: "c".into(),
            layer: 3,
            bytes: 8 << 30,
            free: 1 << 30,
        };
        assert_eq!(status(no_cache_memory), 503);
        // Full attention over keys in host memory: the client asks with an index instead,
        // and hears nothing of the CLI's options.
        let full = ApiError::from(E::FullAttentionFromHost { corpus: "c".into() });
        assert_eq!(full.status.as_u16(), 422);
        assert!(
            full.message.contains("ask with an index") && !full.message.contains("--"),
            "{}",
            full.message
        );
        let bug = ApiError::from(E::Internal("the model returned no logits".into()));
        assert_eq!(bug.status.as_u16(), 500);
        assert!(!bug.message.contains("logits"), "{}", bug.message);
        assert_eq!(status(E::Corrupt("a block is short".into())), 500);
        // A broken invariant inside the model is the server's fault, not the request's.
        let model_bug = kvdb_model::ModelError::Internal("q/k/v projections are not three".into());
        assert_eq!(status(E::Model(model_bug)), 500);
    }

    /// A long spec in an error is echoed cut short.
    #[test]
    fn long_specs_are_echoed_short() {
        let spec = "x".repeat(10_000);
        let api = ApiError::from(E::NotBucketIndex { spec });
        assert_eq!(api.status.as_u16(), 422);
        assert!(api.message.len() < 1_000, "{} bytes", api.message.len());
    }
}
