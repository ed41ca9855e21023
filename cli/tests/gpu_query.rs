//! Queries decoded on the GPU (feature `gpu`) answer as the CPU session does: on a tiny
//! random-weight model, a corpus ingested once is asked through every index type and with
//! full attention on both devices. Selecting every token on the GPU gives GPU full
//! attention's answer (the same keys, another summation order); the GPU's answers through
//! flat, ivf (searched on the CPU, and `norope,all` routed on the GPU) and saap (routed on
//! the GPU by its classifier) equal the CPU's (bf16 weights against f32, so greedy answers
//! are compared, with the ranking of provenance and the search statistics); every other
//! index type answers on the GPU. Questions answered together (one batched step per answer
//! token) answer as each does alone. A corpus kept in pinned host memory behind the GPU's
//! block caches answers as the resident one, refuses full attention, and says when its
//! caches are too small.
//!
//! Needs a GPU: on a machine without one (CI) each test prints `SKIPPED` and passes.

use std::io::Write;

mod common;

/// Says that a test skipped, on stderr itself: libtest captures `eprintln!`, not this.
fn skip(test: &str, reason: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {reason}");
}

#[cfg(not(feature = "gpu"))]
#[test]
fn gpu_query_tests() {
    skip("gpu_query_tests", "built without feature `gpu`");
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use std::sync::Arc;

    use anyhow::{ensure, Result};
    use kvdb::ingest;
    use kvdb::read_documents;
    use kvdb::store::{Access, LayerPolicy, Store};
    use kvdb::GenerateOptions;
    use kvdb::{train_artifact, SaapTraining};
    use kvdb::{Answer, AskOptions, AttentionMode, Corpus, Retrieval};
    use kvdb::{ComputeDevice, GpuKv, LoadedModel};
    use kvdb_attention::DensePolicy;
    use kvdb_index::IndexSpec;
    use kvdb_model::EncodeOptions;
    use kvdb_tests::relative_max_error;

    use super::common::{tiny, tiny_on, write_documents};
    use super::skip;

    /// The dense part of every retrieval question here.
    const POLICY: DensePolicy = DensePolicy {
        sink: 4,
        window: 32,
    };

    /// Largest relative logit difference between two GPU runs over the same keys in another
    /// summation order.
    const SAME_KEYS: f32 = 1e-3;

    /// Largest relative logit difference between the GPU (bf16 weights) and the CPU (f32).
    const DEVICES: f32 = 0.1;

    /// Answer tokens per question.
    const TOKENS: usize = 12;

    /// The specs asked through besides flat: the CPU and GPU must agree on the first ones.
    /// `ivf…,norope,all` and saap are routed on the GPU (no CPU search), the others search
    /// on the CPU.
    const SAME_ANSWER: &[&str] = &[
        "flat",
        "ivf16,np4",
        "ivf16,np4,norope,all",
        "ivf16,np4,hot50,norope,all",
        "saap16,l4",
    ];
    const ANSWERS: &[&str] = &[
        "hnsw8,ef32",
        "lsh:L=8,K=6,min=1",
        "hip:k16,bq1,bk4",
        "ihip:1k",
    ];

    /// The questions asked; the first is the one every device compares on.
    /// More questions than a batched step has lanes, so that lanes take several rows.
    const QUESTIONS: [&str; 5] = [
        "the river and the stone of the old town are",
        "where the bridge",
        "and then the water of the long quiet river by the old stone town was",
        "the stone",
        "by the long quiet water the old bridge of the town",
    ];

    fn options(mode: AttentionMode) -> AskOptions {
        AskOptions {
            profile: false,
            mode,
            generate: GenerateOptions {
                max_tokens: TOKENS,
                ..Default::default()
            },
            template: None,
        }
    }

    fn ask(model: &LoadedModel, corpus: &Corpus, mode: AttentionMode) -> Result<Answer> {
        let options = options(mode);
        Ok(corpus.ask(model.as_ref(), QUESTIONS[0], &options, &mut |_| Ok(()))?)
    }

    /// Questions answered together on the GPU (one batched step per answer token) answer as
    /// each does alone: the same tokens, streamed as they come, the same searches and
    /// provenance; the steps ran every answer token but each answer's last.
    fn together_as_alone(gpu: &LoadedModel, corpus: &Corpus, mode: AttentionMode) -> Result<()> {
        let options = options(mode);
        let mut streamed = vec![String::new(); QUESTIONS.len()];
        let together = corpus.ask_together(gpu.as_ref(), &QUESTIONS, &options, &mut |i, p| {
            streamed[i].push_str(p);
            Ok(())
        })?;
        ensure!(together.answers.len() == QUESTIONS.len(), "answers missing");
        let mut ran = 0;
        for ((question, answer), streamed) in QUESTIONS.iter().zip(&together.answers).zip(&streamed)
        {
            let alone = corpus.ask(gpu.as_ref(), question, &options, &mut |_| Ok(()))?;
            println!("together {:?}, alone {:?}", answer.answer, alone.answer);
            ensure!(
                answer.tokens == alone.tokens,
                "{question:?}: answered differently"
            );
            ensure!(
                answer.answer == *streamed,
                "{question:?}: streamed {streamed:?}"
            );
            let (t, a) = (
                answer.retrieval.clone().unwrap_or_default(),
                alone.retrieval.clone().unwrap_or_default(),
            );
            ensure!(
                (t.searches, t.eligible) == (a.searches, a.eligible)
                    && t.selected.abs_diff(a.selected) <= a.selected / 20,
                "{question:?}: together {t:?}, alone {a:?}"
            );
            ensure!(
                answer.provenance.documents.first().map(|d| d.number)
                    == alone.provenance.documents.first().map(|d| d.number),
                "{question:?}: provenance ranks another document first"
            );
            ran += answer.tokens.len() - usize::from(answer.stop != kvdb::StopReason::EndOfText);
        }
        ensure!(
            together.steps.tokens == ran && together.steps.steps <= TOKENS,
            "steps {:?}, {ran} tokens to run",
            together.steps
        );
        Ok(())
    }

    fn retrieval(spec: &str, k: Option<usize>) -> Result<AttentionMode> {
        Ok(AttentionMode::Retrieval(Retrieval {
            index: Some(spec.parse::<IndexSpec>()?),
            k,
            policy: POLICY,
            ..Retrieval::default()
        }))
    }

    /// The specs asked through with `follow`: a flat scan and a hierarchical index searched on
    /// the CPU, and a bucket index routed on the GPU, which follows there too.
    const FOLLOWED: &[&str] = &[
        "flat",
        "ivf16,np4,norope,all",
        "ivf16,np4,hot50,norope,all",
        "hip:k16,bq1,bk4",
    ];

    /// Retrieval through `spec` following the `follow` most attended tokens of each step.
    fn following(spec: &str, follow: usize) -> Result<AttentionMode> {
        Ok(AttentionMode::Retrieval(Retrieval {
            index: Some(spec.parse::<IndexSpec>()?),
            follow,
            policy: POLICY,
            ..Retrieval::default()
        }))
    }

    /// Whether `a` and `b` are within 5% of `a`.
    fn near(a: usize, b: usize) -> bool {
        (a as f64 - b as f64).abs() <= 0.05 * a as f64
    }

    /// The corpus kept in pinned host memory answers as the resident one, behind the GPU's
    /// block caches and without them (every row read in place): the same logits but for
    /// summation order, the same answers, searches and provenance through every index, the
    /// bucket indexes routed on the GPU as the resident corpus routes them (their rows read
    /// in place), the rest searched on the CPU; questions answered together (each on a stream
    /// of its own, taking turns at the caches) as each alone; a repeated question finds its
    /// blocks in the caches. Full attention and a step larger than the caches are refused
    /// with errors that say what to do.
    fn in_host_memory(
        gpu: &LoadedModel,
        resident: &Corpus,
        store: Arc<Store>,
        ids: &[u32],
        n: usize,
    ) -> Result<()> {
        let open = |placement| -> Result<Corpus> {
            Ok(Corpus::open(store.clone(), "c", gpu.as_ref(), 1 << 30)?.with_gpu_kv(placement))
        };
        let on_host = open(GpuKv::Host {
            cache_bytes: Some(64 << 20),
        })?;
        let upload = on_host.upload_to_gpu(gpu.as_ref())?;
        ensure!(
            upload.host_bytes > 0 && upload.bytes == 0 && upload.cache_budget > 0,
            "not in host memory behind caches allocated on first use: {upload:?}"
        );
        // Routed on the GPU, a question allocates none of the corpus's block caches: it reads
        // its visited buckets through caches of its own (gone with it), which keep what its
        // earlier steps copied in.
        ask(gpu, &on_host, retrieval("ivf16,np4,norope,all", None)?)?;
        let routed = on_host.gpu_footprint();
        println!("bucket caches of a routed question: {:?}", routed.cache);
        ensure!(
            routed.gpu_bytes == 0 && routed.routing_bytes > 0,
            "a question routed on the GPU allocated block caches, or no partition: {routed:?}"
        );
        ensure!(
            routed.cache.hits > 0 && routed.cache.bytes_copied > 0,
            "a routed question's later steps found no bucket its earlier ones visited: {routed:?}"
        );
        let in_place = open(GpuKv::Host {
            cache_bytes: Some(0),
        })?;
        let bare = in_place.upload_to_gpu(gpu.as_ref())?;
        ensure!(
            bare.host_bytes == upload.host_bytes && bare.bytes == 0 && bare.cache_budget == 0,
            "a corpus without caches holds {bare:?}"
        );
        let score = |corpus: &Corpus, mode| corpus.score(gpu.as_ref(), ids, mode);
        let everything = retrieval("flat", Some(n))?;
        let err = relative_max_error(
            &score(&on_host, everything.clone())?,
            &score(resident, everything)?,
        )?;
        println!("host memory, every token selected, against resident: {err:.2e}");
        ensure!(
            err < SAME_KEYS,
            "every token selected from host memory: {err}"
        );
        // Searched on the CPU, the question took every layer's cache.
        let searched = on_host.gpu_footprint();
        ensure!(
            searched.gpu_bytes == searched.cache_bytes
                && searched.cache_bytes == upload.cache_budget,
            "the caches were not allocated by a question searched on the CPU: {searched:?}"
        );
        let placements = [(&on_host, "behind caches"), (&in_place, "in place")];
        for ((corpus, placement), index) in placements
            .iter()
            .flat_map(|p| SAME_ANSWER.iter().chain(ANSWERS).map(move |i| (p, i)))
        {
            let spec = format!("{index} ({placement})");
            let (h, r) = (
                ask(gpu, corpus, retrieval(index, None)?)?,
                ask(gpu, resident, retrieval(index, None)?)?,
            );
            let (hs, rs) = (
                h.retrieval.clone().unwrap_or_default(),
                r.retrieval.clone().unwrap_or_default(),
            );
            println!(
                "{spec} from host memory: {:?} ({:.3} selected), resident {:?}",
                h.answer,
                hs.selectivity(),
                r.answer
            );
            ensure!(
                h.tokens == r.tokens,
                "{spec}: host memory answers differently"
            );
            ensure!(
                (hs.searches, hs.eligible) == (rs.searches, rs.eligible),
                "{spec}: searches counted differently: host {hs:?}, resident {rs:?}"
            );
            ensure!(
                (hs.transfer_seconds > 0.0) == (rs.transfer_seconds > 0.0),
                "{spec}: searched elsewhere than on the resident corpus: host {hs:?}, resident {rs:?}"
            );
            ensure!(
                !h.provenance.passages.is_empty()
                    && h.provenance.documents.first().map(|d| d.number)
                        == r.provenance.documents.first().map(|d| d.number),
                "{spec}: provenance ranks another document first: host {:?}, resident {:?}",
                top_documents(&h),
                top_documents(&r)
            );
        }
        together_as_alone(gpu, &on_host, retrieval("flat", None)?)?;
        // Following, the selection is weighed in the block cache's rows (a routed index's
        // buckets and followed ids are read in place).
        for spec in FOLLOWED {
            let (h, r) = (
                ask(gpu, &on_host, following(spec, 4)?)?,
                ask(gpu, resident, following(spec, 4)?)?,
            );
            let (hs, rs) = (
                h.retrieval.clone().unwrap_or_default(),
                r.retrieval.clone().unwrap_or_default(),
            );
            println!(
                "{spec} following 4 from host memory: {:?} ({} selected), resident {:?} ({})",
                h.answer, hs.selected, r.answer, rs.selected
            );
            ensure!(
                h.tokens == r.tokens && near(rs.selected, hs.selected),
                "{spec} following 4: host memory answers differently"
            );
        }
        let before = on_host.gpu_footprint().cache;
        ask(gpu, &on_host, retrieval("flat", None)?)?;
        let after = on_host.gpu_footprint().cache;
        println!("block caches: {after:?}");
        ensure!(
            after.hits > before.hits && after.misses == before.misses,
            "a repeated question missed blocks: before {before:?}, after {after:?}"
        );
        refused(
            ask(gpu, &on_host, AttentionMode::Full),
            |e| matches!(e, kvdb::Error::FullAttentionFromHost { .. }),
            "full attention from host memory",
        )?;
        // Caches of a 64th of each layer's rows: every token selected does not fit.
        let small = open(GpuKv::Host {
            cache_bytes: Some(upload.host_bytes / 64),
        })?;
        refused(
            ask(gpu, &small, retrieval("flat", Some(n))?),
            |e| matches!(e, kvdb::Error::GpuCacheTooSmall { .. }),
            "a step larger than the caches",
        )
    }

    /// Checks that a question failed with the error `expected` accepts.
    fn refused(
        asked: Result<Answer>,
        expected: fn(&kvdb::Error) -> bool,
        what: &str,
    ) -> Result<()> {
        match asked {
            Err(e) if e.downcast_ref::<kvdb::Error>().is_some_and(expected) => Ok(()),
            other => anyhow::bail!(
                "{what}: not refused as expected: {:?}",
                other.map(|a| a.answer)
            ),
        }
    }

    /// The documents of the top passages of an answer's provenance.
    fn top_documents(answer: &Answer) -> Vec<usize> {
        answer
            .provenance
            .passages
            .iter()
            .map(|p| p.document)
            .collect()
    }

    /// A corpus whose first retrieval layer is on the GPU and the second in pinned host
    /// memory (`GpuKv::Split`, on a tiny llama: both layers retrieve) answers as the resident
    /// one: the same logits with every token selected but for summation order, the same
    /// answers through an index searched on the CPU and one routed on the GPU; full
    /// attention is refused.
    #[test]
    fn split_layers_answer_as_resident() -> Result<()> {
        let test = "split_layers_answer_as_resident";
        let file = kvdb_tests::TinyModel {
            context_length: 32768,
            ..kvdb_tests::TinyModel::llama()
        }
        .write_temp()?;
        let load = |device| kvdb::load_model(Some(file.path()), &Default::default(), device);
        let gpu = match load(ComputeDevice::Cuda { ordinal: 0 }) {
            Ok(loaded) => loaded,
            Err(e) => {
                skip(test, &e.to_string());
                return Ok(());
            }
        };
        let cpu = load(ComputeDevice::Cpu)?;
        let dir = tempfile::tempdir()?;
        let docs = read_documents(&write_documents(&dir.path().join("docs"), 3, 1500, 5)?)?;
        let store = Arc::new(Store::open(dir.path().join("s"), Access::Write)?);
        ingest(&store, "c", cpu.as_ref(), &docs, &mut |_| {})?;
        let specs = ["flat", "ivf16,np4,norope,all"];
        let parsed = specs
            .iter()
            .map(|s| s.parse::<IndexSpec>())
            .collect::<Result<Vec<_>, _>>()?;
        kvdb::update_indexes(&store, "c", cpu.as_ref(), &parsed, None, &mut |_| {})?;
        let open = |placement| -> Result<Corpus> {
            Ok(Corpus::open(store.clone(), "c", gpu.as_ref(), 1 << 30)?.with_gpu_kv(placement))
        };
        let resident = open(GpuKv::Resident)?;
        let all = resident.upload_to_gpu(gpu.as_ref())?;
        let split = open(GpuKv::Split {
            gpu_bytes: all.bytes / 2,
        })?;
        let halves = split.upload_to_gpu(gpu.as_ref())?;
        println!("resident {all:?}, split {halves:?}");
        ensure!(
            halves.bytes == all.bytes / 2
                && halves.cache_bytes == 0
                && halves.cache_budget > 0
                && halves.host_bytes >= all.bytes / 2,
            "not one layer on the GPU and one in host memory: {halves:?} (all {all:?})"
        );
        let n = resident.manifest().tokens;
        let ids = gpu.tokenizer.encode(
            "the old town by the river was quiet",
            EncodeOptions {
                add_bos: false,
                add_eos: false,
                parse_special: false,
            },
        )?;
        let everything = retrieval("flat", Some(n))?;
        let score = |corpus: &Corpus| corpus.score(gpu.as_ref(), &ids, everything.clone());
        let err = relative_max_error(&score(&split)?, &score(&resident)?)?;
        println!("split, every token selected, against resident: {err:.2e}");
        ensure!(err < SAME_KEYS, "every token selected, split: {err}");
        for spec in specs {
            let (s, r) = (
                ask(&gpu, &split, retrieval(spec, None)?)?,
                ask(&gpu, &resident, retrieval(spec, None)?)?,
            );
            println!("{spec} split: {:?}, resident {:?}", s.answer, r.answer);
            ensure!(s.tokens == r.tokens, "{spec}: split answers differently");
        }
        refused(
            ask(&gpu, &split, AttentionMode::Full),
            |e| matches!(e, kvdb::Error::FullAttentionFromHost { .. }),
            "full attention with a layer in host memory",
        )
    }

    #[test]
    fn gpu_answers_match_cpu_and_full_attention() -> Result<()> {
        let test = "gpu_answers_match_cpu_and_full_attention";
        let (_gpu_file, gpu) = match tiny_on(ComputeDevice::Cuda { ordinal: 0 }) {
            Ok(loaded) => loaded,
            Err(e) => {
                skip(test, &e.to_string());
                return Ok(());
            }
        };
        // The same file's bytes: the corpus's model record matches both.
        let (_cpu_file, cpu) = tiny()?;
        ensure!(cpu.record == gpu.record, "the tiny models differ");
        let dir = tempfile::tempdir()?;
        let docs = read_documents(&write_documents(&dir.path().join("docs"), 4, 1500, 11)?)?;
        let store = Arc::new(Store::open(dir.path().join("s"), Access::Write)?);
        ingest(&store, "c", cpu.as_ref(), &docs, &mut |_| {})?;
        let text: String = docs.iter().map(|d| d.text.as_str()).collect();
        let artifact = dir.path().join("tiny.saap");
        // No drills: the tiny corpus is all the training text there is.
        let training = SaapTraining {
            options: kvdb::TrainOptions {
                centroids: 16,
                seed: 3,
                ..Default::default()
            },
            tokens: 32_768,
            drills: 0,
        };
        train_artifact(&cpu, &text, &training, &mut |_| {})?.write(&artifact)?;
        let specs = SAME_ANSWER
            .iter()
            .chain(ANSWERS)
            .map(|s| s.parse::<IndexSpec>())
            .collect::<Result<Vec<_>, _>>()?;
        kvdb::update_indexes(
            &store,
            "c",
            cpu.as_ref(),
            &specs,
            Some(&artifact),
            &mut |_| {},
        )?;
        let on_cpu = Corpus::open(store.clone(), "c", cpu.as_ref(), 1 << 30)?;
        let on_gpu =
            Corpus::open(store.clone(), "c", gpu.as_ref(), 1 << 30)?.with_gpu_kv(GpuKv::Resident);
        let n = on_cpu.manifest().tokens;
        println!("corpus of {n} tokens");

        // Logits of a text after the corpus: every token selected on the GPU is GPU full
        // attention but for summation order; the GPU's retrieval is the CPU's but for bf16.
        let ids = gpu.tokenizer.encode(
            "the old town by the river was quiet and the stone bridge stood over the water",
            EncodeOptions {
                add_bos: false,
                add_eos: false,
                parse_special: false,
            },
        )?;
        let score =
            |model: &LoadedModel, corpus: &Corpus, mode| corpus.score(model.as_ref(), &ids, mode);
        let gpu_full = score(&gpu, &on_gpu, AttentionMode::Full)?;
        let gpu_everything = score(&gpu, &on_gpu, retrieval("flat", Some(n))?)?;
        let err = relative_max_error(&gpu_everything, &gpu_full)?;
        println!("GPU, every token selected against GPU full attention: {err:.2e}");
        ensure!(err < SAME_KEYS, "every token selected: {err}");
        let cpu_full = score(&cpu, &on_cpu, AttentionMode::Full)?;
        let err = relative_max_error(&gpu_full, &cpu_full)?;
        println!("full attention, GPU (bf16) against CPU (f32): {err:.2e}");
        ensure!(err < DEVICES, "full attention across devices: {err}");
        for spec in SAME_ANSWER {
            let mode = || retrieval(spec, None);
            let err = relative_max_error(
                &score(&gpu, &on_gpu, mode()?)?,
                &score(&cpu, &on_cpu, mode()?)?,
            )?;
            println!("{spec}, GPU against CPU: {err:.2e}");
            ensure!(err < DEVICES, "{spec} across devices: {err}");
        }

        // Every token selected on the GPU is GPU full attention.
        let full = ask(&gpu, &on_gpu, AttentionMode::Full)?;
        let everything = ask(&gpu, &on_gpu, retrieval("flat", Some(n))?)?;
        println!("GPU full attention: {:?}", full.answer);
        ensure!(
            everything.tokens == full.tokens,
            "every token selected {:?} against full attention {:?}",
            everything.answer,
            full.answer
        );
        let stats = everything.retrieval.clone().unwrap_or_default();
        ensure!(
            stats.selected == stats.eligible && stats.eligible > 0,
            "not every token selected: {stats:?}"
        );
        let footprint = on_gpu.gpu_footprint();
        ensure!(
            footprint.gpu_bytes > 0 && footprint.host_bytes == 0,
            "the corpus's rows are not on the GPU: {footprint:?}"
        );
        let cpu_full = ask(&cpu, &on_cpu, AttentionMode::Full)?;
        println!("CPU full attention: {:?}", cpu_full.answer);
        ensure!(
            cpu_full.tokens == full.tokens,
            "full attention differs across devices"
        );

        for spec in SAME_ANSWER {
            let (c, g) = (
                ask(&cpu, &on_cpu, retrieval(spec, None)?)?,
                ask(&gpu, &on_gpu, retrieval(spec, None)?)?,
            );
            let share = |a: &Answer| a.retrieval.as_ref().map_or(0.0, |s| s.selectivity());
            println!(
                "{spec}: CPU {:?} ({:.3} selected), GPU {:?} ({:.3} selected), top passages \
                 CPU {:?} GPU {:?}",
                c.answer,
                share(&c),
                g.answer,
                share(&g),
                top_documents(&c),
                top_documents(&g)
            );
            ensure!(
                c.tokens == g.tokens,
                "{spec}: the devices answer differently"
            );
            // Both devices (the GPU's routing included) count the same searches over the
            // same eligible keys; what they score and select may differ only where the
            // devices' queries (bf16 weights against f32) rank two buckets or keys apart.
            let (cs, gs) = (
                c.retrieval.clone().unwrap_or_default(),
                g.retrieval.clone().unwrap_or_default(),
            );
            ensure!(
                (cs.searches, cs.eligible) == (gs.searches, gs.eligible),
                "{spec}: searches counted differently: CPU {cs:?}, GPU {gs:?}"
            );
            // Routed on the GPU: no query goes to the host.
            let routed = spec.ends_with("norope,all") || spec.starts_with("saap");
            ensure!(
                (gs.transfer_seconds == 0.0) == routed,
                "{spec}: routed on the GPU {routed}, queries copied to the host for {} s",
                gs.transfer_seconds
            );
            ensure!(
                near(cs.scored, gs.scored) && near(cs.selected, gs.selected),
                "{spec}: CPU scored {} and selected {}, GPU {} and {}",
                cs.scored,
                cs.selected,
                gs.scored,
                gs.selected
            );
            ensure!(
                !g.provenance.passages.is_empty()
                    && g.provenance.documents.first().map(|d| d.number)
                        == c.provenance.documents.first().map(|d| d.number),
                "{spec}: provenance ranks another document first"
            );
        }
        together_as_alone(&gpu, &on_gpu, AttentionMode::Full)?;
        for spec in SAME_ANSWER {
            together_as_alone(&gpu, &on_gpu, retrieval(spec, None)?)?;
        }
        // Questions that follow, routed on the GPU and answered together: each ranks what it
        // follows on its own stream. The first makes the routed partition's map of every
        // row's bucket (4 bytes a row and KV head in each retrieval layer), which the
        // footprint counts beside the partition's centroids and lists.
        let before = on_gpu.gpu_footprint().routing_bytes;
        together_as_alone(&gpu, &on_gpu, following("ivf16,np4,norope,all", 4)?)?;
        let after = on_gpu.gpu_footprint().routing_bytes;
        let manifest = on_gpu.manifest();
        let layers = manifest
            .layers
            .iter()
            .filter(|l| matches!(l, LayerPolicy::All));
        let rows = manifest.tokens;
        let map = layers.count() * manifest.model.n_kv_heads * rows * size_of::<u32>();
        ensure!(
            before > 0 && after == before + map,
            "routing footprint {before} bytes before following, {after} after, want {map} more"
        );
        for spec in ANSWERS {
            let g = ask(&gpu, &on_gpu, retrieval(spec, None)?)?;
            let stats = g.retrieval.clone().unwrap_or_default();
            println!(
                "{spec}: GPU {:?}, {:.3} selected",
                g.answer,
                stats.selectivity()
            );
            ensure!(stats.searches > 0, "{spec}: nothing searched");
            ensure!(!g.provenance.passages.is_empty(), "{spec}: no provenance");
        }
        // Following the most attended tokens: the GPU weighs each step's selection and the
        // next search adds the successors of the most attended, as the CPU does (a routed
        // index ranks them and attends them on the GPU, with no query copied to the host),
        // so both answer alike and select as many keys, more than without following.
        for spec in FOLLOWED {
            let (c, g, plain) = (
                ask(&cpu, &on_cpu, following(spec, 4)?)?,
                ask(&gpu, &on_gpu, following(spec, 4)?)?,
                ask(&gpu, &on_gpu, following(spec, 0)?)?,
            );
            let (cs, gs, ps) = (
                c.retrieval.clone().unwrap_or_default(),
                g.retrieval.clone().unwrap_or_default(),
                plain.retrieval.clone().unwrap_or_default(),
            );
            println!(
                "{spec} following 4: CPU {:?} ({} selected), GPU {:?} ({} selected; {} without \
                 following)",
                c.answer, cs.selected, g.answer, gs.selected, ps.selected
            );
            ensure!(
                c.tokens == g.tokens,
                "{spec} following 4: the devices answer differently"
            );
            ensure!(
                near(cs.selected, gs.selected) && gs.selected > ps.selected,
                "{spec} following 4: GPU selected {}, CPU {}, GPU without following {}",
                gs.selected,
                cs.selected,
                ps.selected
            );
            let routed = spec.ends_with("norope,all");
            ensure!(
                (gs.transfer_seconds > 0.0) != routed,
                "{spec} following 4: {} s copying queries to the host (routed on the GPU: {routed})",
                gs.transfer_seconds
            );
        }
        in_host_memory(&gpu, &on_gpu, store, &ids, n)?;
        // What the GPU path lacks says so.
        let estimating = Retrieval {
            index: Some("ivf16,np4".parse()?),
            estimate: true,
            policy: POLICY,
            ..Retrieval::default()
        };
        refused(
            ask(&gpu, &on_gpu, AttentionMode::Retrieval(estimating)),
            |e| matches!(e, kvdb::Error::NotOnGpu { .. }),
            "estimation on the GPU",
        )
    }
}
