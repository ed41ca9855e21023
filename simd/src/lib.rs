//! The small numeric kernels the model, the indexes and the attention share, compiled twice
//! and chosen at run time, so that one binary runs on any x86-64 CPU and uses AVX2 where the
//! CPU has it.
//!
//! The workspace is compiled for the x86-64 baseline (SSE2). A loop that LLVM vectorises
//! gets 4-wide SSE2 code there; [`multiversion!`] compiles the same body a second time
//! inside a function with AVX2 and FMA enabled, and calls that copy when [`level`] says the
//! CPU has them. Both copies run the same operations in the same order (the bodies use no
//! `mul_add`: a fused product is exact in one copy and a libm call in the other), so results
//! are bit-identical on every CPU: the tests compare the two copies directly.
//!
//! [`q8_0_dot`] is the exception: one AVX2 copy, bit for bit candle's kernel for the same
//! product, and `None` on other CPUs, where the caller runs candle's own.
//!
//! `KVDB_CPU=baseline` forces the baseline copies (to compare speed, or to rule them out);
//! candle's quantized kernels and its matrix products choose their own instructions at run
//! time the same way.
//!
//! ```
//! assert_eq!(kvdb_simd::dot(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
//! ```

use std::sync::OnceLock;

/// The vector instructions the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// What every x86-64 CPU (and every other architecture) has.
    Baseline,
    /// AVX2 and FMA (x86-64-v3: Intel since 2013, AMD since 2015).
    Avx2,
}

impl Level {
    /// The level's name, as `KVDB_CPU` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Level::Baseline => "baseline",
            Level::Avx2 => "avx2",
        }
    }

    /// The best level this CPU runs.
    pub fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx2;
        }
        Level::Baseline
    }
}

/// The level the kernels use in this process: [`Level::detected`], or the baseline when the
/// environment variable `KVDB_CPU` is `baseline`. Read once.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("KVDB_CPU").as_deref() {
        Ok("baseline") => Level::Baseline,
        _ => Level::detected(),
    })
}

/// Defines `fn NAME(ARGS) -> RET { BODY }` whose body is compiled twice: as written, and
/// inside a function with AVX2 and FMA enabled (x86-64 only), called when [`level`] is
/// [`Level::Avx2`]. The body is `#[inline(always)]` into both, so what it calls inline is
/// vectorised for the level too. Both copies are public in the module named by
/// `variants NAME;`, for tests that compare them.
#[macro_export]
macro_rules! multiversion {
    (
        variants $variants:ident;
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if $crate::level() == $crate::Level::Avx2 {
                // SAFETY: level() is Avx2 only when the CPU has AVX2 and FMA.
                return unsafe { $variants::avx2($($arg),*) };
            }
            $variants::baseline($($arg),*)
        }

        /// The two compiled copies of the kernel of the same name.
        #[allow(dead_code)]
        $vis mod $variants {
            #[allow(unused_imports)]
            use super::*;

            /// The body, compiled for the baseline.
            #[inline(always)]
            pub fn baseline($($arg: $ty),*) $(-> $ret)? $body

            /// The body, compiled with AVX2 and FMA.
            ///
            /// # Safety
            /// The CPU must have AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                baseline($($arg),*)
            }
        }
    };
}

/// Independent accumulators of [`dot`] and [`squared_l2`]: two AVX2 registers or four SSE2
/// ones.
const LANES: usize = 16;

/// `Σ term(aᵢ, bᵢ)` over the common length: [`LANES`] independent accumulators over blocks
/// of that many floats, reduced pairwise (a fixed order, the same for both copies), then the
/// remainder one by one.
#[inline(always)]
fn sum_of_terms(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let (blocks_a, blocks_b) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (tail_a, tail_b) = (blocks_a.remainder(), blocks_b.remainder());
    for (x, y) in blocks_a.zip(blocks_b) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += term(x, y);
        }
    }
    let mut half = [0f32; LANES / 2];
    for (i, h) in half.iter_mut().enumerate() {
        *h = acc[i] + acc[i + LANES / 2];
    }
    let mut tail = 0f32;
    for (&x, &y) in tail_a.iter().zip(tail_b) {
        tail += term(x, y);
    }
    (((half[0] + half[4]) + (half[1] + half[5])) + ((half[2] + half[6]) + (half[3] + half[7])))
        + tail
}

multiversion! {
    variants dot_variants;
    /// Inner product of `a` and `b` over their common length.
    pub fn dot(a: &[f32], b: &[f32]) -> f32
    {
        sum_of_terms(a, b, |x, y| x * y)
    }
}

multiversion! {
    variants squared_l2_variants;
    /// `|a − b|²` over the common length, summed like [`dot`].
    pub fn squared_l2(a: &[f32], b: &[f32]) -> f32
    {
        sum_of_terms(a, b, |x, y| (x - y) * (x - y))
    }
}

multiversion! {
    variants axpy_variants;
    /// `y += a · x` over the common length.
    pub fn axpy(a: f32, x: &[f32], y: &mut [f32])
    {
        for (y, x) in y.iter_mut().zip(x) {
            *y += a * x;
        }
    }
}

/// Values in one block of GGML's Q8_0 format.
pub const Q8_0_VALUES: usize = 32;
/// Bytes of one Q8_0 block: the scale (f16, little-endian), then the 32 values (i8).
pub const Q8_0_BYTES: usize = 34;

/// The dot product of a Q8_0 row `w` (whole blocks) with a vector quantized to Q8_0 the same
/// way (`x_scales`, one f32 per block, each an f16 widened; `x_values`, 32 per block), in the
/// order of candle's AVX2 kernel for the pair, so bit for bit its result: in each block, lane
/// j of 8 sums the products of values 4j..4j+3 (an exact integer), and adds it times the
/// product of the two scales with a fused multiply-add; the lanes are summed pairwise at the
/// end. `None` where [`level`] is not AVX2: candle then runs its scalar kernel, which sums in
/// another order, and the caller calls that instead, so that a product is candle's on every
/// CPU. Why at all: a binary built for the x86-64 baseline gets candle's AVX2 kernel as a
/// call per row that widens each block's scale through a run-time dispatch (docs/
/// benchmarks.md, "Model forward pass"), 13% of a decode step on the default model.
pub fn q8_0_dot(w: &[u8], x_scales: &[f32], x_values: &[i8]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if has_q8_0_kernel() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return Some(unsafe { q8_0_dot_avx2(w, x_scales, x_values) });
    }
    let _ = (w, x_scales, x_values);
    None
}

/// Whether [`q8_0_dot`]'s kernel runs here: [`level`] AVX2, and F16C (every AVX2 CPU has it)
/// to widen the scales.
#[cfg(target_arch = "x86_64")]
fn has_q8_0_kernel() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| level() == Level::Avx2 && std::arch::is_x86_feature_detected!("f16c"))
}

/// [`q8_0_dot`]'s kernel: blocks past the shortest of the three inputs are ignored. The
/// products of a block's 32 value pairs are summed in 16-bit pairs (`|w| · sign(x, w)`:
/// at most 2 · 128 · 127, no saturation) and then in 32-bit lanes of 4.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_dot_avx2(w: &[u8], x_scales: &[f32], x_values: &[i8]) -> f32 {
    use std::arch::x86_64::*;
    let blocks = w
        .chunks_exact(Q8_0_BYTES)
        .zip(x_scales)
        .zip(x_values.chunks_exact(Q8_0_VALUES));
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for ((block, &x_scale), xs) in blocks {
        let bits = u16::from_le_bytes([block[0], block[1]]);
        let w_scale = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))));
        let d = _mm256_set1_ps(w_scale * x_scale);
        // SAFETY: both slices hold 32 bytes past these pointers (whole blocks).
        let (wv, xv) = unsafe {
            (
                _mm256_loadu_si256(block.as_ptr().add(2).cast()),
                _mm256_loadu_si256(xs.as_ptr().cast()),
            )
        };
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, pairs));
        acc = _mm256_fmadd_ps(d, lanes, acc);
    }
    // ((4 + 0) + (6 + 2)) + ((5 + 1) + (7 + 3)).
    let quad = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) without a random-number crate.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    const LENGTHS: [usize; 9] = [0, 1, 7, 15, 16, 17, 64, 255, 1000];

    #[test]
    fn dot_and_squared_l2_match_plain_f64_sums() {
        for n in LENGTHS {
            let (a, b) = (values(n, 1), values(n + 3, 2));
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!(
                (dot(&a, &b) as f64 - want).abs() <= 1e-5 * (1.0 + n as f64),
                "dot, n={n}"
            );
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
                .sum();
            let got = squared_l2(&a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + n as f64),
                "squared_l2, n={n}"
            );
        }
    }

    #[test]
    fn axpy_adds_a_scaled_copy_over_the_common_length() {
        let mut y = vec![1.0, 2.0, 3.0];
        axpy(2.0, &[1.0, 1.0], &mut y);
        assert_eq!(y, [3.0, 4.0, 3.0]);
    }

    /// The AVX2 copies give the same bits as the baseline ones: the same operations in the same
    /// order, so a result never depends on the CPU. Skipped (with a line) without AVX2.
    #[test]
    fn both_copies_give_identical_bits() {
        #[cfg(target_arch = "x86_64")]
        {
            if Level::detected() != Level::Avx2 {
                eprintln!("SKIPPED: this CPU has no AVX2, only the baseline copies run");
                return;
            }
            for n in LENGTHS {
                let (a, b) = (values(n, 3), values(n, 4));
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                unsafe {
                    assert_eq!(
                        dot_variants::baseline(&a, &b).to_bits(),
                        dot_variants::avx2(&a, &b).to_bits(),
                        "dot, n={n}"
                    );
                    assert_eq!(
                        squared_l2_variants::baseline(&a, &b).to_bits(),
                        squared_l2_variants::avx2(&a, &b).to_bits(),
                        "squared_l2, n={n}"
                    );
                    let (mut y1, mut y2) = (b.clone(), b.clone());
                    axpy_variants::baseline(0.37, &a, &mut y1);
                    axpy_variants::avx2(0.37, &a, &mut y2);
                    assert_eq!(y1, y2, "axpy, n={n}");
                }
            }
        }
    }
}
