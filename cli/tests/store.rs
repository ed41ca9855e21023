//! The store, ingest and queries end to end on a tiny random-weight gemma3 (five sliding
//! layers of 16 tokens, one global layer, 2 KV heads): appends and resumes are bit-exact,
//! a SIGKILLed `kvdb ingest` resumes to exactly what an uninterrupted one stores, queries
//! are concurrent and read through a RAM tier, and bad input is a clear error that writes
//! nothing.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use anyhow::Result;
use common::{dump, sigkill_and_resume, tiny, write_documents};
use kvdb::read_documents;
use kvdb::store::{Access, Store};
use kvdb::update_indexes;
use kvdb::LoadedModel;
use kvdb::{ingest, ingest_until, IngestEvent};
use kvdb::{AskOptions, AttentionMode, Corpus};
use kvdb_attention::DensePolicy;
use kvdb_tests::{TinyFile, TinyModel};

/// A tiny model and a store holding corpus `c` of generated documents (the temporary
/// files live as long as it does).
struct TinyCorpus {
    _model: TinyFile,
    _dir: tempfile::TempDir,
    loaded: LoadedModel,
    store: Arc<Store>,
}

fn tiny_corpus(count: usize, chars: usize, seed: u64) -> Result<TinyCorpus> {
    let (model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), count, chars, seed)?;
    let store = Arc::new(Store::open(dir.path().join("s"), Access::Write)?);
    ingest(
        &store,
        "c",
        loaded.as_ref(),
        &read_documents(&paths)?,
        &mut |_| {},
    )?;
    Ok(TinyCorpus {
        _model: model,
        _dir: dir,
        loaded,
        store,
    })
}

/// Retrieval of `k` keys with a small dense part (2 sink tokens, a window of 8).
fn retrieval(k: usize) -> AskOptions {
    AskOptions {
        profile: false,
        mode: AttentionMode::top_k(k, DensePolicy { sink: 2, window: 8 }),
        ..AskOptions::default()
    }
}

fn m_final_tokens(store: &Path) -> Result<u64> {
    Ok(Store::open(store, Access::Read)?.manifest("c")?.tokens as u64)
}

fn kvdb_cmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvdb"))
}

fn run(args: &[&str]) -> Output {
    kvdb_cmd().args(args).output().expect("running kvdb")
}

/// A tiny model and documents for driving the `kvdb` binary, with a store path (not yet
/// created) in the same temporary folder.
struct CliCorpus {
    model: TinyFile,
    docs: Vec<PathBuf>,
    store: PathBuf,
    _dir: tempfile::TempDir,
}

impl CliCorpus {
    fn new(count: usize, chars: usize, seed: u64) -> Result<Self> {
        let (model, _) = tiny()?;
        let dir = tempfile::tempdir()?;
        Ok(Self {
            model,
            docs: write_documents(&dir.path().join("docs"), count, chars, seed)?,
            store: dir.path().join("s"),
            _dir: dir,
        })
    }
}

/// `kvdb ingest` of `doc` into corpus `c` of store `s` with model `m`, `extra` arguments
/// first, without progress output.
fn ingest_cli(s: &str, m: &str, doc: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["ingest", "--store", s, "--corpus", "c", "--model", m];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--progress", "none", path_str(doc)]);
    run(&args)
}

/// `kvdb index add` of `spec` to corpus `c` of store `s` with model `m`, without progress.
fn index_add_cli(s: &str, m: &str, spec: &str) -> Output {
    run(&[
        "index",
        "add",
        "--store",
        s,
        "--corpus",
        "c",
        "--model",
        m,
        "--progress",
        "none",
        spec,
    ])
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temp path")
}

#[test]
fn appending_in_steps_stores_exactly_what_one_ingest_stores() -> Result<()> {
    let (_model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 4, 1500, 7)?;
    let docs = read_documents(&paths)?;

    let one = Store::open(dir.path().join("one"), Access::Write)?;
    let report = ingest(&one, "c", loaded.as_ref(), &docs, &mut |_| {})?;
    assert_eq!(report.added.len(), 4);

    let steps = Store::open(dir.path().join("steps"), Access::Write)?;
    ingest(&steps, "c", loaded.as_ref(), &docs[..1], &mut |_| {})?;
    ingest(&steps, "c", loaded.as_ref(), &docs[1..3], &mut |_| {})?;
    // Already-present documents are skipped and reported, the new one appended.
    let again = ingest(&steps, "c", loaded.as_ref(), &docs, &mut |_| {})?;
    assert_eq!(again.added.len(), 1);
    assert_eq!(again.skipped.len(), 3);
    assert!(again.skipped[0].1.contains("already in the corpus"));

    assert_eq!(dump(&one, "c")?, dump(&steps, "c")?);
    let m = one.manifest("c")?;
    assert_eq!(m.documents, 4);
    // Sliding layers keep only their window (15 tokens), the global layer every token.
    assert_eq!(m.stored_range(0, m.tokens).len(), 15);
    assert_eq!(m.stored_range(5, m.tokens), 0..m.tokens);
    Ok(())
}

/// An ingest stopped by its caller after a commit keeps exactly the committed chunks (an
/// interrupted document, no half-written chunk), and ingesting the same documents again
/// finishes it to what one uninterrupted ingest stores.
#[test]
fn a_stopped_ingest_keeps_its_commits_and_resumes_exactly() -> Result<()> {
    let (_model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 2, 3000, 5)?;
    let docs = read_documents(&paths)?;
    let one = Store::open(dir.path().join("one"), Access::Write)?;
    ingest(&one, "c", loaded.as_ref(), &docs, &mut |_| {})?;

    let stopped = Store::open(dir.path().join("stopped"), Access::Write)?;
    let mut commits = 0;
    let err = ingest_until(&stopped, "c", loaded.as_ref(), &docs, &mut |event| {
        if matches!(event, IngestEvent::Committed { .. }) {
            commits += 1;
        }
        if commits == 1 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .expect_err("the ingest should stop");
    assert!(
        matches!(err, kvdb::Error::Cancelled { tokens: 512, .. }),
        "{err}"
    );
    let m = stopped.manifest("c")?;
    assert_eq!((m.tokens, m.documents), (512, 0));
    assert!(m.pending.is_some(), "the first document is interrupted");

    // Stopping at the plan writes nothing more.
    let err = ingest_until(&stopped, "c", loaded.as_ref(), &docs, &mut |_| {
        ControlFlow::Break(())
    })
    .expect_err("stopped at the plan");
    assert!(matches!(err, kvdb::Error::Cancelled { tokens: 512, .. }));
    // Resuming loads every stored layer into the model first, saying so after each (tens of
    // GB at a million tokens); stopping there writes nothing either.
    let mut events = Vec::new();
    let err = ingest_until(&stopped, "c", loaded.as_ref(), &docs, &mut |event| {
        if let IngestEvent::Loaded { layers, of, tokens } = event {
            events.push((layers, of, tokens));
            if layers == 2 {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })
    .expect_err("stopped while loading");
    assert!(matches!(err, kvdb::Error::Cancelled { tokens: 512, .. }));
    let layers = m.layers.len();
    assert_eq!(events, [(1, layers, 512), (2, layers, 512)]);
    assert_eq!(stopped.manifest("c")?, m);
    ingest(&stopped, "c", loaded.as_ref(), &docs, &mut |_| {})?;
    assert_eq!(dump(&one, "c")?, dump(&stopped, "c")?);
    Ok(())
}

/// Kills a real `kvdb ingest` with SIGKILL at seeded moments (after the n-th commit, plus a
/// seeded delay), resumes it each time, and checks the result is bit-identical to an
/// uninterrupted ingest, with every document exactly once.
#[test]
fn sigkilled_ingest_resumes_to_the_uninterrupted_result() -> Result<()> {
    let (model, _loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 5, 2500, 11)?;
    let args = |store: &Path| -> Vec<String> {
        let mut a: Vec<String> = ["ingest", "--store", path_str(store), "--corpus", "c"]
            .into_iter()
            .chain(["--model", path_str(model.path()), "--progress", "json"])
            .map(String::from)
            .collect();
        a.extend(paths.iter().map(|p| path_str(p).to_string()));
        a
    };
    sigkill_and_resume(dir.path(), &args, &|_| Ok(()), 20261121)
}

#[test]
fn concurrent_queries_answer_as_sequential_ones_do() -> Result<()> {
    let TinyCorpus { loaded, store, .. } = tiny_corpus(3, 1200, 3)?;
    let corpus = Corpus::open(store, "c", loaded.as_ref(), 1 << 30)?;
    let options = retrieval(32);
    let questions = [
        "what does the store keep?",
        "which layer retrieves a block?",
    ];
    let sequential: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            Ok(corpus
                .ask(loaded.as_ref(), q, &options, &mut |_| Ok(()))?
                .tokens)
        })
        .collect::<Result<_>>()?;

    let in_flight = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    let barrier = Barrier::new(questions.len());
    let concurrent: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = questions
            .iter()
            .map(|q| {
                s.spawn(|| -> Result<Vec<u32>> {
                    barrier.wait();
                    in_flight.fetch_add(1, Ordering::SeqCst);
                    let answer = corpus.ask(loaded.as_ref(), q, &options, &mut |_| {
                        most.fetch_max(in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(2));
                        Ok(())
                    });
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    Ok(answer?.tokens)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("query thread"))
            .collect::<Result<_>>()
    })?;
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "the queries never overlapped"
    );
    assert_eq!(sequential, concurrent);
    assert!(sequential.iter().all(|t| !t.is_empty()));

    // Asked together (on the CPU, one after another): the same answers, streamed by index,
    // with a step counted per token after each one's first.
    let mut streamed = vec![String::new(); questions.len()];
    let together = corpus.ask_together(loaded.as_ref(), &questions, &options, &mut |i, p| {
        streamed[i].push_str(p);
        Ok(())
    })?;
    let tokens: Vec<Vec<u32>> = together.answers.iter().map(|a| a.tokens.clone()).collect();
    assert_eq!(tokens, sequential);
    let texts: Vec<&str> = together.answers.iter().map(|a| a.answer.as_str()).collect();
    assert_eq!(texts, streamed);
    assert_eq!(
        together.steps.steps,
        sequential.iter().map(|t| t.len() - 1).sum::<usize>()
    );
    // The first answer's reader leaves at its second piece: that answer stops as
    // abandoned (on the CPU it still runs to its end, unseen), the others are unchanged.
    assert!(
        sequential[0].len() > 2,
        "the first answer is too short to leave"
    );
    let mut pieces = vec![0usize; questions.len()];
    let left = corpus.ask_together(loaded.as_ref(), &questions, &options, &mut |i, _| {
        pieces[i] += 1;
        match (i, pieces[i]) {
            (0, 2..) => Err(kvdb::Error::Abandoned),
            _ => Ok(()),
        }
    })?;
    assert_eq!(pieces[0], 2, "pieces streamed after the reader left");
    assert_eq!(left.answers[0].stop, kvdb::StopReason::Abandoned);
    let rest: Vec<Vec<u32>> = left.answers[1..].iter().map(|a| a.tokens.clone()).collect();
    assert_eq!(rest, sequential[1..]);
    assert!(left.answers[1..]
        .iter()
        .all(|a| a.stop != kvdb::StopReason::Abandoned));
    // A bad question among them fails the call before anything is answered.
    let refused = corpus.ask_together(loaded.as_ref(), &["fine", ""], &options, &mut |_, _| {
        panic!("answered before the empty question was refused")
    });
    assert!(
        matches!(refused, Err(kvdb::Error::EmptyInput { .. })),
        "{refused:?}"
    );
    Ok(())
}

/// A session is a checked question: its errors come before any answer, it names the index
/// it searches, and answering it is what `ask` does.
#[test]
fn a_session_checks_the_question_before_answering() -> Result<()> {
    let TinyCorpus { loaded, store, .. } = tiny_corpus(2, 1200, 7)?;
    let corpus = Corpus::open(store, "c", loaded.as_ref(), 1 << 30)?;
    let model = loaded.as_ref();
    let options = retrieval(32);
    let question = "which layer retrieves a block?";
    let session = corpus.session(model, question, &options)?;
    assert_eq!(session.index_spec().as_deref(), Some("flat"));
    let tokens = session.question_tokens();
    assert!(tokens > 0);
    let answered = session.answer(&mut |_| Ok(()))?;
    let asked = corpus.ask(model, question, &options, &mut |_| Ok(()))?;
    assert_eq!(answered.tokens, asked.tokens);
    assert_eq!(answered.question_tokens, tokens);
    assert!(!answered.tokens.is_empty());

    let full = AskOptions {
        mode: AttentionMode::Full,
        ..AskOptions::default()
    };
    assert_eq!(corpus.session(model, question, &full)?.index_spec(), None);
    let context = model.model.config().context_length;
    let too_long = "key ".repeat(context);
    assert!(matches!(
        corpus.session(model, &too_long, &options),
        Err(kvdb::Error::TooLongForContext { .. })
    ));
    let no_placeholder = AskOptions {
        template: Some("no question here".into()),
        ..retrieval(32)
    };
    assert!(matches!(
        corpus.session(model, question, &no_placeholder),
        Err(kvdb::Error::TemplatePlaceholder)
    ));
    Ok(())
}

/// An error kvdb raises inside the model's forward pass (here an observer's, at the first
/// layer) comes out as itself, not as the model's text of it.
#[test]
fn errors_raised_inside_the_forward_pass_keep_their_type() -> Result<()> {
    let TinyCorpus { loaded, store, .. } = tiny_corpus(1, 800, 9)?;
    let corpus = Corpus::open(store, "c", loaded.as_ref(), 1 << 30)?;
    for mode in [AttentionMode::Full, retrieval(16).mode] {
        let scored = corpus.score_observed(loaded.as_ref(), &[5, 6, 7], mode, &mut |_| {
            Err(kvdb::Error::Abandoned)
        });
        assert!(
            matches!(scored, Err(kvdb::Error::Abandoned)),
            "{:?}",
            scored.map(|_| ())
        );
    }
    Ok(())
}

#[test]
fn a_small_ram_budget_evicts_blocks_and_answers_the_same() -> Result<()> {
    let TinyCorpus { loaded, store, .. } = tiny_corpus(2, 2000, 5)?;
    let options = retrieval(48);
    let ask = |budget: usize| -> Result<_> {
        let corpus = Corpus::open(store.clone(), "c", loaded.as_ref(), budget)?;
        let answer = corpus.ask(loaded.as_ref(), "the value of a key", &options, &mut |_| {
            Ok(())
        })?;
        Ok((answer.tokens, corpus.tier_stats()))
    };
    let (roomy, roomy_stats) = ask(1 << 30)?;
    // One block of keys is 64 tokens x 32 dims x 4 bytes = 8 KiB: keep about two.
    let (tight, tight_stats) = ask(16 << 10)?;
    assert_eq!(roomy, tight);
    assert_eq!(roomy_stats.evictions, 0);
    assert!(tight_stats.evictions > 0, "{tight_stats:?}");
    assert!(tight_stats.resident_bytes <= 16 << 10, "{tight_stats:?}");
    Ok(())
}

#[test]
fn ask_works_while_an_ingest_holds_the_store() -> Result<()> {
    let (model, _loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    // Enough documents that the ingest is still running when the reader has answered.
    let paths = write_documents(&dir.path().join("docs"), 14, 2000, 9)?;
    let store = dir.path().join("s");
    let mut args = vec![
        "ingest".to_string(),
        "--store".into(),
        path_str(&store).into(),
        "--corpus".into(),
        "c".into(),
        "--model".into(),
        path_str(model.path()).into(),
        "--progress".into(),
        "json".into(),
    ];
    args.extend(paths.iter().map(|p| path_str(p).to_string()));
    let mut child = kvdb_cmd()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    // Wait for the first complete document.
    let mut committed = 0;
    for line in lines.by_ref() {
        let line = line?;
        let event: serde_json::Value = serde_json::from_str(&line)?;
        if event["event"] == "committed" && event["done"] == event["total"] {
            committed = event["corpus_tokens"].as_u64().unwrap_or(0);
            break;
        }
    }
    assert!(committed > 0);
    // A writer is refused while the ingest runs ...
    let busy = run(&[
        "corpus",
        "delete",
        "--store",
        path_str(&store),
        "--corpus",
        "c",
    ]);
    // ... while a reader answers from the last committed state.
    let out = run(&[
        "ask",
        "--store",
        path_str(&store),
        "--corpus",
        "c",
        "--model",
        path_str(model.path()),
        "--max-tokens",
        "4",
        "--json",
        "what is kept?",
    ]);
    let still_running = child.try_wait()?.is_none();
    for _ in lines {}
    let status = child.wait()?;
    assert!(status.success());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let seen = answer["corpus_tokens"].as_u64().unwrap_or(0);
    assert!(
        seen >= committed,
        "ask saw {seen} tokens, {committed} were committed"
    );
    // The reader answered while the writer held the store, and the writer was refused.
    assert!(still_running, "the ingest ended before the reader answered");
    assert!(
        seen < m_final_tokens(&store)?,
        "the reader saw the final state"
    );
    assert!(!busy.status.success());
    assert!(
        text(&busy.stderr).contains("in use by another kvdb process"),
        "{}",
        text(&busy.stderr)
    );
    let m = Store::open(&store, Access::Read)?.manifest("c")?;
    assert!(seen <= m.tokens as u64);
    Ok(())
}

#[test]
fn bad_input_is_a_clear_error_and_writes_nothing() -> Result<()> {
    let (model, _loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let model_path = path_str(model.path()).to_string();
    let store = dir.path().join("s");
    let store_s = path_str(&store).to_string();
    let good = write_documents(&dir.path().join("docs"), 1, 400, 1)?;
    let good_s = path_str(&good[0]).to_string();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "  \n")?;
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait")?;
    let pdf = dir.path().join("paper.pdf");
    std::fs::write(&pdf, b"%PDF")?;
    let huge = dir.path().join("huge.txt");
    std::fs::write(&huge, "word ".repeat(40_000))?;

    let ingest = |extra: &[&str]| {
        let mut a = vec![
            "ingest",
            "--store",
            &store_s,
            "--corpus",
            "c",
            "--model",
            &model_path,
        ];
        a.extend_from_slice(extra);
        run(&a)
    };
    let cases: Vec<(Output, &str)> = vec![
        (
            ingest(&[&good_s, path_str(&empty)]),
            "the document is empty",
        ),
        (ingest(&[&good_s, path_str(&latin1)]), "not UTF-8"),
        (
            ingest(&[&good_s, "/nonexistent/file.txt"]),
            "cannot read it",
        ),
        (ingest(&[path_str(&pdf)]), "unsupported file type"),
        (
            ingest(&[&good_s, path_str(&huge)]),
            "more than the model's context",
        ),
        (
            run(&[
                "ingest",
                "--store",
                &store_s,
                "--corpus",
                "../etc",
                "--model",
                &model_path,
                &good_s,
            ]),
            "not a valid corpus name",
        ),
        (
            run(&[
                "ask",
                "--store",
                &store_s,
                "--corpus",
                "c",
                "--model",
                &model_path,
                "hi",
            ]),
            "no kvdb store at",
        ),
    ];
    for (out, needle) in &cases {
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Nothing was written: the failed ingests created no corpus.
    if Store::exists(&store) {
        assert!(Store::open(&store, Access::Read)?.corpora()?.is_empty());
    }

    // A real corpus, then errors against it.
    let out = ingest(&[&good_s]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let before = dump(&Store::open(&store, Access::Read)?, "c")?;
    let ask = |corpus: &str, question: &str| {
        run(&[
            "ask",
            "--store",
            &store_s,
            "--corpus",
            corpus,
            "--model",
            &model_path,
            question,
        ])
    };
    let long_question = "é".repeat(40_000);
    let other_model = TinyModel {
        seed: 99,
        context_length: 32768,
        ..TinyModel::gemma3()
    }
    .write_temp()?;
    let cases: Vec<(Output, &str)> = vec![
        (ask("nope", "hi"), "no corpus `nope`"),
        (ask("c", &long_question), "leaves room for at most"),
        (
            run(&[
                "ask",
                "--store",
                &store_s,
                "--corpus",
                "c",
                "--model",
                path_str(other_model.path()),
                "hi",
            ]),
            "was ingested with model",
        ),
        (
            run(&[
                "ingest",
                "--store",
                &store_s,
                "--corpus",
                "c",
                "--model",
                path_str(other_model.path()),
                path_str(&huge),
            ]),
            "was ingested with model",
        ),
        (ingest(&[path_str(&huge)]), "more than the model's context"),
    ];
    for (out, needle) in &cases {
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert_eq!(before, dump(&Store::open(&store, Access::Read)?, "c")?);

    // A store written by another format version is refused, for reading and writing.
    {
        let mut opts = rocksdb::Options::default();
        opts.create_missing_column_families(true);
        let db = rocksdb::DB::open_cf(
            &opts,
            &store,
            [
                "meta", "docs", "tokens", "keys", "values", "index", "queries",
            ],
        )?;
        let meta = db.cf_handle("meta").expect("meta family");
        db.put_cf(
            meta,
            b"store",
            br#"{"format_version":999,"next_corpus_id":2}"#,
        )?;
    }
    for out in [ask("c", "hi"), ingest(&[path_str(&huge)])] {
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("format version 999"),
            "{}",
            text(&out.stderr)
        );
    }
    Ok(())
}

#[test]
fn corpus_commands_list_describe_and_delete() -> Result<()> {
    let (model, _loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let docs = write_documents(&dir.path().join("docs"), 2, 600, 2)?;
    let store = dir.path().join("s");
    let s = path_str(&store);
    for name in ["alpha", "beta"] {
        let out = run(&[
            "ingest",
            "--store",
            s,
            "--corpus",
            name,
            "--model",
            path_str(model.path()),
            "--progress",
            "none",
            path_str(&docs[0]),
            path_str(&docs[1]),
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let list = text(&run(&["corpus", "list", "--store", s]).stdout);
    assert!(list.contains("alpha") && list.contains("beta"), "{list}");
    let info = run(&["corpus", "info", "--store", s, "--corpus", "alpha"]);
    let info = text(&info.stdout);
    for needle in [
        "documents:   2",
        "doc00.txt",
        "doc01.txt",
        "stored K/V",
        "tokens:",
        "prefill:     chunks of 512 tokens (last ingest on cpu)",
    ] {
        assert!(info.contains(needle), "`{needle}` missing from {info}");
    }
    let out = run(&["corpus", "delete", "--store", s, "--corpus", "alpha"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let list = text(&run(&["corpus", "list", "--store", s]).stdout);
    assert!(!list.contains("alpha") && list.contains("beta"), "{list}");
    let out = run(&["corpus", "info", "--store", s, "--corpus", "alpha"]);
    assert!(text(&out.stderr).contains("no corpus `alpha`"));
    Ok(())
}

/// Indexes named at ingest are built and listed (the default `flat` gives way to them),
/// `index add` appends one, `ask --index` uses it, a later ingest brings every index up to
/// date, and a bad spec is an error that shows the grammar.
#[test]
fn index_commands_build_list_and_query() -> Result<()> {
    let cli = CliCorpus::new(3, 900, 5)?;
    let (docs, store) = (&cli.docs, &cli.store);
    let (s, m) = (path_str(store), path_str(cli.model.path()));
    let ingest = |doc: &Path, extra: &[&str]| ingest_cli(s, m, doc, extra);
    let out = ingest(
        &docs[0],
        &["--index", "hnsw8,ef32", "--index", "hip:k16,bq1,bk4"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let list = |expect: &[&str]| -> Result<String> {
        let out = run(&["index", "list", "--store", s, "--corpus", "c"]);
        let listed = text(&out.stdout);
        for spec in expect {
            assert!(listed.contains(spec), "`{spec}` missing from {listed}");
        }
        Ok(listed)
    };
    let listed = list(&["hnsw8,ef32,efc200", "hip:k16,bq1,bk4", "(default)"])?;
    assert!(!listed.contains("flat"), "{listed}");
    let out = index_add_cli(s, m, "lsh:L=8,K=6,min=1");
    assert!(out.status.success(), "{}", text(&out.stderr));
    list(&["lsh:L=8,K=6,min=1,seed=0"])?;
    // A later ingest catches every index up with the new tokens.
    let out = ingest(&docs[1], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let manifest = Store::open(store, Access::Read)?.manifest("c")?;
    let listed = list(&[])?;
    let keys = manifest.tokens.to_string();
    assert_eq!(
        listed
            .lines()
            .skip(1)
            .filter(|l| l.split_whitespace().nth(3) == Some(keys.as_str()))
            .count(),
        3,
        "every index covers the {keys} tokens: {listed}"
    );
    for index in ["lsh:L=8,K=6,min=1", "hip:k16,bq1,bk4", "flat"] {
        let out = run(&[
            "ask",
            "--store",
            s,
            "--corpus",
            "c",
            "--model",
            m,
            "--index",
            index,
            "--max-tokens",
            "3",
            "--json",
            "question",
        ]);
        assert!(out.status.success(), "{index}: {}", text(&out.stderr));
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert!(
            answer["retrieval"]["searches"].as_u64().unwrap_or(0) > 0,
            "{index}: {answer}"
        );
    }
    let out = run(&[
        "ask", "--store", s, "--corpus", "c", "--model", m, "--index", "ivf8,np2", "q",
    ]);
    assert!(
        text(&out.stderr).contains("has no index `ivf8,np2`"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&[
        "index", "add", "--store", s, "--corpus", "c", "--model", m, "ivf8,np9",
    ]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("np9") && err.contains("hnsw<M>,ef<E>"),
        "{err}"
    );
    Ok(())
}

/// `kvdb decode-bench` answers under full attention and each index, alone and `--concurrent`
/// questions together, and writes both tables as JSON.
#[test]
fn decode_bench_reports_single_and_concurrent_questions() -> Result<()> {
    let cli = CliCorpus::new(2, 900, 8)?;
    let (s, m) = (path_str(&cli.store), path_str(cli.model.path()));
    let out = ingest_cli(s, m, &cli.docs[0], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json = cli.store.with_extension("json");
    let out = run(&[
        "decode-bench",
        "--store",
        s,
        "--corpus",
        "c",
        "--model",
        m,
        "--index",
        "flat",
        "--tokens",
        "3",
        "--repeats",
        "1",
        "--concurrent",
        "1,3",
        "--json",
        path_str(&json),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.contains("questions answered together"), "{table}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json)?)?;
    let modes = |rows: &serde_json::Value| -> Vec<String> {
        let rows = rows.as_array().cloned().unwrap_or_default();
        rows.iter().map(|r| r["mode"].to_string()).collect()
    };
    assert_eq!(
        modes(&report["single"]),
        ["\"full attention\"", "\"flat\""],
        "{report}"
    );
    let together = report["concurrent"].as_array().cloned().unwrap_or_default();
    let shape: Vec<(String, u64)> = together
        .iter()
        .map(|r| (r["mode"].to_string(), r["questions"].as_u64().unwrap_or(0)))
        .collect();
    let expected: Vec<(String, u64)> = [("full attention", 1), ("full attention", 3)]
        .into_iter()
        .chain([("flat", 1), ("flat", 3)])
        .map(|(mode, n)| (format!("{mode:?}"), n))
        .collect();
    assert_eq!(shape, expected, "{report}");
    for row in &together {
        let questions = row["questions"].as_u64().unwrap_or(0);
        assert!(
            row["tokens"].as_u64().unwrap_or(0) >= questions
                && row["tokens_per_second"].as_f64().unwrap_or(0.0) > 0.0,
            "{row}"
        );
    }
    Ok(())
}

/// A spec that parses but cannot build, or whose numbers wrapped, is refused before anything
/// is saved (the corpus used to list it unbuilt, and every later ingest and `index add`
/// failed on it); an ingest naming one commits no document.
#[test]
fn a_spec_that_cannot_be_built_is_refused_before_anything_is_saved() -> Result<()> {
    let cli = CliCorpus::new(2, 600, 11)?;
    let (docs, store) = (&cli.docs, &cli.store);
    let (s, m) = (path_str(store), path_str(cli.model.path()));
    let ingest = |doc: &Path, extra: &[&str]| ingest_cli(s, m, doc, extra);
    let out = ingest(&docs[0], &["--index", "hip:k16,bq1,bk4"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed = || text(&run(&["index", "list", "--store", s, "--corpus", "c"]).stdout);
    let before = listed();
    let tokens = m_final_tokens(store)?;
    for (spec, token) in [
        ("hnsw1,ef1", "hnsw1"),
        ("ihip:99999999999999999k", "99999999999999999k"),
        ("ihip:18014398509481984k", "18014398509481984k"),
        ("lsh:L=99999,K=8", "L=99999"),
    ] {
        let out = index_add_cli(s, m, spec);
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains(&format!("at `{token}`")),
            "{spec}: {err}"
        );
        assert_eq!(listed(), before, "{spec}");
    }
    // No SAAP artifact is registered for the tiny model: the ingest fails before it commits
    // the document, not after.
    let out = ingest(&docs[1], &["--index", "saap8,l2"]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no SAAP artifact"),
        "{err}"
    );
    assert_eq!(m_final_tokens(store)?, tokens);
    assert_eq!(listed(), before);
    // The corpus is not stuck: the next ingest and index add work.
    let out = ingest(&docs[1], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(m_final_tokens(store)? > tokens);
    let out = index_add_cli(s, m, "hnsw2,ef8");
    assert!(out.status.success(), "{}", text(&out.stderr));
    Ok(())
}

/// A spec listed without ever being built (as a corpus created over HTTP lists its specs
/// before its first ingest) that fails to build is taken off the list, so the next update
/// does not fail on it again.
#[test]
fn a_listed_spec_that_fails_to_build_is_dropped() -> Result<()> {
    let (_model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let docs = write_documents(&dir.path().join("docs"), 1, 600, 12)?;
    let store = Store::open(dir.path().join("s"), Access::Write)?;
    // A corpus that lists `specs` before anything is stored, as one created over HTTP does.
    let listing = |name: &str, specs: &[&str]| -> Result<()> {
        let mut manifest = store.create_corpus(
            name,
            loaded.record.clone(),
            kvdb::store::LayerPolicy::for_model(loaded.model.config()),
            kvdb::store::DEFAULT_BLOCK_SIZE,
            kvdb::store::PrefillRecord::default(),
        )?;
        manifest.indexes = specs.iter().map(|s| s.to_string()).collect();
        let mut batch = store.batch();
        batch.put_manifest(&manifest)?;
        store.commit(batch)?;
        ingest(
            &store,
            name,
            loaded.as_ref(),
            &read_documents(&docs)?,
            &mut |_| {},
        )?;
        Ok(())
    };
    listing("c", &["saap8,l2", "hip:k16,bq1,bk4"])?;
    let err = update_indexes(&store, "c", loaded.as_ref(), &[], None, &mut |_| {})
        .expect_err("saap without an artifact");
    assert!(
        matches!(&err, kvdb::Error::IndexBuild { dropped: true, spec, .. } if spec == "saap8,l2"),
        "{err}"
    );
    assert_eq!(store.manifest("c")?.indexes, ["hip:k16,bq1,bk4"]);
    let infos = update_indexes(&store, "c", loaded.as_ref(), &[], None, &mut |_| {})?;
    assert_eq!(infos.len(), 1);
    assert!(infos[0].parts > 0 && infos[0].keys == store.manifest("c")?.tokens);
    // A corpus whose only spec is dropped falls back to `flat`, a new corpus's default.
    listing("d", &["saap8,l2"])?;
    assert!(update_indexes(&store, "d", loaded.as_ref(), &[], None, &mut |_| {}).is_err());
    assert_eq!(store.manifest("d")?.indexes, ["flat"]);
    update_indexes(&store, "d", loaded.as_ref(), &[], None, &mut |_| {})?;
    Ok(())
}

/// `kvdb index remove` deletes an index and moves the later ones up without rebuilding
/// them; an unknown spec and a corpus's only index are clear errors.
#[test]
fn index_remove_keeps_the_other_indexes_as_they_were() -> Result<()> {
    let cli = CliCorpus::new(1, 900, 13)?;
    let (docs, store) = (&cli.docs, &cli.store);
    let (s, m) = (path_str(store), path_str(cli.model.path()));
    let out = ingest_cli(
        s,
        m,
        &docs[0],
        &[
            "--index",
            "hip:k16,bq1,bk4",
            "--index",
            "lsh:L=8,K=6,min=1",
            "--index",
            "hnsw8,ef32",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let saved = |spec: &str| -> Result<Vec<Vec<u8>>> {
        let store = Store::open(store, Access::Read)?;
        let manifest = store.manifest("c")?;
        let number = manifest.indexes.iter().position(|s| s == spec).expect(spec);
        let mut parts = Vec::new();
        for layer in manifest.retrieval_layers() {
            for head in 0..manifest.model.n_kv_heads {
                let key = kvdb::store::IndexKey {
                    corpus: manifest.id,
                    index: number as u16,
                    layer: layer as u16,
                    head: head as u16,
                };
                parts.push(store.index(key)?.expect("saved"));
            }
        }
        Ok(parts)
    };
    let hnsw = saved("hnsw8,ef32,efc200")?;
    let hip = saved("hip:k16,bq1,bk4")?;
    let remove = |spec: &str| run(&["index", "remove", "--store", s, "--corpus", "c", spec]);
    // Any spelling of the spec names it.
    let out = remove("lsh:K=6,L=8,min=1");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let manifest = Store::open(store, Access::Read)?.manifest("c")?;
    assert_eq!(manifest.indexes, ["hip:k16,bq1,bk4", "hnsw8,ef32,efc200"]);
    assert_eq!(saved("hnsw8,ef32,efc200")?, hnsw, "moved up unchanged");
    assert_eq!(saved("hip:k16,bq1,bk4")?, hip);
    {
        let store = Store::open(store, Access::Read)?;
        let key = kvdb::store::IndexKey {
            corpus: manifest.id,
            index: 2,
            layer: manifest.retrieval_layers()[0] as u16,
            head: 0,
        };
        assert!(store.index(key)?.is_none(), "the last place is emptied");
    }
    let out = run(&[
        "ask",
        "--store",
        s,
        "--corpus",
        "c",
        "--model",
        m,
        "--index",
        "hnsw8,ef32",
        "--max-tokens",
        "2",
        "--json",
        "question",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = remove("ivf8,np2");
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has no index `ivf8,np2`"),
        "{err}"
    );
    assert!(remove("hip:k16,bq1,bk4").status.success());
    let out = remove("hnsw8,ef32");
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("only index"), "{err}");
    Ok(())
}

/// Option values the server refuses with 422 are refused by the CLI at argument parsing,
/// by the same checks.
#[test]
fn out_of_range_options_are_refused_at_parsing() {
    for (flag, value) in [
        ("--temperature", "-1"),
        ("--temperature", "NaN"),
        ("--temperature", "inf"),
        ("--temperature", "1e30"),
        ("--top-p", "0"),
        ("--k", "0"),
        ("--k", "99999999"),
    ] {
        let arg = format!("{flag}={value}");
        let out = run(&["ask", "--store", "/nonexistent", "--corpus", "c", &arg, "q"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains("must be"), "{flag} {value}: {err}");
    }
}

/// A reader that closes its end early (`kvdb corpus list | head -c0`) ends kvdb quietly: no
/// panic message, no exit status 101.
#[test]
fn a_closed_stdout_ends_quietly() -> Result<()> {
    let corpus = tiny_corpus(1, 300, 14)?;
    let path = corpus.store.path().to_path_buf();
    drop(corpus.store);
    let mut child = kvdb_cmd()
        .args([
            "corpus",
            "info",
            "--store",
            path_str(&path),
            "--corpus",
            "c",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    let out = child.wait_with_output()?;
    let err = text(&out.stderr);
    assert_ne!(out.status.code(), Some(101), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    Ok(())
}

/// `kvdb serve` holds the store: a CLI writer fails saying the server owns it (with its pid
/// and address); SIGTERM stops the server cleanly and frees the store for writers again.
#[test]
fn a_served_store_refuses_cli_writers_until_sigterm() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let models = dir.path().join("home/models");
    std::fs::create_dir_all(&models)?;
    let model = models.join("tiny.gguf");
    kvdb_tests::TinyModel {
        context_length: 32768,
        ..TinyModel::gemma3()
    }
    .write(&model)?;
    let docs = write_documents(&dir.path().join("docs"), 1, 400, 3)?;
    let store = dir.path().join("s");
    let mut server = kvdb_cmd()
        .args([
            "serve",
            "--store",
            path_str(&store),
            "--addr",
            "127.0.0.1:0",
        ])
        .env("KVDB_HOME", dir.path().join("home"))
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stderr = BufReader::new(server.stderr.take().expect("piped stderr"));
    let mut line = String::new();
    stderr.read_line(&mut line)?;
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let mut http = std::net::TcpStream::connect(&addr)?;
    http.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut reply = String::new();
    http.read_to_string(&mut reply)?;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");

    let ingest = || {
        run(&[
            "ingest",
            "--store",
            path_str(&store),
            "--corpus",
            "c",
            "--model",
            path_str(&model),
            "--progress",
            "none",
            path_str(&docs[0]),
        ])
    };
    let refused = ingest();
    let message = text(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        message.contains(&format!(
            "owned by a kvdb server (pid {}, http://{addr})",
            server.id()
        )) && message.contains("HTTP API"),
        "{message}"
    );

    let term = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()?;
    assert!(term.success());
    let status = server.wait()?;
    let mut rest = String::new();
    stderr.read_to_string(&mut rest)?;
    assert!(status.success(), "{rest}");
    assert!(rest.contains("server stopped"), "{rest}");
    // stderr is a pipe here, not a terminal: no colour codes in the log.
    assert!(!rest.contains('\x1b') && !line.contains('\x1b'), "{rest:?}");
    let out = ingest();
    assert!(out.status.success(), "{}", text(&out.stderr));
    Ok(())
}
