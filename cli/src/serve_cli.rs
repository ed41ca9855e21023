//! `kvdb serve`: the HTTP API (kvdb-server) on a store until SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::time::Duration;

use crate::parse_bytes;
use anyhow::{Context, Result};
use kvdb_server::Config;

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// The store's folder (created when absent). The server holds it for writing: other
    /// writers fail until it stops, readers (`kvdb ask`) still work.
    #[arg(long)]
    store: PathBuf,
    /// Address to listen on (port 0: any free port, printed on start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Bearer token that write endpoints need (also read from KVDB_TOKEN).
    #[arg(long, env = "KVDB_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Require the token on every endpoint but /health.
    #[arg(long, requires = "token")]
    token_all: bool,
    /// Generations running at once (default: one per CPU core; on a GPU one, whose batches
    /// answer the questions waiting for it together).
    #[arg(long)]
    max_concurrent: Option<usize>,
    /// Most questions answered together in one batch: questions on one corpus with the same
    /// options that wait for a worker go with the first of them to get one (default: 16 on a
    /// GPU, where a batch reads the weights and the corpus once a step for all its answers;
    /// 1 on the CPU, where a batch answers one after another).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    max_batch: Option<u64>,
    /// Queries waiting for a worker before the server answers 429.
    #[arg(long, default_value_t = 16)]
    max_queue: usize,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Bytes of keys and values each open corpus holds in memory (e.g. 512M, 2G).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    ram_budget: usize,
    /// Seconds a client may take to send a request's headers (and an idle keep-alive
    /// connection stays open).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=3600))]
    header_timeout: u64,
    /// Seconds a request body may pause before the request fails with 408.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    body_timeout: u64,
    /// Seconds a shutdown gives requests in flight before it closes their connections.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=3600))]
    shutdown_grace: u64,
    /// Where ingests' prefill and queries' decoding run: `cpu`, or `cuda` / `cuda:N` (an
    /// NVIDIA GPU; needs a build with feature `gpu`; indexes are still searched on the CPU).
    #[arg(long, default_value = "cpu")]
    device: kvdb::ComputeDevice,
    /// Where a GPU keeps each open corpus's keys and values: `resident`, `host` (pinned host
    /// memory, read in place or through a GPU cache of hot blocks; questions must retrieve),
    /// `host:SIZE` (`host:0`: no cache), `split:SIZE` (whole layers on the GPU up to SIZE, the
    /// rest as `host`), or `auto` (resident when they fit, else split), as for `kvdb ask`.
    #[arg(long, default_value = "auto", value_parser = crate::parse_gpu_kv)]
    gpu_kv: kvdb::GpuKv,
}

pub(crate) fn serve(args: ServeArgs) -> Result<()> {
    let mut config = Config::new(args.store.clone(), kvdb_model::fetch::models_dir()?);
    config.token = args.token;
    config.token_all = args.token_all;
    let gpu = matches!(args.device, kvdb::ComputeDevice::Cuda { .. });
    if gpu {
        config.max_concurrent = 1;
        config.max_batch = 16;
    }
    if let Some(n) = args.max_concurrent {
        anyhow::ensure!(n > 0, "--max-concurrent must be at least 1");
        config.max_concurrent = n;
    }
    if let Some(n) = args.max_batch {
        config.max_batch = n as usize;
    }
    config.max_queue = args.max_queue;
    config.max_tokens = args.max_tokens;
    config.ram_budget = args.ram_budget;
    config.header_read_timeout = Duration::from_secs(args.header_timeout);
    config.body_read_timeout = Duration::from_secs(args.body_timeout);
    config.shutdown_grace = Duration::from_secs(args.shutdown_grace);
    config.device = args.device;
    config.gpu_kv = args.gpu_kv;
    // The server logs what it does not tell clients (internal errors, job events).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a person watching, not in a redirected log.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .with_target(false)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.addr)
            .await
            .with_context(|| format!("listening on {}", args.addr))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "kvdb: serving {} on http://{addr} (models from {})",
            args.store.display(),
            config.models_dir.display()
        );
        kvdb_server::serve(config, listener, shutdown_signal()).await?;
        eprintln!("kvdb: server stopped");
        Ok(())
    })
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    eprintln!("kvdb: shutting down: finishing requests, stopping jobs at a commit point");
}
