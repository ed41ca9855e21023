//! What every handler shares: the store (opened once, for writing), the models, the open
//! corpora, the query pool, the jobs and the metrics.
//!
//! Corpora open lazily and stay open as `Arc<Corpus>` snapshots; a job's commit drops the
//! cached one, so the next query opens the last committed state while queries already
//! running finish on theirs. The query pool admits `max_concurrent` generations at once and
//! queues up to `max_queue` more; past that a request is refused at once (429), so an
//! overloaded server answers quickly instead of slowing everyone down.
//!
//! Every query holds a [`QueryGuard`] on its corpus from before the corpus opens until its
//! generation ends (streams included). Guards are taken under the catalog lock, and deleting
//! a corpus or removing one of its indexes checks under the same lock that none is held, so a
//! query never finds its corpus's keys or indexes gone or renumbered under it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvdb::store::Store;
use kvdb::Corpus;
use kvdb::LoadedModel;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::batches::Batches;
use crate::error::{ApiError, ApiResult};
use crate::jobs::Jobs;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::Config;

/// The server's shared state.
#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) config: Config,
    pub(crate) store: Arc<Store>,
    pub(crate) models: Models,
    pub(crate) jobs: Jobs,
    pub(crate) metrics: Metrics,
    pub(crate) pool: Arc<Pool>,
    /// Questions waiting for a worker that may be answered together.
    pub(crate) batches: Arc<Batches>,
    /// Held by whoever changes which corpora exist (create, delete, queueing an ingest), so
    /// that checking and acting are one step.
    pub(crate) catalog: Mutex<()>,
    /// Set when shutdown begins: jobs stop at their next commit point.
    pub(crate) stopping: AtomicBool,
    corpora: Mutex<CorpusCache>,
    queries: QueryCounts,
}

/// An open corpus with the model it answers with.
#[derive(Debug)]
pub(crate) struct OpenCorpus {
    pub(crate) corpus: Corpus,
    pub(crate) model: Arc<LoadedModel>,
}

#[derive(Debug, Default)]
struct CorpusCache {
    open: HashMap<String, Arc<OpenCorpus>>,
    /// Held while a corpus opens: the queries that want it meanwhile wait for that open
    /// rather than each loading its own copy of the RAM tier (four first questions at once
    /// on a 120K-token Llama-3-8B corpus took 130 GB and the server was killed).
    opening: HashMap<String, Arc<Mutex<()>>>,
    /// Bumped by every invalidation, so that an open that raced a commit is not cached.
    generation: HashMap<String, u64>,
}

impl AppState {
    pub(crate) fn new(config: Config, store: Store, jobs: Jobs) -> ApiResult<Self> {
        let metrics = Metrics::new().map_err(ApiError::internal)?;
        Ok(Self {
            models: Models::new(config.models_dir.clone(), config.device),
            pool: Arc::new(Pool::new(
                config.max_concurrent,
                config.max_queue,
                metrics.clone(),
            )),
            batches: Arc::default(),
            config,
            store: Arc::new(store),
            jobs,
            metrics,
            catalog: Mutex::default(),
            stopping: AtomicBool::new(false),
            corpora: Mutex::default(),
            queries: QueryCounts::default(),
        })
    }

    /// Counts a query on corpus `name` until the guard drops. Taken under the catalog lock,
    /// so that it cannot slip between a delete's check and its deletion: the query either
    /// counts before the check (and the delete answers 409) or starts after the deletion
    /// (and its corpus open answers 404).
    pub(crate) fn start_query(&self, name: &str) -> ApiResult<QueryGuard> {
        let _catalog = self.lock_catalog()?;
        Ok(self.queries.enter(name))
    }

    /// 409 unless corpus `name` is idle: no job works on it (or waits to) and no query runs
    /// on it. Call it holding the catalog lock, and change the corpus under the same hold.
    pub(crate) fn check_idle(&self, name: &str) -> ApiResult<()> {
        if let Some(job) = self.jobs.active(name)? {
            return Err(ApiError::conflict(format!(
                "job `{job}` is working on corpus `{name}`: cancel it (DELETE /v1/jobs/{job}) \
                 or wait for it to end, then retry"
            )));
        }
        match self.queries.count(name) {
            0 => Ok(()),
            1 => Err(ApiError::conflict(format!(
                "a query is running on corpus `{name}`: retry once it has finished"
            ))),
            n => Err(ApiError::conflict(format!(
                "{n} queries are running on corpus `{name}`: retry once they have finished"
            ))),
        }
    }

    /// Corpus `name`, opened on first use, once however many queries ask for it at the same
    /// time (blocking: run it off the async executor).
    pub(crate) fn corpus(&self, name: &str) -> ApiResult<Arc<OpenCorpus>> {
        let gate = {
            let mut cache = self.lock_cache()?;
            if let Some(open) = cache.open.get(name) {
                return Ok(open.clone());
            }
            cache.opening.entry(name.to_string()).or_default().clone()
        };
        // Opened outside the cache's lock (queries of other corpora do not wait for it) but
        // under the corpus's gate: whoever waited there finds it open.
        let _opening = gate
            .lock()
            .map_err(|_| ApiError::internal("a corpus open panicked"))?;
        let generation = {
            let cache = self.lock_cache()?;
            if let Some(open) = cache.open.get(name) {
                return Ok(open.clone());
            }
            cache.generation.get(name).copied().unwrap_or(0)
        };
        self.metrics.corpus_opens.inc();
        let manifest = self.store.manifest(name)?;
        let model = self.models.for_corpus(&manifest)?;
        let corpus = Corpus::open(
            self.store.clone(),
            name,
            LoadedModel::as_ref(&model),
            self.config.ram_budget,
        )?
        .with_gpu_kv(self.config.gpu_kv);
        let open = Arc::new(OpenCorpus { corpus, model });
        let mut cache = self.lock_cache()?;
        if cache.generation.get(name).copied().unwrap_or(0) == generation {
            cache.open.insert(name.to_string(), open.clone());
        }
        Ok(open)
    }

    /// Drops the cached corpus `name` (its store state changed).
    pub(crate) fn invalidate(&self, name: &str) {
        if let Ok(mut cache) = self.lock_cache() {
            cache.open.remove(name);
            *cache.generation.entry(name.to_string()).or_default() += 1;
        }
    }

    /// The corpora open now.
    pub(crate) fn open_corpora(&self) -> Vec<(String, Arc<OpenCorpus>)> {
        self.lock_cache()
            .map(|c| c.open.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    fn lock_cache(&self) -> ApiResult<std::sync::MutexGuard<'_, CorpusCache>> {
        self.corpora
            .lock()
            .map_err(|_| ApiError::internal("a corpus open panicked"))
    }

    /// Takes the catalog lock.
    pub(crate) fn lock_catalog(&self) -> ApiResult<std::sync::MutexGuard<'_, ()>> {
        self.catalog
            .lock()
            .map_err(|_| ApiError::internal("a catalog change panicked"))
    }
}

/// Queries in flight, by corpus.
#[derive(Debug, Default)]
struct QueryCounts(Arc<Mutex<HashMap<String, usize>>>);

impl QueryCounts {
    fn enter(&self, name: &str) -> QueryGuard {
        *lock(&self.0).entry(name.to_string()).or_default() += 1;
        QueryGuard {
            counts: self.0.clone(),
            name: name.to_string(),
        }
    }

    fn count(&self, name: &str) -> usize {
        lock(&self.0).get(name).copied().unwrap_or(0)
    }
}

/// The counts stay right even if a holder panicked: each change is one step, nothing is
/// left half-done.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One query in flight on a corpus (see [`AppState::start_query`]).
#[derive(Debug)]
pub(crate) struct QueryGuard {
    counts: Arc<Mutex<HashMap<String, usize>>>,
    name: String,
}

impl Drop for QueryGuard {
    fn drop(&mut self) {
        let mut counts = lock(&self.counts);
        if let Some(n) = counts.get_mut(&self.name) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.name);
            }
        }
    }
}

/// The bounded pool of query workers.
#[derive(Debug)]
pub(crate) struct Pool {
    permits: Arc<Semaphore>,
    admitted: AtomicUsize,
    limit: usize,
    metrics: Metrics,
}

impl Pool {
    fn new(max_concurrent: usize, max_queue: usize, metrics: Metrics) -> Self {
        let workers = max_concurrent.max(1);
        Self {
            permits: Arc::new(Semaphore::new(workers)),
            admitted: AtomicUsize::new(0),
            limit: workers + max_queue,
            metrics,
        }
    }

    /// A place in the queue, or 429 at once when running and queued queries fill the limit.
    pub(crate) fn admit(self: &Arc<Self>) -> ApiResult<Ticket> {
        let before = self.admitted.fetch_add(1, Ordering::SeqCst);
        if before >= self.limit {
            self.admitted.fetch_sub(1, Ordering::SeqCst);
            self.metrics.rejected.inc();
            return Err(ApiError::overloaded(self.limit));
        }
        self.metrics.queries.inc();
        self.metrics.queue_depth.inc();
        Ok(Ticket {
            pool: self.clone(),
            permit: None,
            riding: false,
        })
    }
}

/// An admitted query: queued until [`Ticket::start`], running until dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    pool: Arc<Pool>,
    permit: Option<OwnedSemaphorePermit>,
    /// Running on another query's worker ([`Ticket::ride`]).
    riding: bool,
}

impl Ticket {
    /// Waits for a worker.
    pub(crate) async fn start(&mut self) -> ApiResult<()> {
        let permit = self
            .pool
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(ApiError::internal)?;
        self.permit = Some(permit);
        self.pool.metrics.queue_depth.dec();
        self.pool.metrics.running.inc();
        Ok(())
    }
}

impl Ticket {
    /// Runs on another query's worker (answered in its batch, `crate::batches`): gives its
    /// own worker back if it has one; counted as running until dropped.
    pub(crate) fn ride(&mut self) {
        if self.permit.take().is_none() && !self.riding {
            self.pool.metrics.queue_depth.dec();
            self.pool.metrics.running.inc();
        }
        self.riding = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.permit.is_some() || self.riding {
            self.pool.metrics.running.dec();
        } else {
            self.pool.metrics.queue_depth.dec();
        }
        self.pool.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}
