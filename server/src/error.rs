//! One error type for every handler: a status, a stable machine-readable code and a message,
//! answered as `{"error": {"code": ..., "message": ...}}`. Engine errors map here once;
//! internal failures are logged and answered with a generic message (their text can name
//! files and store internals).

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
    /// `conflict`, `payload_too_large`, `unsupported_media_type`, `invalid_request`,
    /// `overloaded`, `unavailable` or `internal`.
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

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
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
        match &e {
            E::CorpusMissing { .. } => Self::not_found(e.to_string()),
            E::InvalidCorpusName { .. } => Self::bad_request(e.to_string()),
            E::ModelMismatch { .. } | E::Interrupted { .. } | E::Cancelled { .. } => {
                Self::conflict(e.to_string())
            }
            E::Query(_) | E::ContextOverflow { .. } | E::Document { .. } => {
                Self::invalid(e.to_string())
            }
            E::Index(kvdb_index::IndexError::Spec { .. }) => Self::bad_request(e.to_string()),
            E::StoreBusy { .. } | E::StoreOwned { .. } => Self::unavailable(e.to_string()),
            _ => Self::internal(e),
        }
    }
}

/// Keeps axum's status for a rejected body (400 syntax, 413 size, 415 type, 422 data) and
/// answers it in the API's error shape.
fn rejection(status: StatusCode, message: String) -> ApiError {
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
        s if s.is_server_error() => return ApiError::internal(message),
        _ => "bad_request",
    };
    ApiError::new(status, code, message)
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        rejection(r.status(), r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        rejection(r.status(), r.body_text())
    }
}

impl From<MultipartRejection> for ApiError {
    fn from(r: MultipartRejection) -> Self {
        rejection(r.status(), r.body_text())
    }
}

impl From<MultipartError> for ApiError {
    fn from(r: MultipartError) -> Self {
        rejection(r.status(), r.body_text())
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
