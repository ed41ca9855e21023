//! The GPU forward pass (`GpuModel`, feature `gpu`) against the CPU model, on random-weight
//! GGUF models: the tiny gemma3/llama/qwen2 of the other tests and the real shapes of
//! Gemma 3 270M and Llama-3-8B (fewer layers for the 8B shape, so that the CPU side stays
//! quick; every layer has the real sizes).
//!
//! Errors are `max |gpu - cpu| / max |cpu|` over every compared logit row. Every test needs
//! a GPU: on a machine without one (CI), or built without feature `gpu`, each prints
//! `SKIPPED` on stderr and passes. `KVDB_GPU_LONG=1` also runs the Gemma shape at 32K tokens.

use std::io::Write;

/// Says that a test skipped, on stderr itself: libtest captures `eprintln!`, not this.
fn skip(test: &str, reason: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {reason}");
}

#[cfg(not(feature = "gpu"))]
#[test]
fn gpu_model_tests() {
    skip("gpu_model_tests", "built without feature `gpu`");
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use std::sync::Arc;

    use anyhow::{ensure, Result};
    use candle_core::{Device, Tensor};
    use kvdb_model::{
        greedy_token, Forward, Gpu, GpuModel, LoadOptions, Logits, Model, Pick, Picked, Precision,
        SequenceOptions, WeightMode,
    };
    use kvdb_tests::{random_tokens, relative_max_error, TinyModel};

    use super::skip;

    /// Exact mode (f32 weights, GEMMs without TF32, f32 attention) against the CPU's f32:
    /// only summation orders differ (cuBLAS's blocking, the GPU's reductions).
    const F32_TOLERANCE: f32 = 1e-4;
    /// bf16 weights and GEMM inputs, f16 keys/values/queries, against the CPU's f32: each
    /// product carries bf16's 2^-9 relative rounding of its inputs, through every layer.
    const BF16_TOLERANCE: f32 = 0.08;

    fn gpu(test: &str) -> Option<Arc<Gpu>> {
        match Gpu::new(0) {
            Ok(gpu) => Some(Arc::new(gpu)),
            Err(e) => {
                skip(test, &e.to_string());
                None
            }
        }
    }

    fn cpu_model(spec: &TinyModel) -> Result<(kvdb_tests::TinyFile, Model)> {
        let file = spec.write_temp()?;
        let options = LoadOptions {
            weights: WeightMode::Dequantized,
            ..LoadOptions::default()
        };
        let model = Model::load(file.path(), &options, &Device::Cpu)?;
        Ok((file, model))
    }

    /// The logits of every token of `tokens`, fed in calls of `chunk` tokens.
    fn logits_all(sequence: &mut dyn Forward, tokens: &[u32], chunk: usize) -> Result<Tensor> {
        let mut rows = Vec::new();
        for part in tokens.chunks(chunk) {
            if let Some(l) = sequence.forward(part, &Logits::All)? {
                rows.push(l);
            }
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    fn tiny_models() -> Vec<(&'static str, TinyModel)> {
        vec![
            ("gemma3", TinyModel::gemma3()),
            ("llama", TinyModel::llama()),
            ("qwen2", TinyModel::qwen2()),
        ]
    }

    /// One-shot prefill, chunked prefill and step-by-step decode on the GPU, each against
    /// the CPU's one-shot prefill, for one model and precision. Returns the worst error.
    fn compare(name: &str, model: &Model, gpu_model: &GpuModel, tokens: &[u32]) -> Result<f32> {
        let cpu = logits_all(
            &mut model.sequence(&SequenceOptions::default())?,
            tokens,
            tokens.len(),
        )?;
        let mut worst = 0f32;
        for chunk in [tokens.len(), 37, 1] {
            let mut sequence = gpu_model.sequence(&SequenceOptions::default())?;
            let gpu = logits_all(&mut *sequence, tokens, chunk)?;
            let e = relative_max_error(&gpu, &cpu)?;
            println!(
                "{name}: {} tokens in calls of {chunk}: {e:.3e}",
                tokens.len()
            );
            worst = worst.max(e);
        }
        Ok(worst)
    }

    #[test]
    fn tiny_models_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu("tiny_models_match_the_cpu") else {
            return Ok(());
        };
        for (name, spec) in tiny_models() {
            // Longer than the tiny gemma3's 16-token window, within the 256-token context.
            let tokens = random_tokens(200, spec.vocab, 11);
            let (_file, model) = cpu_model(&spec)?;
            for (precision, tolerance) in [
                (Precision::F32, F32_TOLERANCE),
                (Precision::Bf16, BF16_TOLERANCE),
            ] {
                let gpu_model = GpuModel::new(&model, gpu.clone(), precision)?;
                let e = compare(
                    &format!("{name} {precision:?}"),
                    &model,
                    &gpu_model,
                    &tokens,
                )?;
                ensure!(e <= tolerance, "{name} {precision:?}: {e} > {tolerance}");
            }
        }
        Ok(())
    }

    /// Greedy continuation of `prompt` for `steps` tokens, each picked on the device
    /// ([`Forward::forward_greedy`]) after the prompt's first.
    fn greedy_picked(sequence: &mut dyn Forward, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
        let logits = sequence
            .forward(prompt, &Logits::Last)?
            .ok_or_else(|| anyhow::anyhow!("no logits"))?;
        let mut out = vec![greedy_token(&logits.squeeze(0)?)?];
        while out.len() < steps {
            let next = sequence.forward_greedy(out[out.len() - 1])?;
            out.push(next);
        }
        Ok(out)
    }

    /// Greedy continuation of `prompt` for `steps` tokens.
    fn greedy(sequence: &mut dyn Forward, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut logits = sequence
            .forward(prompt, &Logits::Last)?
            .ok_or_else(|| anyhow::anyhow!("no logits"))?;
        for _ in 0..steps {
            let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
            out.push(next);
            logits = sequence
                .forward(&[next], &Logits::Last)?
                .ok_or_else(|| anyhow::anyhow!("no logits"))?;
        }
        Ok(out)
    }

    /// Sequences decoded as a batch (`GpuModel::batch_with`) give each sequence's logits as
    /// when it runs alone: six prompts of different lengths (more rows than a step has
    /// lanes, so that lanes take several rows), prefilled alone, then fed the same tokens
    /// step by step, the batch with one sequence sitting out some steps (its position
    /// stays). A twin batch fed the same steps picks greedy tokens on the GPU: each is the
    /// first batch's row's greedy choice. Both precisions; bad steps are refused.
    #[test]
    fn batched_steps_match_sequences_alone() -> Result<()> {
        let Some(gpu) = gpu("batched_steps_match_sequences_alone") else {
            return Ok(());
        };
        for (name, spec) in tiny_models() {
            let (_file, model) = cpu_model(&spec)?;
            let prompts: Vec<Vec<u32>> = [5usize, 23, 40, 9, 31, 17]
                .iter()
                .enumerate()
                .map(|(i, &n)| random_tokens(n, spec.vocab, 3 + i as u64))
                .collect();
            let sequences = prompts.len();
            let steps = random_tokens(sequences * 12, spec.vocab, 17);
            for (precision, tolerance) in [(Precision::F32, 1e-4), (Precision::Bf16, 1e-2)] {
                let gpu_model = GpuModel::new(&model, gpu.clone(), precision)?;
                let mut batch = gpu_model.batch_with((0..sequences).map(|_| None).collect())?;
                let mut twin = gpu_model.batch_with((0..sequences).map(|_| None).collect())?;
                let mut worst = 0f32;
                for (b, prompt) in prompts.iter().enumerate() {
                    batch.sequence(b)?.forward(prompt, &Logits::None)?;
                    twin.sequence(b)?.forward(prompt, &Logits::None)?;
                }
                // Sequence 1 sits out every third step.
                let mut fed: Vec<Vec<u32>> = prompts.clone();
                let mut batched: Vec<Vec<Tensor>> = vec![Vec::new(); sequences];
                for (i, tokens) in steps.chunks(sequences).enumerate() {
                    let step: Vec<(usize, u32)> = (0..sequences)
                        .filter(|&b| b != 1 || i % 3 != 2)
                        .map(|b| (b, tokens[b]))
                        .collect();
                    let Picked::Logits(logits) = batch.step(&step, Pick::Logits)?.picked else {
                        anyhow::bail!("{name}: a step asked for logits returned none");
                    };
                    ensure!(
                        logits.dims() == [step.len(), spec.vocab],
                        "{:?}",
                        logits.dims()
                    );
                    let Picked::Greedy(picked) = twin.step(&step, Pick::Greedy)?.picked else {
                        anyhow::bail!("{name}: a greedy step returned no tokens");
                    };
                    ensure!(picked.len() == step.len(), "{name}: {picked:?}");
                    for (row, &(b, id)) in step.iter().enumerate() {
                        fed[b].push(id);
                        let row_logits = logits.get(row)?;
                        ensure!(
                            picked[row] == greedy_token(&row_logits)?,
                            "{name} {precision:?}: step {i} row {row} picked {}",
                            picked[row]
                        );
                        batched[b].push(row_logits.unsqueeze(0)?);
                    }
                }
                for (b, tokens) in fed.iter().enumerate() {
                    let mut alone = gpu_model.sequence(&SequenceOptions::default())?;
                    let all = logits_all(&mut *alone, tokens, 1)?;
                    let n = batched[b].len();
                    let expected = all.narrow(0, tokens.len() - n, n)?;
                    let e = relative_max_error(&Tensor::cat(&batched[b], 0)?, &expected)?;
                    worst = worst.max(e);
                    ensure!(
                        batch.sequence(b)?.position() == tokens.len(),
                        "{name}: sequence {b} at the wrong position"
                    );
                }
                println!("{name} {precision:?}: batched steps against alone {worst:.3e}");
                ensure!(worst < tolerance, "{name} {precision:?}: {worst}");
                for bad in [
                    vec![(sequences, 1)],
                    vec![(0, 1), (0, 2)],
                    vec![(0, spec.vocab as u32)],
                ] {
                    for pick in [Pick::Logits, Pick::Greedy] {
                        ensure!(
                            batch.step(&bad, pick).is_err(),
                            "{name}: step {bad:?} was taken"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Decode steps whose layers run from CUDA graphs (the default) give the logits that
    /// launching every kernel gives: a sequence's steps past the tiny gemma3's 16-token
    /// window (its ring wraps while the graphs replay) and a batch's of two; graphs are
    /// launched from each shape's second call on (which captures them), one a layer and one
    /// more, and none when they are off. Both precisions. And kernels launched as
    /// programmatic dependent launches (the default on Hopper: each starts while the one
    /// before it finishes, and waits for it before it reads) give the same logits, bit for
    /// bit, as launches that each wait for the one before, prompts and steps, graphs or not.
    #[test]
    fn step_graphs_replay_what_launches_compute() -> Result<()> {
        let Some(gpu) = gpu("step_graphs_replay_what_launches_compute") else {
            return Ok(());
        };
        const STEPS: usize = 60;
        for (name, spec) in tiny_models() {
            let (_file, model) = cpu_model(&spec)?;
            let prompt = random_tokens(30, spec.vocab, 21);
            let steps = random_tokens(STEPS, spec.vocab, 22);
            let pieces = model.config().n_layers() + 1;
            for (precision, tolerance) in [(Precision::F32, 1e-6), (Precision::Bf16, 1e-4)] {
                let gpu_model = GpuModel::new(&model, gpu.clone(), precision)?;
                let mut runs = Vec::new();
                // Graphs and overlapped launches; plain launches; graphs of launches that
                // each wait for the one before (captured afresh by a new sequence).
                for (graphs, overlap) in [(true, true), (false, true), (true, false)] {
                    gpu_model.set_step_graphs(graphs);
                    gpu.set_programmatic_launch(overlap);
                    let before = gpu_model.step_graph_launches();
                    let mut sequence = gpu_model.sequence(&SequenceOptions::default())?;
                    sequence.forward(&prompt, &Logits::None)?;
                    let alone = logits_all(&mut *sequence, &steps, 1)?;
                    let mut batch = gpu_model.batch_with(vec![None, None])?;
                    for b in 0..2 {
                        batch
                            .sequence(b)?
                            .forward(&prompt[..20 + 5 * b], &Logits::None)?;
                    }
                    let mut batched = Vec::new();
                    for pair in steps.chunks(2) {
                        let step = [(0, pair[0]), (1, pair[1])];
                        let Picked::Logits(logits) = batch.step(&step, Pick::Logits)?.picked else {
                            anyhow::bail!("{name}: a step asked for logits returned none");
                        };
                        batched.push(logits);
                    }
                    let launched = gpu_model.step_graph_launches() - before;
                    runs.push((alone, Tensor::cat(&batched, 0)?, launched));
                }
                let [(alone, batched, on), (alone_off, batched_off, off), (alone_plain, batched_plain, _)] =
                    &runs[..]
                else {
                    anyhow::bail!("three runs");
                };
                let e = relative_max_error(alone, alone_off)?
                    .max(relative_max_error(batched, batched_off)?);
                let overlap = relative_max_error(alone, alone_plain)?
                    .max(relative_max_error(batched, batched_plain)?);
                println!(
                    "{name} {precision:?}: {on} graphs launched; graphs against launches {e:.3e}; \
                     overlapped against waiting launches {overlap:.3e}"
                );
                ensure!(
                    overlap == 0.0,
                    "{name} {precision:?}: overlapped launches changed the logits by {overlap}"
                );
                // Each shape's first call launches its kernels, the second captures its graphs.
                let expected = (STEPS - 1 + STEPS / 2 - 1) * pieces;
                ensure!(
                    *on as usize == expected,
                    "{name} {precision:?}: {on} graphs launched, {expected} expected"
                );
                ensure!(*off == 0, "{name}: {off} graphs launched while off");
                ensure!(e <= tolerance, "{name} {precision:?}: {e} > {tolerance}");
            }
        }
        gpu.set_programmatic_launch(true);
        Ok(())
    }

    #[test]
    fn greedy_generations_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu("greedy_generations_match_the_cpu") else {
            return Ok(());
        };
        for (name, spec) in tiny_models() {
            let prompt = random_tokens(40, spec.vocab, 5);
            let (_file, model) = cpu_model(&spec)?;
            let cpu = greedy(
                &mut model.sequence(&SequenceOptions::default())?,
                &prompt,
                32,
            )?;
            let gpu_model = GpuModel::new(&model, gpu.clone(), Precision::F32)?;
            let ours = greedy(
                &mut *gpu_model.sequence(&SequenceOptions::default())?,
                &prompt,
                32,
            )?;
            let picked = greedy_picked(
                &mut *gpu_model.sequence(&SequenceOptions::default())?,
                &prompt,
                32,
            )?;
            println!("{name}: cpu {cpu:?}\n{name}: gpu {ours:?}\n{name}: picked {picked:?}");
            ensure!(ours == cpu, "{name}: greedy generations differ");
            ensure!(
                picked == cpu,
                "{name}: tokens picked on the GPU differ from the CPU's greedy generation"
            );
        }
        Ok(())
    }

    /// Ingest's state: keys and values rounded to f16 and kept for the store, the sampled
    /// pre-RoPE queries as the CPU's, and a state that continues a stored prefix (preload)
    /// gives what one that computed it gives.
    #[test]
    fn stored_keys_and_preload_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu("stored_keys_and_preload_match_the_cpu") else {
            return Ok(());
        };
        let store = SequenceOptions {
            store_kv: true,
            query_sample: 16,
        };
        for (name, spec) in tiny_models() {
            let tokens = random_tokens(120, spec.vocab, 7);
            let (first, rest) = tokens.split_at(70);
            let (_file, model) = cpu_model(&spec)?;
            let gpu_model = GpuModel::new(&model, gpu.clone(), Precision::F32)?;
            let mut cpu = model.sequence(&store)?;
            let mut ours = gpu_model.sequence(&store)?;
            cpu.forward(first, &Logits::None)?;
            ours.forward(first, &Logits::None)?;
            let mut resumed = gpu_model.sequence(&store)?;
            let config = model.config();
            for layer in 0..config.n_layers() {
                let all = 0..first.len();
                let widen = |v: Vec<half::f16>| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
                let (ck, cv) = cpu
                    .take_stored(layer, all.clone())?
                    .expect("the CPU keeps them");
                let (gk, gv) = ours.take_stored(layer, all)?.expect("the GPU keeps them");
                // The sample of the queries ingest takes (positions 15, 31, 47 and 63 of 70),
                // each taken once, of global layers only.
                let (cq, gq) = (cpu.take_queries(layer)?, ours.take_queries(layer)?);
                ensure!(
                    ours.take_queries(layer)?.is_none(),
                    "layer {layer} taken twice"
                );
                let global = config.layers[layer].kind == kvdb_model::LayerKind::Global;
                let (cq, gq) = match (cq, gq) {
                    (Some(cq), Some(gq)) if global => (cq, gq),
                    (None, None) if !global => Default::default(),
                    (cq, gq) => anyhow::bail!(
                        "{name} layer {layer} (global: {global}): sampled on the CPU {}, on \
                         the GPU {}",
                        cq.is_some(),
                        gq.is_some()
                    ),
                };
                let expected = if global { vec![15, 31, 47, 63] } else { vec![] };
                ensure!(cq.positions == expected && gq.positions == expected);
                let (ck, cv, gk, gv) = (widen(ck), widen(cv), widen(gk), widen(gv));
                let (cq, gq) = (widen(cq.queries), widen(gq.queries));
                ensure!(cq.len() == expected.len() * config.n_heads * config.head_dim);
                for (what, a, b) in [
                    ("keys", &gk, &ck),
                    ("values", &gv, &cv),
                    ("queries", &gq, &cq),
                ] {
                    if b.is_empty() {
                        continue; // a sliding-window layer's queries
                    }
                    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let e = a
                        .iter()
                        .zip(b.iter())
                        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
                        / scale;
                    // One f16 step (2^-10 relative) where the f32 inputs straddle a rounding
                    // boundary; a wiring bug is of order 1.
                    ensure!(e <= 2e-3, "{name} layer {layer} {what}: {e}");
                }
                // Preload what a store would hand back: sliding-window layers their window.
                let keep = match config.layers[layer].kind {
                    kvdb_model::LayerKind::Global => first.len(),
                    kvdb_model::LayerKind::SlidingWindow { window } => window.min(first.len()),
                };
                let row = config.n_kv_heads * config.head_dim;
                let from = first.len() - keep;
                resumed.preload(
                    layer,
                    &ck[from * row..],
                    &cv[from * row..],
                    from..first.len(),
                )?;
            }
            let expected = logits_all(&mut cpu, rest, rest.len())?;
            let got = logits_all(&mut *resumed, rest, rest.len())?;
            let e = relative_max_error(&got, &expected)?;
            println!("{name}: resumed after preload: {e:.3e}");
            ensure!(e <= F32_TOLERANCE, "{name}: preload {e}");
        }
        Ok(())
    }

    /// A stored prefix preloaded as the store holds it (`preload_stored`: f16, head-major; in
    /// bf16 a global layer's rows are uploaded whole and their keys rotated on the GPU)
    /// continues as one preloaded through f32 rows (`preload`, which places them a chunk at
    /// a time) does, in both precisions, for every tiny model.
    #[test]
    fn stored_preload_continues_as_preload() -> Result<()> {
        let Some(gpu) = gpu("stored_preload_continues_as_preload") else {
            return Ok(());
        };
        for (name, spec) in tiny_models() {
            let tokens = random_tokens(150, spec.vocab, 11);
            let (first, rest) = tokens.split_at(90);
            let (_file, model) = cpu_model(&spec)?;
            let config = model.config();
            let (heads, d) = (config.n_kv_heads, config.head_dim);
            for precision in [Precision::F32, Precision::Bf16] {
                let gpu_model = GpuModel::new(&model, gpu.clone(), precision)?;
                let mut prefix = gpu_model.sequence(&SequenceOptions {
                    store_kv: true,
                    ..Default::default()
                })?;
                prefix.forward(first, &Logits::None)?;
                let mut placed = gpu_model.sequence(&SequenceOptions::default())?;
                let mut uploaded = gpu_model.sequence(&SequenceOptions::default())?;
                for layer in 0..config.n_layers() {
                    let (keys, values) = prefix
                        .take_stored(layer, 0..first.len())?
                        .expect("the state keeps them");
                    let keep = match config.layers[layer].kind {
                        kvdb_model::LayerKind::Global => first.len(),
                        kvdb_model::LayerKind::SlidingWindow { window } => window.min(first.len()),
                    };
                    let from = first.len() - keep;
                    let rows = &(from..first.len());
                    let widen = |v: &[half::f16]| -> Vec<f32> {
                        v[from * heads * d..].iter().map(|x| x.to_f32()).collect()
                    };
                    // [tokens, heads, d] to the store's [heads, tokens, d].
                    let head_major = |v: &[half::f16]| -> Vec<half::f16> {
                        (0..heads)
                            .flat_map(|h| rows.clone().map(move |t| (h, t)))
                            .flat_map(|(h, t)| &v[(t * heads + h) * d..(t * heads + h + 1) * d])
                            .copied()
                            .collect()
                    };
                    placed.preload(layer, &widen(&keys), &widen(&values), rows.clone())?;
                    uploaded.preload_stored(
                        layer,
                        &head_major(&keys),
                        &head_major(&values),
                        rows.clone(),
                    )?;
                }
                let expected = logits_all(&mut *placed, rest, rest.len())?;
                let got = logits_all(&mut *uploaded, rest, rest.len())?;
                let e = relative_max_error(&got, &expected)?;
                println!("{name} {precision:?}: stored preload against preload: {e:.3e}");
                // The same f16 rows rotated by the same formula; keys not rotated, rotated at
                // other positions or transposed are wrong at order 1.
                ensure!(e <= 1e-3, "{name} {precision:?}: stored preload {e}");
            }
        }
        Ok(())
    }

    /// The real shapes: Gemma 3 270M whole (2,048 tokens, 32K with KVDB_GPU_LONG=1) and
    /// Llama-3-8B with 2 of its 32 layers (640 tokens), exact mode and bf16.
    #[test]
    fn real_shapes_match_the_cpu() -> Result<()> {
        let Some(gpu) = gpu("real_shapes_match_the_cpu") else {
            return Ok(());
        };
        let long = std::env::var("KVDB_GPU_LONG").is_ok_and(|v| v == "1");
        let gemma_tokens = if long { 32_768 } else { 2_048 };
        let cases = [
            ("gemma3-270m", TinyModel::gemma3_270m(), gemma_tokens),
            (
                "llama3-8b (2 layers)",
                TinyModel {
                    layers: 2,
                    ..TinyModel::llama3_8b()
                },
                640,
            ),
        ];
        for (name, spec, n) in cases {
            let started = std::time::Instant::now();
            let (_file, model) = cpu_model(&spec)?;
            let tokens = random_tokens(n, spec.vocab, 3);
            // The CPU computes the last 64 rows' logits only: the vocabulary projection of
            // every row would dominate its time.
            let rows: Vec<usize> = (n - 64..n).collect();
            let cpu = model
                .sequence(&SequenceOptions::default())?
                .forward(&tokens, &Logits::Rows(rows.clone()))?
                .ok_or_else(|| anyhow::anyhow!("no logits"))?;
            println!(
                "{name}: CPU {n} tokens in {:.1}s",
                started.elapsed().as_secs_f64()
            );
            for (precision, tolerance) in [
                (Precision::F32, F32_TOLERANCE),
                (Precision::Bf16, BF16_TOLERANCE),
            ] {
                let gpu_model = GpuModel::new(&model, gpu.clone(), precision)?;
                let mut sequence = gpu_model.sequence(&SequenceOptions::default())?;
                let started = std::time::Instant::now();
                let got = sequence
                    .forward(&tokens, &Logits::Rows(rows.clone()))?
                    .ok_or_else(|| anyhow::anyhow!("no logits"))?;
                let e = relative_max_error(&got, &cpu)?;
                println!(
                    "{name} {precision:?}: {n} tokens in {:.3}s, error {e:.3e}",
                    started.elapsed().as_secs_f64()
                );
                ensure!(e <= tolerance, "{name} {precision:?}: {e} > {tolerance}");
            }
        }
        Ok(())
    }
}
