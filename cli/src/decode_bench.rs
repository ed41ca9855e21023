//! `kvdb decode-bench`: what a user gets per token. One process loads the model, opens the
//! corpus and (on a GPU) uploads its retrieval layers once, then answers one question under
//! full attention and under each index given, the same way each time, and prints a table:
//! time to the first token, milliseconds per answer token after it, and what retrieval
//! selected and scored, with each mode's speed against full attention's from the same run.
//! The first answer of each mode warms it up (it loads the mode's indexes and compiles its
//! kernels) and is reported apart from the measured ones; one more answer, profiled with
//! CUDA events on a GPU, says where the attention layers' GPU time goes.
//!
//! With the corpus in host memory (`--gpu-kv host`, or `auto` when it does not fit the GPU)
//! full attention cannot run: the modes are compared with each other, and each row that went
//! through the layers' block caches says how they did over its measured answers.
//!
//! `--concurrent 1,4,16` adds a second table: for each mode, that many questions answered
//! together (`Corpus::ask_together`: on a GPU one batched step per answer token, the
//! weights read once for all answers), with the decode's throughput in answer tokens per
//! second against full attention's at the same concurrency.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kvdb::{Answer, AskOptions, AttentionMode, Retrieval};
use kvdb_attention::DensePolicy;
use kvdb_index::IndexSpec;
use serde::Serialize;

use crate::corpus_cli::{open_for_questions, OpenArgs};
use crate::index_cli::parse_spec;

#[derive(clap::Args)]
pub(crate) struct DecodeBenchArgs {
    #[command(flatten)]
    open: OpenArgs,
    /// Indexes to compare with full attention (`flat` needs no build; others must be built
    /// on the corpus).
    #[arg(long = "index", num_args = 1.., value_parser = parse_spec)]
    index: Vec<IndexSpec>,
    /// Keys a top-k index retrieves per retrieval layer and KV head at every step (default:
    /// 1% of the corpus, the papers' budget; bucket indexes attend whole buckets).
    #[arg(long, value_parser = crate::retrieval_k)]
    k: Option<usize>,
    /// Most answer tokens per question (greedy; an end-of-text token stops it earlier).
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Measured answers per mode, after one warm-up answer.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: u32,
    /// The question.
    #[arg(long, default_value = "What does the text say about this?")]
    question: String,
    /// Also answer this many questions together per mode, for each number given (e.g.
    /// `1,4,16`): the question numbered 1 to N, decoded as one batch on a GPU.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=256))]
    concurrent: Vec<u32>,
    /// Also answer through each index following the N most attended tokens of each step
    /// (`kvdb ask --follow`): one more mode per index, named `SPEC follow N`.
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = crate::retrieval_follow)]
    follow: usize,
    /// On a GPU, launch every kernel of a decode step instead of running each layer's work
    /// besides its attention from CUDA graphs (the default): the two compared, one command
    /// with the flag and one without.
    #[arg(long)]
    no_step_graphs: bool,
    /// On a GPU, start every kernel only once the one before it has finished, instead of
    /// letting its blocks start while that one finishes (programmatic dependent launch, the
    /// default on Hopper): the two compared, one command with the flag and one without.
    #[arg(long)]
    no_programmatic_launch: bool,
    /// Also write the rows as JSON here: `{"single": [...], "concurrent": [...]}`.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Every table's rows, as `--json` writes them.
#[derive(Debug, Serialize)]
struct Report<'r> {
    single: &'r [Row],
    concurrent: &'r [ConcurrentRow],
}

/// One mode's questions answered together.
#[derive(Debug, Serialize)]
struct ConcurrentRow {
    /// `full attention` or the index spec.
    mode: String,
    /// Questions answered together.
    questions: usize,
    /// Best answer tokens per second of the batched decode (after every question's first
    /// token), over the measured runs.
    tokens_per_second: f64,
    /// Milliseconds per batched step in that run.
    ms_per_step: f64,
    /// Seconds the questions' prefills took in that run, one after another.
    prefill_seconds: f64,
    /// Milliseconds per batched step that the host spent sampling the next tokens.
    sample_ms_per_step: f64,
    /// Milliseconds per batched step that the host spent queuing the layers' work.
    queue_ms_per_step: f64,
    /// Answer tokens over all questions in that run.
    tokens: usize,
    /// Throughput over full attention's with as many questions.
    speedup: f64,
}

/// One mode's measurements.
#[derive(Debug, Serialize)]
struct Row {
    /// `full attention` or the index spec.
    mode: String,
    /// The warm-up answer's time to its first token (loads the mode's indexes).
    warmup_first_token_seconds: f64,
    /// Best time to the first token over the measured answers: the question's prefill and
    /// the first step.
    first_token_seconds: f64,
    /// Best milliseconds per answer token after the first, over the measured answers.
    ms_per_token: f64,
    /// Answer tokens of the last answer.
    tokens: usize,
    /// Share of the eligible corpus keys selected (`None` under full attention).
    selected: Option<f64>,
    /// Share of the eligible corpus keys scored by searches.
    scored: Option<f64>,
    /// Full attention's milliseconds per token over this mode's (`None` when full attention
    /// did not run: the corpus is in host memory).
    speedup: Option<f64>,
    /// Whether the last answer's tokens equal full attention's (the first mode's when full
    /// attention did not run).
    same_answer: bool,
    /// With the corpus in host memory, the share of cache lookups over the measured answers
    /// that found their block (a selection searched on the CPU) or bucket (routed on the GPU)
    /// on the GPU.
    cache_hit_ratio: Option<f64>,
    /// With the corpus in host memory, MiB copied from host memory per measured answer.
    cache_mib_per_answer: Option<f64>,
    /// On a GPU, milliseconds of GPU time per position (question and answer) of each stage
    /// of the attention the query computes itself, from one more, profiled answer.
    gpu_ms_per_position: BTreeMap<String, f64>,
    /// Milliseconds of host time per position (question and answer) of the last measured
    /// answer spent searching on the CPU (`search`) and, on a GPU, waiting for the queries
    /// to reach the host (`queries`, the GPU's work queued before them included); empty
    /// under full attention.
    host_ms_per_position: BTreeMap<String, f64>,
}

pub(crate) fn decode_bench(args: DecodeBenchArgs) -> Result<()> {
    let opened = open_for_questions(&args.open, args.index.iter())?;
    #[cfg(feature = "gpu")]
    if let Some(gpu) = &opened.model.gpu {
        gpu.set_step_graphs(!args.no_step_graphs);
        gpu.gpu()
            .set_programmatic_launch(!args.no_programmatic_launch);
    }
    let (model, corpus) = (opened.model.as_ref(), &opened.corpus);
    let n = corpus.manifest().tokens;
    let k = args.k.unwrap_or((n / 100).max(1));
    let in_host = cache_stats(corpus).is_some();
    if in_host {
        eprintln!(
            "kvdb: the corpus's keys and values are in host memory: full attention cannot run, \
             the modes are compared with each other"
        );
    }
    let full = (!in_host).then_some(AttentionMode::Full);
    let follows = [0, args.follow];
    let follows = &follows[..if args.follow > 0 { 2 } else { 1 }];
    let modes = full.into_iter().chain(args.index.iter().flat_map(|spec| {
        follows.iter().map(|&follow| {
            AttentionMode::Retrieval(Retrieval {
                index: Some(spec.clone()),
                k: Some(k),
                follow,
                policy: DensePolicy::default(),
                ..Retrieval::default()
            })
        })
    }));
    let mut rows: Vec<Row> = Vec::new();
    let mut together: Vec<ConcurrentRow> = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    for mode in modes {
        let name = match &mode {
            AttentionMode::Full => "full attention".to_string(),
            AttentionMode::Retrieval(r) => {
                let spec = r.index.as_ref().map_or("flat".into(), |s| s.to_string());
                match r.follow {
                    0 => spec,
                    follow => format!("{spec} follow {follow}"),
                }
            }
        };
        let options = AskOptions {
            mode,
            generate: kvdb::GenerateOptions {
                max_tokens: args.tokens,
                ..Default::default()
            },
            template: None,
            profile: false,
        };
        let ask = |options: &AskOptions| -> Result<Answer> {
            corpus
                .ask(model, &args.question, options, &mut |_| Ok(()))
                .with_context(|| format!("answering under {name}"))
        };
        eprintln!("kvdb: {name}: warm-up answer");
        let warmup = ask(&options)?;
        let mut answers = Vec::new();
        let cache_before = cache_stats(corpus);
        for i in 0..args.repeats {
            eprintln!("kvdb: {name}: answer {} of {}", i + 1, args.repeats);
            answers.push(ask(&options)?);
        }
        // None where no cache was used: resident rows, or host rows read in place.
        let cache = cache_before
            .zip(cache_stats(corpus))
            .and_then(|(before, after)| {
                let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
                let mib = (after.bytes_copied - before.bytes_copied) as f64 / (1 << 20) as f64;
                (hits + misses > 0).then(|| {
                    (
                        hits as f64 / (hits + misses) as f64,
                        mib / f64::from(args.repeats),
                    )
                })
            });
        // Apart from the measured answers: the events it records add work to every layer.
        eprintln!("kvdb: {name}: profiled answer");
        let profiled = ask(&AskOptions {
            profile: true,
            ..options.clone()
        })?;
        let positions = (profiled.question_tokens + profiled.tokens.len()).max(1);
        let gpu_ms_per_position = profiled
            .timings
            .gpu_stage_seconds
            .iter()
            .map(|(stage, s)| (stage.to_string(), 1000.0 * s / positions as f64))
            .collect();
        let last = answers.last().context("no measured answer")?;
        let best = |f: fn(&Answer) -> f64| answers.iter().map(f).fold(f64::INFINITY, f64::min);
        let ms_per_token = best(|a| 1000.0 / a.timings.tokens_per_second.max(1e-9));
        let host_ms_per_position = last.retrieval.as_ref().map_or_else(BTreeMap::new, |r| {
            let per_position =
                |s: f64| 1000.0 * s / (last.question_tokens + last.tokens.len()).max(1) as f64;
            BTreeMap::from([
                ("search".to_string(), per_position(r.search_seconds)),
                ("queries".to_string(), per_position(r.transfer_seconds)),
            ])
        });
        let reference = reference.get_or_insert_with(|| last.tokens.clone());
        let full_ms = match in_host {
            true => None,
            false => Some(rows.first().map_or(ms_per_token, |full| full.ms_per_token)),
        };
        rows.push(Row {
            mode: name.clone(),
            warmup_first_token_seconds: warmup.timings.first_token_seconds,
            first_token_seconds: best(|a| a.timings.first_token_seconds),
            ms_per_token,
            tokens: last.tokens.len(),
            selected: last.retrieval.as_ref().map(|r| r.selectivity()),
            scored: last.retrieval.as_ref().map(|r| r.scored_share()),
            speedup: full_ms.map(|full| full / ms_per_token),
            same_answer: last.tokens == *reference,
            cache_hit_ratio: cache.map(|c| c.0),
            cache_mib_per_answer: cache.map(|c| c.1),
            gpu_ms_per_position,
            host_ms_per_position,
        });
        for &count in &args.concurrent {
            let questions: Vec<String> = (1..=count)
                .map(|i| format!("{} (question {i})", args.question))
                .collect();
            let questions: Vec<&str> = questions.iter().map(String::as_str).collect();
            let mut best: Option<ConcurrentRow> = None;
            for i in 0..args.repeats {
                eprintln!(
                    "kvdb: {name}: {count} questions together, run {} of {}",
                    i + 1,
                    args.repeats
                );
                let run = corpus
                    .ask_together(model, &questions, &options, &mut |_, _| Ok(()))
                    .with_context(|| format!("answering {count} questions under {name}"))?;
                let steps = run.steps;
                let row = ConcurrentRow {
                    mode: name.clone(),
                    questions: questions.len(),
                    tokens_per_second: steps.tokens as f64 / steps.decode_seconds.max(1e-9),
                    ms_per_step: 1000.0 * steps.decode_seconds / steps.steps.max(1) as f64,
                    prefill_seconds: steps.prefill_seconds,
                    sample_ms_per_step: 1000.0 * steps.sample_seconds / steps.steps.max(1) as f64,
                    queue_ms_per_step: 1000.0 * steps.queue_seconds / steps.steps.max(1) as f64,
                    tokens: run.answers.iter().map(|a| a.tokens.len()).sum(),
                    speedup: 1.0,
                };
                if best
                    .as_ref()
                    .is_none_or(|b| row.tokens_per_second > b.tokens_per_second)
                {
                    best = Some(row);
                }
            }
            let mut row = best.context("no concurrent run")?;
            let full = together
                .iter()
                .find(|r| r.questions == row.questions)
                .map_or(row.tokens_per_second, |full| full.tokens_per_second);
            row.speedup = row.tokens_per_second / full.max(1e-9);
            together.push(row);
        }
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "corpus `{}`: {n} tokens, {} on {}; {} measured answers per mode after a warm-up",
        args.open.target.corpus, opened.model.record.name, args.open.device, args.repeats
    )?;
    #[cfg(feature = "gpu")]
    if let Some(gpu) = &opened.model.gpu {
        writeln!(
            out,
            "decode steps' layers from CUDA graphs: {} ({} graphs launched); programmatic \
             dependent launches: {}",
            if args.no_step_graphs { "off" } else { "on" },
            gpu.step_graph_launches(),
            if args.no_programmatic_launch {
                "off"
            } else {
                "on"
            },
        )?;
    }
    let reference = match in_host {
        true => "the first mode (keys and values of some or all layers in host memory)",
        false => "full",
    };
    writeln!(
        out,
        "| mode | first token (s) | ms/token | vs full | selected | scored | tokens | same answer as {reference} | warm-up first token (s) | cache hits | MiB copied per answer | GPU ms/position by stage | host ms/position |"
    )?;
    writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|"
    )?;
    let share = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{:.2}%", 100.0 * x));
    for r in &rows {
        writeln!(
            out,
            "| {} | {:.3} | {:.2} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} |",
            r.mode,
            r.first_token_seconds,
            r.ms_per_token,
            r.speedup.map_or("-".into(), |s| format!("{s:.2}x")),
            share(r.selected),
            share(r.scored),
            r.tokens,
            if r.same_answer { "yes" } else { "no" },
            r.warmup_first_token_seconds,
            share(r.cache_hit_ratio),
            r.cache_mib_per_answer
                .map_or("-".into(), |m| format!("{m:.1}")),
            stages(&r.gpu_ms_per_position),
            stages(&r.host_ms_per_position)
        )?;
    }
    if !together.is_empty() {
        writeln!(
            out,
            "\nquestions answered together (numbered copies of the question; on a GPU one \
             batched step per answer token):"
        )?;
        writeln!(
            out,
            "| mode | questions | answer tokens/s | vs full | ms/step | of it queuing layers | of it sampling | tokens | prefills (s) |"
        )?;
        writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        for r in &together {
            writeln!(
                out,
                "| {} | {} | {:.1} | {:.2}x | {:.2} | {:.2} | {:.2} | {} | {:.3} |",
                r.mode,
                r.questions,
                r.tokens_per_second,
                r.speedup,
                r.ms_per_step,
                r.queue_ms_per_step,
                r.sample_ms_per_step,
                r.tokens,
                r.prefill_seconds
            )?;
        }
    }
    if let Some(path) = &args.json {
        let report = Report {
            single: &rows,
            concurrent: &together,
        };
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Cache lookups: blocks or buckets found on the GPU, those copied (or read in place), bytes
/// copied.
#[derive(Debug, Clone, Copy)]
struct Lookups {
    hits: u64,
    misses: u64,
    bytes_copied: u64,
}

/// The caches' lookups so far (block caches, and the bucket caches of the questions routed
/// on the GPU) when the corpus's keys and values are in host memory (a GPU question uploaded
/// them), else `None`.
fn cache_stats(corpus: &kvdb::Corpus) -> Option<Lookups> {
    #[cfg(feature = "gpu")]
    {
        let footprint = corpus.gpu_footprint();
        let cache = footprint.cache;
        (footprint.host_bytes > 0).then_some(Lookups {
            hits: cache.hits,
            misses: cache.misses,
            bytes_copied: cache.bytes_copied,
        })
    }
    #[cfg(not(feature = "gpu"))]
    {
        let _ = corpus;
        None
    }
}

/// `attention 1.23, routing 0.10` (`-` for none).
fn stages(ms: &BTreeMap<String, f64>) -> String {
    if ms.is_empty() {
        return "-".into();
    }
    let parts: Vec<String> = ms.iter().map(|(s, t)| format!("{s} {t:.3}")).collect();
    parts.join(", ")
}
