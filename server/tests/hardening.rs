//! The server against clients that misbehave or race it (tiny random-weight gemma3 on
//! loopback): writes without the token on routes whose names look like reads, deletes and
//! index removals under running queries, slow and stalled connections at work and at
//! shutdown, made-up methods in the metrics, long input echoed in errors, interrupted
//! documents and multipart parts without a filename.

// Each test binary compiles the helpers; this one does not use all of them.
#[allow(dead_code)]
mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use support::{documents, expect_error, json_of, parse_sse, TestServer, MODEL};
use tokio::net::TcpStream;

/// Corpus names equal to every path segment the API uses.
const SEGMENTS: [&str; 12] = [
    "v1",
    "corpora",
    "documents",
    "indexes",
    "query",
    "jobs",
    "models",
    "completions",
    "chat",
    "health",
    "metrics",
    "openapi.json",
];

/// Creates the empty corpus `name` (with the server's token, if any).
async fn create(s: &TestServer, name: &str, indexes: &[&str]) -> Result<()> {
    let (status, body) = json_of(
        s.post(
            "/v1/corpora",
            &json!({"name": name, "model": MODEL, "indexes": indexes}),
        )
        .send()
        .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    Ok(())
}

/// The names of the corpora the server lists.
async fn corpus_names(s: &TestServer) -> Result<BTreeSet<String>> {
    let (status, list) = json_of(s.get("/v1/corpora").send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{list}");
    Ok(list["corpora"]
        .as_array()
        .context("corpora")?
        .iter()
        .filter_map(|c| c["name"].as_str().map(str::to_string))
        .collect())
}

/// The write routes as (method, route template, concrete path, body) for corpus `name`.
fn writes(name: &str) -> Vec<(Method, &'static str, String, Option<Value>)> {
    let doc = json!({"documents": [{"title": "a.txt", "text": "Some words."}]});
    vec![
        (
            Method::POST,
            "/v1/corpora",
            "/v1/corpora".into(),
            Some(json!({"name": format!("{name}-new"), "model": MODEL})),
        ),
        (
            Method::DELETE,
            "/v1/corpora/{name}",
            format!("/v1/corpora/{name}"),
            None,
        ),
        (
            Method::POST,
            "/v1/corpora/{name}/documents",
            format!("/v1/corpora/{name}/documents"),
            Some(doc),
        ),
        (
            Method::POST,
            "/v1/corpora/{name}/indexes",
            format!("/v1/corpora/{name}/indexes"),
            Some(json!({"specs": ["hnsw16,ef64"]})),
        ),
        (
            Method::DELETE,
            "/v1/corpora/{name}/indexes/{spec}",
            format!("/v1/corpora/{name}/indexes/flat"),
            None,
        ),
        (
            Method::DELETE,
            "/v1/jobs/{id}",
            format!("/v1/jobs/{name}"),
            None,
        ),
    ]
}

/// With `--token`, every write route refuses a request without it, whatever the corpus is
/// called (a corpus named `query` was deletable without it when reads were told apart by
/// the path's suffix); reads and questions still need no token, and the routes tested are
/// every write the OpenAPI document lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn write_routes_need_the_token_whatever_the_corpus_is_called() -> Result<()> {
    let mut s = TestServer::start(|c| c.token = Some("s3cret".into())).await?;
    for name in SEGMENTS {
        create(&s, name, &["flat", "hnsw16,ef64"]).await?;
    }
    let token = s.token.take();
    let mut tested = BTreeSet::new();
    // Every answer that is not a 401 (collected, so that a failure lists them all).
    let mut let_through = Vec::new();
    for name in SEGMENTS {
        let mut cases = writes(name);
        // A spec spelled like a segment.
        cases.push((
            Method::DELETE,
            "/v1/corpora/{name}/indexes/{spec}",
            format!("/v1/corpora/{name}/indexes/query"),
            None,
        ));
        for (method, route, path, body) in cases {
            tested.insert((method.to_string().to_lowercase(), route.to_string()));
            let mut request = s.request(method.clone(), &path);
            if let Some(body) = &body {
                request = request.json(body);
            }
            let (status, body) = json_of(request.send().await?).await?;
            if status != StatusCode::UNAUTHORIZED || body["error"]["code"] != "unauthorized" {
                let_through.push(format!("{method} {path}: {status} {body}"));
            }
        }
        // A method no route has, on a path ending in a segment.
        let status = s
            .delete(&format!("/v1/corpora/{name}/query"))
            .send()
            .await?
            .status();
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{name}");
    }
    assert!(
        let_through.is_empty(),
        "writes without the token were not refused:\n{}",
        let_through.join("\n")
    );
    let all: BTreeSet<String> = SEGMENTS.iter().map(|n| n.to_string()).collect();
    assert_eq!(corpus_names(&s).await?, all, "a write got through");
    for name in SEGMENTS {
        let (_, indexes) =
            json_of(s.get(&format!("/v1/corpora/{name}/indexes")).send().await?).await?;
        assert_eq!(
            indexes["indexes"].as_array().map(Vec::len),
            Some(2),
            "{name}: {indexes}"
        );
    }

    // Every write the API documents was tried.
    let (_, api) = json_of(s.get("/openapi.json").send().await?).await?;
    let questions = [
        "/v1/corpora/{name}/query",
        "/v1/completions",
        "/v1/chat/completions",
    ];
    let mut documented = BTreeSet::new();
    for (path, item) in api["paths"].as_object().context("paths")? {
        for method in item.as_object().context("path item")?.keys() {
            if method != "get" && !questions.contains(&path.as_str()) {
                documented.insert((method.clone(), path.clone()));
            }
        }
    }
    assert_eq!(tested, documented);

    // Reads and questions need no token.
    for name in SEGMENTS {
        for path in [
            format!("/v1/corpora/{name}"),
            format!("/v1/corpora/{name}/indexes"),
        ] {
            assert_eq!(
                s.get(&path).send().await?.status(),
                StatusCode::OK,
                "{path}"
            );
        }
        // The corpora are empty: the question is refused, but not for want of a token.
        let question = json!({"question": "q", "max_tokens": 2});
        for (path, body) in [
            (format!("/v1/corpora/{name}/query"), question),
            (
                "/v1/completions".to_string(),
                json!({"model": name, "prompt": "q", "max_tokens": 2}),
            ),
            (
                "/v1/chat/completions".to_string(),
                json!({"model": name, "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}),
            ),
        ] {
            expect_error(
                s.post(&path, &body).send().await?,
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
            )
            .await
            .with_context(|| path.clone())?;
        }
    }
    for path in [
        "/v1/corpora",
        "/v1/models",
        "/metrics",
        "/openapi.json",
        "/",
    ] {
        assert_eq!(s.get(path).send().await?.status(), StatusCode::OK, "{path}");
    }

    // With the token the writes work.
    s.token = token;
    let (status, body) = json_of(s.delete("/v1/corpora/query").send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{body}");
    drop(s);

    // With `--token-all`, unknown paths and methods answer 401 before 404 and 405.
    let mut s = TestServer::start(|c| {
        c.token = Some("s3cret".into());
        c.token_all = true;
    })
    .await?;
    let token = s.token.take();
    for (method, path) in [
        (Method::GET, "/v2/nothing"),
        (Method::PATCH, "/v1/corpora"),
        (Method::GET, "/v1/corpora/query"),
    ] {
        expect_error(
            s.request(method.clone(), path).send().await?,
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        )
        .await
        .with_context(|| format!("{method} {path}"))?;
    }
    assert_eq!(s.get("/health").send().await?.status(), StatusCode::OK);
    assert_eq!(s.get("/").send().await?.status(), StatusCode::OK);
    s.token = token;
    expect_error(
        s.get("/v2/nothing").send().await?,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;
    expect_error(
        s.request(Method::PATCH, "/v1/corpora").send().await?,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await?;
    Ok(())
}

/// Waits until no query runs.
async fn wait_idle(s: &TestServer) -> Result<()> {
    let started = Instant::now();
    while s.metric("kvdb_queries_running", "").await? > 0.0 {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("a generation did not stop");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Deleting a corpus, or one of its indexes, while a query (streamed, or through the
/// OpenAI endpoints) runs on it answers 409 saying so, instead of pulling the keys from under
/// the query (which then failed with a 500 about a missing block); once the queries end it
/// works, and a later query finds no corpus (404).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_under_running_queries_answers_409() -> Result<()> {
    let s = TestServer::start(|c| c.max_tokens = 8192).await?;
    create(&s, "c", &["flat", "hnsw16,ef64"]).await?;
    s.ingest("c", &documents(2, 1500)).await?;
    let long = json!({"question": "Tell me everything.", "max_tokens": 8192, "stream": true});
    let (stream, _) = s.open_stream("/v1/corpora/c/query", &long, "data:").await?;
    let m = expect_error(
        s.delete("/v1/corpora/c").send().await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;
    assert!(
        m.contains("a query is running on corpus `c`") && m.contains("retry"),
        "{m}"
    );
    let m = expect_error(
        s.delete("/v1/corpora/c/indexes/hnsw16,ef64").send().await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;
    assert!(m.contains("query"), "{m}");
    // Two at once are counted.
    let chat = json!({"model": "c", "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 8192, "stream": true});
    let (chat_stream, _) = s
        .open_stream("/v1/chat/completions", &chat, "data:")
        .await?;
    let m = expect_error(
        s.delete("/v1/corpora/c").send().await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;
    assert!(m.contains("2 queries are running"), "{m}");
    drop(stream);
    let m = expect_error(
        s.delete("/v1/corpora/c").send().await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;
    assert!(
        m.contains("running on corpus `c`"),
        "the chat still runs: {m}"
    );
    drop(chat_stream);
    wait_idle(&s).await?;

    // Once they have ended (their guards drop with their generations), the delete works.
    let started = Instant::now();
    loop {
        let response = s.delete("/v1/corpora/c").send().await?;
        if response.status() == StatusCode::OK {
            break;
        }
        let m = expect_error(response, StatusCode::CONFLICT, "conflict").await?;
        assert!(started.elapsed() < Duration::from_secs(10), "{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.post_error(
        "/v1/corpora/c/query",
        &json!({"question": "q", "max_tokens": 2}),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;
    Ok(())
}

/// Writes all of `bytes` to `stream` (tokio's `io-util` is not among this crate's features).
async fn write_all(stream: &TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads what `stream` has into `buf` (0: the server closed it).
async fn read(stream: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            result => return result,
        }
    }
}

/// Reads from `stream` until the server closes it (`Ok(text so far)`) or `limit` passes.
async fn read_until_closed(stream: &TcpStream, limit: Duration) -> Result<String> {
    read_until(stream, limit, |_| false).await
}

/// Reads from `stream` until the server closes it or what came satisfies `done` (`Ok(text so
/// far)`), or `limit` passes (an error).
async fn read_until(
    stream: &TcpStream,
    limit: Duration,
    done: impl Fn(&str) -> bool,
) -> Result<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, read(stream, &mut buf)).await {
            Err(_) => bail!(
                "the server kept the connection open for {limit:?}; it sent {:?}",
                String::from_utf8_lossy(&got)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(String::from_utf8_lossy(&got).into_owned()),
            Ok(Ok(n)) => {
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got);
                if done(&text) {
                    return Ok(text.into_owned());
                }
            }
        }
    }
}

/// The sum of metric `name`'s series whose labels include all of `labels`.
fn series_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Headers must arrive within the header read timeout (whole, not byte by byte), and a body
/// must keep coming (408); other clients are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_clients_are_cut_off() -> Result<()> {
    let mut s = TestServer::start(|c| {
        c.header_read_timeout = Duration::from_secs(1);
        c.body_read_timeout = Duration::from_secs(1);
        c.shutdown_grace = Duration::from_secs(1);
    })
    .await?;
    let addr = s.base.trim_start_matches("http://").to_string();

    // Half a header, then nothing: closed after the header timeout.
    let started = Instant::now();
    let half = TcpStream::connect(&addr).await?;
    write_all(&half, b"GET /health HTTP/1.1\r\nHost: x\r\n").await?;
    let answer = read_until_closed(&half, Duration::from_secs(10)).await?;
    assert!(!answer.contains("200 OK"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // One header byte every 200 ms: the timeout counts the whole header, not each byte.
    let started = Instant::now();
    let drip = TcpStream::connect(&addr).await?;
    let request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
        .iter()
        .chain(&[b'a'; 200]);
    let mut closed = false;
    for byte in request {
        if write_all(&drip, &[*byte]).await.is_err() {
            closed = true;
            break;
        }
        let mut buf = [0u8; 64];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(200), read(&drip, &mut buf)).await
        {
            closed = true;
            break;
        }
    }
    assert!(
        closed,
        "a dripping client was served for {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // A body that stops: 408 after the body timeout.
    let stalled = TcpStream::connect(&addr).await?;
    write_all(
        &stalled,
        b"POST /v1/corpora HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"na",
    )
    .await?;
    let answer = read_until(&stalled, Duration::from_secs(10), |text| {
        text.contains("request_timeout")
    })
    .await?;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");

    // Still serving everyone else.
    assert_eq!(s.get("/health").send().await?.status(), StatusCode::OK);
    s.stop().await?;
    Ok(())
}

/// A shutdown waits neither for a client sending half a header nor for an idle one past its
/// grace (it used to wait until they left), while a stream in flight still finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shutdown_waits_for_no_half_sent_request() -> Result<()> {
    // The header timeout, a minute here, is not what ends them.
    let mut s = TestServer::start(|c| {
        c.header_read_timeout = Duration::from_secs(60);
        c.shutdown_grace = Duration::from_secs(1);
    })
    .await?;
    let addr = s.base.trim_start_matches("http://").to_string();
    let half = TcpStream::connect(&addr).await?;
    write_all(&half, b"GET /health HTTP/1.1\r\nHost: x\r\n").await?;
    let _idle = TcpStream::connect(&addr).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(20), s.stop())
        .await
        .context("the server did not stop with a half-sent request open")??;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    read_until_closed(&half, Duration::from_secs(5)).await?;

    // A stream in flight at shutdown still finishes (within a longer grace), and the shutdown
    // waits for it but not for its grace.
    let mut s = TestServer::start(|c| c.shutdown_grace = Duration::from_secs(30)).await?;
    s.corpus("c", &documents(1, 800)).await?;
    let body = json!({"question": "Go on.", "max_tokens": 48, "stream": true});
    let (mut stream, mut text) = s.open_stream("/v1/corpora/c/query", &body, "data:").await?;
    let started = Instant::now();
    let stopping = tokio::spawn(async move { s.stop().await });
    while let Some(chunk) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(chunk?.as_ref()));
    }
    let events = parse_sse(&text);
    assert_eq!(events.last().map(|e| e.0.as_str()), Some("done"), "{text}");
    stopping.await??;
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

/// Made-up methods and paths add no metric series: they count as `other` and `unmatched`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_label_known_methods_and_routes_only() -> Result<()> {
    let s = TestServer::start(|_| {}).await?;
    let long = "XLONG".repeat(400);
    for method in ["XMETHOD1", "XMETHOD2", "BREW", long.as_str()] {
        for path in ["/health", "/v1/corpora", "/made-up-path"] {
            let response = s
                .request(Method::from_bytes(method.as_bytes())?, path)
                .send()
                .await?;
            assert!(
                response.status().is_client_error(),
                "{method} {path}: {}",
                response.status()
            );
        }
    }
    s.get("/another-made-up-path").send().await?;
    let text = s.get("/metrics").send().await?.text().await?;
    for made_up in ["XMETHOD", "BREW", "XLONG", "made-up"] {
        assert!(!text.contains(made_up), "{made_up} names a series:\n{text}");
    }
    let requests = "kvdb_http_requests_total";
    let text = s.get("/metrics").send().await?.text().await?;
    let other = series_sum(&text, requests, &["route=\"/health\"", "method=\"other\""]);
    assert!(other >= 4.0, "{text}");
    assert!(
        series_sum(&text, requests, &["route=\"unmatched\""]) >= 5.0,
        "{text}"
    );
    assert!(
        series_sum(&text, requests, &["route=\"/health\"", "method=\"GET\""]) >= 1.0,
        "{text}"
    );
    Ok(())
}

/// The index specs `GET /v1/corpora/{name}/indexes` lists.
async fn index_specs(s: &TestServer, name: &str) -> Result<Vec<String>> {
    let (status, list) =
        json_of(s.get(&format!("/v1/corpora/{name}/indexes")).send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{list}");
    Ok(list["indexes"]
        .as_array()
        .context("indexes")?
        .iter()
        .filter_map(|i| i["spec"].as_str().map(str::to_string))
        .collect())
}

/// `DELETE /v1/corpora/{name}/indexes/{spec}` removes an index (spec URL-encoded, any
/// spelling that parses to it): 400 for a spec that does not parse, 404 for one the corpus
/// lacks, 409 for its only index and while a job is queued on the corpus. A query naming
/// the removed index is told how to add it over HTTP, not with the CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn indexes_are_removed_over_http() -> Result<()> {
    let s = TestServer::start(|_| {}).await?;
    create(&s, "c", &["flat", "hnsw16,ef64"]).await?;
    s.ingest("c", &documents(2, 1500)).await?;
    let hnsw = "hnsw16,ef64,efc200";
    assert_eq!(index_specs(&s, "c").await?, ["flat", hnsw]);
    let ask = json!({"question": "What colour is the river?", "max_tokens": 4, "index": hnsw});
    let (status, answer) = json_of(s.post("/v1/corpora/c/query", &ask).send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");

    let (status, left) = json_of(
        s.delete("/v1/corpora/c/indexes/hnsw16%2Cef64%2Cefc200")
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{left}");
    assert_eq!(left["indexes"][0]["spec"], "flat", "{left}");
    assert_eq!(left["indexes"].as_array().map(Vec::len), Some(1), "{left}");
    assert_eq!(index_specs(&s, "c").await?, ["flat"]);
    let (_, info) = json_of(s.get("/v1/corpora/c").send().await?).await?;
    assert_eq!(info["indexes"], json!(["flat"]), "{info}");

    // The cached corpus was dropped: queries see the index gone, and learn how to add it.
    let m = s
        .post_error(
            "/v1/corpora/c/query",
            &ask,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        )
        .await?;
    assert!(
        m.contains("no index") && m.contains("POST /v1/corpora/c/indexes"),
        "{m}"
    );
    assert!(!m.contains("kvdb index add"), "{m}");
    let m = s
        .post_error(
            "/v1/completions",
            &json!({"model": format!("c:{hnsw}"), "prompt": "q", "max_tokens": 2}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        )
        .await?;
    assert!(m.contains("POST /v1/corpora/c/indexes"), "{m}");

    // Errors.
    let m = expect_error(
        s.delete("/v1/corpora/c/indexes/hnsw16%2Cef64")
            .send()
            .await?,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;
    assert!(m.contains(hnsw) && m.contains("flat"), "{m}");
    for (path, status, code) in [
        (
            "/v1/corpora/c/indexes/ivf0%2C%2C",
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "/v1/corpora/none/indexes/flat",
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "/v1/corpora/c/indexes/flat",
            StatusCode::CONFLICT,
            "conflict",
        ),
    ] {
        expect_error(s.delete(path).send().await?, status, code)
            .await
            .with_context(|| path.to_string())?;
    }
    expect_error(
        s.request(Method::GET, "/v1/corpora/c/indexes/flat")
            .send()
            .await?,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await?;

    // Added back, then removing it waits for a job queued on the corpus (behind a long
    // ingest of another corpus, so that it is still queued).
    let (status, job) = json_of(
        s.post("/v1/corpora/c/indexes", &json!({"specs": [hnsw]}))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    let job = s.wait_job(job["id"].as_str().context("id")?).await?;
    assert_eq!(job["status"], "succeeded", "{job}");
    assert_eq!(index_specs(&s, "c").await?, ["flat", hnsw]);
    create(&s, "other", &[]).await?;
    let mut ids = Vec::new();
    for (corpus, docs) in [("other", documents(1, 20_000)), ("c", documents(1, 300))] {
        let body: Vec<Value> = docs
            .iter()
            .map(|(t, x)| json!({"title": format!("{corpus}-{t}"), "text": x}))
            .collect();
        let (status, job) = json_of(
            s.post(
                &format!("/v1/corpora/{corpus}/documents"),
                &json!({"documents": body}),
            )
            .send()
            .await?,
        )
        .await?;
        assert_eq!(status, StatusCode::ACCEPTED, "{job}");
        ids.push(job["id"].as_str().context("id")?.to_string());
    }
    let m = expect_error(
        s.delete(&format!("/v1/corpora/c/indexes/{hnsw}"))
            .send()
            .await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;
    assert!(m.contains(&format!("job `{}`", ids[1])), "{m}");
    for id in ids.iter().rev() {
        s.delete(&format!("/v1/jobs/{id}")).send().await?;
        s.wait_job(id).await?;
    }
    let (status, left) = json_of(
        s.delete(&format!("/v1/corpora/c/indexes/{hnsw}"))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{left}");

    let (_, api) = json_of(s.get("/openapi.json").send().await?).await?;
    assert!(
        api["paths"]["/v1/corpora/{name}/indexes/{spec}"]
            .get("delete")
            .is_some(),
        "{}",
        api["paths"]
    );
    Ok(())
}

/// A cancelled ingest leaves its document part-way; the job says so, and a later ingest
/// without that document is refused at once (409) naming it, instead of failing as a job.
/// Sending it again among new documents finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interrupted_document_is_named_when_documents_come_without_it() -> Result<()> {
    let s = TestServer::start(|_| {}).await?;
    create(&s, "c", &[]).await?;
    let long = ("long.txt".to_string(), documents(1, 20_000)[0].1.clone());
    let (status, job) = json_of(
        s.post(
            "/v1/corpora/c/documents",
            &json!({"documents": [{"title": long.0, "text": long.1}]}),
        )
        .send()
        .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    let id = job["id"].as_str().context("id")?.to_string();
    let started = Instant::now();
    loop {
        let (_, j) = json_of(s.get(&format!("/v1/jobs/{id}")).send().await?).await?;
        if j["progress"]["tokens_done"].as_u64() > Some(0) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{j}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, j) = json_of(s.delete(&format!("/v1/jobs/{id}")).send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{j}");
    let j = s.wait_job(&id).await?;
    assert_eq!(j["status"], "cancelled", "{j}");
    let (_, info) = json_of(s.get("/v1/corpora/c").send().await?).await?;
    assert_eq!(info["interrupted"], "long.txt", "{info}");
    let note = j["interrupted"]
        .as_str()
        .context("the job names no document")?;
    assert!(
        note.contains("long.txt") && note.contains("send it again"),
        "{note}"
    );

    let new = documents(2, 400);
    let body = |docs: &[(String, String)]| {
        let docs: Vec<Value> = docs
            .iter()
            .map(|(t, x)| json!({"title": t, "text": x}))
            .collect();
        json!({ "documents": docs })
    };
    let m = s
        .post_error(
            "/v1/corpora/c/documents",
            &body(&new[..1]),
            StatusCode::CONFLICT,
            "conflict",
        )
        .await?;
    assert!(
        m.contains("`long.txt`")
            && m.contains("tokens stored")
            && m.contains("send it again")
            && m.contains("among other documents"),
        "{m}"
    );
    // The same content under another title finishes it too (documents are known by content).
    let again = [
        new[0].clone(),
        ("long-again.txt".to_string(), long.1.clone()),
        new[1].clone(),
    ];
    let job = s.ingest("c", &again).await?;
    assert_eq!(job["status"], "succeeded", "{job}");
    let (_, info) = json_of(s.get("/v1/corpora/c").send().await?).await?;
    assert!(info.get("interrupted").is_none(), "{info}");
    assert_eq!(info["document_count"].as_u64(), Some(3), "{info}");
    Ok(())
}

/// Long names, specs, titles, job ids, filenames, models and field names come back cut
/// short in error messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn error_messages_cut_long_input_short() -> Result<()> {
    let s = TestServer::start(|c| c.max_body_bytes = 1 << 20).await?;
    create(&s, "c", &[]).await?;
    let long = "a".repeat(100_000);
    // Paths stay under hyper's URI limit (64 KiB).
    let long_path = "b".repeat(30_000);
    let cases = vec![
        (
            s.post("/v1/corpora", &json!({"name": long, "model": MODEL})),
            StatusCode::BAD_REQUEST,
        ),
        (
            s.post("/v1/corpora", &json!({"name": "ok", "model": long})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            s.post("/v1/corpora", &json!({"name": "ok", "indexes": [long]})),
            StatusCode::BAD_REQUEST,
        ),
        (
            s.post("/v1/corpora", &json!({"name": "ok", long.as_str(): 1})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            s.get(&format!("/v1/corpora/{long_path}")),
            StatusCode::BAD_REQUEST,
        ),
        (
            s.delete(&format!("/v1/corpora/c/indexes/{long_path}")),
            StatusCode::BAD_REQUEST,
        ),
        (
            s.post("/v1/corpora/c/indexes", &json!({"specs": [long]})),
            StatusCode::BAD_REQUEST,
        ),
        (
            s.get(&format!("/v1/jobs/{long_path}")),
            StatusCode::NOT_FOUND,
        ),
        (
            s.post(
                "/v1/corpora/c/query",
                &json!({"question": "q", "index": long}),
            ),
            StatusCode::BAD_REQUEST,
        ),
        (
            s.post(
                "/v1/chat/completions",
                &json!({"model": "c", "messages": [{"role": long, "content": "q"}]}),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            s.request(Method::POST, "/v1/corpora/c/documents")
                .multipart(reqwest::multipart::Form::new().part(
                    "f",
                    reqwest::multipart::Part::text("words").file_name(format!("{long}.pdf")),
                )),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            s.request(Method::POST, "/v1/corpora/c/documents")
                .multipart(
                    reqwest::multipart::Form::new()
                        .part(long.clone(), reqwest::multipart::Part::text("words")),
                ),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ];
    for (i, (request, status)) in cases.into_iter().enumerate() {
        let response = request.send().await?;
        let got = response.status();
        let text = response.text().await?;
        assert_eq!(got, status, "case {i}: {:.300}", text);
        let body: Value = serde_json::from_str(&text)?;
        let message = body["error"]["message"].as_str().unwrap_or_default();
        // A spec's error carries the spec grammar (about 1 KB) after the spec.
        assert!(
            text.len() < 2500,
            "case {i}: {} bytes: {:.300}",
            text.len(),
            text
        );
        assert!(
            message.contains("…(") && message.contains("bytes)"),
            "case {i}: {message:.300}"
        );
    }
    Ok(())
}

/// A multipart part without a filename is refused naming the part and what each part must
/// be (it used to say "``: upload files named ...").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multipart_parts_must_be_files_with_names() -> Result<()> {
    let s = TestServer::start(|_| {}).await?;
    create(&s, "c", &[]).await?;
    let form = reqwest::multipart::Form::new()
        .part(
            "a",
            reqwest::multipart::Part::text("Plain words.").file_name("a.txt"),
        )
        .text("notes", "not a file");
    let m = expect_error(
        s.request(Method::POST, "/v1/corpora/c/documents")
            .multipart(form)
            .send()
            .await?,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    assert!(
        m.contains("`notes`") && m.contains("must be a file with a filename"),
        "{m}"
    );
    assert!(!m.contains("``"), "{m}");
    Ok(())
}

/// A spec that parses but cannot be built is refused when a corpus is created with it or
/// an index job names it, before anything is saved: the corpus used to be created listing
/// it, its ingest job failed and every query answered 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unbuildable_specs_are_refused_before_anything_is_saved() -> Result<()> {
    let s = TestServer::start(|_| {}).await?;
    for (spec, status, code) in [
        ("hnsw1,ef1", StatusCode::BAD_REQUEST, "bad_request"),
        (
            "ihip:18014398509481984k",
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        // No SAAP artifact is registered for the tiny model.
        (
            "saap8,l2",
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
    ] {
        let body = json!({"name": "c", "model": MODEL, "indexes": ["flat", spec]});
        let m = s.post_error("/v1/corpora", &body, status, code).await?;
        assert!(
            m.contains("no SAAP artifact") || m.contains("at `"),
            "{spec}: {m}"
        );
        assert!(corpus_names(&s).await?.is_empty(), "{spec}");
    }
    create(&s, "c", &["flat"]).await?;
    let m = s
        .post_error(
            "/v1/corpora/c/indexes",
            &json!({"specs": ["saap8,l2"]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        )
        .await?;
    assert!(m.contains("no SAAP artifact"), "{m}");
    assert_eq!(index_specs(&s, "c").await?, ["flat"]);
    Ok(())
}
