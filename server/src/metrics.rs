//! Prometheus metrics, one registry per server (so servers in one process, as in tests, do
//! not mix counts): requests and their latencies by route, generated tokens and their speed,
//! the query queue, ingest progress and the RAM tier's bytes.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the server exports.
#[derive(Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    pub(crate) requests: IntCounterVec,
    pub(crate) request_seconds: HistogramVec,
    pub(crate) queries: IntCounter,
    pub(crate) rejected: IntCounter,
    pub(crate) cancelled: IntCounter,
    pub(crate) batched: IntCounter,
    pub(crate) corpus_opens: IntCounter,
    pub(crate) queue_depth: IntGauge,
    pub(crate) running: IntGauge,
    pub(crate) first_token_seconds: Histogram,
    pub(crate) generated_tokens: IntCounter,
    pub(crate) tokens_per_second: Gauge,
    pub(crate) ingest_tokens: IntCounter,
    pub(crate) ingest_planned: IntGauge,
    pub(crate) ingest_done: IntGauge,
    pub(crate) jobs: IntCounterVec,
    pub(crate) tier_bytes: IntGaugeVec,
    pub(crate) index_bytes: IntGaugeVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub(crate) fn new() -> prometheus::Result<Self> {
        let registry = Registry::new_custom(Some("kvdb".into()), None)?;
        let latency = vec![
            0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ];
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new("http_requests_total", "HTTP requests answered"),
                &["route", "method", "status"],
            )?,
            request_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "http_request_seconds",
                    "Seconds to answer (stream: to its head)",
                )
                .buckets(latency.clone()),
                &["route"],
            )?,
            queries: IntCounter::new("queries_total", "Queries and completions admitted")?,
            rejected: IntCounter::new("queries_rejected_total", "Queries refused with 429")?,
            batched: IntCounter::new(
                "queries_batched_total",
                "Queries answered in one batch with others (each counted)",
            )?,
            corpus_opens: IntCounter::new(
                "corpus_opens_total",
                "Corpora opened for queries (their RAM tier loaded), first uses and reopenings \
                 after a change",
            )?,
            cancelled: IntCounter::new(
                "queries_cancelled_total",
                "Generations stopped because their client went away",
            )?,
            queue_depth: IntGauge::new("query_queue_depth", "Queries waiting for a worker")?,
            running: IntGauge::new("queries_running", "Queries generating now")?,
            first_token_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "query_first_token_seconds",
                    "Seconds to the first answer token",
                )
                .buckets(latency),
            )?,
            generated_tokens: IntCounter::new("generated_tokens_total", "Answer tokens generated")?,
            tokens_per_second: Gauge::new(
                "generation_tokens_per_second",
                "Decode speed of the last finished query",
            )?,
            ingest_tokens: IntCounter::new("ingest_tokens_total", "Tokens ingested and committed")?,
            ingest_planned: IntGauge::new(
                "ingest_job_tokens_planned",
                "Tokens the running ingest job prefills",
            )?,
            ingest_done: IntGauge::new(
                "ingest_job_tokens_done",
                "Tokens the running ingest job has committed",
            )?,
            jobs: IntCounterVec::new(
                Opts::new("jobs_total", "Background jobs finished"),
                &["kind", "status"],
            )?,
            tier_bytes: IntGaugeVec::new(
                Opts::new(
                    "ram_tier_bytes",
                    "Bytes of keys and values in an open corpus's RAM tier",
                ),
                &["corpus"],
            )?,
            index_bytes: IntGaugeVec::new(
                Opts::new("index_bytes", "Bytes of an open corpus's loaded indexes"),
                &["corpus"],
            )?,
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.requests.clone()))?;
        r.register(Box::new(m.request_seconds.clone()))?;
        r.register(Box::new(m.queries.clone()))?;
        r.register(Box::new(m.rejected.clone()))?;
        r.register(Box::new(m.cancelled.clone()))?;
        r.register(Box::new(m.batched.clone()))?;
        r.register(Box::new(m.corpus_opens.clone()))?;
        r.register(Box::new(m.queue_depth.clone()))?;
        r.register(Box::new(m.running.clone()))?;
        r.register(Box::new(m.first_token_seconds.clone()))?;
        r.register(Box::new(m.generated_tokens.clone()))?;
        r.register(Box::new(m.tokens_per_second.clone()))?;
        r.register(Box::new(m.ingest_tokens.clone()))?;
        r.register(Box::new(m.ingest_planned.clone()))?;
        r.register(Box::new(m.ingest_done.clone()))?;
        r.register(Box::new(m.jobs.clone()))?;
        r.register(Box::new(m.tier_bytes.clone()))?;
        r.register(Box::new(m.index_bytes.clone()))?;
        Ok(m)
    }

    /// The text exposition format of every metric.
    pub(crate) fn render(&self) -> Result<String, prometheus::Error> {
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out)?;
        String::from_utf8(out).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}
