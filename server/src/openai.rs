//! OpenAI-compatible endpoints, so that an unmodified OpenAI client can query a corpus:
//! `model` is `<corpus>` or `<corpus>:<index spec>`, the prompt (or the chat) is the question,
//! and answers come back in OpenAI's shapes, streamed as `data: {chunk}` lines ending with
//! `data: [DONE]`. Each answer also carries kvdb's provenance under `kvdb`, which OpenAI
//! clients ignore.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvdb::StopReason;
use kvdb::{Answer, Provenance};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{echo, ApiError, ApiJson, ApiResult, ErrorBody};
use crate::query::{admit, json_event, sse, Ask, Sampling, Streamed};
use crate::{blocking, Shared};

/// `POST /v1/completions`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// `<corpus>` or `<corpus>:<index spec>`.
    pub model: String,
    /// The question (one string, or a list of one).
    #[schema(value_type = String)]
    pub prompt: Prompt,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Stream `data:` chunks.
    #[serde(default)]
    pub stream: bool,
    /// Choices to generate: only 1.
    #[serde(default)]
    pub n: Option<usize>,
}

/// A prompt: one string or a list of one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One prompt.
    One(String),
    /// Several (only one is answered).
    Many(Vec<String>),
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// `<corpus>` or `<corpus>:<index spec>`.
    pub model: String,
    /// The conversation; its text (one user message alone, else `Role: text` lines) is the
    /// question.
    pub messages: Vec<ChatMessage>,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Newer clients' name for `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// Stream `data:` chunks.
    #[serde(default)]
    pub stream: bool,
    /// Choices to generate: only 1.
    #[serde(default)]
    pub n: Option<usize>,
}

/// One chat message.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Its text, or a list of parts whose `text` parts are joined.
    #[schema(value_type = String)]
    pub content: Content,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Parts (`{"type": "text", "text": ...}`).
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// Its text (parts without text, e.g. images, are refused).
    #[serde(default)]
    pub text: Option<String>,
}

/// Token counts.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// Tokens of the question (the corpus before it is stored, not counted).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}

/// kvdb's own part of an answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct KvdbExtra {
    /// Documents and passages attended to, with their shares.
    #[schema(value_type = Object)]
    pub provenance: Provenance,
    /// Tokens of the corpus before the question.
    pub corpus_tokens: usize,
}

/// One choice of a completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    /// The answer (or, streamed, a piece of it).
    pub text: String,
    /// Always 0.
    pub index: usize,
    /// Always null.
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<()>,
    /// `stop` or `length` (null until the last chunk).
    pub finish_reason: Option<&'static str>,
}

/// `POST /v1/completions`'s answer (and, streamed, each chunk).
#[derive(Debug, Serialize, ToSchema)]
pub struct Completion {
    /// An id.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The `model` asked for.
    pub model: String,
    /// One choice.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (the last chunk only when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Provenance (the last chunk only when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvdb: Option<KvdbExtra>,
}

/// The assistant's message.
#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// `assistant` (streamed: in the first chunk only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// The answer (streamed: a piece of it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a chat completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    /// Always 0.
    pub index: usize,
    /// The answer (plain answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    /// A piece of the answer (streamed chunks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<AssistantMessage>,
    /// `stop` or `length` (null until the last chunk).
    pub finish_reason: Option<&'static str>,
}

/// `POST /v1/chat/completions`'s answer (and, streamed, each chunk).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// An id.
    pub id: String,
    /// `chat.completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The `model` asked for.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts (the last chunk only when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Provenance (the last chunk only when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvdb: Option<KvdbExtra>,
}

/// One model (a corpus, or a corpus with one of its indexes).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ModelCard {
    /// `<corpus>` or `<corpus>:<index spec>`.
    pub id: String,
    /// `model`.
    pub object: String,
    /// Always 0.
    pub created: u64,
    /// `kvdb`.
    pub owned_by: String,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// Every corpus, then every corpus with each of its indexes.
    pub data: Vec<ModelCard>,
}

fn now() -> (u64, String) {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_secs(), format!("{:x}", t.as_nanos()))
}

fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::EndOfText | StopReason::StopString => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        // Nobody reads an abandoned answer; "stop" is the nearest of OpenAI's reasons.
        StopReason::Abandoned => "stop",
    }
}

fn usage(a: &Answer) -> Usage {
    Usage {
        prompt_tokens: a.question_tokens,
        completion_tokens: a.tokens.len(),
        total_tokens: a.question_tokens + a.tokens.len(),
    }
}

fn extra(a: &Answer) -> KvdbExtra {
    KvdbExtra {
        provenance: a.provenance.clone(),
        corpus_tokens: a.corpus_tokens,
    }
}

/// Splits `<corpus>[:<spec>]` (corpus names have no `:`, specs may).
fn corpus_and_index(model: &str) -> (&str, Option<&str>) {
    match model.split_once(':') {
        Some((corpus, spec)) => (corpus, Some(spec)),
        None => (model, None),
    }
}

fn only_one(n: Option<usize>) -> ApiResult<()> {
    match n {
        None | Some(1) => Ok(()),
        Some(_) => Err(ApiError::invalid(
            "kvdb answers with one choice: `n` must be 1",
        )),
    }
}

/// The data-only event that ends an OpenAI stream.
fn done_event() -> Event {
    Event::default().data("[DONE]")
}

/// List the corpora as models.
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, body = ModelList)))]
pub(crate) async fn models(State(state): State<Shared>) -> ApiResult<Json<ModelList>> {
    blocking(state, |s| {
        let corpora = s.store.corpora()?;
        let card = |id: String| ModelCard {
            id,
            object: "model".into(),
            created: 0,
            owned_by: "kvdb".into(),
        };
        let mut data: Vec<ModelCard> = corpora.iter().map(|m| card(m.name.clone())).collect();
        for m in &corpora {
            data.extend(m.indexes.iter().map(|i| card(format!("{}:{i}", m.name))));
        }
        Ok(Json(ModelList {
            object: "list".into(),
            data,
        }))
    })
    .await
}

/// OpenAI-compatible completion: the prompt is the question.
#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionRequest,
    responses((status = 200, body = Completion, description = "Streamed: `data:` chunks, then `data: [DONE]`"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 429, body = ErrorBody)))]
pub(crate) async fn completions(
    State(state): State<Shared>,
    ApiJson(body): ApiJson<CompletionRequest>,
) -> ApiResult<Response> {
    only_one(body.n)?;
    let prompt = match body.prompt {
        Prompt::One(p) => p,
        Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
        Prompt::Many(_) => return Err(ApiError::invalid("give exactly one prompt")),
    };
    let (corpus, index) = corpus_and_index(&body.model);
    let ask = Ask::new(&state, corpus, prompt, index, None, body.sampling)?;
    let admitted = admit(&state, ask).await?;
    let (created, nanos) = now();
    let id = format!("cmpl-{nanos}");
    let model = body.model;
    let chunk = move |text: String, answer: Option<&Answer>| Completion {
        id: id.clone(),
        object: "text_completion",
        created,
        model: model.clone(),
        choices: vec![CompletionChoice {
            text,
            index: 0,
            logprobs: None,
            finish_reason: answer.map(|a| finish_reason(a.stop)),
        }],
        usage: answer.map(usage),
        kvdb: answer.map(extra),
    };
    if !body.stream {
        let answer = admitted.answer(&state).await?;
        return Ok(Json(chunk(answer.answer.clone(), Some(&answer))).into_response());
    }
    Ok(sse(admitted.stream(&state), move |item| match item {
        Streamed::Text(text) => vec![json_event(None, &chunk(text, None))],
        Streamed::Done(answer) => vec![
            json_event(None, &chunk(String::new(), Some(&answer))),
            done_event(),
        ],
        Streamed::Failed(e) => vec![json_event(None, &e.body()), done_event()],
    }))
}

/// The question a chat asks: one user message alone, else the conversation as `Role: text`
/// lines ending with `Assistant:`.
fn chat_question(messages: Vec<ChatMessage>) -> ApiResult<String> {
    let mut turns = Vec::with_capacity(messages.len());
    for m in messages {
        let text = match m.content {
            Content::Text(t) => t,
            Content::Parts(parts) => parts
                .into_iter()
                .map(|p| {
                    p.text
                        .ok_or_else(|| ApiError::invalid("only text message parts are supported"))
                })
                .collect::<ApiResult<Vec<_>>>()?
                .join("\n"),
        };
        let role = match m.role.as_str() {
            "system" | "developer" => "System",
            "user" => "User",
            "assistant" => "Assistant",
            other => {
                return Err(ApiError::invalid(format!(
                    "unsupported message role `{}`",
                    echo(other)
                )))
            }
        };
        turns.push((role, text));
    }
    match turns.as_slice() {
        [] => Err(ApiError::invalid("`messages` is empty")),
        [("User", text)] => Ok(text.clone()),
        _ => {
            let mut q: Vec<String> = turns.iter().map(|(r, t)| format!("{r}: {t}")).collect();
            q.push("Assistant:".into());
            Ok(q.join("\n"))
        }
    }
}

/// OpenAI-compatible chat completion: the conversation is the question.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatRequest,
    responses((status = 200, body = ChatCompletion, description = "Streamed: `data:` chunks, then `data: [DONE]`"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 429, body = ErrorBody)))]
pub(crate) async fn chat_completions(
    State(state): State<Shared>,
    ApiJson(body): ApiJson<ChatRequest>,
) -> ApiResult<Response> {
    only_one(body.n)?;
    let question = chat_question(body.messages)?;
    let mut sampling = body.sampling;
    sampling.max_tokens = sampling.max_tokens.or(body.max_completion_tokens);
    let (corpus, index) = corpus_and_index(&body.model);
    let ask = Ask::new(&state, corpus, question, index, None, sampling)?;
    let admitted = admit(&state, ask).await?;
    let (created, nanos) = now();
    let id = format!("chatcmpl-{nanos}");
    let model = body.model;
    let completion = move |object, choice: ChatChoice, answer: Option<&Answer>| ChatCompletion {
        id: id.clone(),
        object,
        created,
        model: model.clone(),
        choices: vec![choice],
        usage: answer.map(usage),
        kvdb: answer.map(extra),
    };
    if !body.stream {
        let answer = admitted.answer(&state).await?;
        let choice = ChatChoice {
            index: 0,
            message: Some(AssistantMessage {
                role: Some("assistant"),
                content: Some(answer.answer.clone()),
            }),
            delta: None,
            finish_reason: Some(finish_reason(answer.stop)),
        };
        return Ok(Json(completion("chat.completion", choice, Some(&answer))).into_response());
    }
    let mut first = true;
    let delta = |role: bool, content: Option<String>, finish| ChatChoice {
        index: 0,
        message: None,
        delta: Some(AssistantMessage {
            role: role.then_some("assistant"),
            content,
        }),
        finish_reason: finish,
    };
    let chunk = "chat.completion.chunk";
    Ok(sse(admitted.stream(&state), move |item| match item {
        Streamed::Text(text) => {
            let role = std::mem::take(&mut first);
            vec![json_event(
                None,
                &completion(chunk, delta(role, Some(text), None), None),
            )]
        }
        Streamed::Done(answer) => {
            let last = delta(first, None, Some(finish_reason(answer.stop)));
            vec![
                json_event(None, &completion(chunk, last, Some(&answer))),
                done_event(),
            ]
        }
        Streamed::Failed(e) => vec![json_event(None, &e.body()), done_event()],
    }))
}
