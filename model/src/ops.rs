//! The fused MLP gate `act(gate) * up` on the CPU: one parallel pass instead of candle's two
//! element-wise ops, and GELU in its exact sigmoid form `x·σ(2u)` (= `½x(1 + tanh u)`), whose
//! `exp` is several times cheaper than libm's `tanh`.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::config::Activation;
use crate::error::{ModelError, Result};

/// `√(2/π)`, GELU's tanh-approximation constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// Elements per parallel task: large enough to amortise scheduling.
const CHUNK: usize = 1 << 14;

struct GatedActivation(Activation);

/// `eˣ` for f32 in straight-line arithmetic (no libm call), so that loops over slices
/// vectorise: `eˣ = 2ⁿ·eʳ` with `n = round(x/ln 2)`, `|r| ≤ ln2/2`, and a degree-6 Taylor
/// polynomial for `eʳ` (relative error below 2e-7 over the clamped range).
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    // floor(y) from a truncating conversion, which vectorises on every x86-64 (`floor` itself
    // is an instruction only from SSE4.1 on, a libm call before).
    let y = x * std::f32::consts::LOG2_E + 0.5;
    let truncated = y as i32;
    let n = (truncated - i32::from(y < truncated as f32)) as f32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2ⁿ built from its exponent bits (n is within [-126, 127] after the clamp).
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[inline(always)]
fn act(kind: Activation, x: f32) -> f32 {
    match kind {
        // 0.5·x·(1 + tanh u) = x / (1 + e^(−2u)), u = √(2/π)(x + 0.044715x³).
        Activation::GeluTanh => {
            let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
            x / (1.0 + fast_exp(-2.0 * u))
        }
        Activation::Silu => x / (1.0 + fast_exp(-x)),
    }
}

impl CustomOp2 for GatedActivation {
    fn name(&self) -> &'static str {
        "gated-activation"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("gated-activation needs contiguous inputs")
        };
        let (CpuStorage::F32(gate), CpuStorage::F32(up)) = (s1, s2) else {
            candle_core::bail!("gated-activation needs f32 inputs")
        };
        let (gate, up) = (&gate[a0..a1], &up[b0..b1]);
        let mut out = vec![0f32; gate.len()];
        let kind = self.0;
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| gated_chunk(kind, g, u, o));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

kvdb_simd::multiversion! {
    variants gated_chunk_variants;
    /// `out = act(gate) * up` over one chunk, 8 lanes wide with AVX2 where the CPU has it.
    fn gated_chunk(kind: Activation, gate: &[f32], up: &[f32], out: &mut [f32])
    {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = act(kind, g) * u;
        }
    }
}

/// `act(gate) * up`, element-wise; both `[rows, width]` f32.
pub(crate) fn gated_activation(kind: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.device().is_cpu() {
        let (gate, up) = (gate.contiguous()?, up.contiguous()?);
        return Ok(gate.apply_op2_no_bwd(&up, &GatedActivation(kind))?);
    }
    let gate = match kind {
        Activation::GeluTanh => gate.gelu()?,
        Activation::Silu => candle_nn::ops::silu(gate)?,
    };
    Ok((gate * up)?)
}

/// Row-wise softmax of attention scores under a causal (optionally sliding-window) mask, in
/// one parallel pass: each row's visible keys are a contiguous range, so no mask tensor is
/// built and masked entries cost nothing.
struct CausalSoftmax {
    /// Query rows per head (the block's tokens); rows are `[heads][tokens]` major.
    tokens: usize,
    /// Position of the block's first query.
    first_query: usize,
    /// Position of the first key column.
    first_key: usize,
    window: Option<usize>,
}

impl candle_core::CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("causal-softmax needs a contiguous input")
        };
        let CpuStorage::F32(scores) = s else {
            candle_core::bail!("causal-softmax needs f32 scores")
        };
        let scores = &scores[start..end];
        let keys = l.dims().last().copied().unwrap_or(0);
        let mut out = vec![0f32; scores.len()];
        if keys > 0 {
            out.par_chunks_mut(keys)
                .zip(scores.par_chunks(keys))
                .enumerate()
                .for_each(|(row, (o, x))| {
                    let p = self.first_query + row % self.tokens;
                    let lo = self.window.map_or(0, |w| (p + 1).saturating_sub(w));
                    let a = lo.saturating_sub(self.first_key).min(keys);
                    let b = (p + 1).saturating_sub(self.first_key).min(keys);
                    if a >= b {
                        return;
                    }
                    softmax_row(&x[a..b], &mut o[a..b]);
                });
        }
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

kvdb_simd::multiversion! {
    variants softmax_row_variants;
    /// `o = softmax(x)` for one row's visible scores.
    fn softmax_row(x: &[f32], o: &mut [f32])
    {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (o, &v) in o.iter_mut().zip(x) {
            *o = fast_exp(v - max);
        }
        for &v in o.iter() {
            sum += v;
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Softmax over the last dim of `scores` (`[.., heads * tokens, keys]`, rows `[head][token]`)
/// where query `i` of the block sits at position `first_query + i`, key column `j` at
/// `first_key + j`, and a query sees keys at positions `p - window < k <= p`.
pub(crate) fn causal_softmax(
    scores: &Tensor,
    tokens: usize,
    first_query: usize,
    first_key: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let op = CausalSoftmax {
        tokens,
        first_query,
        first_key,
        window,
    };
    if scores.device().is_cpu() {
        return Ok(scores.contiguous()?.apply_op1_no_bwd(&op)?);
    }
    // Other devices: an explicit mask and candle's softmax.
    let keys = scores.dim(candle_core::D::Minus1)?;
    let mut mask = vec![0f32; tokens * keys];
    for (r, row) in mask.chunks_mut(keys).enumerate() {
        let p = first_query + r;
        for (j, m) in row.iter_mut().enumerate() {
            let k = first_key + j;
            if k > p || window.is_some_and(|w| p - k >= w) {
                *m = f32::NEG_INFINITY;
            }
        }
    }
    let rows = scores.elem_count() / keys;
    let mask = Tensor::from_vec(mask, (1, tokens, keys), scores.device())?;
    let masked = scores
        .reshape((rows / tokens, tokens, keys))?
        .broadcast_add(&mask)?
        .reshape(scores.shape())?;
    Ok(candle_nn::ops::softmax_last_dim(&masked)?)
}

/// Weight rows per parallel task of [`small_matmul`].
const GEMV_ROWS: usize = 64;

/// `x Wᵀ` for a few rows of `x` (`[m, k]`) and a row-major weight `w` (`[n, k]`), both f32
/// and contiguous: each weight row is read once for all `m` rows. For decode, where a
/// general matrix product spends its time packing and synchronising.
pub(crate) fn small_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, k2) = w.dims2()?;
    if k != k2 {
        return Err(ModelError::Internal(format!(
            "small_matmul: [{m}, {k}] x [{n}, {k2}]ᵀ"
        )));
    }
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(ws)) = &*storage else {
        return Err(ModelError::Internal(
            "small_matmul needs an f32 CPU weight".into(),
        ));
    };
    let Some((w0, w1)) = layout.contiguous_offsets() else {
        return Err(ModelError::Internal(
            "small_matmul needs a contiguous weight".into(),
        ));
    };
    let ws = &ws[w0..w1];
    // Output laid out [n, m] while computing (weight-row major), transposed at the end.
    let mut out = vec![0f32; n * m];
    out.par_chunks_mut(GEMV_ROWS * m)
        .zip(ws.par_chunks(GEMV_ROWS * k))
        .for_each(|(o, wblock)| {
            for (orow, wrow) in o.chunks_mut(m).zip(wblock.chunks(k)) {
                for (oj, xrow) in orow.iter_mut().zip(xs.chunks(k)) {
                    *oj = kvdb_simd::dot(wrow, xrow);
                }
            }
        });
    drop(storage);
    Ok(Tensor::from_vec(out, (n, m), x.device())?
        .t()?
        .contiguous()?)
}

/// `x` (`[m, k]` f32 rows) quantized to Q8_0 block by block as candle quantizes a product's
/// input (scale `max|x| / 127` rounded to f16, values `round(x / scale)`): the scales widened
/// to f32 and the values, each `[m, k / 32]` and `[m, k]`.
fn quantize_q8_0(xs: &[f32]) -> (Vec<f32>, Vec<i8>) {
    let blocks = xs.len() / kvdb_simd::Q8_0_VALUES;
    let mut scales = Vec::with_capacity(blocks);
    let mut values = vec![0i8; blocks * kvdb_simd::Q8_0_VALUES];
    for (block, out) in xs
        .chunks_exact(kvdb_simd::Q8_0_VALUES)
        .zip(values.chunks_exact_mut(kvdb_simd::Q8_0_VALUES))
    {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
        scales.push(half::f16::from_f32(d).to_f32());
        for (q, &x) in out.iter_mut().zip(block) {
            *q = (x * inverse).round() as i8;
        }
    }
    (scales, values)
}

/// `x Wᵀ` for a few rows of `x` (`[m, k]` f32) and a Q8_0 weight (`[n, k]`): candle's quantized
/// product, bit for bit (the input quantized as candle quantizes it, then
/// [`kvdb_simd::q8_0_dot`] per row and weight row), without its per-row calls into a kernel
/// the baseline build cannot inline. `None` where `q8_0_dot` is (a CPU without AVX2): the
/// caller runs candle's product.
pub(crate) fn q8_0_small_matmul(x: &Tensor, w: &QTensor) -> Result<Option<Tensor>> {
    let (m, k) = x.dims2()?;
    let (n, k2) = w.shape().dims2()?;
    if k != k2 || w.dtype() != GgmlDType::Q8_0 || !k.is_multiple_of(kvdb_simd::Q8_0_VALUES) {
        return Err(ModelError::Internal(format!(
            "q8_0_small_matmul: [{m}, {k}] x {:?} [{n}, {k2}]ᵀ",
            w.dtype()
        )));
    }
    let row_blocks = k / kvdb_simd::Q8_0_VALUES;
    // Whether the CPU has the kernel at all (its answer for no blocks).
    if kvdb_simd::q8_0_dot(&[], &[], &[]).is_none() {
        return Ok(None);
    }
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let (scales, values) = quantize_q8_0(&xs);
    let data = w.data()?;
    let row_bytes = row_blocks * kvdb_simd::Q8_0_BYTES;
    if data.len() != n * row_bytes {
        return Err(ModelError::Internal(format!(
            "q8_0_small_matmul: {} bytes of weights for [{n}, {k}]",
            data.len()
        )));
    }
    // Output laid out [n, m] while computing (weight-row major), transposed at the end.
    let mut out = vec![0f32; n * m];
    out.par_chunks_mut(GEMV_ROWS * m)
        .zip(data.par_chunks(GEMV_ROWS * row_bytes))
        .for_each(|(o, wblock)| {
            for (orow, wrow) in o.chunks_mut(m).zip(wblock.chunks(row_bytes)) {
                for (i, oj) in orow.iter_mut().enumerate() {
                    let x_scales = &scales[i * row_blocks..(i + 1) * row_blocks];
                    let x_values = &values[i * k..(i + 1) * k];
                    // Some: checked above, and the level does not change.
                    *oj = kvdb_simd::q8_0_dot(wrow, x_scales, x_values).unwrap_or(f32::NAN);
                }
            }
        });
    Ok(Some(
        Tensor::from_vec(out, (n, m), x.device())?
            .t()?
            .contiguous()?,
    ))
}

/// Makes OpenBLAS (feature `openblas`) run every product on the thread that calls it, the
/// policy of the model's own products (parallelism comes from rayon), for every other user
/// of the library too: faiss's products, which otherwise share OpenBLAS's thread pool across
/// the threads that build or load indexes in parallel (`cargo bench -p kvdb-benches --bench
/// build`). A no-op without the feature.
pub fn blas_on_calling_threads() {
    #[cfg(feature = "openblas")]
    blas::single_threaded_blas();
}

/// How [`matmul`] reads its right-hand side `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rhs {
    /// `a · b`, `b` `[.., k, n]`.
    AsIs,
    /// `a · bᵀ`, `b` `[.., n, k]` (a projection's weights, stored `[out, in]`).
    Transposed,
}

/// Matrix products `a · b` or `a · bᵀ` (`rhs`) of f32 CPU tensors, 2-D or batched 3-D. With
/// feature `openblas` they run through the system OpenBLAS; otherwise (or for other devices)
/// through candle.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, rhs: Rhs) -> Result<Tensor> {
    #[cfg(feature = "openblas")]
    if a.device().is_cpu()
        && a.dtype() == candle_core::DType::F32
        && b.dtype() == candle_core::DType::F32
    {
        return blas::matmul(a, b, rhs);
    }
    let b = match rhs {
        Rhs::AsIs => b.clone(),
        Rhs::Transposed => b.t()?,
    };
    Ok(a.matmul(&b)?)
}

#[cfg(feature = "openblas")]
pub(crate) mod blas {
    use candle_core::{CpuStorage, Storage, Tensor};
    use rayon::prelude::*;

    use super::Rhs;
    use crate::error::{ModelError, Result};

    /// Rows below which a product is not split further.
    const MIN_ROWS_PER_TASK: usize = 32;

    extern "C" {
        fn openblas_set_num_threads(n: std::ffi::c_int);
    }

    /// OpenBLAS runs on the calling thread only; parallelism comes from rayon.
    pub(crate) fn single_threaded_blas() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: a plain setter of OpenBLAS's global thread count, called once.
        ONCE.call_once(|| unsafe { openblas_set_num_threads(1) });
    }

    fn bail<T>(msg: String) -> Result<T> {
        Err(ModelError::Internal(msg))
    }

    /// The f32 data of a contiguous CPU tensor, copied only when it is not contiguous.
    fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
            return bail("BLAS matmul needs f32 CPU tensors".into());
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return bail("BLAS matmul needs contiguous tensors".into());
        };
        f(&data[start..end])
    }

    pub(super) fn matmul(a: &Tensor, b: &Tensor, rhs: Rhs) -> Result<Tensor> {
        let transpose_b = rhs == Rhs::Transposed;
        let (batch, m, k) = match a.dims() {
            [m, k] => (None, *m, *k),
            [bt, m, k] => (Some(*bt), *m, *k),
            d => return bail(format!("BLAS matmul: lhs of rank {}", d.len())),
        };
        let (bb, r, c) = match b.dims() {
            [r, c] => (None, *r, *c),
            [bt, r, c] => (Some(*bt), *r, *c),
            d => return bail(format!("BLAS matmul: rhs of rank {}", d.len())),
        };
        let (kb, n) = if transpose_b { (c, r) } else { (r, c) };
        if kb != k || bb != batch {
            return bail(format!(
                "BLAS matmul: {:?} x {:?} (transpose_b {transpose_b})",
                a.dims(),
                b.dims()
            ));
        }
        let batches = batch.unwrap_or(1);
        let mut out = vec![0f32; batches * m * n];
        if m * n * k > 0 {
            single_threaded_blas();
            let (trans, ldb) = if transpose_b {
                (cblas_sys::CBLAS_TRANSPOSE::CblasTrans, k)
            } else {
                (cblas_sys::CBLAS_TRANSPOSE::CblasNoTrans, n)
            };
            // Rows split over rayon's threads, each a single-threaded product: OpenBLAS's own
            // thread pool spins and yields against rayon's and candle's on small machines.
            let rows = m
                .div_ceil(rayon::current_num_threads().max(1))
                .max(MIN_ROWS_PER_TASK);
            with_slice(a, |a| {
                with_slice(b, |b| {
                    out.par_chunks_mut(m * n)
                        .enumerate()
                        .flat_map(|(i, o)| {
                            o.par_chunks_mut(rows * n)
                                .enumerate()
                                .map(move |(j, oj)| (i, j, oj))
                        })
                        .for_each(|(i, j, o)| {
                            let mj = o.len() / n;
                            let ai = &a[i * m * k + j * rows * k..][..mj * k];
                            let bi = &b[i * k * n..(i + 1) * k * n];
                            // SAFETY: `ai` holds mj·k, `bi` k·n and `o` mj·n elements, laid
                            // out row-major with the leading dimensions passed.
                            unsafe {
                                cblas_sys::cblas_sgemm(
                                    cblas_sys::CBLAS_LAYOUT::CblasRowMajor,
                                    cblas_sys::CBLAS_TRANSPOSE::CblasNoTrans,
                                    trans,
                                    mj as i32,
                                    n as i32,
                                    k as i32,
                                    1.0,
                                    ai.as_ptr(),
                                    k as i32,
                                    bi.as_ptr(),
                                    ldb as i32,
                                    0.0,
                                    o.as_mut_ptr(),
                                    n as i32,
                                );
                            }
                        });
                    Ok(())
                })
            })?;
        }
        let shape = match batch {
            Some(bt) => vec![bt, m, n],
            None => vec![m, n],
        };
        Ok(Tensor::from_vec(out, shape, a.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst = worst.max(((fast_exp(x) as f64 - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(fast_exp(f32::NEG_INFINITY), fast_exp(-87.0));
    }

    /// The AVX2 copies of the fused activation and the softmax row give the baseline copies'
    /// bits, so an answer does not depend on the CPU (kvdb-simd states why). Skipped without
    /// AVX2.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_cpu_copies_give_identical_bits() {
        if kvdb_simd::Level::detected() != kvdb_simd::Level::Avx2 {
            eprintln!("SKIPPED: this CPU has no AVX2, only the baseline copies run");
            return;
        }
        let xs: Vec<f32> = (0..1037)
            .map(|i| ((i * 7919) % 2003) as f32 / 97.0 - 10.0)
            .collect();
        let ys: Vec<f32> = xs.iter().rev().map(|x| x * 0.3).collect();
        for kind in [Activation::GeluTanh, Activation::Silu] {
            let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            gated_chunk_variants::baseline(kind, &xs, &ys, &mut a);
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { gated_chunk_variants::avx2(kind, &xs, &ys, &mut b) };
            assert_eq!(a, b, "{kind:?}");
        }
        let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
        softmax_row_variants::baseline(&xs, &mut a);
        // SAFETY: as above.
        unsafe { softmax_row_variants::avx2(&xs, &mut b) };
        assert_eq!(a, b);
    }

    /// A product small_matmul cannot make is reported as the bug it is (its callers pass
    /// matching f32 CPU tensors), not as a tensor library message.
    #[test]
    fn small_matmul_refuses_what_it_cannot_multiply() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 3), candle_core::DType::F32, &dev)?;
        let internal = |r: Result<Tensor>| matches!(r, Err(ModelError::Internal(_)));
        let w = Tensor::zeros((4, 5), candle_core::DType::F32, &dev)?;
        assert!(internal(small_matmul(&x, &w)));
        let w = Tensor::zeros((4, 3), candle_core::DType::F64, &dev)?;
        assert!(internal(small_matmul(&x, &w)));
        let w = Tensor::zeros((3, 4), candle_core::DType::F32, &dev)?.t()?;
        assert!(internal(small_matmul(&x, &w)));
        let w = Tensor::ones((4, 3), candle_core::DType::F32, &dev)?;
        assert_eq!(small_matmul(&x, &w)?.dims(), &[2, 4]);
        Ok(())
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() -> Result<()> {
        let dev = Device::Cpu;
        // 2 heads × 5 queries at positions 7..12 over keys at positions 4..12, window 4.
        let (heads, tokens, keys) = (2, 5, 8);
        let scores = Tensor::randn(0f32, 1., (1, heads * tokens, keys), &dev)?;
        let probs = causal_softmax(&scores, tokens, 7, 4, Some(4))?;
        let rows: Vec<Vec<f32>> = scores.squeeze(0)?.to_vec2()?;
        let got: Vec<Vec<f32>> = probs.squeeze(0)?.to_vec2()?;
        for (r, (x, y)) in rows.iter().zip(&got).enumerate() {
            let p = 7 + r % tokens;
            let visible: Vec<bool> = (0..keys).map(|j| 4 + j <= p && p - (4 + j) < 4).collect();
            let max = x
                .iter()
                .zip(&visible)
                .filter(|v| *v.1)
                .map(|v| *v.0)
                .fold(f32::MIN, f32::max);
            let sum: f32 = x
                .iter()
                .zip(&visible)
                .filter(|v| *v.1)
                .map(|v| (v.0 - max).exp())
                .sum();
            for j in 0..keys {
                let want = if visible[j] {
                    (x[j] - max).exp() / sum
                } else {
                    0.0
                };
                assert!(
                    (y[j] - want).abs() < 1e-6,
                    "row {r} key {j}: {} vs {want}",
                    y[j]
                );
            }
        }
        Ok(())
    }

    #[test]
    fn matmul_matches_candle() -> Result<()> {
        let dev = Device::Cpu;
        for (batch, m, k, n) in [
            (None, 37, 64, 50),
            (Some(3), 20, 16, 9),
            (None, 512, 640, 256),
        ] {
            let (ashape, bshape, btshape) = match batch {
                Some(b) => (vec![b, m, k], vec![b, k, n], vec![b, n, k]),
                None => (vec![m, k], vec![k, n], vec![n, k]),
            };
            let a = Tensor::randn(0f32, 1., ashape, &dev)?;
            let b = Tensor::randn(0f32, 1., bshape, &dev)?;
            let bt = Tensor::randn(0f32, 1., btshape, &dev)?;
            let d1 = (matmul(&a, &b, Rhs::AsIs)? - a.matmul(&b)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            let bt_t = bt.transpose(batch.map_or(0, |_| 1), batch.map_or(1, |_| 2))?;
            let d2 = (matmul(&a, &bt, Rhs::Transposed)? - a.matmul(&bt_t)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(d1 < 1e-3 && d2 < 1e-3, "{batch:?} {m} {k} {n}: {d1} {d2}");
        }
        Ok(())
    }

    #[test]
    fn small_matmul_matches_candle_matmul() -> Result<()> {
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 640, 1024), (3, 100, 7), (15, 2048, 130)] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let reference = x.matmul(&w.t()?)?;
            let ours = small_matmul(&x, &w)?;
            let d = (ours - &reference)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(d < 1e-3, "({m},{k},{n}): max |Δ| {d}");
        }
        Ok(())
    }

    /// Bit for bit candle's quantized product where the CPU has AVX2 (the kernel it mirrors),
    /// and `None` elsewhere; inputs with a zero block (scale 0) and blocks of large values
    /// (values near ±127) included.
    #[test]
    fn q8_0_small_matmul_is_candles_product() -> Result<()> {
        use candle_core::quantized::QMatMul;
        use candle_core::Module;
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 640, 1024), (3, 64, 7), (2, 2048, 130), (1, 32, 65)] {
            let mut x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            if k >= 64 {
                // One zero block and one block of large values in the first row.
                let mut row: Vec<f32> = x.flatten_all()?.to_vec1()?;
                row[..32].fill(0.0);
                row[32..64].iter_mut().for_each(|v| *v *= 1e4);
                x = Tensor::from_vec(row, (m, k), &dev)?;
            }
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let q = std::sync::Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0)?);
            let reference: Vec<Vec<f32>> = QMatMul::QTensor(q.clone()).forward(&x)?.to_vec2()?;
            match q8_0_small_matmul(&x, &q)? {
                Some(ours) => {
                    assert_eq!(ours.dims(), [m, n]);
                    let ours: Vec<Vec<f32>> = ours.to_vec2()?;
                    for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
                        for (j, (a, b)) in a.iter().zip(b).enumerate() {
                            assert_eq!(a.to_bits(), b.to_bits(), "({m},{k},{n}) [{i},{j}]");
                        }
                    }
                }
                None => assert!(kvdb_simd::level() != kvdb_simd::Level::Avx2),
            }
        }
        // Shapes it cannot multiply are errors, not panics.
        let x = Tensor::zeros((1, 64), candle_core::DType::F32, &dev)?;
        let q = QTensor::quantize(
            &Tensor::zeros((4, 96), candle_core::DType::F32, &dev)?,
            GgmlDType::Q8_0,
        )?;
        assert!(q8_0_small_matmul(&x, &q).is_err());
        Ok(())
    }

    #[test]
    fn matches_candle_element_wise_ops() -> Result<()> {
        let xs: Vec<f32> = (0..5000).map(|i| (i as f32 - 2500.0) / 300.0).collect();
        let gate = Tensor::new(xs.as_slice(), &Device::Cpu)?.reshape((50, 100))?;
        let up = (gate.sin()? + 1.5)?;
        for (kind, reference) in [
            (Activation::GeluTanh, (gate.gelu()? * &up)?),
            (Activation::Silu, (candle_nn::ops::silu(&gate)? * &up)?),
        ] {
            let ours = gated_activation(kind, &gate, &up)?;
            let d = (ours - reference)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(d < 1e-5, "{kind:?}: max |Δ| {d}");
        }
        Ok(())
    }
}
