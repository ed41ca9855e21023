//! The bench harness on a tiny random-weight model, where the answers are known: flat with
//! every key selected is exact (mass recall 1, output error 0, full attention's logits), a
//! random selection covers about its share of the mass, and the report's files are written.

use std::fmt::Write as _;

use anyhow::Result;
use indicatif::ProgressBar;
use kvdb::{load_model, ComputeDevice};
use kvdb_benches::harness::{run, BenchOptions, Preset};
use kvdb_benches::report::{overall, write_report};
use kvdb_index::IndexSpec;
use kvdb_model::LoadOptions;
use kvdb_tests::TinyModel;
use rand::{Rng, SeedableRng};

/// Paragraphs of random words.
fn text(paragraphs: usize, seed: u64) -> String {
    let words = [
        "store", "key", "value", "layer", "head", "query", "token", "bucket", "graph", "table",
        "cache", "model", "index", "budget", "window", "sink",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = String::new();
    for _ in 0..paragraphs {
        for _ in 0..rng.random_range(20..40) {
            let _ = write!(out, "{} ", words[rng.random_range(0..words.len())]);
        }
        out.push_str(".\n\n");
    }
    out
}

#[test]
fn flat_is_exact_random_covers_its_share_and_the_report_is_written() -> Result<()> {
    let model = TinyModel {
        context_length: 32768,
        ..TinyModel::gemma3()
    }
    .write_temp()?;
    let loaded = load_model(
        Some(model.path()),
        &LoadOptions::default(),
        ComputeDevice::Cpu,
    )?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("text.txt");
    std::fs::write(&path, text(400, 3))?;
    let mut options = BenchOptions::preset(Preset::Quick, vec![path], vec![IndexSpec::Flat]);
    options.contexts = vec![1500];
    options.depths = vec![0.5];
    options.needles = 1;
    options.budgets = vec![0.2, 1.0];
    options.eval_tokens = 24;
    let result = run(loaded.as_ref(), &options, &ProgressBar::hidden())?;
    let context = &result.contexts[0];
    let n = context.tokens;
    assert!(n >= 1500, "{n} tokens");
    assert_eq!(context.quality.len(), 2, "flat at two budgets");
    for (point, heads) in &context.quality {
        assert!(!heads.is_empty(), "no retrieval layer measured");
        let q = overall(heads);
        if point.k == Some(n) {
            // Every eligible key selected: exact.
            for h in heads {
                assert!((h.quality.mass_recall - 1.0).abs() < 1e-12, "{h:?}");
                assert!(h.quality.output_error < 1e-12, "{h:?}");
                assert_eq!(h.quality.top_k_recall, 1.0);
                assert_eq!(h.quality.selectivity, 1.0);
            }
        } else {
            // A fifth of the keys: random covers about a fifth of the mass, flat more.
            assert!((q.selectivity - 0.2).abs() < 0.01, "{q:?}");
            assert!(
                (q.random_mass_recall - q.selectivity).abs() < 0.05,
                "random {:.3} at selectivity {:.3}",
                q.random_mass_recall,
                q.selectivity
            );
            // (Not the output error: on near-uniform random-weight attention, the heaviest
            // fifth of the keys gives a more biased output than a random fifth.)
            assert!(q.mass_recall > q.random_mass_recall, "{q:?}");
        }
    }
    // End to end, flat with every key is full attention up to summation order.
    let everything = context
        .end_to_end
        .iter()
        .find(|e| e.label == format!("flat @k={n}"))
        .expect("flat at k = n");
    assert_eq!(everything.top1_agreement, 1.0);
    assert!(everything.kl < 1e-6, "{everything:?}");
    assert_eq!(context.needles.len(), 1);

    let out = dir.path().join("report");
    let result = kvdb_benches::harness::BenchResult {
        command: "kvdb bench (test)".into(),
        ..result
    };
    let files = write_report(&result, &out)?;
    for name in [
        "report.md",
        "results.json",
        "needles.svg",
        &format!("recall_vs_selectivity_{n}.svg"),
        &format!("recall_vs_scored_{n}.svg"),
    ] {
        assert!(files.contains(&out.join(name)), "{name} missing");
        assert!(
            std::fs::metadata(out.join(name))?.len() > 100,
            "{name} empty"
        );
    }
    let report = std::fs::read_to_string(out.join("report.md"))?;
    assert!(report.contains(&format!("`flat @k={n}`")), "{report}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json"))?)?;
    assert_eq!(json["options"]["specs"][0], "flat");
    // A saved run reads back as itself, so its report can be drawn again.
    let again = kvdb_benches::report::read_results(&out)?;
    assert_eq!(again.command, result.command);
    assert_eq!(again.options.specs, result.options.specs);
    let (was, is) = (&result.contexts[0], &again.contexts[0]);
    assert_eq!(is.quality.len(), was.quality.len());
    assert_eq!(is.quality[0].0, was.quality[0].0);
    assert_eq!(is.needles[0].answers, was.needles[0].answers);
    Ok(())
}
