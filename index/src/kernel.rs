//! Small numeric kernels shared by the indexes and by `kvdb-attention`.
//!
//! Written so that LLVM vectorises them (the workspace builds with
//! `-C target-cpu=x86-64-v3`, so AVX2): no `unsafe`, no intrinsics.

/// Inner product of `a` and `b` over their common length.
///
/// Eight independent accumulators over blocks of eight floats become one AVX2 register of
/// partial sums, reduced pairwise at the end; the remainder is added one by one.
///
/// ```
/// assert_eq!(kvdb_index::kernel::dot(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
/// ```
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (blocks_a, blocks_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let (tail_a, tail_b) = (blocks_a.remainder(), blocks_b.remainder());
    for (x, y) in blocks_a.zip(blocks_b) {
        for ((s, x), y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in tail_a.iter().zip(tail_b) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::dot;

    /// Every length around the block size agrees with a plain f64 sum.
    #[test]
    fn dot_matches_plain_sum() {
        for n in 0..40 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 1.91).cos()).collect();
            let expected: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = dot(&a, &b) as f64;
            assert!((got - expected).abs() < 1e-5, "n={n}: {got} vs {expected}");
        }
        assert_eq!(dot(&[1.0, 2.0], &[3.0]), 3.0);
    }
}
