//! Background jobs: ingests and index builds, run one at a time by one worker thread (they
//! write to the store and are CPU-bound; one at a time is also one ingest per corpus).
//!
//! Each job is kept as a JSON file in `<store>/kvdb-server-jobs/`, with an ingest's
//! documents beside it until it ends. The engine commits chunk by chunk, so a job stopped
//! anywhere leaves the corpus at a commit point: cancelled jobs keep their commits (an
//! interrupted document finishes when the same documents are ingested again), and jobs a
//! shutdown or crash interrupted are queued again when the server restarts and resume
//! where their last commit left off.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use kvdb::LoadedModel;
use kvdb::SourceDocument;
use kvdb::{ingest_until, IngestEvent};
use kvdb::{update_indexes_until, IndexEvent};
use kvdb_index::IndexSpec;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{echo, interrupted, ApiError, ApiResult, ErrorDetail};
use crate::state::AppState;

/// A job's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Waiting for the worker.
    Queued,
    /// Being worked on.
    Running,
    /// Done.
    Succeeded,
    /// Stopped by an error (see `error`).
    Failed,
    /// Stopped by `DELETE /v1/jobs/{id}` at a commit point.
    Cancelled,
}

impl JobStatus {
    fn finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }

    fn name(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// What a job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    /// Appends documents to a corpus, then brings its indexes up to date.
    Ingest,
    /// Adds indexes to a corpus.
    Index,
}

/// How far a job has come.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct Progress {
    /// Documents to add (known once the ingest has planned).
    pub documents: usize,
    /// Documents added so far.
    pub documents_done: usize,
    /// Tokens to prefill.
    pub tokens: usize,
    /// Tokens committed so far.
    pub tokens_done: usize,
    /// Layer/KV-head indexes to build or catch up.
    pub index_parts: usize,
    /// Of those, done.
    pub index_parts_done: usize,
}

/// A background job as `GET /v1/jobs/{id}` reports it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Job {
    /// Its id.
    pub id: String,
    /// Ingest or index.
    pub kind: JobKind,
    /// The corpus it works on.
    pub corpus: String,
    /// Its state.
    pub status: JobStatus,
    /// How far it has come.
    pub progress: Progress,
    /// Index specs it adds (index jobs).
    #[serde(default)]
    pub specs: Vec<String>,
    /// Documents skipped because the corpus already held their content.
    #[serde(default)]
    pub skipped: Vec<String>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
    /// The document a cancelled or failed ingest left part-way, and how to finish it (the
    /// corpus takes no other documents until it is sent again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<String>,
    /// Whether a cancel was asked for (it stops at the next commit point).
    #[serde(default)]
    pub cancel_requested: bool,
    /// Times a server restart queued it again.
    #[serde(default)]
    pub restarts: usize,
    /// Unix seconds when it was submitted.
    pub created: u64,
    /// Unix seconds when it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<u64>,
}

/// The work of a job, kept until it ends.
#[derive(Debug, Clone)]
pub(crate) enum Work {
    Ingest(Vec<SourceDocument>),
    Index(Vec<IndexSpec>),
}

#[derive(Debug)]
struct Entry {
    job: Job,
    cancel: Arc<AtomicBool>,
    work: Option<Work>,
}

#[derive(Debug, Default)]
struct Inner {
    jobs: HashMap<String, Entry>,
    queue: VecDeque<String>,
    next: u64,
    stopping: bool,
}

/// The job registry and queue.
#[derive(Debug)]
pub(crate) struct Jobs {
    dir: PathBuf,
    inner: Mutex<Inner>,
    wake: Condvar,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn io_error(what: &str, path: &Path, e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("{what} {}: {e}", path.display()))
}

impl Jobs {
    /// Loads the jobs kept in `<store>/kvdb-server-jobs`: those a shutdown or crash
    /// interrupted are queued again (in submission order); an ingest whose documents were
    /// not kept is reported failed.
    pub(crate) fn load(store: &Path) -> ApiResult<Self> {
        let dir = store.join("kvdb-server-jobs");
        std::fs::create_dir_all(&dir).map_err(|e| io_error("creating", &dir, e))?;
        let mut inner = Inner::default();
        let mut pending = Vec::new();
        let entries = std::fs::read_dir(&dir).map_err(|e| io_error("listing", &dir, e))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !name.ends_with(".job.json") {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|e| io_error("reading", &path, e))?;
            let Ok(mut job) = serde_json::from_slice::<Job>(&bytes) else {
                tracing::warn!("ignoring the unreadable job file {}", path.display());
                continue;
            };
            let mut work = None;
            if !job.status.finished() {
                work = match job.kind {
                    JobKind::Ingest => std::fs::read(documents_path(&dir, &job.id))
                        .ok()
                        .and_then(|b| serde_json::from_slice(&b).ok())
                        .map(Work::Ingest),
                    JobKind::Index => job
                        .specs
                        .iter()
                        .map(|s| s.parse())
                        .collect::<Result<Vec<IndexSpec>, _>>()
                        .ok()
                        .map(Work::Index),
                };
                if work.is_some() {
                    job.status = JobStatus::Queued;
                    job.restarts += 1;
                    pending.push(job.id.clone());
                } else {
                    job.status = JobStatus::Failed;
                    job.finished = Some(now());
                    job.error = Some(ErrorDetail {
                        code: "interrupted".into(),
                        message: "a server restart interrupted this job and its work was not \
                                  kept; the corpus holds what it committed"
                            .into(),
                    });
                }
                write_job(&dir, &job)?;
            }
            inner.next = inner.next.max(sequence(&job.id) + 1);
            inner.jobs.insert(
                job.id.clone(),
                Entry {
                    job,
                    cancel: Arc::default(),
                    work,
                },
            );
        }
        pending.sort_by_key(|id| sequence(id));
        inner.queue.extend(pending);
        Ok(Self {
            dir,
            inner: Mutex::new(inner),
            wake: Condvar::new(),
        })
    }

    fn lock(&self) -> ApiResult<MutexGuard<'_, Inner>> {
        self.inner
            .lock()
            .map_err(|_| ApiError::internal("a job update panicked"))
    }

    /// Queues a job (kept on disk first, so a crash right after cannot lose it).
    pub(crate) fn submit(&self, corpus: &str, work: Work) -> ApiResult<Job> {
        let mut inner = self.lock()?;
        if inner.stopping {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let id = format!("{:08x}", inner.next);
        let (kind, specs) = match &work {
            Work::Ingest(_) => (JobKind::Ingest, Vec::new()),
            Work::Index(specs) => (
                JobKind::Index,
                specs.iter().map(|s| s.to_string()).collect(),
            ),
        };
        let job = Job {
            id: id.clone(),
            kind,
            corpus: corpus.to_string(),
            status: JobStatus::Queued,
            progress: Progress::default(),
            specs,
            skipped: Vec::new(),
            error: None,
            interrupted: None,
            cancel_requested: false,
            restarts: 0,
            created: now(),
            finished: None,
        };
        if let Work::Ingest(documents) = &work {
            let path = documents_path(&self.dir, &id);
            let bytes = serde_json::to_vec(documents).map_err(ApiError::internal)?;
            std::fs::write(&path, bytes).map_err(|e| io_error("writing", &path, e))?;
        }
        write_job(&self.dir, &job)?;
        inner.next += 1;
        inner.jobs.insert(
            id.clone(),
            Entry {
                job: job.clone(),
                cancel: Arc::default(),
                work: Some(work),
            },
        );
        inner.queue.push_back(id);
        self.wake.notify_all();
        Ok(job)
    }

    /// Job `id`.
    pub(crate) fn get(&self, id: &str) -> ApiResult<Job> {
        self.lock()?
            .jobs
            .get(id)
            .map(|e| e.job.clone())
            .ok_or_else(|| ApiError::not_found(format!("no job `{}`", echo(id))))
    }

    /// The unfinished job of corpus `name`, if any.
    pub(crate) fn active(&self, name: &str) -> ApiResult<Option<String>> {
        Ok(self
            .lock()?
            .jobs
            .values()
            .find(|e| e.job.corpus == name && !e.job.status.finished())
            .map(|e| e.job.id.clone()))
    }

    /// Cancels job `id`: a queued job at once, a running one at its next commit point.
    pub(crate) fn cancel(&self, id: &str) -> ApiResult<Job> {
        let mut inner = self.lock()?;
        let entry = inner
            .jobs
            .get_mut(id)
            .ok_or_else(|| ApiError::not_found(format!("no job `{}`", echo(id))))?;
        match entry.job.status {
            JobStatus::Queued => {
                entry.cancel.store(true, Ordering::SeqCst);
                entry.job.cancel_requested = true;
                self.finish_entry(entry, JobStatus::Cancelled, None)?;
                let job = entry.job.clone();
                inner.queue.retain(|q| q != id);
                Ok(job)
            }
            JobStatus::Running => {
                entry.cancel.store(true, Ordering::SeqCst);
                entry.job.cancel_requested = true;
                Ok(entry.job.clone())
            }
            s => Err(ApiError::conflict(format!(
                "job `{id}` has already ended ({})",
                s.name()
            ))),
        }
    }

    fn finish_entry(
        &self,
        entry: &mut Entry,
        status: JobStatus,
        error: Option<ErrorDetail>,
    ) -> ApiResult<()> {
        entry.job.status = status;
        entry.job.error = error;
        entry.job.finished = Some(now());
        entry.work = None;
        let _ = std::fs::remove_file(documents_path(&self.dir, &entry.job.id));
        write_job(&self.dir, &entry.job)
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut Job)) {
        if let Ok(mut inner) = self.lock() {
            if let Some(e) = inner.jobs.get_mut(id) {
                f(&mut e.job);
            }
        }
    }

    /// Stops handing out jobs and wakes the worker so that it can return.
    pub(crate) fn stop(&self) {
        if let Ok(mut inner) = self.lock() {
            inner.stopping = true;
        }
        self.wake.notify_all();
    }

    /// The next queued job, waiting for one; `None` once stopping.
    fn next(&self) -> Option<(String, Work, Arc<AtomicBool>)> {
        let mut inner = self.lock().ok()?;
        loop {
            if inner.stopping {
                return None;
            }
            while let Some(id) = inner.queue.pop_front() {
                if let Some(entry) = inner.jobs.get_mut(&id) {
                    if let (JobStatus::Queued, Some(work)) = (entry.job.status, entry.work.clone())
                    {
                        entry.job.status = JobStatus::Running;
                        let _ = write_job(&self.dir, &entry.job);
                        return Some((id, work, entry.cancel.clone()));
                    }
                }
            }
            inner = self.wake.wait(inner).ok()?;
        }
    }

    /// Records how a job ended: succeeded, failed, cancelled (noting the document it left
    /// part-way, `left`), or (stopped by a shutdown) queued again for the next start.
    fn end(&self, id: &str, result: Result<(), ApiError>, shutdown: bool, left: Option<String>) {
        let Ok(mut inner) = self.lock() else {
            return;
        };
        let Some(entry) = inner.jobs.get_mut(id) else {
            return;
        };
        let outcome = match result {
            Ok(()) => self.finish_entry(entry, JobStatus::Succeeded, None),
            Err(e) if e.code == CANCELLED && shutdown && !entry.job.cancel_requested => {
                entry.job.status = JobStatus::Queued;
                write_job(&self.dir, &entry.job)
            }
            Err(e) if e.code == CANCELLED => {
                entry.job.interrupted = left;
                self.finish_entry(entry, JobStatus::Cancelled, None)
            }
            Err(e) => {
                entry.job.interrupted = left;
                self.finish_entry(entry, JobStatus::Failed, Some(e.body().error))
            }
        };
        if let Err(e) = outcome {
            tracing::error!("recording the end of job {id}: {e}");
        }
    }
}

/// The code [`ApiError`] carries for a job stopped at a commit point.
const CANCELLED: &str = "cancelled";

fn sequence(id: &str) -> u64 {
    u64::from_str_radix(id, 16).unwrap_or(0)
}

fn job_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.job.json"))
}

fn documents_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.documents.json"))
}

/// Writes a job's record atomically (a temporary file renamed over the old one).
fn write_job(dir: &Path, job: &Job) -> ApiResult<()> {
    let path = job_path(dir, &job.id);
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec_pretty(job).map_err(ApiError::internal)?;
    std::fs::write(&tmp, bytes).map_err(|e| io_error("writing", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io_error("renaming", &tmp, e))
}

/// Runs queued jobs one at a time until the server stops (blocking: a thread of its own).
pub(crate) fn worker(state: Arc<AppState>) {
    while let Some((id, work, cancel)) = state.jobs.next() {
        let (corpus, kind) = match state.jobs.get(&id) {
            Ok(job) => (job.corpus, job.kind),
            Err(_) => continue,
        };
        let result = run(&state, &id, &corpus, work, &cancel);
        state.invalidate(&corpus);
        state.metrics.ingest_planned.set(0);
        state.metrics.ingest_done.set(0);
        let shutdown = state.stopping.load(Ordering::SeqCst);
        let left = match (&result, kind) {
            (Err(_), JobKind::Ingest) => left_part_way(&state, &corpus),
            _ => None,
        };
        state.jobs.end(&id, result, shutdown, left);
        if let Ok(job) = state.jobs.get(&id) {
            if job.status.finished() {
                let kind = match kind {
                    JobKind::Ingest => "ingest",
                    JobKind::Index => "index",
                };
                state
                    .metrics
                    .jobs
                    .with_label_values(&[kind, job.status.name()])
                    .inc();
            }
        }
    }
}

/// The document corpus `corpus` has part-way, and how to finish it, if any.
fn left_part_way(state: &AppState, corpus: &str) -> Option<String> {
    let manifest = state.store.manifest(corpus).ok()?;
    let pending = manifest.pending?;
    Some(interrupted(
        corpus,
        &pending.title,
        manifest.tokens.saturating_sub(pending.start),
        pending.total,
    ))
}

/// One job: an ingest (then its corpus's index update), or an index build.
fn run(
    state: &AppState,
    id: &str,
    corpus: &str,
    work: Work,
    cancel: &AtomicBool,
) -> Result<(), ApiError> {
    let stop = || cancel.load(Ordering::SeqCst) || state.stopping.load(Ordering::SeqCst);
    let flow = |stop: bool| {
        if stop {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let manifest = state.store.manifest(corpus)?;
    let model = state.models.for_corpus(&manifest)?;
    let specs = match work {
        Work::Ingest(documents) => {
            let report = ingest_until(
                &state.store,
                corpus,
                LoadedModel::as_ref(&model),
                &documents,
                &mut |event| {
                    match event {
                        IngestEvent::Planned { documents, tokens } => {
                            state.metrics.ingest_planned.set(tokens as i64);
                            state.jobs.update(id, |j| {
                                j.progress.documents = documents;
                                j.progress.tokens = tokens;
                            });
                        }
                        IngestEvent::Skipped { title, .. } => {
                            state.jobs.update(id, |j| j.skipped.push(title.to_string()))
                        }
                        IngestEvent::Loaded { .. } | IngestEvent::Started { .. } => {}
                        IngestEvent::Committed {
                            chunk, done, total, ..
                        } => {
                            state.invalidate(corpus);
                            state.metrics.ingest_tokens.inc_by(chunk as u64);
                            state.metrics.ingest_done.add(chunk as i64);
                            state.jobs.update(id, |j| {
                                j.progress.tokens_done += chunk;
                                j.progress.documents_done += usize::from(done == total);
                            });
                        }
                    }
                    flow(stop())
                },
            )
            .map_err(job_error)?;
            tracing::info!(
                "job {id}: added {} documents ({} tokens) to `{corpus}`",
                report.added.len(),
                report.tokens
            );
            Vec::new()
        }
        Work::Index(specs) => specs,
    };
    update_indexes_until(
        &state.store,
        corpus,
        LoadedModel::as_ref(&model),
        &specs,
        None,
        &mut |event| {
            match event {
                IndexEvent::Started { parts, .. } => {
                    state.jobs.update(id, |j| j.progress.index_parts += parts)
                }
                IndexEvent::Part { .. } => {
                    state.jobs.update(id, |j| j.progress.index_parts_done += 1)
                }
                IndexEvent::Warning { spec, message } => {
                    tracing::warn!("job {id}: index {spec}: {message}")
                }
            }
            flow(stop())
        },
    )
    .map_err(job_error)?;
    Ok(())
}

fn job_error(e: kvdb::Error) -> ApiError {
    match e {
        kvdb::Error::Cancelled { .. } => ApiError {
            code: CANCELLED,
            ..ApiError::conflict(e.to_string())
        },
        e => e.into(),
    }
}
