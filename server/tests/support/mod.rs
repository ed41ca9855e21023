//! A real server on loopback over a tiny random-weight gemma3 (fast, deterministic answers),
//! with a reqwest client and helpers for jobs, server-sent events and metrics.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvdb_server::{serve, Config, ServeError};
use kvdb_tests::TinyModel;
use reqwest::{Client, Method, RequestBuilder, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The tiny model's file name in the server's model folder.
pub const MODEL: &str = "tiny.gguf";

/// A server running on 127.0.0.1 with its own store and model folder.
pub struct TestServer {
    pub base: String,
    pub client: Client,
    pub token: Option<String>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServeError>>>,
    _temp: Option<tempfile::TempDir>,
}

/// Writes the tiny model into `dir/models` (once).
pub fn write_model(dir: &Path) -> Result<PathBuf> {
    let models = dir.join("models");
    std::fs::create_dir_all(&models)?;
    let path = models.join(MODEL);
    if !path.exists() {
        TinyModel {
            context_length: 32768,
            ..TinyModel::gemma3()
        }
        .write(&path)?;
    }
    Ok(models)
}

/// A configuration for a store in `dir` with small limits that tests can reach.
pub fn config(dir: &Path) -> Result<Config> {
    let mut config = Config::new(dir.join("store"), write_model(dir)?);
    config.max_concurrent = 2;
    config.max_queue = 8;
    config.max_body_bytes = 256 << 10;
    config.max_question_chars = 2000;
    config.max_tokens = 256;
    Ok(config)
}

impl TestServer {
    /// A server in a fresh temporary folder, `edit` adjusting its configuration.
    pub async fn start(edit: impl FnOnce(&mut Config)) -> Result<Self> {
        let temp = tempfile::tempdir()?;
        let mut server = Self::start_in(temp.path(), edit).await?;
        server._temp = Some(temp);
        Ok(server)
    }

    /// A server on the store in `dir` (which outlives it: restarts reuse it).
    pub async fn start_in(dir: &Path, edit: impl FnOnce(&mut Config)) -> Result<Self> {
        let mut config = config(dir)?;
        edit(&mut config);
        let token = config.token.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr: SocketAddr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(serve(config, listener, async move {
            let _ = rx.await;
        }));
        let server = Self {
            base: format!("http://{addr}"),
            client: Client::new(),
            token,
            shutdown: Some(tx),
            task: Some(task),
            _temp: None,
        };
        // Up once /health answers.
        let started = Instant::now();
        while server.get("/health").send().await.is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                bail!("the server did not come up");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(server)
    }

    /// Shuts down gracefully and waits for it.
    pub async fn stop(&mut self) -> Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await??;
        }
        Ok(())
    }

    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let r = self.client.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    pub fn get(&self, path: &str) -> RequestBuilder {
        self.request(Method::GET, path)
    }

    pub fn post(&self, path: &str, body: &Value) -> RequestBuilder {
        self.request(Method::POST, path).json(body)
    }

    /// POSTs `body` to `path` and asserts the error answer (see [`expect_error`]).
    /// Posts `body` to `path` as a stream, checks it is answered 200 and reads until the text
    /// so far contains `marker`: the stream (kept open by the caller) and that text.
    pub async fn open_stream(
        &self,
        path: &str,
        body: &Value,
        marker: &str,
    ) -> Result<(
        impl futures::Stream<Item = reqwest::Result<impl AsRef<[u8]>>> + Unpin,
        String,
    )> {
        use futures::StreamExt;
        let response = self.post(path, body).send().await?;
        if response.status() != StatusCode::OK {
            bail!("{path}: {}", response.status());
        }
        let mut stream = Box::pin(response.bytes_stream());
        let mut seen = String::new();
        while !seen.contains(marker) {
            let chunk = stream.next().await.context("the stream ended")??;
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        Ok((stream, seen))
    }

    pub async fn post_error(
        &self,
        path: &str,
        body: &Value,
        status: StatusCode,
        code: &str,
    ) -> Result<String> {
        expect_error(self.post(path, body).send().await?, status, code).await
    }

    pub fn delete(&self, path: &str) -> RequestBuilder {
        self.request(Method::DELETE, path)
    }

    /// Creates corpus `name` with the tiny model and ingests `documents` (title, text),
    /// waiting for the job.
    pub async fn corpus(&self, name: &str, documents: &[(String, String)]) -> Result<Value> {
        let (status, body) = json_of(
            self.post("/v1/corpora", &json!({"name": name, "model": MODEL}))
                .send()
                .await?,
        )
        .await?;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        self.ingest(name, documents).await
    }

    /// Ingests `documents` into corpus `name` and waits for the job to succeed.
    pub async fn ingest(&self, name: &str, documents: &[(String, String)]) -> Result<Value> {
        let docs: Vec<Value> = documents
            .iter()
            .map(|(title, text)| json!({"title": title, "text": text}))
            .collect();
        let (status, job) = json_of(
            self.post(
                &format!("/v1/corpora/{name}/documents"),
                &json!({"documents": docs}),
            )
            .send()
            .await?,
        )
        .await?;
        assert_eq!(status, StatusCode::ACCEPTED, "{job}");
        let job = self.wait_job(job["id"].as_str().context("job id")?).await?;
        assert_eq!(job["status"], "succeeded", "{job}");
        Ok(job)
    }

    /// Polls job `id` until it ends.
    pub async fn wait_job(&self, id: &str) -> Result<Value> {
        let started = Instant::now();
        loop {
            let (status, job) = json_of(self.get(&format!("/v1/jobs/{id}")).send().await?).await?;
            assert_eq!(status, StatusCode::OK, "{job}");
            if !matches!(job["status"].as_str(), Some("queued" | "running")) {
                return Ok(job);
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!("job {id} did not end: {job}");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// One metric's value (summed over its label sets matching `labels`).
    pub async fn metric(&self, name: &str, labels: &str) -> Result<f64> {
        let text = self.get("/metrics").send().await?.text().await?;
        Ok(text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
            .filter(|l| l.contains(labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Status and JSON body of a response.
pub async fn json_of(response: Response) -> Result<(StatusCode, Value)> {
    let status = response.status();
    let text = response.text().await?;
    let body = serde_json::from_str(&text).with_context(|| format!("{status}: {text}"))?;
    Ok((status, body))
}

/// Asserts an error answer: its status and its `{"error": {"code", "message"}}` body.
pub async fn expect_error(response: Response, status: StatusCode, code: &str) -> Result<String> {
    let (got, body) = json_of(response).await?;
    assert_eq!(got, status, "{body}");
    assert_eq!(body["error"]["code"], code, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{body}");
    Ok(message.to_string())
}

/// Sends each request in turn and asserts its error answer (see [`expect_error`]).
pub async fn expect_errors(cases: Vec<(RequestBuilder, StatusCode, &str)>) -> Result<()> {
    for (request, status, code) in cases {
        expect_error(request.send().await?, status, code).await?;
    }
    Ok(())
}

/// Generated documents: `count` of about `chars` characters, different sentences each.
pub fn documents(count: usize, chars: usize) -> Vec<(String, String)> {
    let things = [
        "river", "lantern", "orchard", "harbour", "glacier", "library", "meadow",
    ];
    let colours = ["amber", "teal", "crimson", "ivory", "olive", "slate"];
    (0..count)
        .map(|d| {
            let mut text = String::new();
            let mut i = d;
            while text.len() < chars {
                text.push_str(&format!(
                    "The {} near house {} is {}. ",
                    things[i % things.len()],
                    i * 7 + d,
                    colours[(i / 3) % colours.len()]
                ));
                i += 1;
            }
            (format!("doc{d}.txt"), text)
        })
        .collect()
}

/// The events of a server-sent event stream: (event name, data).
pub async fn sse_events(response: Response) -> Result<Vec<(String, String)>> {
    let text = response.text().await?;
    Ok(parse_sse(&text))
}

pub fn parse_sse(text: &str) -> Vec<(String, String)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut event = "message".to_string();
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                }
            }
            (!data.is_empty()).then(|| (event, data.join("\n")))
        })
        .collect()
}
