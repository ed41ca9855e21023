//! Questions over a corpus: `POST /v1/corpora/{name}/query`, and the generation path the
//! OpenAI-compatible endpoints share.
//!
//! A request is checked against the limits, admitted to the query pool (429 when it is
//! full), counted on its corpus (so that the corpus is not deleted under it), its corpus and
//! index opened (so that a bad name or index is an error status, not an event in a stream),
//! and then it waits for a worker and generates on a blocking thread.
//! A generation stops as soon as its client is gone: a stream's receiver is dropped, or a
//! plain request's handler future is dropped (its guard clears the flag `on_text` checks).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use kvdb::LoadedModel;
use kvdb::{checked_follow, checked_k, checked_temperature, checked_top_p};
use kvdb::{Answer, AskOptions, AttentionMode, Retrieval};
use kvdb::{GenerateOptions, StopReason};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use utoipa::ToSchema;

use crate::batches::{Batches, Ride, Waiting};
use crate::corpora::{checked_name, parse_spec};
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult, ErrorBody};
use crate::state::{OpenCorpus, QueryGuard, Ticket};
use crate::{blocking, Shared};

/// Most stop strings, and their longest length in characters.
const STOP_STRINGS: (usize, usize) = (8, 64);

/// `POST /v1/corpora/{name}/query`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct QueryRequest {
    /// The question, appended after the corpus.
    pub question: String,
    /// The index to retrieve with (a spec the corpus has; default: its first).
    #[serde(default)]
    pub index: Option<String>,
    /// Keys retrieved per retrieval layer and KV head (default: the spec's own budget for hip
    /// and ihip, else 64).
    #[serde(default)]
    pub k: Option<usize>,
    /// At every step, each KV head also attends the token after each of the `follow`
    /// retrieved tokens it attended most at the step before (helps an answer that copies a
    /// number or a name from the corpus); 0 is off.
    #[serde(default = "default_follow")]
    #[schema(maximum = 65536, default = 8)]
    // kvdb::MAX_K and DEFAULT_FOLLOW, which the HTTP tests check.
    pub follow: usize,
    /// Attend to every corpus token exactly instead of retrieving (no provenance).
    #[serde(default)]
    pub full_attention: bool,
    /// A prompt template with `{question}` where the question goes.
    #[serde(default)]
    pub template: Option<String>,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Answer as server-sent events: `token` events (`{"text": ...}`), then one `done`
    /// event with the whole answer (as the plain answer), or an `error` event.
    #[serde(default)]
    pub stream: bool,
}

/// `follow` when a query leaves it out.
fn default_follow() -> usize {
    kvdb::DEFAULT_FOLLOW
}

/// Sampling and stopping, shared by every generating endpoint.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct Sampling {
    /// Most tokens to generate (default 128, at most the server's limit).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// 0 (the default) decodes greedily; at most 2.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling threshold in (0, 1].
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop before any of these strings.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub stop: Option<StopStrings>,
}

/// One stop string or several (OpenAI accepts both).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopStrings {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// A query's answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct QueryAnswer {
    /// The answer text.
    pub answer: String,
    /// Why generation stopped: `end_of_text`, `stop_string`, `max_tokens`, `context_full`.
    #[schema(value_type = String)]
    pub stop: StopReason,
    /// Answer tokens.
    pub tokens: usize,
    /// Tokens of the corpus the question followed.
    pub corpus_tokens: usize,
    /// Tokens of the question.
    pub question_tokens: usize,
    /// Which documents and passages the answer attended to, each with its share of the
    /// attention mass that reached the corpus: `{"documents": [{"number", "title", "share"}],
    /// "passages": [{"document", "title", "tokens": {"start", "end"}, "share", "text"}]}`,
    /// largest first (empty with full attention).
    #[schema(value_type = Object)]
    pub provenance: kvdb::Provenance,
    /// What retrieval selected and scored (absent with full attention).
    #[schema(value_type = Option<Object>)]
    pub retrieval: Option<kvdb::RetrievalStats>,
    /// `first_token_seconds`, `decode_seconds`, `tokens_per_second`.
    #[schema(value_type = Object)]
    pub timings: kvdb::Timings,
}

impl From<Answer> for QueryAnswer {
    fn from(a: Answer) -> Self {
        Self {
            tokens: a.tokens.len(),
            answer: a.answer,
            stop: a.stop,
            corpus_tokens: a.corpus_tokens,
            question_tokens: a.question_tokens,
            provenance: a.provenance,
            retrieval: a.retrieval,
            timings: a.timings,
        }
    }
}

/// A question, checked against the limits and ready to run.
#[derive(Debug)]
pub(crate) struct Ask {
    pub(crate) corpus: String,
    pub(crate) question: String,
    pub(crate) options: AskOptions,
}

impl Ask {
    /// Checks a question and its options against the server's limits.
    pub(crate) fn new(
        state: &crate::state::AppState,
        corpus: &str,
        question: String,
        index: Option<&str>,
        k: Option<usize>,
        sampling: Sampling,
    ) -> ApiResult<Self> {
        checked_name(corpus)?;
        let limits = &state.config;
        if question.trim().is_empty() {
            return Err(ApiError::invalid("the question is empty"));
        }
        if question.chars().count() > limits.max_question_chars {
            return Err(ApiError::too_large(format!(
                "the question is longer than the server's limit of {} characters",
                limits.max_question_chars
            )));
        }
        let index = index.map(parse_spec).transpose()?;
        // The same checks as the CLI's, so both refuse the same values.
        let k = k.map(checked_k).transpose()?;
        let defaults = GenerateOptions::default();
        let max_tokens = sampling.max_tokens.unwrap_or(defaults.max_tokens);
        if max_tokens == 0 || max_tokens > limits.max_tokens {
            return Err(ApiError::invalid(format!(
                "`max_tokens` must be in 1..={}",
                limits.max_tokens
            )));
        }
        let temperature =
            checked_temperature(sampling.temperature.unwrap_or(defaults.temperature))?;
        let top_p = checked_top_p(sampling.top_p.unwrap_or(defaults.top_p))?;
        let stop = match sampling.stop {
            None => Vec::new(),
            Some(StopStrings::One(s)) => vec![s],
            Some(StopStrings::Many(v)) => v,
        };
        let (most, longest) = STOP_STRINGS;
        if stop.len() > most
            || stop
                .iter()
                .any(|s| s.is_empty() || s.chars().count() > longest)
        {
            return Err(ApiError::invalid(format!(
                "at most {most} stop strings of 1 to {longest} characters"
            )));
        }
        Ok(Self {
            corpus: corpus.to_string(),
            question,
            options: AskOptions {
                profile: false,
                mode: AttentionMode::Retrieval(Retrieval {
                    index,
                    k,
                    follow: kvdb::DEFAULT_FOLLOW,
                    ..Retrieval::default()
                }),
                generate: GenerateOptions {
                    max_tokens,
                    temperature,
                    top_p,
                    seed: sampling.seed.unwrap_or(defaults.seed),
                    stop,
                },
                template: None,
            },
        })
    }
}

/// An admitted question with its corpus open and its index loaded.
#[derive(Debug)]
pub(crate) struct Admitted {
    ticket: Ticket,
    /// Held until the generation ends: the corpus is not deleted under it.
    guard: QueryGuard,
    open: Arc<OpenCorpus>,
    ask: Ask,
}

/// Admits `ask` to the pool (429 when full), counts it on its corpus and opens its corpus
/// and index.
pub(crate) async fn admit(state: &Shared, ask: Ask) -> ApiResult<Admitted> {
    let ticket = state.pool.admit()?;
    let name = ask.corpus.clone();
    let mode = ask.options.mode.clone();
    let (guard, open) = blocking(state.clone(), move |s| {
        // Counted before the corpus opens: a delete from here on answers 409, and one that
        // came first leaves no corpus to open (404).
        let guard = s.start_query(&name)?;
        let open = s.corpus(&name)?;
        if let AttentionMode::Retrieval(r) = &mode {
            let spec = match &r.index {
                Some(spec) => spec.clone(),
                None => open.corpus.default_index()?,
            };
            open.corpus.index(LoadedModel::as_ref(&open.model), &spec)?;
        }
        Ok((guard, open))
    })
    .await?;
    Ok(Admitted {
        ticket,
        guard,
        open,
        ask,
    })
}

impl Admitted {
    /// Waits for a worker and generates on a blocking thread, handing every piece of text to
    /// `on_text`; generation stops when it returns false. With batches on
    /// ([`crate::Config::max_batch`]), the question waits in its line and is answered in a
    /// batch: its own, if it gets a worker first, or another question's (`crate::batches`).
    pub(crate) async fn run(
        mut self,
        state: &Shared,
        mut on_text: impl FnMut(&str) -> bool + Send + 'static,
    ) -> ApiResult<Answer> {
        let max_batch = state.config.max_batch;
        if max_batch <= 1 {
            self.ticket.start().await?;
            return self.lead(state, Vec::new(), on_text).await;
        }
        // Questions go together only on the same corpus with the same options.
        let line = format!("{}\n{:?}", self.ask.corpus, self.ask.options);
        let (place, mut ride) = state.batches.wait(line, self.ask.question.clone());
        let started = tokio::select! {
            started = self.ticket.start() => {
                started?;
                true
            }
            _ = &mut ride.taken => false,
        };
        if started {
            if let Some(riders) = Batches::lead(&place, max_batch - 1) {
                drop(place);
                return self.lead(state, riders, on_text).await;
            }
        }
        // Taken by a leader (perhaps while this one's worker came): its worker answers.
        drop(place);
        self.ticket.ride();
        let Ride { pieces, done, .. } = ride;
        let forwarded = tokio::task::spawn_blocking(move || {
            let mut pieces = pieces;
            while let Some(piece) = pieces.blocking_recv() {
                if !on_text(&piece) {
                    // Dropping the receiver tells the leader: this answer stops there.
                    return false;
                }
            }
            true
        });
        let read = forwarded.await.map_err(ApiError::internal)?;
        if !read {
            state.metrics.cancelled.inc();
            return Err(kvdb::Error::Abandoned.into());
        }
        // Held until the answer is in: the corpus stays while the batch answers it.
        let _held = (self.ticket, self.guard);
        done.await
            .map_err(|_| ApiError::internal("the batch that took this query ended without it"))?
    }

    /// Generates this question's answer and `riders`' (answered together when there are
    /// any) on a blocking thread with this query's worker; sends each rider its text and
    /// answer.
    async fn lead(
        self,
        state: &Shared,
        riders: Vec<Waiting>,
        mut on_text: impl FnMut(&str) -> bool + Send + 'static,
    ) -> ApiResult<Answer> {
        let Self {
            ticket,
            guard,
            open,
            ask,
        } = self;
        let (answer, gone, riders) = tokio::task::spawn_blocking(move || {
            // The worker's slot is free, and the corpus may be deleted, only once the
            // generation has stopped.
            let _held = (ticket, guard);
            let mut gone = false;
            let mut mine = |piece: &str| {
                if on_text(piece) {
                    Ok(())
                } else {
                    gone = true;
                    Err(kvdb::Error::Abandoned)
                }
            };
            let model = LoadedModel::as_ref(&open.model);
            let answer = match riders.is_empty() {
                true => open
                    .corpus
                    .ask(model, &ask.question, &ask.options, &mut mine)
                    .map(|answer| vec![answer]),
                false => {
                    let questions: Vec<&str> = std::iter::once(ask.question.as_str())
                        .chain(riders.iter().map(|r| r.question.as_str()))
                        .collect();
                    open.corpus
                        .ask_together(model, &questions, &ask.options, &mut |i, piece| match i
                            .checked_sub(1)
                        {
                            None => mine(piece),
                            Some(r) => riders[r]
                                .pieces
                                .send(piece.to_string())
                                .map_err(|_| kvdb::Error::Abandoned),
                        })
                        .map(|together| together.answers)
                }
            };
            (answer, gone, riders)
        })
        .await
        .map_err(ApiError::internal)?;
        let m = &state.metrics;
        if !riders.is_empty() {
            m.batched.inc_by(riders.len() as u64 + 1);
        }
        let mut answers = match answer {
            Ok(answers) => answers.into_iter(),
            Err(e) => {
                let e = ApiError::from(e);
                for rider in riders {
                    let _ = rider.done.send(Err(e.clone()));
                }
                if gone {
                    m.cancelled.inc();
                }
                return Err(e);
            }
        };
        let mine = answers.next();
        for (rider, answer) in riders.into_iter().zip(answers) {
            record(m, &answer);
            // Its receiver is gone when its client is: nothing to tell then.
            let _ = rider.done.send(Ok(answer));
        }
        if gone {
            m.cancelled.inc();
            return Err(kvdb::Error::Abandoned.into());
        }
        let answer =
            mine.ok_or_else(|| ApiError::internal("a batch without its leader's answer"))?;
        record(m, &answer);
        Ok(answer)
    }

    /// Runs to the end for a plain (not streamed) answer, stopping if the request is dropped.
    pub(crate) async fn answer(self, state: &Shared) -> ApiResult<Answer> {
        let alive = Arc::new(AtomicBool::new(true));
        let _guard = ClearOnDrop(alive.clone());
        self.run(state, move |_| alive.load(Ordering::SeqCst)).await
    }

    /// Streams the answer: `Text` events, then `Done` or `Failed`.
    pub(crate) fn stream(self, state: &Shared) -> ReceiverStream<Streamed> {
        let (tx, rx) = mpsc::channel(64);
        let state = state.clone();
        tokio::spawn(async move {
            let pieces = tx.clone();
            let result = self
                .run(&state, move |piece| {
                    pieces
                        .blocking_send(Streamed::Text(piece.to_string()))
                        .is_ok()
                })
                .await;
            let last = match result {
                Ok(answer) => Streamed::Done(Box::new(answer)),
                Err(e) => Streamed::Failed(e),
            };
            let _ = tx.send(last).await;
        });
        ReceiverStream::new(rx)
    }
}

/// Counts an answer in the metrics.
fn record(m: &crate::metrics::Metrics, answer: &Answer) {
    m.generated_tokens.inc_by(answer.tokens.len() as u64);
    m.first_token_seconds
        .observe(answer.timings.first_token_seconds);
    m.tokens_per_second.set(answer.timings.tokens_per_second);
}

/// Clears its flag when dropped: the request it lives in is gone.
struct ClearOnDrop(Arc<AtomicBool>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// What a streamed generation produces.
#[derive(Debug)]
pub(crate) enum Streamed {
    Text(String),
    Done(Box<Answer>),
    Failed(ApiError),
}

/// Server-sent events from a generation, each item formatted by `format` into events.
pub(crate) fn sse<F, I>(events: ReceiverStream<Streamed>, format: F) -> Response
where
    F: FnMut(Streamed) -> I + Send + 'static,
    I: IntoIterator<Item = Event> + Send + 'static,
    I::IntoIter: Send,
{
    let stream = events
        .map(format)
        .flat_map(|items| stream::iter(items.into_iter().map(Ok::<_, Infallible>)));
    sse_response(stream)
}

fn sse_response(
    stream: impl Stream<Item = Result<Event, Infallible>> + Send + 'static,
) -> Response {
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A JSON `data:` event, with an event name when given.
pub(crate) fn json_event(name: Option<&str>, value: &impl Serialize) -> Event {
    let data = serde_json::to_string(value).unwrap_or_else(|e| {
        serde_json::json!({"error": {"code": "internal", "message": e.to_string()}}).to_string()
    });
    let event = Event::default().data(data);
    match name {
        Some(name) => event.event(name),
        None => event,
    }
}

#[derive(Serialize)]
struct TokenEvent<'a> {
    text: &'a str,
}

/// Ask a question about a corpus.
#[utoipa::path(post, path = "/v1/corpora/{name}/query", tag = "query",
    params(("name" = String, Path, description = "The corpus")), request_body = QueryRequest,
    responses(
        (status = 200, body = QueryAnswer, description = "The answer; with `stream: true`, \
            `text/event-stream` of `token` events and a final `done` event"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 429, body = ErrorBody)))]
pub(crate) async fn query(
    State(state): State<Shared>,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<QueryRequest>,
) -> ApiResult<Response> {
    let mut ask = Ask::new(
        &state,
        &name,
        body.question,
        body.index.as_deref(),
        body.k,
        body.sampling,
    )?;
    let follow = checked_follow(body.follow)?;
    if let AttentionMode::Retrieval(retrieval) = &mut ask.options.mode {
        retrieval.follow = follow;
    }
    if body.full_attention {
        ask.options.mode = AttentionMode::Full;
    }
    if let Some(t) = &body.template {
        if t.chars().count() > state.config.max_question_chars {
            return Err(ApiError::too_large(
                "the template is longer than the question limit",
            ));
        }
    }
    ask.options.template = body.template;
    let admitted = admit(&state, ask).await?;
    if !body.stream {
        let answer = admitted.answer(&state).await?;
        return Ok(Json(QueryAnswer::from(answer)).into_response());
    }
    Ok(sse(admitted.stream(&state), |item| {
        [match item {
            Streamed::Text(text) => json_event(Some("token"), &TokenEvent { text: &text }),
            Streamed::Done(answer) => json_event(Some("done"), &QueryAnswer::from(*answer)),
            Streamed::Failed(e) => json_event(Some("error"), &e.body()),
        }]
    }))
}
