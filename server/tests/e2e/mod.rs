//! End to end from other processes: the official `openai` Python client, a load test with
//! `wrk`, and chromium driving the web page. Each needs a tool from outside Cargo; without
//! it the test prints `SKIPPED` and passes, unless `KVDB_REQUIRE_E2E=1` (set by `.ci/run`,
//! which installs them) makes a missing tool a failure.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fantoccini::{ClientBuilder, Locator};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::support::{documents, json_of, TestServer};

/// Whether the tool is there; `Ok(false)` (after printing `SKIPPED`) when it is not and
/// missing tools are allowed.
fn tool_present(test: &str, present: bool, what: &str) -> Result<bool> {
    if present {
        return Ok(true);
    }
    if std::env::var_os("KVDB_REQUIRE_E2E").is_some_and(|v| v == "1") {
        bail!("{test}: {what} is missing and KVDB_REQUIRE_E2E=1");
    }
    println!("SKIPPED {test}: {what} is not installed");
    Ok(false)
}

/// A Python that can import `openai`: `$KVDB_PYTHON`, the venv `.ci/run` makes under
/// `~/.cache/kvdb/venv`, or `python3`.
fn python_with_openai() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("KVDB_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(PathBuf::from(home).join(".cache/kvdb/venv/bin/python"));
    }
    candidates.push("python3".into());
    candidates.into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import openai"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

fn on_path(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    })
}

async fn greedy_answer(s: &TestServer, question: &str, max_tokens: usize) -> Result<Value> {
    let (status, answer) = json_of(
        s.post(
            "/v1/corpora/c/query",
            &json!({"question": question, "max_tokens": max_tokens}),
        )
        .send()
        .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    Ok(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_official_openai_client_reads_our_shapes() -> Result<()> {
    let python = python_with_openai();
    if !tool_present(
        "openai client",
        python.is_some(),
        "Python's `openai` package",
    )? {
        return Ok(());
    }
    let s = TestServer::start(|_| {}).await?;
    s.corpus("c", &documents(2, 1500)).await?;
    let question = "What colour is the river?";
    let expected = greedy_answer(&s, question, 6).await?["answer"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/openai_client.py");
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python.expect("checked above"))
            .arg(script)
            .args([base.as_str(), "c", question, expected.as_str()])
            .output()
    })
    .await??;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("openai client: OK"),
        "{text}"
    );
    Ok(())
}

/// What wrk reported.
#[derive(Debug)]
struct Load {
    requests: u64,
    p50_ms: f64,
    p99_ms: f64,
    non_2xx: u64,
    socket_errors: u64,
}

fn parse_wrk(out: &str) -> Result<Load> {
    let millis = |v: &str| -> Result<f64> {
        let (n, unit) = v.split_at(v.find(|c: char| c.is_alphabetic()).context("a unit")?);
        let n: f64 = n.parse()?;
        Ok(match unit {
            "us" => n / 1000.0,
            "ms" => n,
            "s" => n * 1000.0,
            "m" => n * 60_000.0,
            u => bail!("unknown unit {u}"),
        })
    };
    let percentile = |p: &str| -> Result<f64> {
        let line = out
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with(p))
            .with_context(|| format!("no {p} line"))?;
        millis(line.split_whitespace().nth(1).context("a value")?)
    };
    let requests = out
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .context("no request count")?;
    let non_2xx = out
        .lines()
        .find(|l| l.contains("Non-2xx or 3xx responses:"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0);
    let socket_errors = out
        .lines()
        .find(|l| l.contains("Socket errors:"))
        .map(|l| {
            l.split(',')
                .filter_map(|part| part.rsplit(' ').next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Ok(Load {
        requests,
        p50_ms: percentile("50%")?,
        p99_ms: percentile("99%")?,
        non_2xx,
        socket_errors,
    })
}

/// wrk from a second process at a concurrency the pool admits (2 workers + 8 queued, 4
/// connections): no transport errors, no 5xx, no 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn load_within_the_limit_has_no_errors() -> Result<()> {
    let Some(wrk) = on_path("wrk") else {
        tool_present("load test", false, "wrk")?;
        return Ok(());
    };
    let s = TestServer::start(|c| {
        c.max_concurrent = 2;
        c.max_queue = 8;
    })
    .await?;
    s.corpus("c", &documents(2, 1500)).await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("query.lua");
    std::fs::write(
        &script,
        "wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\n\
         wrk.body = '{\"question\": \"What colour is the river?\", \"max_tokens\": 8}'\n",
    )?;
    let (connections, seconds) = (4, 6);
    let url = format!("{}/v1/corpora/c/query", s.base);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(wrk)
            .args([
                "-t",
                "2",
                "-c",
                &connections.to_string(),
                "-d",
                &format!("{seconds}s"),
                "--timeout",
                "30s",
                "--latency",
                "-s",
            ])
            .arg(&script)
            .arg(url)
            .output()
    })
    .await??;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let load = parse_wrk(&text)?;
    println!(
        "load: wrk -c {connections} -d {seconds}s: {} requests ({:.1}/s), p50 {:.1} ms, p99 {:.1} ms\n{text}",
        load.requests,
        load.requests as f64 / seconds as f64,
        load.p50_ms,
        load.p99_ms
    );
    assert!(load.requests > 10, "{load:?}");
    assert_eq!((load.non_2xx, load.socket_errors), (0, 0), "{text}");
    assert_eq!(s.metric("kvdb_queries_rejected_total", "").await?, 0.0);
    assert_eq!(
        s.metric("kvdb_http_requests_total", "status=\"5").await?,
        0.0
    );
    Ok(())
}

/// Kills the process when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Chromium (headless, through chromedriver) asks on the web page: the streamed greedy
/// answer it shows equals the JSON API's, and a passage is highlighted with a share above 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_web_page_streams_the_answer_and_highlights_passages() -> Result<()> {
    let (chromium, driver) = (on_path("chromium"), on_path("chromedriver"));
    if !tool_present(
        "web page",
        chromium.is_some() && driver.is_some(),
        "chromium with chromium-driver",
    )? {
        return Ok(());
    }
    let s = TestServer::start(|_| {}).await?;
    s.corpus("c", &documents(2, 1500)).await?;
    let question = "What colour is the river?";
    let expected = greedy_answer(&s, question, 16).await?;

    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let _driver = Killed(
        Command::new(driver.context("checked")?)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium.context("checked")?,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        }),
    );
    let started = Instant::now();
    let browser = loop {
        let mut builder =
            ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
        match builder
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(b) => break b,
            Err(e) if started.elapsed() > Duration::from_secs(30) => bail!("chromedriver: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let result = drive(&browser, &s.base, question, &expected).await;
    browser.close().await?;
    result
}

async fn drive(
    browser: &fantoccini::Client,
    base: &str,
    question: &str,
    expected: &Value,
) -> Result<()> {
    browser.goto(base).await?;
    browser
        .wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css("#corpus option[value='c']"))
        .await?;
    browser
        .find(Locator::Id("question"))
        .await?
        .send_keys(question)
        .await?;
    let max = browser.find(Locator::Id("max-tokens")).await?;
    max.clear().await?;
    max.send_keys("16").await?;
    browser.find(Locator::Id("ask")).await?.click().await?;
    let started = Instant::now();
    loop {
        let status = browser.find(Locator::Id("status")).await?.text().await?;
        if status.starts_with("done") {
            break;
        }
        if started.elapsed() > Duration::from_secs(60)
            || browser.find(Locator::Css("#status.error")).await.is_ok()
        {
            bail!("the page did not finish: {status}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let shown = browser
        .execute(
            "return document.getElementById('answer').textContent;",
            vec![],
        )
        .await?;
    assert_eq!(
        shown, expected["answer"],
        "the page shows the JSON API's greedy answer"
    );
    let shares = browser
        .execute(
            "return [...document.querySelectorAll('.passage.highlighted')].map(p => Number(p.dataset.share));",
            vec![],
        )
        .await?;
    let shares: Vec<f64> = serde_json::from_value(shares)?;
    assert!(
        shares.iter().any(|&s| s > 0.0),
        "no highlighted passage: {shares:?}"
    );
    let first = expected["provenance"]["passages"][0]["share"]
        .as_f64()
        .context("a passage")?;
    assert!((shares[0] - first).abs() < 1e-9, "{shares:?} vs {first}");
    Ok(())
}
