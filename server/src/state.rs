//! What every handler shares: the store (opened once, for writing), the models, the open
//! corpora, the query pool, the jobs and the metrics.
//!
//! Corpora open lazily and stay open as `Arc<Corpus>` snapshots; a job's commit drops the
//! cached one, so the next query opens the last committed state while queries already
//! running finish on theirs. The query pool admits `max_concurrent` generations at once and
//! queues up to `max_queue` more; past that a request is refused at once (429), so an
//! overloaded server answers quickly instead of slowing everyone down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvdb::models::LoadedModel;
use kvdb::session::Corpus;
use kvdb::store::Store;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
    /// Held by whoever changes which corpora exist (create, delete, queueing an ingest), so
    /// that checking and acting are one step.
    pub(crate) catalog: Mutex<()>,
    /// Set when shutdown begins: jobs stop at their next commit point.
    pub(crate) stopping: AtomicBool,
    corpora: Mutex<CorpusCache>,
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
    /// Bumped by every invalidation, so that an open that raced a commit is not cached.
    generation: HashMap<String, u64>,
}

impl AppState {
    pub(crate) fn new(config: Config, store: Store, jobs: Jobs) -> ApiResult<Self> {
        let metrics = Metrics::new().map_err(ApiError::internal)?;
        Ok(Self {
            models: Models::new(config.models_dir.clone()),
            pool: Arc::new(Pool::new(
                config.max_concurrent,
                config.max_queue,
                metrics.clone(),
            )),
            config,
            store: Arc::new(store),
            jobs,
            metrics,
            catalog: Mutex::default(),
            stopping: AtomicBool::new(false),
            corpora: Mutex::default(),
        })
    }

    /// Corpus `name`, opened on first use (blocking: run it off the async executor).
    pub(crate) fn corpus(&self, name: &str) -> ApiResult<Arc<OpenCorpus>> {
        let generation = {
            let cache = self.lock_cache()?;
            if let Some(open) = cache.open.get(name) {
                return Ok(open.clone());
            }
            cache.generation.get(name).copied().unwrap_or(0)
        };
        // Opened outside the lock: queries of other corpora do not wait for it.
        let manifest = self.store.manifest(name)?;
        let model = self.models.for_corpus(&manifest)?;
        let corpus = Corpus::open(
            self.store.clone(),
            name,
            LoadedModel::as_ref(&model),
            self.config.ram_budget,
        )?;
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
        })
    }
}

/// An admitted query: queued until [`Ticket::start`], running until dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    pool: Arc<Pool>,
    permit: Option<OwnedSemaphorePermit>,
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

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.permit.is_some() {
            self.pool.metrics.running.dec();
        } else {
            self.pool.metrics.queue_depth.dec();
        }
        self.pool.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}
