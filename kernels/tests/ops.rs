//! The forward pass's kernels (`kvdb_kernels::ops`) and matrix products (`Gemm`) against
//! plain Rust references in f64, on fresh random inputs (the seed is printed).
//!
//! Every test needs a GPU: on a machine without one (CI), or built without feature `gpu`,
//! each says on stderr that it skipped, and passes. With `--nocapture`, every comparison
//! prints its worst error and each test a `WORST` line per kernel and type.
//!
//! The error of an output is the worst over its elements of `|got − want| / (|want| + rms)`,
//! `rms` being the root mean square of the reference: a relative error for the large
//! elements and an error relative to the tensor's scale for those near zero, where
//! cancellation (RoPE, dot products) makes a relative error meaningless.

mod common;

#[cfg(not(feature = "gpu"))]
#[test]
fn ops_tests() {
    common::skip("ops_tests", "built without feature `gpu`");
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use std::collections::HashMap;

    use anyhow::{ensure, Context, Result};
    use half::{bf16, f16};
    use kvdb_kernels::cudarc::driver::{CudaSlice, CudaView};
    use kvdb_kernels::ops::{
        self, GateActivation, Norm, QkvShape, QueryRows, RopePairs, Rotary, StoreRows,
    };
    use kvdb_kernels::{Float, Gemm, Gpu, KernelError, KvCache};
    use rand::rngs::StdRng;
    use rand::Rng;

    use super::common::start;

    /// f32 arithmetic against the f64 reference: each output is a handful of f32 roundings
    /// (unit roundoff 6e-8) away, `__expf` a few ulp; measured errors are near 1e-7.
    const F32_TOL: f64 = 1e-5;
    /// One rounding of the f32 result to f16 (unit roundoff 2^-11 = 4.9e-4) on top of f32.
    const F16_TOL: f64 = 5e-4;
    /// One rounding to bf16 (unit roundoff 2^-8 = 3.9e-3) on top of f32.
    const BF16_TOL: f64 = 4e-3;
    /// Keys rounded to f16 before RoPE: each input of a pair carries up to 2^-11 of itself,
    /// so an output up to 2^-11 (|x0| + |x1|) ≤ 2^-11 · 5 rms (inputs at most 2.5 rms here),
    /// plus one more f16 rounding when the buffer is f16: 2.4e-3 + 4.9e-4.
    const ROUNDED_KEYS_TOL: f64 = 4e-3;
    /// Matrix products in f32 (no TF32): f32 accumulation over k terms, ~sqrt(k) roundings
    /// of the running sum, relative to a sum of size ~sqrt(k): near 1e-7 measured.
    const GEMM_F32_TOL: f64 = 1e-5;
    /// Matrix products of bf16/f16 inputs against the reference of the rounded inputs: the
    /// products are exact in f32 and accumulate in f32 (tensor cores), as for f32 above.
    const GEMM_HALF_TOL: f64 = 1e-4;

    /// The worst error of each kernel and type in a test, printed at its end, and the
    /// comparisons over their tolerance (all of them reported, then the test fails).
    #[derive(Default)]
    struct Worst(HashMap<String, f64>, Vec<String>);

    impl Worst {
        /// Compares `got` with `want` (see the file's doc), records the error under `family`
        /// and fails above `tolerance` or on any non-finite output (an unwritten one).
        fn check(
            &mut self,
            family: &str,
            what: &str,
            got: &[f64],
            want: &[f64],
            tolerance: f64,
        ) -> Result<()> {
            ensure!(
                got.len() == want.len(),
                "{what}: {} outputs for {} references",
                got.len(),
                want.len()
            );
            let unwritten = got.iter().filter(|x| !x.is_finite()).count();
            ensure!(
                unwritten == 0,
                "{what}: {unwritten} of {} outputs not finite (not written?)",
                got.len()
            );
            let e = error(got, want);
            println!("{what}: worst error {e:.2e} (tolerance {tolerance:.0e})");
            let worst = self.0.entry(family.to_string()).or_insert(0.0);
            *worst = worst.max(e);
            if e > tolerance {
                println!("FAILED {what}: error {e:.3e} > {tolerance:.0e}");
                self.1
                    .push(format!("{what}: error {e:.3e} > {tolerance:.0e}"));
            }
            Ok(())
        }

        /// Prints the worst errors; fails if any comparison was over its tolerance.
        fn finish(&self) -> Result<()> {
            let mut families: Vec<_> = self.0.iter().collect();
            families.sort_by(|a, b| a.0.cmp(b.0));
            for (family, e) in families {
                println!("WORST {family}: {e:.2e}");
            }
            ensure!(self.1.is_empty(), "over tolerance:\n{}", self.1.join("\n"));
            Ok(())
        }
    }

    /// max |got − want| / (|want| + rms(want)).
    fn error(got: &[f64], want: &[f64]) -> f64 {
        let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len().max(1) as f64).sqrt();
        let floor = rms.max(f64::MIN_POSITIVE);
        got.iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs() / (w.abs() + floor))
            .fold(0.0, f64::max)
    }

    fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    }

    /// `values` rounded to `T`, and their exact values.
    fn rounded<T: Float>(values: &[f32]) -> (Vec<T>, Vec<f64>) {
        let r: Vec<T> = values.iter().map(|&x| T::from_f32(x)).collect();
        let exact = wide(&r);
        (r, exact)
    }

    fn wide<T: Float>(values: &[T]) -> Vec<f64> {
        values.iter().map(|x| x.to_f32() as f64).collect()
    }

    /// A device buffer of NaN (in `T`), so that an element a kernel does not write shows.
    fn poisoned<T: Float>(gpu: &Gpu, len: usize) -> Result<CudaSlice<T>> {
        Ok(gpu.upload(&vec![T::from_f32(f32::NAN); len])?)
    }

    fn download<T: Float>(gpu: &Gpu, data: &CudaSlice<T>) -> Result<Vec<f64>> {
        Ok(wide(&gpu.download(data)?))
    }

    fn download_view<T: Float>(gpu: &Gpu, view: &CudaView<'_, T>) -> Result<Vec<T>> {
        let host = gpu.stream().clone_dtoh(view)?;
        gpu.synchronize()?;
        Ok(host)
    }

    /// The tolerance of one f32 computation whose result is rounded to `T`.
    fn out_tol<T: Float>() -> f64 {
        match T::NAME {
            "float" => F32_TOL,
            "__half" => F16_TOL,
            _ => BF16_TOL,
        }
    }

    /// A short name of `T` for the output.
    fn name<T: Float>() -> &'static str {
        match T::NAME {
            "float" => "f32",
            "__half" => "f16",
            _ => "bf16",
        }
    }

    /// RMSNorm in f64: `x / sqrt(mean(x²) + eps) * (w + offset)`.
    fn rms_norm_ref(x: &[f64], weight: &[f32], eps: f32, offset: f32) -> Vec<f64> {
        let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let rms = (mean + eps as f64).sqrt();
        x.iter()
            .zip(weight)
            .map(|(v, &w)| v / rms * (w as f64 + offset as f64))
            .collect()
    }

    // ---------------------------------------------------------------------------- embed

    #[test]
    fn embed_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("embed_matches_reference") else {
            return Ok(());
        };
        let mut worst = Worst::default();
        embed_case::<f32>(&gpu, &mut rng, &mut worst)?;
        embed_case::<bf16>(&gpu, &mut rng, &mut worst)?;
        embed_case::<f16>(&gpu, &mut rng, &mut worst)?;
        worst.finish()
    }

    /// Rows of a random table, scaled, written into the middle of a larger buffer; an id
    /// past the vocabulary gives zeros. Tolerance F32_TOL: one f32 product.
    fn embed_case<W: Float>(gpu: &Gpu, rng: &mut StdRng, worst: &mut Worst) -> Result<()> {
        let (vocab, hidden) = (97, 300);
        let (table, table_f64) = rounded::<W>(&uniform(rng, vocab * hidden, -2.0, 2.0));
        let mut ids: Vec<u32> = (0..13).map(|_| rng.random_range(0..vocab as u32)).collect();
        ids.push(vocab as u32 + 3);
        let scale = rng.random_range(0.5f32..40.0);
        let table_d = gpu.upload(&table)?;
        let ids_d = gpu.upload(&ids)?;
        // Rows 2.. of a buffer of ids + 3 rows: the others must stay NaN.
        let mut out = poisoned::<f32>(gpu, (ids.len() + 3) * hidden)?;
        ops::embed(
            gpu,
            &table_d.as_view(),
            hidden,
            &ids_d.as_view(),
            scale,
            &mut out.slice_mut(2 * hidden..(2 + ids.len()) * hidden),
        )?;
        let got = download(gpu, &out)?;
        let outside = got[..2 * hidden]
            .iter()
            .chain(&got[(2 + ids.len()) * hidden..]);
        ensure!(
            outside.into_iter().all(|x| x.is_nan()),
            "embed wrote outside its rows"
        );
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&id| {
                let id = id as usize;
                (0..hidden).map(move |j| (id, j))
            })
            .map(|(id, j)| {
                if id < vocab {
                    table_f64[id * hidden + j] * scale as f64
                } else {
                    0.0
                }
            })
            .collect();
        let got = &got[2 * hidden..(2 + ids.len()) * hidden];
        let family = format!("embed {}", name::<W>());
        worst.check(&family, &family, got, &want, F32_TOL)?;
        let past = &got[(ids.len() - 1) * hidden..];
        ensure!(
            past.iter().all(|&x| x == 0.0),
            "id past the vocabulary: not zeros"
        );
        Ok(())
    }

    // ---------------------------------------------------------------------- RMSNorm

    /// (rows, width): one element, widths below, at and above the block's 256 threads.
    const NORM_SHAPES: [(usize, usize); 5] = [(1, 1), (7, 300), (3, 256), (33, 2048), (2, 5000)];

    /// Rows of very different scales (1e-2 to 1e2), so that eps matters in some.
    fn norm_input(rng: &mut StdRng, rows: usize, width: usize) -> Vec<f32> {
        (0..rows)
            .flat_map(|_| {
                let scale = 10f32.powf(rng.random_range(-2.0..2.0));
                uniform(rng, width, -scale, scale)
            })
            .collect()
    }

    #[test]
    fn rms_norm_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("rms_norm_matches_reference") else {
            return Ok(());
        };
        let mut worst = Worst::default();
        for (rows, width) in NORM_SHAPES {
            for offset in [0.0, 1.0] {
                rms_norm_case::<f32>(&gpu, &mut rng, rows, width, offset, &mut worst)?;
                rms_norm_case::<bf16>(&gpu, &mut rng, rows, width, offset, &mut worst)?;
                rms_norm_case::<f16>(&gpu, &mut rng, rows, width, offset, &mut worst)?;
            }
        }
        worst.finish()
    }

    /// Tolerance: F32_TOL for f32 outputs, plus one rounding for bf16 (BF16_TOL) or f16.
    fn rms_norm_case<O: Float>(
        gpu: &Gpu,
        rng: &mut StdRng,
        rows: usize,
        width: usize,
        offset: f32,
        worst: &mut Worst,
    ) -> Result<()> {
        let x = norm_input(rng, rows, width);
        // Gemma's `1 + w` form has weights near 0, the usual form near 1.
        let weight = uniform(rng, width, -1.0 + 1.0 - offset, 1.0 + 1.0 - offset);
        let eps = 1e-6;
        let (x_d, weight_d) = (gpu.upload(&x)?, gpu.upload(&weight)?);
        let mut out = poisoned::<O>(gpu, x.len())?;
        let w = weight_d.as_view();
        let norm = Norm {
            weight: &w,
            eps,
            offset,
        };
        ops::rms_norm(gpu, &x_d.as_view(), width, &norm, &mut out.as_view_mut())?;
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let want: Vec<f64> = x64
            .chunks(width)
            .flat_map(|row| rms_norm_ref(row, &weight, eps, offset))
            .collect();
        let family = format!("rms_norm {}", name::<O>());
        let what = format!("{family} [{rows}, {width}] offset {offset}");
        worst.check(&family, &what, &download(gpu, &out)?, &want, out_tol::<O>())
    }

    #[test]
    fn add_rms_norm_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("add_rms_norm_matches_reference") else {
            return Ok(());
        };
        let mut worst = Worst::default();
        for (rows, width) in NORM_SHAPES {
            for offset in [None, Some(0.0), Some(1.0)] {
                add_rms_norm_case(&gpu, &mut rng, rows, width, offset, &mut worst)?;
            }
        }
        worst.finish()
    }

    /// `residual += norm(y)` or `+= y`. Tolerance F32_TOL.
    fn add_rms_norm_case(
        gpu: &Gpu,
        rng: &mut StdRng,
        rows: usize,
        width: usize,
        offset: Option<f32>,
        worst: &mut Worst,
    ) -> Result<()> {
        let residual = uniform(rng, rows * width, -3.0, 3.0);
        let y = norm_input(rng, rows, width);
        let weight = uniform(rng, width, -1.0, 1.0);
        let eps = 1e-6;
        let mut residual_d = gpu.upload(&residual)?;
        let (y_d, weight_d) = (gpu.upload(&y)?, gpu.upload(&weight)?);
        let w = weight_d.as_view();
        let norm = offset.map(|offset| Norm {
            weight: &w,
            eps,
            offset,
        });
        ops::add_rms_norm(
            gpu,
            &mut residual_d.as_view_mut(),
            &y_d.as_view(),
            width,
            norm.as_ref(),
        )?;
        let y64: Vec<f64> = y.iter().map(|&v| v as f64).collect();
        let added: Vec<f64> = match offset {
            Some(offset) => y64
                .chunks(width)
                .flat_map(|row| rms_norm_ref(row, &weight, eps, offset))
                .collect(),
            None => y64,
        };
        let want: Vec<f64> = residual
            .iter()
            .zip(&added)
            .map(|(&r, a)| r as f64 + a)
            .collect();
        let what = format!("add_rms_norm [{rows}, {width}] norm offset {offset:?}");
        worst.check(
            "add_rms_norm",
            &what,
            &download(gpu, &residual_d)?,
            &want,
            F32_TOL,
        )
    }

    /// `add_rms_norm_then_norm` is `add_rms_norm` then `rms_norm` in one launch: the same
    /// residual and the same normalised output, bit for bit (widths past one step of the
    /// norms' loop included: 5,000 > 4,096), with and without the post-norm, f32 and bf16.
    #[test]
    fn add_rms_norm_then_norm_is_the_two_launches() -> Result<()> {
        let Some((gpu, mut rng)) = start("add_rms_norm_then_norm_is_the_two_launches") else {
            return Ok(());
        };
        for (rows, width) in NORM_SHAPES {
            for offset in [None, Some(0.0), Some(1.0)] {
                then_norm_case::<f32>(&gpu, &mut rng, rows, width, offset)?;
                then_norm_case::<bf16>(&gpu, &mut rng, rows, width, offset)?;
            }
        }
        Ok(())
    }

    fn then_norm_case<O: Float>(
        gpu: &Gpu,
        rng: &mut StdRng,
        rows: usize,
        width: usize,
        offset: Option<f32>,
    ) -> Result<()> {
        let residual = uniform(rng, rows * width, -3.0, 3.0);
        let y = norm_input(rng, rows, width);
        let (weight, next_weight) = (
            uniform(rng, width, -1.0, 1.0),
            uniform(rng, width, 0.5, 1.5),
        );
        let (y_d, weight_d, next_d) = (
            gpu.upload(&y)?,
            gpu.upload(&weight)?,
            gpu.upload(&next_weight)?,
        );
        let (w, nw) = (weight_d.as_view(), next_d.as_view());
        let norm = offset.map(|offset| Norm {
            weight: &w,
            eps: 1e-6,
            offset,
        });
        let next = Norm {
            weight: &nw,
            eps: 1e-5,
            offset: 0.0,
        };
        let mut fused_residual = gpu.upload(&residual)?;
        let mut fused_out = poisoned::<O>(gpu, rows * width)?;
        ops::add_rms_norm_then_norm(
            gpu,
            &mut fused_residual.as_view_mut(),
            &y_d.as_view(),
            width,
            norm.as_ref(),
            &next,
            &mut fused_out.as_view_mut(),
        )?;
        let mut residual_d = gpu.upload(&residual)?;
        let mut out = poisoned::<O>(gpu, rows * width)?;
        ops::add_rms_norm(
            gpu,
            &mut residual_d.as_view_mut(),
            &y_d.as_view(),
            width,
            norm.as_ref(),
        )?;
        ops::rms_norm(
            gpu,
            &residual_d.as_view(),
            width,
            &next,
            &mut out.as_view_mut(),
        )?;
        let what = format!(
            "[{rows}, {width}] {} post-norm offset {offset:?}",
            name::<O>()
        );
        ensure!(
            download(gpu, &fused_residual)? == download(gpu, &residual_d)?,
            "{what}: the residuals differ"
        );
        let (fused, apart) = (download(gpu, &fused_out)?, download(gpu, &out)?);
        ensure!(
            fused
                .iter()
                .zip(&apart)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: the normalised outputs differ"
        );
        Ok(())
    }

    // ------------------------------------------------------------- attention inputs

    /// One configuration of `attention_inputs`.
    #[derive(Debug, Clone, Copy)]
    struct AttnCase {
        shape: QkvShape,
        pairs: RopePairs,
        /// Bias and q/k norms (with this offset) or neither.
        extras: Option<f32>,
        round: bool,
        store: bool,
        /// The store keeps the queries of one position in this many ([`QueryRows`]).
        query_every: usize,
        first_position: usize,
        capacity: usize,
    }

    /// The reference of one case: queries `[tokens, heads, d]`, the KV rows by (kv head,
    /// slot), and the store's pre-RoPE keys and values `[tokens, kv_heads, d]`, all f64 and
    /// unrounded (the tolerances account for the rounding).
    struct AttnRef {
        queries: Vec<f64>,
        keys: HashMap<(usize, usize), Vec<f64>>,
        values: HashMap<(usize, usize), Vec<f64>>,
        store_keys: Vec<f64>,
        store_values: Vec<f64>,
        /// Pre-RoPE queries `[tokens, heads, d]`.
        store_queries: Vec<f64>,
    }

    /// The inputs of one case.
    struct AttnInputs {
        qkv: Vec<f32>,
        bias: Vec<f32>,
        q_weight: Vec<f32>,
        k_weight: Vec<f32>,
        inv_freq: Vec<f64>,
    }

    const EPS: f32 = 1e-6;

    /// RoPE as kvdb-model's CPU computes it: angle in f64, cos and sin rounded to f32, the
    /// rotation itself here in f64.
    fn rotate(x: &mut [f64], position: usize, inv_freq: &[f64], pairs: RopePairs) {
        let half = inv_freq.len();
        for (i, f) in inv_freq.iter().enumerate() {
            let (s, c) = (position as f64 * f).sin_cos();
            let (s, c) = (s as f32 as f64, c as f32 as f64);
            let (a, b) = match pairs {
                RopePairs::Halves => (i, i + half),
                RopePairs::Interleaved => (2 * i, 2 * i + 1),
            };
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * c - x1 * s;
            x[b] = x0 * s + x1 * c;
        }
    }

    fn attention_ref(case: &AttnCase, inputs: &AttnInputs) -> AttnRef {
        let QkvShape {
            tokens,
            heads,
            kv_heads,
            head_dim: d,
        } = case.shape;
        let all = heads + 2 * kv_heads;
        let mut out = AttnRef {
            queries: Vec::new(),
            keys: HashMap::new(),
            values: HashMap::new(),
            store_keys: vec![0.0; tokens * kv_heads * d],
            store_values: vec![0.0; tokens * kv_heads * d],
            store_queries: Vec::new(),
        };
        for t in 0..tokens {
            let p = case.first_position + t;
            let slot = p % case.capacity;
            for h in 0..all {
                let at = (t * all + h) * d;
                let mut x: Vec<f64> = (0..d)
                    .map(|j| {
                        let bias = case.extras.map_or(0.0, |_| inputs.bias[h * d + j] as f64);
                        inputs.qkv[at + j] as f64 + bias
                    })
                    .collect();
                if let Some(offset) = case.extras {
                    if h < heads + kv_heads {
                        let w = if h < heads {
                            &inputs.q_weight
                        } else {
                            &inputs.k_weight
                        };
                        x = rms_norm_ref(&x, w, EPS, offset);
                    }
                }
                if h < heads {
                    out.store_queries.extend(&x);
                    rotate(&mut x, p, &inputs.inv_freq, case.pairs);
                    out.queries.extend(x);
                } else if h < heads + kv_heads {
                    let kh = h - heads;
                    out.store_keys[(t * kv_heads + kh) * d..][..d].copy_from_slice(&x);
                    rotate(&mut x, p, &inputs.inv_freq, case.pairs);
                    out.keys.insert((kh, slot), x);
                } else {
                    let vh = h - heads - kv_heads;
                    out.store_values[(t * kv_heads + vh) * d..][..d].copy_from_slice(&x);
                    out.values.insert((vh, slot), x);
                }
            }
        }
        out
    }

    /// The cases: every combination of pairing, bias + norms (offsets 0 and 1), rounding,
    /// store and buffer type, on shapes and positions that vary with them; half of them on a
    /// ring smaller than `first_position + tokens` whose chunk wraps around its end.
    fn attention_cases(rng: &mut StdRng) -> Vec<AttnCase> {
        // (tokens, heads, kv_heads, head_dim): GQA, MHA, odd head dims, up to 512.
        let shapes = [
            (5, 4, 2, 64),
            (17, 8, 2, 128),
            (3, 2, 1, 256),
            (9, 6, 3, 80),
            (2, 4, 4, 512),
            (1, 8, 1, 96),
            (32, 2, 2, 2),
        ];
        let mut cases = Vec::new();
        let mut index = 0;
        for pairs in [RopePairs::Halves, RopePairs::Interleaved] {
            for extras in [None, Some(0.0), Some(1.0)] {
                for round in [false, true] {
                    for store in [false, true] {
                        let (tokens, heads, kv_heads, head_dim) = shapes[index % shapes.len()];
                        let ring = index % 2 == 0;
                        index += 1;
                        let (first_position, capacity) = if ring {
                            // A chunk that wraps: it starts 2 slots before the ring's end.
                            let capacity = tokens + rng.random_range(2..6);
                            let laps = rng.random_range(0..300);
                            (laps * capacity + capacity - 2, capacity)
                        } else {
                            let first = rng.random_range(0..5000);
                            (first, first + tokens + rng.random_range(0..4))
                        };
                        cases.push(AttnCase {
                            shape: QkvShape {
                                tokens,
                                heads,
                                kv_heads,
                                head_dim,
                            },
                            pairs,
                            extras,
                            round,
                            store,
                            query_every: [1, 3, 16][index % 3],
                            first_position,
                            capacity,
                        });
                    }
                }
            }
        }
        cases
    }

    #[test]
    fn attention_inputs_match_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("attention_inputs_match_reference") else {
            return Ok(());
        };
        let mut worst = Worst::default();
        for case in attention_cases(&mut rng) {
            attention_case::<f32>(&gpu, &mut rng, &case, &mut worst)
                .with_context(|| format!("f32 {case:?}"))?;
            attention_case::<f16>(&gpu, &mut rng, &case, &mut worst)
                .with_context(|| format!("f16 {case:?}"))?;
        }
        worst.finish()
    }

    /// Tolerances: queries F32_TOL (f32 buffer) or F16_TOL (f16 buffer); values and the
    /// store's rows the same, and F16_TOL whenever they are rounded to f16; rotated keys as
    /// queries, or ROUNDED_KEYS_TOL when rounded before RoPE.
    fn attention_case<A: Float>(
        gpu: &Gpu,
        rng: &mut StdRng,
        case: &AttnCase,
        worst: &mut Worst,
    ) -> Result<()> {
        let QkvShape {
            tokens,
            heads,
            kv_heads,
            head_dim: d,
        } = case.shape;
        let row = case.shape.row();
        let base = [10_000.0f64, 1_000_000.0][rng.random_range(0..2)];
        let (q_offset, k_offset) = (case.extras.unwrap_or(0.0), case.extras.unwrap_or(0.0));
        let inputs = AttnInputs {
            qkv: uniform(rng, tokens * row, -2.0, 2.0),
            bias: uniform(rng, row, -0.5, 0.5),
            q_weight: uniform(rng, d, 0.5 - q_offset, 1.5 - q_offset),
            k_weight: uniform(rng, d, 0.5 - k_offset, 1.5 - k_offset),
            inv_freq: (0..d / 2)
                .map(|i| 1.0 / base.powf(2.0 * i as f64 / d as f64))
                .collect(),
        };
        let want = attention_ref(case, &inputs);

        let qkv = gpu.upload(&inputs.qkv)?;
        let bias = gpu.upload(&inputs.bias)?;
        let (q_weight, k_weight) = (gpu.upload(&inputs.q_weight)?, gpu.upload(&inputs.k_weight)?);
        let inv_freq = gpu.upload(&inputs.inv_freq)?;
        let (bias_v, qw, kw, inv) = (
            bias.as_view(),
            q_weight.as_view(),
            k_weight.as_view(),
            inv_freq.as_view(),
        );
        let q_norm = case.extras.map(|offset| Norm {
            weight: &qw,
            eps: EPS,
            offset,
        });
        let k_norm = case.extras.map(|offset| Norm {
            weight: &kw,
            eps: EPS,
            offset,
        });
        let rotary = Rotary {
            inv_freq: &inv,
            pairs: case.pairs,
        };
        let mut queries = poisoned::<A>(gpu, tokens * heads * d)?;
        let mut kv = KvCache::<A>::zeros(gpu, kv_heads, case.capacity, d)?;
        let mut store_keys = poisoned::<f16>(gpu, tokens * kv_heads * d)?;
        let mut store_values = poisoned::<f16>(gpu, tokens * kv_heads * d)?;
        // The sampled rows and one more, which must stay poisoned.
        let sampled = ops::sampled_rows(case.first_position, tokens, case.query_every);
        let mut store_queries = poisoned::<f32>(gpu, (sampled + 1) * heads * d)?;
        let (mut sk, mut sv) = (store_keys.as_view_mut(), store_values.as_view_mut());
        let mut sq = store_queries.slice_mut(..sampled * heads * d);
        let store = case.store.then_some(StoreRows {
            keys: &mut sk,
            values: &mut sv,
            queries: Some(QueryRows {
                rows: &mut sq,
                every: case.query_every,
            }),
        });
        ops::attention_inputs(
            gpu,
            &qkv.as_view(),
            &case.shape,
            case.extras.map(|_| &bias_v),
            q_norm.as_ref(),
            k_norm.as_ref(),
            &rotary,
            case.round,
            &mut queries.as_view_mut(),
            ops::KvPlacement::Chunk {
                kv: &mut kv,
                first_position: case.first_position,
            },
            store,
        )?;

        let label = format!(
            "{} {:?} extras {:?} round {} store {} (queries 1 in {}) [{tokens}, {heads}, {kv_heads}, {d}] first {} capacity {}",
            name::<A>(),
            case.pairs,
            case.extras,
            case.round,
            case.store,
            case.query_every,
            case.first_position,
            case.capacity
        );
        let family = |part: &str| format!("attention_inputs {part} {}", name::<A>());
        let a_tol = out_tol::<A>();
        worst.check(
            &family("queries"),
            &format!("queries {label}"),
            &download(gpu, &queries)?,
            &want.queries,
            a_tol,
        )?;

        let (keys, values) = ops::kv_views(&kv);
        let (keys, values) = (download_view(gpu, &keys)?, download_view(gpu, &values)?);
        let (key_tol, value_tol) = match case.round {
            true => (ROUNDED_KEYS_TOL, F16_TOL),
            false => (a_tol, a_tol),
        };
        for (part, data, reference, tol) in [
            ("keys", &keys, &want.keys, key_tol),
            ("values", &values, &want.values, value_tol),
        ] {
            let (mut got, mut expected) = (Vec::new(), Vec::new());
            for h in 0..kv_heads {
                for slot in 0..case.capacity {
                    let rows = &data[(h * case.capacity + slot) * d..][..d];
                    match reference.get(&(h, slot)) {
                        Some(want) => {
                            got.extend(wide(rows));
                            expected.extend(want);
                        }
                        None => ensure!(
                            rows.iter().all(|x| x.to_f32() == 0.0),
                            "{part}: slot {slot} of KV head {h} written, no token maps there ({label})"
                        ),
                    }
                }
            }
            let what = format!("{part} {label}");
            worst.check(&family(part), &what, &got, &expected, tol)?;
        }
        if case.round {
            ensure!(
                values
                    .iter()
                    .all(|v| f16::from_f32(v.to_f32()).to_f32() == v.to_f32()),
                "values not rounded to f16 ({label})"
            );
        }
        if case.store {
            for (part, data, reference) in [
                ("store keys", &store_keys, &want.store_keys),
                ("store values", &store_values, &want.store_values),
            ] {
                let what = format!("{part} {label}");
                let family = format!("attention_inputs {part}");
                worst.check(&family, &what, &download(gpu, data)?, reference, F16_TOL)?;
            }
            // f32 copies of the normed queries of the sampled positions, in order: only the
            // rounding of the norm.
            let row = heads * d;
            let expected: Vec<f64> = (0..tokens)
                .filter(|t| (case.first_position + t + 1).is_multiple_of(case.query_every))
                .flat_map(|t| want.store_queries[t * row..(t + 1) * row].iter().copied())
                .collect();
            ensure!(
                expected.len() == sampled * row,
                "sampled rows counted ({label})"
            );
            let got = download(gpu, &store_queries)?;
            worst.check(
                "attention_inputs store queries",
                &format!("store queries {label}"),
                &got[..sampled * row],
                &expected,
                F32_TOL,
            )?;
            ensure!(
                got[sampled * row..].iter().all(|x| x.is_nan()),
                "a query stored past the sampled rows ({label})"
            );
        } else {
            ensure!(
                download(gpu, &store_keys)?.iter().all(|x| x.is_nan()),
                "store written without being asked"
            );
        }
        Ok(())
    }

    /// A batched step's rows placed by one `attention_inputs` (`KvPlacement::Rows`) are bit
    /// for bit what one call a row (`KvPlacement::Chunk`) writes: queries, the store's rows and each row's own KV
    /// ring at its own position (more rows than one launch takes, so that the launches'
    /// chunks are covered too).
    #[test]
    fn attention_inputs_rows_are_each_row_alone() -> Result<()> {
        let Some((gpu, mut rng)) = start("attention_inputs_rows_are_each_row_alone") else {
            return Ok(());
        };
        for (rows, heads, kv_heads, d) in [(1, 2, 1, 8), (5, 8, 2, 64), (37, 32, 8, 128)] {
            rows_alone::<f16>(&gpu, &mut rng, rows, heads, kv_heads, d)?;
            rows_alone::<f32>(&gpu, &mut rng, rows, heads, kv_heads, d)?;
        }
        // Each target is checked: a KV buffer of other heads is refused.
        let shape = QkvShape {
            tokens: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
        };
        let inv = gpu.upload(&[0.5f64; 4])?;
        let inv_view = inv.as_view();
        let rotary = Rotary {
            inv_freq: &inv_view,
            pairs: RopePairs::Halves,
        };
        let mut wrong = KvCache::<f16>::zeros(&gpu, 2, 4, 8)?;
        let refused = ops::attention_inputs(
            &gpu,
            &gpu.zeros::<f32>(shape.row())?.as_view(),
            &shape,
            None,
            None,
            None,
            &rotary,
            false,
            &mut gpu.zeros::<f16>(16)?.as_view_mut(),
            ops::KvPlacement::Rows(&mut [ops::RowTarget {
                kv: &mut wrong,
                position: 3,
            }]),
            None,
        );
        ensure!(refused.is_err(), "a KV buffer of the wrong heads was taken");
        Ok(())
    }

    fn rows_alone<A: Float>(
        gpu: &Gpu,
        rng: &mut StdRng,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        d: usize,
    ) -> Result<()> {
        let shape = QkvShape {
            tokens: rows,
            heads,
            kv_heads,
            head_dim: d,
        };
        let qkv = gpu.upload(&uniform(rng, rows * shape.row(), -2.0, 2.0))?;
        let bias = gpu.upload(&uniform(rng, shape.row(), -0.5, 0.5))?;
        let (q_weight, k_weight) = (
            gpu.upload(&uniform(rng, d, 0.5, 1.5))?,
            gpu.upload(&uniform(rng, d, 0.5, 1.5))?,
        );
        let inv_freq: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / 10_000f64.powf(2.0 * i as f64 / d as f64))
            .collect();
        let inv = gpu.upload(&inv_freq)?;
        let (inv_view, bias_view, qw, kw) = (
            inv.as_view(),
            bias.as_view(),
            q_weight.as_view(),
            k_weight.as_view(),
        );
        let rotary = Rotary {
            inv_freq: &inv_view,
            pairs: RopePairs::Interleaved,
        };
        let (q_norm, k_norm) = (
            Norm {
                weight: &qw,
                eps: 1e-6,
                offset: 0.0,
            },
            Norm {
                weight: &kw,
                eps: 1e-6,
                offset: 0.0,
            },
        );
        // Each row its own ring of another capacity, at its own position.
        let targets: Vec<(usize, usize)> = (0..rows)
            .map(|_| (rng.random_range(1..20), rng.random_range(0..100_000)))
            .collect();
        let (q_len, kv_len) = (rows * heads * d, rows * kv_heads * d);
        // What each path writes: queries, the store's keys, values and queries, the rings.
        struct Written<A> {
            queries: CudaSlice<A>,
            keys: CudaSlice<f16>,
            values: CudaSlice<f16>,
            raw_queries: CudaSlice<f32>,
            rings: Vec<KvCache<A>>,
        }
        let fresh = || -> Result<Written<A>> {
            Ok(Written {
                queries: gpu.zeros(q_len)?,
                keys: gpu.zeros(kv_len)?,
                values: gpu.zeros(kv_len)?,
                raw_queries: gpu.zeros(q_len)?,
                rings: targets
                    .iter()
                    .map(|&(capacity, _)| KvCache::zeros(gpu, kv_heads, capacity, d))
                    .collect::<kvdb_kernels::Result<_>>()?,
            })
        };
        let (mut alone, mut together) = (fresh()?, fresh()?);
        let row_shape = QkvShape { tokens: 1, ..shape };
        for (r, &(_, position)) in targets.iter().enumerate() {
            let (q, kv) = (
                r * heads * d..(r + 1) * heads * d,
                r * kv_heads * d..(r + 1) * kv_heads * d,
            );
            ops::attention_inputs(
                gpu,
                &qkv.slice(r * shape.row()..(r + 1) * shape.row()),
                &row_shape,
                Some(&bias_view),
                Some(&q_norm),
                Some(&k_norm),
                &rotary,
                false,
                &mut alone.queries.slice_mut(q.clone()),
                ops::KvPlacement::Chunk {
                    kv: &mut alone.rings[r],
                    first_position: position,
                },
                Some(StoreRows {
                    keys: &mut alone.keys.slice_mut(kv.clone()),
                    values: &mut alone.values.slice_mut(kv),
                    queries: Some(QueryRows {
                        rows: &mut alone.raw_queries.slice_mut(q),
                        every: 1,
                    }),
                }),
            )?;
        }
        let mut row_targets: Vec<ops::RowTarget<'_, A>> = together
            .rings
            .iter_mut()
            .zip(&targets)
            .map(|(kv, &(_, position))| ops::RowTarget { kv, position })
            .collect();
        ops::attention_inputs(
            gpu,
            &qkv.as_view(),
            &shape,
            Some(&bias_view),
            Some(&q_norm),
            Some(&k_norm),
            &rotary,
            false,
            &mut together.queries.as_view_mut(),
            ops::KvPlacement::Rows(&mut row_targets),
            Some(StoreRows {
                keys: &mut together.keys.as_view_mut(),
                values: &mut together.values.as_view_mut(),
                queries: Some(QueryRows {
                    rows: &mut together.raw_queries.as_view_mut(),
                    every: 1,
                }),
            }),
        )?;
        let label = format!(
            "{rows} rows, {heads}/{kv_heads} heads of {d}, {}",
            name::<A>()
        );
        // Everything a path wrote, named, on the host.
        let written = |w: &Written<A>| -> Result<Vec<(String, Vec<f64>)>> {
            let mut all = vec![
                ("queries".to_string(), download(gpu, &w.queries)?),
                ("store keys".to_string(), download(gpu, &w.keys)?),
                ("store values".to_string(), download(gpu, &w.values)?),
                ("store queries".to_string(), download(gpu, &w.raw_queries)?),
            ];
            for (r, ring) in w.rings.iter().enumerate() {
                let (keys, values) = ops::kv_views(ring);
                all.push((format!("row {r}'s keys"), wide(&download_view(gpu, &keys)?)));
                all.push((
                    format!("row {r}'s values"),
                    wide(&download_view(gpu, &values)?),
                ));
            }
            Ok(all)
        };
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for ((what, a), (_, b)) in written(&alone)?.iter().zip(&written(&together)?) {
            ensure!(bits(a) == bits(b), "{what} differ ({label})");
        }
        let nonzero = download(gpu, &together.queries)?
            .iter()
            .filter(|x| **x != 0.0)
            .count();
        ensure!(nonzero > q_len / 2, "queries mostly unwritten ({label})");
        println!("attention_inputs, rows together: {label}: bit for bit");
        Ok(())
    }

    /// A stored corpus's keys (f16, pre-RoPE) uploaded head-major and rotated in place are
    /// bit for bit the keys `attention_inputs` writes for the same rows (rounded to f16
    /// first, as the model rounds its own), and the values are the stored ones: both sides
    /// of a retrieval layer attend to the same numbers.
    #[test]
    fn rotate_keys_is_attention_inputs_on_rounded_keys() -> Result<()> {
        let Some((gpu, mut rng)) = start("rotate_keys_is_attention_inputs_on_rounded_keys") else {
            return Ok(());
        };
        for (tokens, kv_heads, d) in [(1, 1, 8), (37, 4, 64), (300, 8, 128), (129, 2, 256)] {
            for pairs in [RopePairs::Halves, RopePairs::Interleaved] {
                // attention_inputs writes position p to slot p % capacity: a multiple of
                // `tokens` puts token t at row t, as the upload has it.
                let first_position = tokens * rng.random_range(0..2000);
                let stored = |rng: &mut StdRng| -> Vec<f16> {
                    uniform(rng, tokens * kv_heads * d, -3.0, 3.0)
                        .into_iter()
                        .map(f16::from_f32)
                        .collect()
                };
                // Token-major, as the model hands rows out: [tokens, kv_heads, d].
                let (keys, values) = (stored(&mut rng), stored(&mut rng));
                let inv_freq: Vec<f64> = (0..d / 2)
                    .map(|i| 1.0 / 500_000f64.powf(2.0 * i as f64 / d as f64))
                    .collect();
                let inv = gpu.upload(&inv_freq)?;
                let inv_view = inv.as_view();
                let rotary = Rotary {
                    inv_freq: &inv_view,
                    pairs,
                };
                // The model's path: one query head of zeros, then the keys and values.
                let row = (1 + 2 * kv_heads) * d;
                let mut qkv = vec![0f32; tokens * row];
                for (t, out) in qkv.chunks_exact_mut(row).enumerate() {
                    let at = t * kv_heads * d..(t + 1) * kv_heads * d;
                    for (o, k) in out[d..(1 + kv_heads) * d].iter_mut().zip(&keys[at.clone()]) {
                        *o = k.to_f32();
                    }
                    for (o, v) in out[(1 + kv_heads) * d..].iter_mut().zip(&values[at]) {
                        *o = v.to_f32();
                    }
                }
                let shape = QkvShape {
                    tokens,
                    heads: 1,
                    kv_heads,
                    head_dim: d,
                };
                let mut queries = gpu.zeros::<f16>(tokens * d)?;
                let mut placed = KvCache::<f16>::zeros(&gpu, kv_heads, tokens, d)?;
                ops::attention_inputs(
                    &gpu,
                    &gpu.upload(&qkv)?.as_view(),
                    &shape,
                    None,
                    None,
                    None,
                    &rotary,
                    true,
                    &mut queries.as_view_mut(),
                    ops::KvPlacement::Chunk {
                        kv: &mut placed,
                        first_position,
                    },
                    None,
                )?;
                // The store's path: head-major halves as they are, rotated on the GPU.
                let head_major = |rows: &[f16]| -> Vec<f16> {
                    (0..kv_heads)
                        .flat_map(|h| {
                            (0..tokens).flat_map(move |t| {
                                rows[(t * kv_heads + h) * d..][..d].iter().copied()
                            })
                        })
                        .collect()
                };
                let mut uploaded =
                    KvCache::upload(&gpu, &head_major(&keys), &head_major(&values), kv_heads, d)?;
                ops::rotate_keys(&gpu, &mut uploaded, &rotary, first_position)?;
                let label = format!("[{tokens}, {kv_heads}, {d}] {pairs:?} at {first_position}");
                let ((pk, pv), (uk, uv)) = (ops::kv_views(&placed), ops::kv_views(&uploaded));
                let bits = |v: Vec<f16>| v.into_iter().map(f16::to_bits).collect::<Vec<_>>();
                ensure!(
                    bits(download_view(&gpu, &pk)?) == bits(download_view(&gpu, &uk)?),
                    "rotated keys differ from attention_inputs' ({label})"
                );
                ensure!(
                    bits(download_view(&gpu, &pv)?) == bits(download_view(&gpu, &uv)?),
                    "uploaded values differ from attention_inputs' ({label})"
                );
                // A rotation must have happened: position 0 alone leaves keys as they are.
                if first_position > 0 || tokens > 1 {
                    ensure!(
                        bits(download_view(&gpu, &uk)?) != bits(head_major(&keys)),
                        "rotate_keys left the keys as they were ({label})"
                    );
                }
            }
        }
        // A rotary table of the wrong length is refused before anything runs.
        let mut kv = KvCache::<f16>::zeros(&gpu, 1, 4, 8)?;
        let short = gpu.upload(&[1.0f64; 3])?;
        let short_view = short.as_view();
        let bad = Rotary {
            inv_freq: &short_view,
            pairs: RopePairs::Halves,
        };
        ensure!(
            matches!(
                ops::rotate_keys(&gpu, &mut kv, &bad, 0),
                Err(KernelError::Length { .. })
            ),
            "a short inv_freq was accepted"
        );
        Ok(())
    }

    // ------------------------------------------------------------ gated activation

    #[test]
    fn gated_activation_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("gated_activation_matches_reference") else {
            return Ok(());
        };
        let mut worst = Worst::default();
        for (rows, width) in [(1, 1), (7, 300), (4, 5000), (64, 1024)] {
            for activation in [GateActivation::GeluTanh, GateActivation::Silu] {
                gated_case::<f32>(&gpu, &mut rng, rows, width, activation, &mut worst)?;
                gated_case::<bf16>(&gpu, &mut rng, rows, width, activation, &mut worst)?;
            }
        }
        worst.finish()
    }

    /// Gates over [-8, 8] (both tails). Tolerance F32_TOL (f32 and `__expf`) or BF16_TOL.
    fn gated_case<O: Float>(
        gpu: &Gpu,
        rng: &mut StdRng,
        rows: usize,
        width: usize,
        activation: GateActivation,
        worst: &mut Worst,
    ) -> Result<()> {
        let gate_up: Vec<f32> = (0..rows)
            .flat_map(|_| {
                let mut row = uniform(rng, width, -8.0, 8.0);
                row.extend(uniform(rng, width, -2.0, 2.0));
                row
            })
            .collect();
        let gate_up_d = gpu.upload(&gate_up)?;
        let mut out = poisoned::<O>(gpu, rows * width)?;
        ops::gated_activation(
            gpu,
            &gate_up_d.as_view(),
            width,
            activation,
            &mut out.as_view_mut(),
        )?;
        let want: Vec<f64> = gate_up
            .chunks(2 * width)
            .flat_map(|row| {
                let (gate, up) = row.split_at(width);
                gate.iter().zip(up).map(|(&g, &u)| {
                    let g = g as f64;
                    let act = match activation {
                        GateActivation::GeluTanh => {
                            let inner =
                                (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                            g / (1.0 + (-2.0 * inner).exp())
                        }
                        GateActivation::Silu => g / (1.0 + (-g).exp()),
                    };
                    act * u as f64
                })
            })
            .collect();
        let family = format!("gated_activation {activation:?} {}", name::<O>());
        let what = format!("{family} [{rows}, {width}]");
        worst.check(&family, &what, &download(gpu, &out)?, &want, out_tol::<O>())
    }

    // -------------------------------------------------------------------- convert

    #[test]
    fn convert_rounds_like_half() -> Result<()> {
        let Some((gpu, mut rng)) = start("convert_rounds_like_half") else {
            return Ok(());
        };
        convert_case::<f32, bf16>(&gpu, &mut rng)?;
        convert_case::<f32, f16>(&gpu, &mut rng)?;
        convert_case::<bf16, f32>(&gpu, &mut rng)?;
        convert_case::<f16, f32>(&gpu, &mut rng)?;
        convert_case::<f16, bf16>(&gpu, &mut rng)?;
        convert_case::<bf16, f16>(&gpu, &mut rng)?;
        convert_case::<f32, f32>(&gpu, &mut rng)?;
        println!("WORST convert: 0 (bit-exact)");
        Ok(())
    }

    /// Values from 2^-30 to 2^30 of both signs (f16's subnormals and overflow included).
    /// Tolerance zero: both sides round once, to nearest even, as the `half` crate does.
    fn convert_case<I: Float, O: Float>(gpu: &Gpu, rng: &mut StdRng) -> Result<()> {
        let n = 100_003;
        let x: Vec<I> = (0..n)
            .map(|_| {
                let magnitude = 2f32.powf(rng.random_range(-30.0..30.0));
                let sign = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
                I::from_f32(sign * magnitude)
            })
            .collect();
        let x_d = gpu.upload(&x)?;
        let mut out = poisoned::<O>(gpu, n + 1)?;
        ops::convert(gpu, &x_d.as_view(), &mut out.slice_mut(..n))?;
        let got = gpu.download(&out)?;
        ensure!(got[n].to_f32().is_nan(), "convert wrote past its output");
        let mismatches = x
            .iter()
            .zip(&got)
            .filter(|(x, g)| O::from_f32(x.to_f32()).to_f32().to_bits() != g.to_f32().to_bits())
            .count();
        println!(
            "convert {} -> {}: {mismatches} of {n} differ from `half`",
            name::<I>(),
            name::<O>()
        );
        ensure!(mismatches == 0, "convert: {mismatches} values differ");
        Ok(())
    }

    // ----------------------------------------------------------------- argmax_rows

    /// The reference: candle's CPU argmax, a scan that takes a value only when it is strictly
    /// larger than the one held (so the first of equal largest values, never a NaN, and 0
    /// for a row that starts with a NaN).
    fn first_largest(row: &[f32]) -> u32 {
        let (mut at, mut held) = (0, row[0]);
        for (i, &x) in row.iter().enumerate() {
            if held < x {
                (at, held) = (i, x);
            }
        }
        at as u32
    }

    /// Rows of random values and rows made to trip a pick by bits: ties (the first wins),
    /// NaNs first, later or everywhere, -0 against +0, infinities, subnormals (which the
    /// GPU's flush-to-zero arithmetic would equate), all at a decode step's vocabulary
    /// (Llama 3's 128,256) and at small widths; every pick bit for bit the reference's, and
    /// nothing written past the rows.
    #[test]
    fn argmax_rows_pick_as_candle_does() -> Result<()> {
        let Some((gpu, mut rng)) = start("argmax_rows_pick_as_candle_does") else {
            return Ok(());
        };
        let nan = f32::NAN;
        let tiny = f32::from_bits(1); // the smallest subnormal
                                      // One scratch for every launch: each must leave it as it found it.
        let mut scratch = ops::ArgmaxScratch::new(&gpu, 16)?;
        for width in [1usize, 7, 1025, 4097, 128_256, 262_144] {
            let random = |rng: &mut StdRng| -> Vec<f32> {
                (0..width).map(|_| rng.random_range(-30.0..30.0)).collect()
            };
            let mut rows: Vec<Vec<f32>> = (0..4).map(|_| random(&mut rng)).collect();
            let last = width - 1;
            let mid = width / 2;
            let mut planted = |cells: &[(usize, f32)], base: f32| {
                let mut row = vec![base; width];
                for &(i, x) in cells {
                    row[i] = x;
                }
                rows.push(row);
            };
            planted(&[(mid, 5.0), (last, 5.0)], 1.0);
            planted(&[(0, nan), (mid, 9.0)], 1.0);
            planted(&[(mid, nan), (last, 2.0)], 1.0);
            planted(&[], nan);
            planted(&[(0, -0.0), (last, 0.0)], -1.0);
            planted(&[(last, -0.0)], -f32::INFINITY);
            planted(&[], -f32::INFINITY);
            planted(&[(mid, f32::INFINITY), (last, f32::INFINITY)], f32::MAX);
            planted(&[(last, 2.0 * tiny), (mid, tiny)], 0.0);
            planted(&[(mid, -tiny)], -2.0 * tiny);
            let want: Vec<u32> = rows.iter().map(|r| first_largest(r)).collect();
            let flat: Vec<f32> = rows.concat();
            let logits = gpu.upload(&flat)?;
            let mut out = gpu.upload(&vec![u32::MAX; rows.len() + 1])?;
            ops::argmax_rows(
                &gpu,
                &logits.as_view(),
                width,
                &mut scratch,
                &mut out.slice_mut(..rows.len()),
            )?;
            let got = gpu.download(&out)?;
            println!("argmax_rows width {width}: {:?}", &got[..rows.len()]);
            ensure!(
                got[rows.len()] == u32::MAX,
                "argmax_rows wrote past its rows"
            );
            ensure!(
                got[..rows.len()] == want[..],
                "width {width}: got {:?}, want {want:?}",
                &got[..rows.len()]
            );
        }
        let logits = gpu.upload(&[0f32; 10])?;
        let mut out = gpu.upload(&[0u32; 3])?;
        let mut small = ops::ArgmaxScratch::new(&gpu, 1)?;
        for (width, small_scratch, rows, what) in [
            (4, false, 3, "a ragged last row"),
            (5, false, 3, "an output longer than the rows"),
            (5, true, 2, "more rows than the scratch holds"),
        ] {
            let scratch = if small_scratch {
                &mut small
            } else {
                &mut scratch
            };
            let refused = ops::argmax_rows(
                &gpu,
                &logits.as_view(),
                width,
                scratch,
                &mut out.slice_mut(..rows),
            )
            .is_err();
            ensure!(refused, "{what} was taken");
        }
        Ok(())
    }

    // ----------------------------------------------------------------------- Gemm

    /// One shape of `linear`: (rows, n, k).
    type GemmShape = (usize, usize, usize);

    /// rows 1 (decode: the matrix-vector kernel, and cuBLASLt when it is off), 2, 7, 64 and
    /// 1000 (prefill), on various n and k: k a multiple of 256 and not (the lanes' last
    /// chunks), k = 8 (one chunk), and more weight rows than the vector kernel's grid has
    /// warps (they stride).
    const GEMM_SHAPES: [GemmShape; 8] = [
        (1, 96, 256),
        (1, 1000, 264),
        (1, 40, 4104),
        (2, 257, 1024),
        (1, 20_000, 8),
        (7, 300, 1000),
        (64, 128, 4096),
        (1000, 384, 512),
    ];

    #[test]
    fn linear_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("linear_matches_reference") else {
            return Ok(());
        };
        let mut gemm = Gemm::new(&gpu)?;
        let mut worst = Worst::default();
        for shape in GEMM_SHAPES {
            linear_case::<f32>(&gpu, &mut gemm, &mut rng, shape, GEMM_F32_TOL, &mut worst)?;
            linear_case::<bf16>(&gpu, &mut gemm, &mut rng, shape, GEMM_HALF_TOL, &mut worst)?;
            linear_case::<f16>(&gpu, &mut gemm, &mut rng, shape, GEMM_HALF_TOL, &mut worst)?;
        }
        // Whether cuBLASLt took the bias epilogue (else the kernel added every bias).
        println!("linear plans: {gemm:?}");
        worst.finish()
    }

    /// `Gemm::gated_linear` gives what `linear` then `gated_activation` give, bit for bit:
    /// one row in one launch (`gemv_gated`, rows of several batches of loads and grids that
    /// stride), several rows through the two; both activations, bf16 and f16.
    #[test]
    fn gated_linear_is_linear_then_gated_activation() -> Result<()> {
        let Some((gpu, mut rng)) = start("gated_linear_is_linear_then_gated_activation") else {
            return Ok(());
        };
        let gemm = Gemm::new(&gpu)?;
        for (rows, n, k) in [
            (1, 1, 8),
            (1, 7, 64),
            (1, 1024, 640),
            (1, 4000, 2056),
            (3, 96, 640),
        ] {
            for activation in [GateActivation::GeluTanh, GateActivation::Silu] {
                gated_linear_case::<bf16>(&gpu, &gemm, &mut rng, (rows, n, k), activation)?;
                gated_linear_case::<f16>(&gpu, &gemm, &mut rng, (rows, n, k), activation)?;
            }
        }
        Ok(())
    }

    fn gated_linear_case<T: Float>(
        gpu: &Gpu,
        gemm: &Gemm,
        rng: &mut StdRng,
        (rows, n, k): GemmShape,
        activation: GateActivation,
    ) -> Result<()> {
        let amplitude = 2.0 / (k as f32).sqrt();
        let (x, _) = rounded::<T>(&uniform(rng, rows * k, -1.0, 1.0));
        let (w, _) = rounded::<T>(&uniform(rng, 2 * n * k, -amplitude, amplitude));
        let (x_d, w_d) = (gpu.upload(&x)?, gpu.upload(&w)?);
        let mut gate_up = gpu.zeros::<f32>(rows * 2 * n)?;
        let mut fused = poisoned::<T>(gpu, rows * n)?;
        gemm.gated_linear(
            gpu,
            &x_d.as_view(),
            &w_d.as_view(),
            k,
            activation,
            &mut gate_up.as_view_mut(),
            &mut fused.as_view_mut(),
        )?;
        let mut apart = poisoned::<T>(gpu, rows * n)?;
        gemm.linear(
            gpu,
            &x_d.as_view(),
            &w_d.as_view(),
            k,
            None,
            false,
            &mut gate_up.as_view_mut(),
        )?;
        ops::gated_activation(
            gpu,
            &gate_up.as_view(),
            n,
            activation,
            &mut apart.as_view_mut(),
        )?;
        let what = format!(
            "gated_linear [{rows}, {n}, {k}] {} {activation:?}",
            name::<T>()
        );
        same_bits(
            &what,
            "linear then gated_activation",
            &download(gpu, &fused)?,
            &download(gpu, &apart)?,
        )
    }

    /// Fails unless `got` equals `want` (finite, from `how`) bit for bit.
    fn same_bits(what: &str, how: &str, got: &[f64], want: &[f64]) -> Result<()> {
        ensure!(
            want.iter().all(|v| v.is_finite()),
            "{what}: {how} not finite"
        );
        let differ = got
            .iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        ensure!(
            differ == 0,
            "{what}: {differ} of {} outputs differ from {how}",
            want.len()
        );
        Ok(())
    }

    /// `linear_of_f32`: f32 inputs rounded to the weights' type as the product reads them,
    /// bit for bit `convert` then `linear`, on the matrix-vector kernel (one row) and off it
    /// (three rows; one row with the kernel off), with and without bias and accumulation;
    /// inputs include halfway cases of both types (ties to even) and the staging buffer is
    /// left as it was where the kernel rounds by itself.
    #[test]
    fn linear_of_f32_is_convert_then_linear() -> Result<()> {
        let Some((gpu, mut rng)) = start("linear_of_f32_is_convert_then_linear") else {
            return Ok(());
        };
        let vector = Gemm::new(&gpu)?;
        let mut blas = Gemm::new(&gpu)?;
        blas.set_vector_kernel(false);
        for (rows, n, k) in [
            (1, 1, 8),
            (1, 7, 64),
            (1, 1024, 640),
            (1, 4000, 2056),
            (3, 96, 640),
        ] {
            for (gemm, on_vector) in [(&vector, rows == 1), (&blas, false)] {
                for (bias, accumulate) in [(false, false), (true, false), (false, true)] {
                    let case = (rows, n, k);
                    linear_of_f32_case::<bf16>(
                        &gpu, gemm, &mut rng, case, bias, accumulate, on_vector,
                    )?;
                    linear_of_f32_case::<f16>(
                        &gpu, gemm, &mut rng, case, bias, accumulate, on_vector,
                    )?;
                }
            }
        }
        Ok(())
    }

    fn linear_of_f32_case<T: Float>(
        gpu: &Gpu,
        gemm: &Gemm,
        rng: &mut StdRng,
        (rows, n, k): GemmShape,
        bias: bool,
        accumulate: bool,
        on_vector: bool,
    ) -> Result<()> {
        let amplitude = 2.0 / (k as f32).sqrt();
        let mut x = uniform(rng, rows * k, -1.0, 1.0);
        // Halfway between two bf16 (1 + 2^-8) and two f16 (1 + 2^-11), either sign: rounded
        // to even by both paths or by neither.
        let len = x.len();
        for (i, tie) in [
            1.0 + 2f32.powi(-8),
            -1.0 - 2f32.powi(-8),
            1.0 + 2f32.powi(-11),
        ]
        .into_iter()
        .enumerate()
        {
            x[(i * 5) % len] = tie;
        }
        let (w, _) = rounded::<T>(&uniform(rng, n * k, -amplitude, amplitude));
        let b = uniform(rng, n, -1.0, 1.0);
        let start = uniform(rng, rows * n, -1.0, 1.0);
        let (x_d, w_d, b_d) = (gpu.upload(&x)?, gpu.upload(&w)?, gpu.upload(&b)?);
        let bias_view = b_d.as_view();
        let bias_arg = bias.then_some(&bias_view);
        let mut staging = poisoned::<T>(gpu, rows * k)?;
        let mut fused = gpu.upload(&start)?;
        gemm.linear_of_f32(
            gpu,
            &x_d.as_view(),
            &mut staging.as_view_mut(),
            &w_d.as_view(),
            k,
            bias_arg,
            accumulate,
            &mut fused.as_view_mut(),
        )?;
        let mut converted = gpu.zeros::<T>(rows * k)?;
        ops::convert(gpu, &x_d.as_view(), &mut converted.as_view_mut())?;
        let mut apart = gpu.upload(&start)?;
        gemm.linear(
            gpu,
            &converted.as_view(),
            &w_d.as_view(),
            k,
            bias_arg,
            accumulate,
            &mut apart.as_view_mut(),
        )?;
        let what = format!(
            "linear_of_f32 [{rows}, {n}, {k}] {} bias {bias} accumulate {accumulate}",
            name::<T>()
        );
        same_bits(
            &what,
            "convert then linear",
            &download(gpu, &fused)?,
            &download(gpu, &apart)?,
        )?;
        let staged = download(gpu, &staging)?;
        let (untouched, converted) = (
            staged.iter().all(|v| v.is_nan()),
            staged == download(gpu, &converted)?,
        );
        ensure!(
            if on_vector { untouched } else { converted },
            "{what}: staging {} where the product {} the matrix-vector kernel",
            if untouched { "untouched" } else { "written" },
            if on_vector {
                "ran on"
            } else {
                "did not run on"
            }
        );
        Ok(())
    }

    /// x [rows, k] · w [n, k]ᵀ in f64 from the (rounded) inputs.
    fn product(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
        x.chunks(k)
            .flat_map(|xr| {
                w.chunks(k)
                    .map(move |wr| xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>())
            })
            .collect()
    }

    /// Every combination on one shape: plain, bias in the epilogue, bias by the kernel,
    /// accumulate, and both; each shape twice (the second time from the plan cache); one row
    /// on the matrix-vector kernel and on cuBLASLt.
    fn linear_case<T: Float>(
        gpu: &Gpu,
        gemm: &mut Gemm,
        rng: &mut StdRng,
        (rows, n, k): GemmShape,
        tol: f64,
        worst: &mut Worst,
    ) -> Result<()> {
        let amplitude = 1.0 / (k as f32).sqrt();
        let (x, x64) = rounded::<T>(&uniform(rng, rows * k, -1.0, 1.0));
        let (w, w64) = rounded::<T>(&uniform(rng, n * k, -amplitude, amplitude));
        let bias = uniform(rng, n, -0.5, 0.5);
        let old = uniform(rng, rows * n, -0.5, 0.5);
        let xw = product(&x64, &w64, k);
        let (x_d, w_d, bias_d) = (gpu.upload(&x)?, gpu.upload(&w)?, gpu.upload(&bias)?);
        let family = format!("linear {}", name::<T>());
        let vector_kernel = [true, false];
        let vector_kernel = &vector_kernel[..if rows == 1 { 2 } else { 1 }];
        for (with_bias, epilogue, accumulate, &vector) in [
            (false, true, false),
            (true, true, false),
            (true, false, false),
            (false, true, true),
            (true, true, true),
            (true, false, true),
            (false, true, false),
        ]
        .into_iter()
        .flat_map(|(b, e, a)| vector_kernel.iter().map(move |v| (b, e, a, v)))
        {
            gemm.set_bias_in_epilogue(epilogue);
            gemm.set_vector_kernel(vector);
            let mut out = match accumulate {
                true => gpu.upload(&old)?,
                false => poisoned::<f32>(gpu, rows * n)?,
            };
            let bias_v = bias_d.as_view();
            gemm.linear(
                gpu,
                &x_d.as_view(),
                &w_d.as_view(),
                k,
                with_bias.then_some(&bias_v),
                accumulate,
                &mut out.as_view_mut(),
            )?;
            let want: Vec<f64> = xw
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let b = if with_bias { bias[i % n] as f64 } else { 0.0 };
                    let o = if accumulate { old[i] as f64 } else { 0.0 };
                    p + b + o
                })
                .collect();
            let what = format!(
                "{family} [{rows}, {n}, {k}] bias {with_bias} epilogue {epilogue} accumulate {accumulate} vector kernel {vector}"
            );
            worst.check(&family, &what, &download(gpu, &out)?, &want, tol)?;
        }
        gemm.set_bias_in_epilogue(true);
        gemm.set_vector_kernel(true);
        Ok(())
    }

    /// Views at offsets cuBLASLt's default alignment (256 bytes) does not hold: x from its
    /// second row with k = 250 (rows of 500 bytes in bf16), out from its second row of 70.
    #[test]
    fn linear_on_unaligned_views() -> Result<()> {
        let Some((gpu, mut rng)) = start("linear_on_unaligned_views") else {
            return Ok(());
        };
        let gemm = Gemm::new(&gpu)?;
        let mut worst = Worst::default();
        let (rows, n, k) = (5, 70, 250);
        let (x, x64) = rounded::<bf16>(&uniform(&mut rng, (rows + 1) * k, -1.0, 1.0));
        let (w, w64) = rounded::<bf16>(&uniform(&mut rng, n * k, -0.1, 0.1));
        let bias = uniform(&mut rng, n, -0.5, 0.5);
        let (x_d, w_d, bias_d) = (gpu.upload(&x)?, gpu.upload(&w)?, gpu.upload(&bias)?);
        let mut out = poisoned::<f32>(&gpu, (rows + 2) * n)?;
        gemm.linear(
            &gpu,
            &x_d.slice(k..),
            &w_d.as_view(),
            k,
            Some(&bias_d.as_view()),
            false,
            &mut out.slice_mut(n..(rows + 1) * n),
        )?;
        let got = download(&gpu, &out)?;
        ensure!(
            got[..n]
                .iter()
                .chain(&got[(rows + 1) * n..])
                .all(|x| x.is_nan()),
            "linear wrote outside its rows"
        );
        let want: Vec<f64> = product(&x64[k..], &w64, k)
            .iter()
            .enumerate()
            .map(|(i, p)| p + bias[i % n] as f64)
            .collect();
        let what = "linear bf16 unaligned views [5, 70, 250]";
        worst.check(
            "linear bf16 unaligned",
            what,
            &got[n..(rows + 1) * n],
            &want,
            GEMM_HALF_TOL,
        )?;
        worst.finish()
    }

    // -------------------------------------------------------------------- errors

    fn is_length(e: &KernelError) -> bool {
        matches!(e, KernelError::Length { .. })
    }

    /// Every launcher refuses inconsistent lengths before launching (outputs stay NaN).
    #[test]
    fn bad_lengths_are_errors() -> Result<()> {
        let Some((gpu, _)) = start("bad_lengths_are_errors") else {
            return Ok(());
        };
        let ones = gpu.upload(&vec![1.0f32; 64])?;
        let ids = gpu.upload(&[0u32, 1])?;
        let mut out = poisoned::<f32>(&gpu, 64)?;
        let v = ones.as_view();
        let norm = Norm {
            weight: &ones.slice(..8),
            eps: 1e-6,
            offset: 0.0,
        };

        // embed: table not whole rows, output of the wrong length, zero width.
        let e = ops::embed(
            &gpu,
            &ones.slice(..63),
            8,
            &ids.as_view(),
            1.0,
            &mut out.slice_mut(..16),
        );
        ensure!(e.as_ref().is_err_and(is_length), "embed table: {e:?}");
        let e = ops::embed(&gpu, &v, 8, &ids.as_view(), 1.0, &mut out.slice_mut(..17));
        ensure!(e.as_ref().is_err_and(is_length), "embed out: {e:?}");
        let e = ops::embed(&gpu, &v, 0, &ids.as_view(), 1.0, &mut out.slice_mut(..0));
        ensure!(
            matches!(e, Err(KernelError::Unsupported { .. })),
            "embed width 0: {e:?}"
        );

        // rms_norm: weight, output, rows.
        let e = ops::rms_norm(&gpu, &v, 16, &norm, &mut out.as_view_mut());
        ensure!(e.as_ref().is_err_and(is_length), "rms_norm weight: {e:?}");
        let e = ops::rms_norm(&gpu, &v, 8, &norm, &mut out.slice_mut(..56));
        ensure!(e.as_ref().is_err_and(is_length), "rms_norm out: {e:?}");
        let e = ops::rms_norm(&gpu, &ones.slice(..60), 8, &norm, &mut out.slice_mut(..60));
        ensure!(e.as_ref().is_err_and(is_length), "rms_norm rows: {e:?}");

        // add_rms_norm: residual and y differ, weight.
        let e = ops::add_rms_norm(&gpu, &mut out.slice_mut(..56), &v, 8, None);
        ensure!(e.as_ref().is_err_and(is_length), "add_rms_norm: {e:?}");
        let e = ops::add_rms_norm(&gpu, &mut out.as_view_mut(), &v, 16, Some(&norm));
        ensure!(
            e.as_ref().is_err_and(is_length),
            "add_rms_norm weight: {e:?}"
        );
        // add_rms_norm_then_norm: the next norm's weight, its output (left NaN too).
        let mut next_out = poisoned::<f32>(&gpu, 64)?;
        let e = ops::add_rms_norm_then_norm(
            &gpu,
            &mut out.as_view_mut(),
            &v,
            16,
            None,
            &norm,
            &mut next_out.as_view_mut(),
        );
        ensure!(e.as_ref().is_err_and(is_length), "then norm weight: {e:?}");
        let e = ops::add_rms_norm_then_norm(
            &gpu,
            &mut out.as_view_mut(),
            &v,
            8,
            None,
            &norm,
            &mut next_out.slice_mut(..56),
        );
        ensure!(e.as_ref().is_err_and(is_length), "then norm out: {e:?}");
        ensure!(
            download(&gpu, &next_out)?.iter().all(|x| x.is_nan()),
            "a refused launch wrote its next norm's output"
        );

        // gated_activation: gate_up not whole rows, output.
        let e = ops::gated_activation(
            &gpu,
            &ones.slice(..60),
            8,
            GateActivation::Silu,
            &mut out.slice_mut(..30),
        );
        ensure!(e.as_ref().is_err_and(is_length), "gated gate_up: {e:?}");
        let e = ops::gated_activation(&gpu, &v, 8, GateActivation::Silu, &mut out.slice_mut(..31));
        ensure!(e.as_ref().is_err_and(is_length), "gated out: {e:?}");

        // convert.
        let e = ops::convert(&gpu, &v, &mut out.slice_mut(..63));
        ensure!(e.as_ref().is_err_and(is_length), "convert: {e:?}");

        ensure!(
            download(&gpu, &out)?.iter().all(|x| x.is_nan()),
            "a refused launch wrote its output"
        );

        // attention_inputs: 1 token, 1 head, 1 KV head, head_dim 8 -> qkv of 24.
        let shape = QkvShape {
            tokens: 1,
            heads: 1,
            kv_heads: 1,
            head_dim: 8,
        };
        let inv = gpu.upload(&[1.0f64, 0.1, 0.01, 0.001])?;
        let inv_v = inv.as_view();
        let rotary = Rotary {
            inv_freq: &inv_v,
            pairs: RopePairs::Halves,
        };
        let mut queries = poisoned::<f32>(&gpu, 8)?;
        let mut kv = KvCache::<f32>::zeros(&gpu, 1, 4, 8)?;
        let mut attn = |shape: &QkvShape,
                        qkv: usize,
                        inv: usize,
                        kv: &mut KvCache<f32>,
                        store: Option<usize>| {
            let inv_short = inv_v.slice(..inv);
            let rotary = Rotary {
                inv_freq: &inv_short,
                pairs: rotary.pairs,
            };
            let mut store_k = gpu.zeros::<f16>(16)?;
            let mut store_v = gpu.zeros::<f16>(16)?;
            let (mut sk, mut sv) = (
                store_k.slice_mut(..store.unwrap_or(8)),
                store_v.slice_mut(..store.unwrap_or(8)),
            );
            ops::attention_inputs(
                &gpu,
                &ones.slice(..qkv),
                shape,
                None,
                None,
                None,
                &rotary,
                false,
                &mut queries.as_view_mut(),
                ops::KvPlacement::Chunk {
                    kv,
                    first_position: 0,
                },
                store.map(|_| StoreRows {
                    keys: &mut sk,
                    values: &mut sv,
                    queries: None,
                }),
            )
        };
        let e = attn(&shape, 23, 4, &mut kv, None);
        ensure!(e.as_ref().is_err_and(is_length), "attention qkv: {e:?}");
        let e = attn(&shape, 24, 3, &mut kv, None);
        ensure!(
            e.as_ref().is_err_and(is_length),
            "attention inv_freq: {e:?}"
        );
        let e = attn(&shape, 24, 4, &mut kv, Some(7));
        ensure!(e.as_ref().is_err_and(is_length), "attention store: {e:?}");
        let e = attn(&shape, 24, 4, &mut KvCache::zeros(&gpu, 2, 4, 8)?, None);
        ensure!(
            e.as_ref().is_err_and(is_length),
            "attention KV heads: {e:?}"
        );
        let odd = QkvShape {
            head_dim: 7,
            ..shape
        };
        let e = attn(&odd, 21, 3, &mut kv, None);
        ensure!(
            matches!(e, Err(KernelError::Unsupported { .. })),
            "attention odd head_dim: {e:?}"
        );
        // The store's query sample: at position 15 one in 16 keeps the token's row (8
        // floats), one in 0 is no sample, and a buffer of another length is refused (rotated
        // queries of their own: the accepted launch writes them).
        for (every, len, ok) in [(16, 8, true), (16, 7, false), (0, 8, false)] {
            let mut rotated = poisoned::<f32>(&gpu, 8)?;
            let mut store_k = gpu.zeros::<f16>(8)?;
            let mut store_v = gpu.zeros::<f16>(8)?;
            let mut store_q = gpu.zeros::<f32>(len)?;
            let e = ops::attention_inputs(
                &gpu,
                &ones.slice(..24),
                &shape,
                None,
                None,
                None,
                &rotary,
                false,
                &mut rotated.as_view_mut(),
                ops::KvPlacement::Chunk {
                    kv: &mut kv,
                    first_position: 15,
                },
                Some(StoreRows {
                    keys: &mut store_k.as_view_mut(),
                    values: &mut store_v.as_view_mut(),
                    queries: Some(QueryRows {
                        rows: &mut store_q.as_view_mut(),
                        every,
                    }),
                }),
            );
            let refused = match every {
                0 => matches!(e, Err(KernelError::Unsupported { .. })),
                _ => e.as_ref().is_err_and(is_length),
            };
            ensure!(
                if ok { e.is_ok() } else { refused },
                "attention query sample 1 in {every}, {len} floats: {e:?}"
            );
        }
        let five = QkvShape { tokens: 5, ..shape };
        // A chunk larger than the ring: two tokens would share a slot.
        let big = gpu.upload(&vec![1.0f32; 5 * 24])?;
        let mut queries5 = poisoned::<f32>(&gpu, 5 * 8)?;
        let e = ops::attention_inputs(
            &gpu,
            &big.as_view(),
            &five,
            None,
            None,
            None,
            &Rotary {
                inv_freq: &inv.as_view(),
                pairs: RopePairs::Interleaved,
            },
            false,
            &mut queries5.as_view_mut(),
            ops::KvPlacement::Chunk {
                kv: &mut kv,
                first_position: 0,
            },
            None,
        );
        ensure!(
            matches!(e, Err(KernelError::OutOfRange { .. })),
            "attention chunk over capacity: {e:?}"
        );
        ensure!(
            download(&gpu, &queries)?.iter().all(|x| x.is_nan()),
            "a refused attention_inputs wrote queries"
        );

        // linear: k = 0, w not whole rows, x not whole rows, output, bias.
        let gemm = Gemm::new(&gpu)?;
        let mut lin = |x: usize, w: usize, k: usize, bias: Option<usize>, out_len: usize| {
            let b = ones.slice(..bias.unwrap_or(0));
            gemm.linear(
                &gpu,
                &ones.slice(..x),
                &ones.slice(..w),
                k,
                bias.map(|_| &b),
                false,
                &mut out.slice_mut(..out_len),
            )
        };
        let e = lin(8, 8, 0, None, 1);
        ensure!(
            matches!(e, Err(KernelError::Unsupported { .. })),
            "linear k 0: {e:?}"
        );
        let e = lin(8, 12, 8, None, 1);
        ensure!(e.as_ref().is_err_and(is_length), "linear w: {e:?}");
        let e = lin(12, 16, 8, None, 2);
        ensure!(e.as_ref().is_err_and(is_length), "linear x: {e:?}");
        let e = lin(16, 16, 8, None, 3);
        ensure!(e.as_ref().is_err_and(is_length), "linear out: {e:?}");
        let e = lin(16, 16, 8, Some(3), 4);
        ensure!(e.as_ref().is_err_and(is_length), "linear bias: {e:?}");
        // And a correct call on the same buffers runs: 2 rows, n 2, k 8 of ones.
        lin(16, 16, 8, Some(2), 4)?;
        let got = download(&gpu, &out)?;
        ensure!(got[..4] == [9.0; 4], "linear of ones: {:?}", &got[..4]);
        ensure!(
            got[4..].iter().all(|x| x.is_nan()),
            "a refused linear wrote its output"
        );
        println!("WORST errors: all refused");
        Ok(())
    }
}
