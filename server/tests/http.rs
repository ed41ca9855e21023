//! The HTTP API against a real server on loopback (tiny random-weight gemma3): every
//! endpoint and error status, SSE framing, tokens, limits, the query pool, cancellation,
//! restarts, metrics and the OpenAPI document. `e2e` adds the official OpenAI client, a load
//! test with wrk and a headless chromium on the web page.

mod e2e;
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use support::{
    documents, expect_error, expect_errors, json_of, parse_sse, sse_events, TestServer, MODEL,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corpora_documents_indexes_and_jobs() -> Result<()> {
    let s = TestServer::start(|_| {}).await?;
    let (status, health) = json_of(s.get("/health").send().await?).await?;
    assert_eq!(
        (status, health["status"].as_str()),
        (StatusCode::OK, Some("ok"))
    );

    // Creating: names and models are checked, bodies parsed.
    let create = |body: Value| s.post("/v1/corpora", &body);
    expect_error(
        create(json!({"name": "../x"})).send().await?,
        StatusCode::BAD_REQUEST,
        "bad_request",
    )
    .await?;
    let m = expect_error(
        create(json!({"name": "c", "model": "../../etc/passwd"}))
            .send()
            .await?,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    assert!(m.contains("not a model name"), "{m}");
    expect_errors(vec![
        (
            create(json!({"name": "c", "model": "absent.gguf"})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            create(json!({"nom": "c"})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            s.request(Method::POST, "/v1/corpora")
                .header("content-type", "application/json")
                .body("{\"name\": "),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            create(json!({"name": "c", "model": MODEL, "indexes": ["ivf0,,"]})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            create(json!({"name": "c", "model": MODEL, "layers": [{"kind": "all"}]})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
    ])
    .await?;
    let (status, created) =
        json_of(create(json!({"name": "c", "model": MODEL})).send().await?).await?;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(
        (created["tokens"].as_u64(), created["indexes"][0].as_str()),
        (Some(0), Some("flat"))
    );
    expect_error(
        create(json!({"name": "c", "model": MODEL})).send().await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;

    // Documents as JSON, then as files.
    let docs = documents(2, 1200);
    let job = s.ingest("c", &docs).await?;
    assert_eq!(job["kind"], "ingest");
    let p = &job["progress"];
    assert!(
        p["tokens"].as_u64() > Some(0) && p["tokens"] == p["tokens_done"],
        "{job}"
    );
    assert_eq!(p["documents_done"].as_u64(), Some(2), "{job}");
    let form = reqwest::multipart::Form::new()
        .part(
            "a",
            reqwest::multipart::Part::text("Plain words in a text file.").file_name("a.txt"),
        )
        .part(
            "b",
            reqwest::multipart::Part::text("<html><body><p>An HTML <b>page</b>.</p></body></html>")
                .file_name("b.html"),
        );
    upload_succeeds(&s, form).await?;
    // A file without an extension is text, as on the command line.
    let licence = reqwest::multipart::Form::new().part(
        "a",
        reqwest::multipart::Part::text("Permission is granted to copy it.").file_name("LICENSE"),
    );
    upload_succeeds(&s, licence).await?;
    let pdf = reqwest::multipart::Form::new().part(
        "a",
        reqwest::multipart::Part::bytes(b"%PDF".to_vec()).file_name("a.pdf"),
    );
    expect_error(
        s.request(Method::POST, "/v1/corpora/c/documents")
            .multipart(pdf)
            .send()
            .await?,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    s.post_error(
        "/v1/corpora/c/documents",
        &json!({"documents": [{"title": "e.txt", "text": "  "}]}),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    s.post_error(
        "/v1/corpora/nope/documents",
        &json!({"documents": [{"title": "t", "text": "x"}]}),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;
    let big = "x".repeat(300 << 10);
    s.post_error(
        "/v1/corpora/c/documents",
        &json!({"documents": [{"title": "big.txt", "text": big}]}),
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    )
    .await?;

    // Describing.
    let (status, info) = json_of(s.get("/v1/corpora/c").send().await?).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info["document_count"].as_u64(), Some(5), "{info}");
    let titles: Vec<&str> = info["documents"]
        .as_array()
        .context("documents")?
        .iter()
        .filter_map(|d| d["title"].as_str())
        .collect();
    assert_eq!(
        titles,
        ["doc0.txt", "doc1.txt", "a.txt", "b.html", "LICENSE"]
    );
    assert!(info["stored_bytes"].as_u64() > Some(0));
    let (_, list) = json_of(s.get("/v1/corpora").send().await?).await?;
    assert_eq!(list["corpora"][0]["name"], "c");
    assert!(list["corpora"][0].get("documents").is_none(), "{list}");
    expect_errors(vec![
        (
            s.get("/v1/corpora/nope"),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            s.get("/v1/corpora/.hidden"),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
    ])
    .await?;

    // Indexes.
    s.post_error(
        "/v1/corpora/c/indexes",
        &json!({"specs": ["nope"]}),
        StatusCode::BAD_REQUEST,
        "bad_request",
    )
    .await?;
    let (status, job) = json_of(
        s.post("/v1/corpora/c/indexes", &json!({"specs": ["hnsw16,ef64"]}))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    let id = job["id"].as_str().context("id")?.to_string();
    let job = s.wait_job(&id).await?;
    assert_eq!(job["status"], "succeeded", "{job}");
    assert!(
        job["progress"]["index_parts_done"].as_u64() > Some(0),
        "{job}"
    );
    let (_, indexes) = json_of(s.get("/v1/corpora/c/indexes").send().await?).await?;
    let specs: Vec<&str> = indexes["indexes"]
        .as_array()
        .context("indexes")?
        .iter()
        .filter_map(|i| i["spec"].as_str())
        .collect();
    // Listed in the canonical spelling, with ef_construction made explicit.
    assert_eq!(specs, ["flat", "hnsw16,ef64,efc200"]);

    // Jobs: unknown ids, ended jobs.
    expect_errors(vec![
        (s.get("/v1/jobs/zz"), StatusCode::NOT_FOUND, "not_found"),
        (
            s.get("/v1/jobs/ffffffff"),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            s.delete(&format!("/v1/jobs/{id}")),
            StatusCode::CONFLICT,
            "conflict",
        ),
    ])
    .await?;

    // Deleting during an ingest is refused; a cancelled ingest keeps its commits.
    let (_, job) = json_of(
        s.post(
            "/v1/corpora/c/documents",
            &json!({"documents": [{"title": "long.txt", "text": documents(1, 20_000)[0].1}]}),
        )
        .send()
        .await?,
    )
    .await?;
    let id = job["id"].as_str().context("id")?.to_string();
    expect_error(
        s.delete("/v1/corpora/c").send().await?,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await?;
    let started = Instant::now();
    loop {
        let (_, j) = json_of(s.get(&format!("/v1/jobs/{id}")).send().await?).await?;
        if j["progress"]["tokens_done"].as_u64() > Some(0)
            || started.elapsed() > Duration::from_secs(60)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, j) = json_of(s.delete(&format!("/v1/jobs/{id}")).send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{j}");
    assert_eq!(j["cancel_requested"], true);
    let j = s.wait_job(&id).await?;
    assert_eq!(j["status"], "cancelled", "{j}");
    let (_, info) = json_of(s.get("/v1/corpora/c").send().await?).await?;
    assert_eq!(
        info["interrupted"], "long.txt",
        "a cancelled ingest stops at a commit point: {info}"
    );
    assert!(info.get("job").is_none(), "{info}");
    let (status, deleted) = json_of(s.delete("/v1/corpora/c").send().await?).await?;
    assert_eq!(
        (status, deleted["name"].as_str()),
        (StatusCode::OK, Some("c"))
    );
    expect_error(
        s.get("/v1/corpora/c").send().await?,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;

    // Routing errors answer in the same shape.
    expect_errors(vec![
        (
            s.request(Method::PUT, "/v1/corpora"),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (s.get("/v2/nothing"), StatusCode::NOT_FOUND, "not_found"),
    ])
    .await?;
    Ok(())
}

/// Posts `form` as documents of corpus `c` and waits for the ingest job to succeed.
async fn upload_succeeds(s: &TestServer, form: reqwest::multipart::Form) -> Result<()> {
    let (status, job) = json_of(
        s.request(Method::POST, "/v1/corpora/c/documents")
            .multipart(form)
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    assert_eq!(
        s.wait_job(job["id"].as_str().context("id")?).await?["status"],
        "succeeded"
    );
    Ok(())
}

/// A server with corpus `c` of two documents.
async fn with_corpus(edit: impl FnOnce(&mut kvdb_server::Config)) -> Result<TestServer> {
    let s = TestServer::start(edit).await?;
    s.corpus("c", &documents(2, 1500)).await?;
    Ok(s)
}

/// Waits (polling every 10 ms) until `metric` (no labels) satisfies `holds`; fails saying
/// `what` after `seconds`.
async fn until(
    s: &TestServer,
    metric: &str,
    holds: impl Fn(f64) -> bool,
    seconds: u64,
    what: &str,
) -> Result<()> {
    let started = Instant::now();
    while !holds(s.metric(metric, "").await?) {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(seconds), "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

async fn ask(s: &TestServer, body: Value) -> Result<Value> {
    let (status, answer) = json_of(s.post("/v1/corpora/c/query", &body).send().await?).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    Ok(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queries_answer_as_json_and_as_events() -> Result<()> {
    let s = with_corpus(|_| {}).await?;
    let before = s
        .metric(
            "kvdb_http_requests_total",
            "route=\"/v1/corpora/{name}/query\"",
        )
        .await?;
    let tokens_before = s.metric("kvdb_generated_tokens_total", "").await?;
    let question = json!({"question": "What colour is the river?", "max_tokens": 12});
    let answer = ask(&s, question.clone()).await?;
    assert!(answer["tokens"].as_u64() >= Some(2), "{answer}");
    let passages = answer["provenance"]["passages"]
        .as_array()
        .context("passages")?;
    assert!(
        !passages.is_empty() && passages[0]["share"].as_f64() > Some(0.0),
        "{answer}"
    );
    assert!(passages[0]["text"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(answer["timings"]["first_token_seconds"].as_f64() > Some(0.0));

    // The stream: token events, then one `done` with the same answer.
    let mut streamed = question.clone();
    streamed["stream"] = json!(true);
    let response = s.post("/v1/corpora/c/query", &streamed).send().await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()["content-type"]
        .to_str()?
        .starts_with("text/event-stream"));
    let events = sse_events(response).await?;
    let (last, tokens) = events.split_last().context("no events")?;
    assert_eq!(last.0, "done", "{events:?}");
    assert!(
        tokens.len() >= 2 && tokens.iter().all(|(e, _)| e == "token"),
        "{events:?}"
    );
    let text: String = tokens
        .iter()
        .map(|(_, d)| {
            Ok(serde_json::from_str::<Value>(d)?["text"]
                .as_str()
                .unwrap_or_default()
                .to_string())
        })
        .collect::<Result<_>>()?;
    let done: Value = serde_json::from_str(&last.1)?;
    assert_eq!(text, done["answer"].as_str().unwrap_or_default());
    assert_eq!(done["answer"], answer["answer"], "greedy answers repeat");
    assert_eq!(
        done["provenance"]["passages"][0],
        answer["provenance"]["passages"][0]
    );

    // Another index, full attention.
    let full = ask(
        &s,
        json!({"question": "What colour is the river?", "max_tokens": 4, "full_attention": true}),
    )
    .await?;
    assert!(full["retrieval"].is_null(), "{full}");
    let flat = ask(
        &s,
        json!({"question": "What colour is the river?", "max_tokens": 4, "index": "flat", "k": 16}),
    )
    .await?;
    assert!(flat["retrieval"]["index"].as_str().is_some(), "{flat}");

    // Limits and bad requests.
    let bad = |body: Value| s.post("/v1/corpora/c/query", &body);
    expect_errors(vec![
        (
            bad(json!({"question": "q", "max_tokens": 100_000})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            bad(json!({"question": "q", "max_tokens": 0})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            bad(json!({"question": "q".repeat(5000)})),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            bad(json!({"question": "   "})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            bad(json!({"question": "q", "temperature": 9})),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            bad(json!({"question": "q", "index": "hnsw0,x"})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
    ])
    .await?;
    let m = expect_error(
        bad(json!({"question": "q", "index": "hnsw16,ef64"}))
            .send()
            .await?,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    assert!(m.contains("no index"), "{m}");
    expect_error(
        bad(json!({"question": 7})).send().await?,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    s.post_error(
        "/v1/corpora/none/query",
        &json!({"question": "q"}),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;

    // Metrics rose.
    let after = s
        .metric(
            "kvdb_http_requests_total",
            "route=\"/v1/corpora/{name}/query\"",
        )
        .await?;
    assert!(after >= before + 12.0, "{before} -> {after}");
    assert!(s.metric("kvdb_generated_tokens_total", "").await? > tokens_before);
    assert!(s.metric("kvdb_ram_tier_bytes", "corpus=\"c\"").await? > 0.0);
    assert!(s.metric("kvdb_ingest_tokens_total", "").await? > 0.0);
    assert!(s.metric("kvdb_generation_tokens_per_second", "").await? > 0.0);
    assert!(
        s.metric(
            "kvdb_http_request_seconds_count",
            "route=\"/v1/corpora/{name}/query\""
        )
        .await?
            > 0.0
    );
    for name in [
        "kvdb_query_queue_depth",
        "kvdb_queries_running",
        "kvdb_ingest_job_tokens_done",
        "kvdb_index_bytes",
    ] {
        let text = s.get("/metrics").send().await?.text().await?;
        assert!(text.contains(name), "{name} missing");
    }

    // The OpenAPI document names every endpoint; the page is served.
    let (status, api) = json_of(s.get("/openapi.json").send().await?).await?;
    assert_eq!(status, StatusCode::OK);
    for path in [
        "/health",
        "/metrics",
        "/v1/corpora",
        "/v1/corpora/{name}",
        "/v1/corpora/{name}/documents",
        "/v1/corpora/{name}/indexes",
        "/v1/corpora/{name}/query",
        "/v1/jobs/{id}",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
    ] {
        assert!(
            api["paths"].get(path).is_some(),
            "{path} missing from /openapi.json"
        );
    }
    assert!(api["components"]["schemas"].get("QueryRequest").is_some());
    let page = s.get("/").send().await?.text().await?;
    assert!(page.contains("<title>kvdb</title>"));
    Ok(())
}

/// Keys a search of flat's selected on average, following `follow` tokens (greedy, so the
/// same question answers the same with the same `follow`; null leaves the field out).
async fn selected_per_search(s: &TestServer, follow: Value) -> Result<f64> {
    let mut query = json!({"question": "What colour is the river?", "max_tokens": 8,
                           "index": "flat", "k": 16});
    if !follow.is_null() {
        query["follow"] = follow;
    }
    let answer = ask(s, query).await?;
    let retrieval = &answer["retrieval"];
    let (selected, searches) = (
        retrieval["selected"].as_f64(),
        retrieval["searches"].as_f64(),
    );
    let (Some(selected), Some(searches)) = (selected, searches) else {
        anyhow::bail!("no retrieval statistics: {answer}");
    };
    Ok(selected / searches.max(1.0))
}

/// `follow` reaches the session: each decode step's searches also select the successors of
/// the tokens the step before attended most, so the same question selects more keys a
/// search, at most `follow` more (the field is not refused when unknown, so only its effect
/// shows it arrived); a query without it follows `DEFAULT_FOLLOW`. The largest value
/// answers, larger ones are refused naming the field, and the OpenAPI schema states the
/// bound and the default.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn follow_adds_the_most_attended_tokens_successors() -> Result<()> {
    let s = with_corpus(|_| {}).await?;
    let plain = selected_per_search(&s, json!(0)).await?;
    let followed = selected_per_search(&s, json!(8)).await?;
    assert!(
        followed > plain && followed <= plain + 8.0,
        "{followed} ids a search following 8, {plain} without"
    );
    assert_eq!(kvdb::DEFAULT_FOLLOW, 8);
    let by_default = selected_per_search(&s, Value::Null).await?;
    assert_eq!(by_default, followed, "a query without `follow`");
    // As many as a query may retrieve allocates no more than the selections hold.
    selected_per_search(&s, json!(kvdb::MAX_K)).await?;

    for follow in [
        json!(kvdb::MAX_K + 1),
        json!(u64::MAX),
        json!(-1),
        json!(1e30),
    ] {
        let m = s
            .post_error(
                "/v1/corpora/c/query",
                &json!({"question": "q", "follow": follow}),
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
            )
            .await?;
        assert!(m.contains("follow"), "{follow}: {m}");
    }

    let (_, api) = json_of(s.get("/openapi.json").send().await?).await?;
    // The flattened sampling fields put the request's own in an `allOf`.
    let request = &api["components"]["schemas"]["QueryRequest"];
    let follow = request["allOf"]
        .as_array()
        .into_iter()
        .flatten()
        .chain([request])
        .map(|part| &part["properties"]["follow"])
        .find(|f| !f.is_null())
        .context("no `follow` in QueryRequest's schema")?;
    assert_eq!(
        follow["maximum"].as_u64(),
        Some(kvdb::MAX_K as u64),
        "{follow}"
    );
    assert_eq!(
        follow["default"].as_u64(),
        Some(kvdb::DEFAULT_FOLLOW as u64),
        "{follow}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_guard_writes_or_everything() -> Result<()> {
    let mut s = TestServer::start(|c| c.token = Some("s3cret".into())).await?;
    let token = s.token.take();
    let create = json!({"name": "c", "model": MODEL});
    expect_errors(vec![
        (
            s.post("/v1/corpora", &create),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            s.post("/v1/corpora", &create).bearer_auth("s3crex"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            s.post("/v1/corpora", &create)
                .header("authorization", "Basic s3cret"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            s.delete("/v1/corpora/c"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
    ])
    .await?;
    // Reads need no token.
    assert_eq!(s.get("/v1/corpora").send().await?.status(), StatusCode::OK);
    assert_eq!(
        s.post("/v1/corpora/c/query", &json!({"question": "q"}))
            .send()
            .await?
            .status(),
        StatusCode::NOT_FOUND
    );
    s.token = token;
    s.corpus("c", &documents(1, 300)).await?;
    drop(s);

    let mut s = TestServer::start(|c| {
        c.token = Some("s3cret".into());
        c.token_all = true;
    })
    .await?;
    s.token = None;
    expect_errors(vec![
        (
            s.get("/v1/corpora"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (s.get("/metrics"), StatusCode::UNAUTHORIZED, "unauthorized"),
        (
            s.get("/openapi.json"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
    ])
    .await?;
    assert_eq!(s.get("/health").send().await?.status(), StatusCode::OK);
    assert_eq!(
        s.get("/v1/corpora")
            .bearer_auth("s3cret")
            .send()
            .await?
            .status(),
        StatusCode::OK
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 6)]
async fn concurrent_queries_answer_as_sequential_ones() -> Result<()> {
    let s = with_corpus(|c| c.max_concurrent = 3).await?;
    let questions: Vec<Value> = (0..6)
        .map(|i| json!({"question": format!("Where is house {}?", i * 7), "max_tokens": 8, "k": 8 + i}))
        .collect();
    let mut sequential = Vec::new();
    for q in &questions {
        sequential.push(ask(&s, q.clone()).await?["answer"].clone());
    }
    let concurrent =
        futures::future::try_join_all(questions.iter().map(|q| ask(&s, q.clone()))).await?;
    let concurrent: Vec<Value> = concurrent
        .into_iter()
        .map(|a| a["answer"].clone())
        .collect();
    assert_eq!(concurrent, sequential);
    Ok(())
}

/// Questions waiting for the worker on one corpus with the same options are answered in
/// one batch (`max_batch`), each as it is alone; a question with other options waits for a
/// batch of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 6)]
async fn waiting_questions_are_answered_together_as_alone() -> Result<()> {
    let s = with_corpus(|c| {
        c.max_concurrent = 1;
        c.max_batch = 4;
        c.max_tokens = 8192;
    })
    .await?;
    let same: Vec<Value> = (0..3)
        .map(|i| json!({"question": format!("Where is house {}?", i * 7), "max_tokens": 8, "k": 8}))
        .collect();
    let other = json!({"question": "Where is house 5?", "max_tokens": 8, "k": 9});
    let questions: Vec<Value> = same.iter().chain([&other]).cloned().collect();
    // One at a time nobody waits: each is answered alone.
    let mut alone = Vec::new();
    for q in &questions {
        alone.push(ask(&s, q.clone()).await?["answer"].clone());
    }
    assert_eq!(s.metric("kvdb_queries_batched_total", "").await?, 0.0);

    // Hold the only worker with a long stream; queue the questions behind it, then let the
    // worker go.
    let long = json!({"question": "Tell me everything.", "max_tokens": 8192, "stream": true});
    let (body, _) = s
        .open_stream("/v1/corpora/c/query", &long, "event: token")
        .await?;
    let answers = futures::future::try_join_all(questions.iter().map(|q| ask(&s, q.clone())));
    let release = async {
        let queued = |n| n >= questions.len() as f64;
        until(
            &s,
            "kvdb_query_queue_depth",
            queued,
            30,
            "the questions did not queue",
        )
        .await?;
        drop(body);
        Ok(())
    };
    let (together, ()) = tokio::try_join!(answers, release)?;
    let together: Vec<Value> = together.into_iter().map(|a| a["answer"].clone()).collect();
    assert_eq!(together, alone);
    // The three of the same options went together; the other alone.
    assert_eq!(s.metric("kvdb_queries_batched_total", "").await?, 3.0);
    until(
        &s,
        "kvdb_queries_running",
        |n| n == 0.0,
        60,
        "the batch did not end",
    )
    .await?;
    assert_eq!(s.metric("kvdb_queries_cancelled_total", "").await?, 1.0);
    assert_eq!(s.metric("kvdb_query_queue_depth", "").await?, 0.0);
    Ok(())
}

/// Questions that reach a corpus nobody has asked yet at the same time open it once: each
/// loading its own RAM tier took 130 GB for four questions on a 120K-token Llama-3-8B corpus
/// on a GPU server, which the kernel killed. Six at once, each with a worker; checked to open
/// the corpus several times without the corpus's open gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corpus_asked_by_several_at_once_opens_once() -> Result<()> {
    let s = with_corpus(|c| {
        c.max_concurrent = 6;
        c.max_tokens = 8192;
    })
    .await?;
    assert_eq!(s.metric("kvdb_corpus_opens_total", "").await?, 0.0);
    let questions =
        (0..6).map(|i| json!({"question": format!("Where is house {i}?"), "max_tokens": 2}));
    futures::future::try_join_all(questions.map(|q| ask(&s, q))).await?;
    assert_eq!(s.metric("kvdb_corpus_opens_total", "").await?, 1.0);
    ask(&s, json!({"question": "And house 9?", "max_tokens": 2})).await?;
    assert_eq!(s.metric("kvdb_corpus_opens_total", "").await?, 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_answers_429_and_a_gone_client_stops_its_generation() -> Result<()> {
    let s = with_corpus(|c| {
        c.max_concurrent = 1;
        c.max_queue = 0;
        c.max_tokens = 8192;
    })
    .await?;
    // Hold the only worker with a long stream, read until its first token.
    let long = json!({"question": "Tell me everything.", "max_tokens": 8192, "stream": true});
    let (body, _) = s
        .open_stream("/v1/corpora/c/query", &long, "event: token")
        .await?;
    let started = Instant::now();
    let m = s
        .post_error(
            "/v1/corpora/c/query",
            &json!({"question": "q", "max_tokens": 2}),
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
        )
        .await?;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "429 should be immediate"
    );
    assert!(m.contains("retry"), "{m}");
    assert!(s.metric("kvdb_queries_rejected_total", "").await? >= 1.0);

    // Hanging up stops the generation: its worker frees long before 8192 tokens.
    drop(body);
    let stopped = "the generation did not stop";
    until(&s, "kvdb_queries_running", |n| n == 0.0, 30, stopped).await?;
    assert_eq!(s.metric("kvdb_queries_cancelled_total", "").await?, 1.0);
    ask(&s, json!({"question": "q", "max_tokens": 2})).await?;
    Ok(())
}

/// A shutdown stops a running ingest at a commit point; the next start resumes the job to
/// the same corpus an uninterrupted ingest makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_resumes_an_interrupted_ingest() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let docs = documents(2, 6_000);
    let reference = TestServer::start(|_| {}).await?;
    reference.corpus("c", &docs).await?;
    let (_, expected) = json_of(reference.get("/v1/corpora/c").send().await?).await?;

    let mut s = TestServer::start_in(dir.path(), |_| {}).await?;
    let (status, _) = json_of(
        s.post("/v1/corpora", &json!({"name": "c", "model": MODEL}))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED);
    let body: Vec<Value> = docs
        .iter()
        .map(|(t, x)| json!({"title": t, "text": x}))
        .collect();
    let (_, job) = json_of(
        s.post("/v1/corpora/c/documents", &json!({"documents": body}))
            .send()
            .await?,
    )
    .await?;
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
    s.stop().await?;
    let record: Value = serde_json::from_slice(&std::fs::read(
        dir.path()
            .join("store/kvdb-server-jobs")
            .join(format!("{id}.job.json")),
    )?)?;
    assert_eq!(record["status"], "queued", "{record}");

    let s = TestServer::start_in(dir.path(), |_| {}).await?;
    let job = s.wait_job(&id).await?;
    assert_eq!(job["status"], "succeeded", "{job}");
    assert_eq!(job["restarts"].as_u64(), Some(1));
    let (_, info) = json_of(s.get("/v1/corpora/c").send().await?).await?;
    for key in ["tokens", "document_count", "documents", "stored_bytes"] {
        assert_eq!(info[key], expected[key], "{key}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn openai_shapes_in_rust() -> Result<()> {
    let s = with_corpus(|_| {}).await?;
    let (status, models) = json_of(s.get("/v1/models").send().await?).await?;
    assert_eq!(status, StatusCode::OK);
    let ids: Vec<&str> = models["data"]
        .as_array()
        .context("data")?
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["c", "c:flat"]);
    let (status, c) = json_of(
        s.post(
            "/v1/completions",
            &json!({"model": "c:flat", "prompt": "What colour is the river?", "max_tokens": 6}),
        )
        .send()
        .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{c}");
    assert_eq!(c["object"], "text_completion");
    let direct = ask(
        &s,
        json!({"question": "What colour is the river?", "max_tokens": 6}),
    )
    .await?;
    assert_eq!(c["choices"][0]["text"], direct["answer"]);
    assert_eq!(c["usage"]["completion_tokens"], direct["tokens"]);

    let chat = json!({"model": "c", "messages": [{"role": "user", "content": "What colour is the river?"}], "max_tokens": 6, "stream": true});
    let text = s
        .post("/v1/chat/completions", &chat)
        .send()
        .await?
        .text()
        .await?;
    let events = parse_sse(&text);
    assert_eq!(
        events.last().map(|e| e.1.as_str()),
        Some("[DONE]"),
        "{text}"
    );
    let mut content = String::new();
    for (_, data) in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(data)?;
        assert_eq!(chunk["object"], "chat.completion.chunk");
        content.push_str(
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default(),
        );
    }
    assert_eq!(content, direct["answer"].as_str().unwrap_or_default());
    s.post_error(
        "/v1/completions",
        &json!({"model": "nope", "prompt": "q"}),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await?;
    s.post_error(
        "/v1/completions",
        &json!({"model": "c", "prompt": "q", "n": 2}),
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    )
    .await?;
    Ok(())
}
