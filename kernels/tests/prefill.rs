//! `prefill_attention` against a direct f64 reference on the host, on fresh random inputs
//! (the seed is printed): f32 (the exact kernel), f16 and bf16 (the tensor-core kernels: on
//! a Hopper GPU both the Hopper kernel and the mma.sync kernel, each tested alone).
//!
//! Every test needs a GPU: on a machine without one (CI), or built without feature `gpu`,
//! each says on stderr that it skipped, and passes.
//!
//! Tolerances, relative L2 error of the whole output against f64 on the inputs as rounded
//! to their type (so the inputs' own rounding is not counted):
//! - f32: 1e-5. f32 sums and the fast-math exponential (about 2e-6 relative at the
//!   exponents met here).
//! - f16: 2e-3, bf16: 8e-3. The tensor-core kernel rounds the softmax weights P to the
//!   input type before P·V: each weight off by up to half an ulp (2^-11 in f16, 2^-9 in
//!   bf16), a relative L2 error of about u/√3 ≈ 3e-4 (f16) and 1.1e-3 (bf16) on flat
//!   attention. An output of a 16-bit type adds its type's tolerance.
//!
//! Measured on an H100, three runs (fresh seeds), worst over every case of each test: f32
//! 1.5e-6; f16 2.6e-4 (output f32), 1.7e-3 (output bf16); bf16 2.2e-3 (output f32), 2.0e-3
//! (output bf16); chunked against the reference f16 1.5e-4, bf16 1.2e-3. The margins are
//! 3.6 (bf16) to 7.7 (f16) times that.

use std::io::Write;

/// Says something on stderr itself: libtest captures `eprintln!`, not this.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

mod common;

#[cfg(not(feature = "gpu"))]
#[test]
fn prefill_tests() {
    say("SKIPPED prefill_tests: built without feature `gpu`");
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use super::common::start;
    use anyhow::{ensure, Context, Result};
    use half::{bf16, f16};
    use kvdb_kernels::cudarc::driver::CudaSlice;
    use kvdb_kernels::{
        dense_attention, prefill_attention, Causal, Dense, Float, Gpu, KernelError, KvCache,
        KvElement, Query, Workspace,
    };
    use rand::rngs::StdRng;
    use rand::Rng;

    use super::say;

    /// Relative L2 error allowed for input type `A` (see the file's doc).
    fn tolerance<A: Float>() -> f64 {
        match A::NAME {
            "float" => 1e-5,
            "__half" => 2e-3,
            _ => 8e-3,
        }
    }

    /// One call's shape and mask.
    #[derive(Debug, Clone, Copy)]
    struct Case {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        tokens: usize,
        first_position: usize,
        window: Option<usize>,
        /// Rows per KV head of the buffer.
        capacity: usize,
    }

    impl Case {
        fn end(&self) -> usize {
            self.first_position + self.tokens
        }

        fn mask(&self) -> Causal {
            Causal {
                first_position: self.first_position,
                window: self.window,
            }
        }
    }

    /// A sequence's random keys and values for positions `0..end` (`[end, kv_heads,
    /// head_dim]`) and one chunk's queries (`[tokens, heads, head_dim]`), rounded to `A`.
    struct Inputs<A> {
        keys: Vec<A>,
        values: Vec<A>,
        queries: Vec<A>,
        scale: f32,
    }

    fn random<A: Float>(rng: &mut StdRng, len: usize, amplitude: f32) -> Vec<A> {
        (0..len)
            .map(|_| A::from_f32(rng.random_range(-amplitude..amplitude)))
            .collect()
    }

    impl<A: Float> Inputs<A> {
        fn new(rng: &mut StdRng, case: &Case) -> Self {
            let kv = case.end() * case.kv_heads * case.head_dim;
            // Queries of varied size, so that some runs' attention is sharp and some flat.
            let amplitude = rng.random_range(0.5..6.0);
            Self {
                keys: random(rng, kv, 1.0),
                values: random(rng, kv, 1.0),
                queries: random(rng, case.tokens * case.heads * case.head_dim, amplitude),
                scale: 1.0 / (case.head_dim as f32).sqrt(),
            }
        }

        /// A buffer of `case.capacity` rows holding the last positions up to `end` (all of
        /// them when they fit), rows past `end` full of NaN, which no query may read.
        fn buffer(&self, gpu: &Gpu, case: &Case) -> Result<KvCache<A>> {
            let (row, cap) = (case.kv_heads * case.head_dim, case.capacity);
            let mut kv = KvCache::zeros(gpu, case.kv_heads, cap, case.head_dim)?;
            let nan = vec![A::from_f32(f32::NAN); cap * row];
            kv.write_positions(gpu, 0, &nan, &nan)?;
            let first = case.end().saturating_sub(cap);
            let (from, to) = (first * row, case.end() * row);
            kv.write_positions(gpu, first, &self.keys[from..to], &self.values[from..to])?;
            Ok(kv)
        }

        /// The exact attention of the chunk's queries, `[tokens, heads, head_dim]`.
        fn reference(&self, case: &Case) -> Vec<f64> {
            let (d, group) = (case.head_dim, case.heads / case.kv_heads);
            let f = |x: &A| f64::from(x.to_f32());
            let mut out = vec![0.0; self.queries.len()];
            let mut scores = Vec::new();
            for i in 0..case.tokens {
                let p = case.first_position + i;
                let low = case.window.map_or(0, |w| (p + 1).saturating_sub(w));
                for qh in 0..case.heads {
                    let kvh = qh / group;
                    let q = &self.queries[(i * case.heads + qh) * d..][..d];
                    let at = |pos: usize| (pos * case.kv_heads + kvh) * d;
                    scores.clear();
                    scores.extend((low..=p).map(|pos| {
                        let k = &self.keys[at(pos)..][..d];
                        let dot: f64 = q.iter().zip(k).map(|(a, b)| f(a) * f(b)).sum();
                        dot * f64::from(self.scale)
                    }));
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let mut sum = 0.0;
                    let o = &mut out[(i * case.heads + qh) * d..][..d];
                    for (pos, s) in (low..=p).zip(&scores) {
                        let e = (s - max).exp();
                        sum += e;
                        for (o, v) in o.iter_mut().zip(&self.values[at(pos)..][..d]) {
                            *o += e * f(v);
                        }
                    }
                    o.iter_mut().for_each(|o| *o /= sum);
                }
            }
            out
        }
    }

    /// Runs the kernel on a NaN-poisoned output and downloads it, checking that every
    /// element was written.
    fn run<A: Float, O: Float>(
        gpu: &Gpu,
        case: &Case,
        queries: &CudaSlice<A>,
        kv: &KvCache<A>,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let mut out: CudaSlice<O> = gpu.upload(&vec![O::from_f32(f32::NAN); queries.len()])?;
        prefill_attention(
            gpu,
            &queries.as_view(),
            case.heads,
            kv,
            &case.mask(),
            scale,
            &mut out.as_view_mut(),
        )?;
        let got: Vec<f32> = gpu.download(&out)?.iter().map(|x| x.to_f32()).collect();
        let unwritten = got.iter().filter(|x| !x.is_finite()).count();
        ensure!(
            unwritten == 0,
            "{unwritten} of {} outputs not finite",
            got.len()
        );
        Ok(got)
    }

    fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
        let diff: f64 = got
            .iter()
            .zip(want)
            .map(|(g, w)| (f64::from(*g) - w).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|w| w * w).sum();
        (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
    }

    /// Worst error seen per input type, printed at the end of a test.
    #[derive(Default)]
    struct Worst(Vec<(&'static str, f64, String)>);

    impl Worst {
        fn check(&mut self, name: &'static str, what: String, error: f64, tol: f64) -> Result<()> {
            ensure!(
                error <= tol,
                "{name} {what}: rel L2 {error:.3e} > {tol:.0e}"
            );
            match self.0.iter_mut().find(|(n, _, _)| *n == name) {
                Some(worst) if worst.1 < error => *worst = (name, error, what),
                Some(_) => {}
                None => self.0.push((name, error, what)),
            }
            Ok(())
        }

        fn print(&self, test: &str) {
            for (name, error, what) in &self.0 {
                say(&format!(
                    "{test}: worst {name} rel L2 {error:.2e} at {what}"
                ));
            }
        }
    }

    /// One case: random inputs, the kernel with output type `O`, the reference.
    fn case<A: Float, O: Float>(
        gpu: &Gpu,
        rng: &mut StdRng,
        case: &Case,
        worst: &mut Worst,
    ) -> Result<()> {
        let inputs = Inputs::<A>::new(rng, case);
        let kv = inputs.buffer(gpu, case)?;
        let queries = gpu.upload(&inputs.queries)?;
        let got = run::<A, O>(gpu, case, &queries, &kv, inputs.scale)
            .with_context(|| format!("{} -> {}: {case:?}", A::NAME, O::NAME))?;
        let error = rel_l2(&got, &inputs.reference(case));
        // An output of a 16-bit type adds its own rounding.
        let tol = tolerance::<A>()
            + if O::NAME == "float" {
                0.0
            } else {
                tolerance::<O>()
            };
        worst.check(A::NAME, format!("-> {} {case:?}", O::NAME), error, tol)
    }

    /// The masks every shape is tried with: (tokens, first_position, window, capacity).
    /// Token counts are not multiples of the tiles; capacities past the end hold NaN rows.
    const MASKS: [(usize, Option<usize>, usize, usize); 6] = [
        // Global, a whole sequence from position 0.
        (200, None, 0, 200),
        // Global, a chunk after a prefix of 150, in a buffer longer than the sequence.
        (77, None, 150, 300),
        // A window shorter than the chunk.
        (200, Some(50), 0, 256),
        // A ring: capacity window + tokens - 1, positions far past it.
        (77, Some(64), 500, 64 + 77 - 1),
        // A decode step over a 1024-key window in a ring.
        (1, Some(1024), 3000, 1024),
        // A global decode step.
        (1, None, 700, 701),
    ];

    /// (query heads, KV heads): GQA groups 1, 4, 8 and 2 query heads over 1 KV head.
    const HEADS: [(usize, usize); 4] = [(2, 2), (8, 2), (8, 1), (2, 1)];

    const HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];

    fn every_case<A: Float>(gpu: &Gpu, rng: &mut StdRng, worst: &mut Worst) -> Result<()> {
        for head_dim in HEAD_DIMS {
            for (heads, kv_heads) in HEADS {
                for (tokens, window, first_position, capacity) in MASKS {
                    let c = Case {
                        heads,
                        kv_heads,
                        head_dim,
                        tokens,
                        first_position,
                        window,
                        capacity,
                    };
                    case::<A, f32>(gpu, rng, &c, worst)?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn f32_matches_reference() -> Result<()> {
        let test = "f32_matches_reference";
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        let mut worst = Worst::default();
        every_case::<f32>(&gpu, &mut rng, &mut worst)?;
        // Head dims the tensor-core kernel does not take.
        for head_dim in [8, 24, 100] {
            let c = Case {
                heads: 4,
                kv_heads: 2,
                head_dim,
                tokens: 50,
                first_position: 10,
                window: Some(20),
                capacity: 60,
            };
            case::<f32, f32>(&gpu, &mut rng, &c, &mut worst)?;
        }
        worst.print(test);
        Ok(())
    }

    #[test]
    fn f16_matches_reference() -> Result<()> {
        let test = "f16_matches_reference";
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        for (kernel, gpu) in gpu.kernel_sets()? {
            let mut worst = Worst::default();
            every_case::<f16>(&gpu, &mut rng, &mut worst)?;
            worst.print(&format!("{test} [{kernel}]"));
        }
        Ok(())
    }

    #[test]
    fn bf16_matches_reference() -> Result<()> {
        let test = "bf16_matches_reference";
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        for (kernel, gpu) in gpu.kernel_sets()? {
            let mut worst = Worst::default();
            every_case::<bf16>(&gpu, &mut rng, &mut worst)?;
            worst.print(&format!("{test} [{kernel}]"));
        }
        Ok(())
    }

    /// Every output type, and a longer sequence (several key tiles past the diagonal, more
    /// query blocks than one wave would need to cover).
    #[test]
    fn output_types_and_longer_sequences() -> Result<()> {
        let test = "output_types_and_longer_sequences";
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        let c = |head_dim, tokens, window| Case {
            heads: 8,
            kv_heads: 2,
            head_dim,
            tokens,
            first_position: 0,
            window,
            capacity: tokens,
        };
        for (kernel, gpu) in gpu.kernel_sets()? {
            let mut worst = Worst::default();
            for d in [64, 128, 256] {
                case::<f16, bf16>(&gpu, &mut rng, &c(d, 300, None), &mut worst)?;
                case::<f16, f16>(&gpu, &mut rng, &c(d, 300, Some(100)), &mut worst)?;
                case::<bf16, bf16>(&gpu, &mut rng, &c(d, 300, None), &mut worst)?;
                case::<bf16, f16>(&gpu, &mut rng, &c(d, 300, Some(100)), &mut worst)?;
                case::<f32, bf16>(&gpu, &mut rng, &c(d, 100, None), &mut worst)?;
                case::<f16, f32>(&gpu, &mut rng, &c(d, 1500, None), &mut worst)?;
                case::<bf16, f32>(&gpu, &mut rng, &c(d, 1500, Some(512)), &mut worst)?;
            }
            worst.print(&format!("{test} [{kernel}]"));
        }
        Ok(())
    }

    /// The model's flow: chunks of a sequence, each appending its keys to the buffer (a
    /// ring for a window) and attending to it, agree with one call over the whole sequence
    /// and with the reference.
    fn chunked<A: Float>(gpu: &Gpu, rng: &mut StdRng, worst: &mut Worst) -> Result<()> {
        let (heads, kv_heads, head_dim, total, chunk) = (8, 2, 128, 700, 256);
        for window in [None, Some(300)] {
            let whole = Case {
                heads,
                kv_heads,
                head_dim,
                tokens: total,
                first_position: 0,
                window,
                capacity: total,
            };
            let inputs = Inputs::<A>::new(rng, &whole);
            let want = inputs.reference(&whole);
            let queries = gpu.upload(&inputs.queries)?;
            let one_shot = run::<A, f32>(
                gpu,
                &whole,
                &queries,
                &inputs.buffer(gpu, &whole)?,
                inputs.scale,
            )?;
            let capacity = window.map_or(total, |w| w + chunk - 1);
            let mut kv = KvCache::<A>::zeros(gpu, kv_heads, capacity, head_dim)?;
            let (row, qrow) = (kv_heads * head_dim, heads * head_dim);
            let mut chunks = Vec::new();
            for start in (0..total).step_by(chunk) {
                let end = (start + chunk).min(total);
                let (from, to) = (start * row, end * row);
                kv.write_positions(gpu, start, &inputs.keys[from..to], &inputs.values[from..to])?;
                let part = Case {
                    tokens: end - start,
                    first_position: start,
                    capacity,
                    ..whole
                };
                let q = gpu.upload(&inputs.queries[start * qrow..end * qrow])?;
                chunks.extend(run::<A, f32>(gpu, &part, &q, &kv, inputs.scale)?);
            }
            let what = |how| format!("{how} {whole:?}");
            worst.check(
                A::NAME,
                what("one shot"),
                rel_l2(&one_shot, &want),
                tolerance::<A>(),
            )?;
            worst.check(
                A::NAME,
                what("chunked"),
                rel_l2(&chunks, &want),
                tolerance::<A>(),
            )?;
        }
        Ok(())
    }

    #[test]
    fn chunked_prefill_matches_one_shot() -> Result<()> {
        let test = "chunked_prefill_matches_one_shot";
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        for (kernel, gpu) in gpu.kernel_sets()? {
            let mut worst = Worst::default();
            chunked::<f32>(&gpu, &mut rng, &mut worst)?;
            chunked::<f16>(&gpu, &mut rng, &mut worst)?;
            chunked::<bf16>(&gpu, &mut rng, &mut worst)?;
            worst.print(&format!("{test} [{kernel}]"));
        }
        Ok(())
    }

    /// A sliding-window layer's decode step as the GPU model runs it: the decode kernel
    /// (`dense_attention`, split over blocks) over the window's rows of the ring
    /// (`KvCache::rows_of`), against the f64 reference: Gemma 3's 512-token window in a ring
    /// of 512 + 4,096 rows, the window clipped at position 0, ending at the ring's last row,
    /// straddling its wrap (two runs) and wrapped many times.
    fn window_decode<A: Float + KvElement>(
        gpu: &Gpu,
        rng: &mut StdRng,
        worst: &mut Worst,
    ) -> Result<()> {
        const WINDOW: usize = 512;
        const CAPACITY: usize = WINDOW + 4096;
        let mut workspace = Workspace::new(gpu)?;
        for head_dim in [64, 128, 256] {
            for (heads, kv_heads) in [(8, 2), (8, 1), (4, 1)] {
                for position in [300, CAPACITY - 1, CAPACITY + 100, 5 * CAPACITY + 333] {
                    let c = Case {
                        heads,
                        kv_heads,
                        head_dim,
                        tokens: 1,
                        first_position: position,
                        window: Some(WINDOW),
                        capacity: CAPACITY,
                    };
                    let inputs = Inputs::<A>::new(rng, &c);
                    let kv = inputs.buffer(gpu, &c)?;
                    let queries = gpu.upload(&inputs.queries)?;
                    let runs: Vec<std::ops::Range<u32>> = kv
                        .rows_of((position + 1).saturating_sub(WINDOW)..position + 1)
                        .collect();
                    let mut out: CudaSlice<f32> =
                        gpu.upload(&vec![f32::NAN; inputs.queries.len()])?;
                    let heads_view = queries.as_view();
                    let query = Query {
                        heads: &heads_view,
                        scale: inputs.scale,
                    };
                    let dense = Dense {
                        kv: &kv,
                        runs: &runs,
                    };
                    dense_attention(gpu, &mut workspace, query, dense, &mut out.as_view_mut())?;
                    let got = gpu.download(&out)?;
                    ensure!(
                        got.iter().all(|x| x.is_finite()),
                        "{} {c:?}: outputs not written",
                        A::NAME
                    );
                    let error = rel_l2(&got, &inputs.reference(&c));
                    worst.check(
                        A::NAME,
                        format!("runs {runs:?} {c:?}"),
                        error,
                        tolerance::<A>(),
                    )?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn window_decode_over_the_ring_matches_reference() -> Result<()> {
        let test = "window_decode_over_the_ring_matches_reference";
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        let mut worst = Worst::default();
        window_decode::<f16>(&gpu, &mut rng, &mut worst)?;
        window_decode::<bf16>(&gpu, &mut rng, &mut worst)?;
        worst.print(test);
        Ok(())
    }

    fn twice<A: Float>(gpu: &Gpu, rng: &mut StdRng, c: &Case) -> Result<()> {
        let inputs = Inputs::<A>::new(rng, c);
        let kv = inputs.buffer(gpu, c)?;
        let queries = gpu.upload(&inputs.queries)?;
        let first = run::<A, f32>(gpu, c, &queries, &kv, inputs.scale)?;
        let second = run::<A, f32>(gpu, c, &queries, &kv, inputs.scale)?;
        let same = first
            .iter()
            .zip(&second)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        ensure!(same, "{} {c:?}: two runs differ", A::NAME);
        Ok(())
    }

    #[test]
    fn deterministic() -> Result<()> {
        let Some((gpu, mut rng)) = start("deterministic") else {
            return Ok(());
        };
        for (_, gpu) in gpu.kernel_sets()? {
            for head_dim in [64, 128, 256] {
                let c = Case {
                    heads: 8,
                    kv_heads: 2,
                    head_dim,
                    tokens: 1000,
                    first_position: 100,
                    window: Some(400),
                    capacity: 1100,
                };
                twice::<f16>(&gpu, &mut rng, &c)?;
                twice::<bf16>(&gpu, &mut rng, &c)?;
                twice::<f32>(&gpu, &mut rng, &Case { tokens: 200, ..c })?;
            }
        }
        Ok(())
    }

    /// One call with `case`'s buffer (zeros) and queries of `len` elements (zeros).
    fn call<A: Float>(
        gpu: &Gpu,
        case: &Case,
        len: usize,
        out_len: usize,
        scale: f32,
    ) -> Result<std::result::Result<(), KernelError>> {
        let kv = KvCache::<A>::zeros(gpu, case.kv_heads, case.capacity, case.head_dim)?;
        let queries = gpu.zeros::<A>(len)?;
        let mut out = gpu.zeros::<f32>(out_len)?;
        Ok(prefill_attention(
            gpu,
            &queries.slice(..len),
            case.heads,
            &kv,
            &case.mask(),
            scale,
            &mut out.slice_mut(..out_len),
        ))
    }

    /// The error of [`call`], which must fail.
    fn error_of<A: Float>(
        gpu: &Gpu,
        case: &Case,
        len: usize,
        out_len: usize,
        scale: f32,
    ) -> Result<KernelError> {
        call::<A>(gpu, case, len, out_len, scale)?
            .err()
            .with_context(|| format!("no error for {case:?}, {len} queries, {out_len} out"))
    }

    #[test]
    fn bad_arguments_are_errors() -> Result<()> {
        let Some((gpu, _)) = start("bad_arguments_are_errors") else {
            return Ok(());
        };
        let ok = Case {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            tokens: 10,
            first_position: 5,
            window: None,
            capacity: 15,
        };
        let n = ok.tokens * ok.heads * ok.head_dim;
        let e = error_of::<f16>(
            &gpu,
            &Case { heads: 3, ..ok },
            10 * 3 * 64,
            10 * 3 * 64,
            0.1,
        )?;
        ensure!(
            matches!(
                e,
                KernelError::Heads {
                    heads: 3,
                    kv_heads: 2
                }
            ),
            "{e}"
        );
        let e = error_of::<f16>(&gpu, &ok, n + 1, n + 1, 0.1)?;
        ensure!(matches!(e, KernelError::Length { .. }), "{e}");
        let e = error_of::<f16>(&gpu, &ok, n, n - 64, 0.1)?;
        ensure!(matches!(e, KernelError::Length { .. }), "{e}");
        for scale in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = error_of::<bf16>(&gpu, &ok, n, n, scale)?;
            ensure!(matches!(e, KernelError::Scale { .. }), "{e}");
        }
        let e = error_of::<f16>(
            &gpu,
            &Case {
                window: Some(0),
                ..ok
            },
            n,
            n,
            0.1,
        )?;
        ensure!(matches!(e, KernelError::Unsupported { .. }), "{e}");
        // Global: the prefix must fit; a window: window + tokens - 1 rows at most.
        let e = error_of::<f16>(&gpu, &Case { capacity: 14, ..ok }, n, n, 0.1)?;
        ensure!(
            matches!(
                e,
                KernelError::Evicted {
                    needed: 15,
                    capacity: 14
                }
            ),
            "{e}"
        );
        let ring = Case {
            first_position: 100,
            window: Some(8),
            capacity: 17,
            ..ok
        };
        call::<f16>(&gpu, &ring, n, n, 0.1)?.context("a ring of window + tokens - 1 rows")?;
        let e = error_of::<f32>(
            &gpu,
            &Case {
                capacity: 16,
                ..ring
            },
            n,
            n,
            0.1,
        )?;
        ensure!(
            matches!(
                e,
                KernelError::Evicted {
                    needed: 17,
                    capacity: 16
                }
            ),
            "{e}"
        );
        // Head dims: multiples of 16 up to 256 on the tensor cores, up to 256 in f32.
        for (head_dim, fast) in [(24, true), (272, true), (264, false)] {
            let c = Case { head_dim, ..ok };
            let len = c.tokens * c.heads * head_dim;
            let e = if fast {
                error_of::<f16>(&gpu, &c, len, len, 0.1)?
            } else {
                error_of::<f32>(&gpu, &c, len, len, 0.1)?
            };
            ensure!(matches!(e, KernelError::Unsupported { .. }), "{e}");
        }
        // A view of queries that does not start on 16 bytes.
        let kv = KvCache::<f16>::zeros(&gpu, ok.kv_heads, ok.capacity, ok.head_dim)?;
        let queries = gpu.zeros::<f16>(n + 4)?;
        let mut out = gpu.zeros::<f32>(n)?;
        let e = prefill_attention(
            &gpu,
            &queries.slice(4..4 + n),
            ok.heads,
            &kv,
            &ok.mask(),
            0.1,
            &mut out.as_view_mut(),
        )
        .err()
        .context("no error for misaligned queries")?;
        ensure!(matches!(e, KernelError::Misaligned { .. }), "{e}");
        Ok(())
    }
}
