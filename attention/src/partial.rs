//! [`Partial`] attention over a token set and the exact log-sum-exp [`merge`].

use kvdb_simd::{axpy, dot};

use crate::error::{length, rows};
use crate::{AttentionError, Result};

/// Tokens accumulated into a block sum before it is added to the running total: two-level
/// summation keeps f32 rounding error small over thousands of tokens.
const BLOCK_TOKENS: usize = 64;

/// Softmax attention of `heads` query heads over one token set, not yet normalised.
///
/// For head `h` over tokens with logits `s_j` and value rows `v_j`: `max[h] = m = max_j s_j`,
/// `sum[h] = Σ_j exp(s_j - m)` and `out[h] = Σ_j exp(s_j - m) · v_j`. A head that saw no
/// token has `max = -inf`, `sum = 0` and a zero `out`; such a partial is the identity of
/// [`merge`].
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    /// Number of query heads.
    pub heads: usize,
    /// Length of each value (and output) row.
    pub head_dim: usize,
    /// Unnormalised outputs `[heads, head_dim]`: `Σ exp(s - max) · v`.
    pub out: Vec<f32>,
    /// Running maximum logit per head `[heads]`; `-inf` when the head saw no token.
    pub max: Vec<f32>,
    /// Sum of exponentials per head `[heads]`: `Σ exp(s - max)`.
    pub sum: Vec<f32>,
}

/// Scaled dot products `scale · q_h · k_j`: queries `[heads, head_dim]` and keys
/// `[n, head_dim]`, both already rotated, give logits `[heads, n]`.
///
/// Trailing floats that do not make a whole row are ignored, and `head_dim == 0` gives no
/// logits; callers that take these slices from users check their shapes first.
pub fn logits(queries: &[f32], keys: &[f32], head_dim: usize, scale: f32) -> Vec<f32> {
    if head_dim == 0 {
        return Vec::new();
    }
    let n = keys.len() / head_dim;
    let heads = queries.len() / head_dim;
    let mut logits = vec![0.0f32; heads * n];
    // Keys outer, heads inner: every key row is read from memory once.
    for (j, key) in keys.chunks_exact(head_dim).enumerate() {
        for (h, query) in queries.chunks_exact(head_dim).enumerate() {
            logits[h * n + j] = scale * dot(query, key);
        }
    }
    logits
}

/// The largest element, `-inf` for none, NaN when any element is NaN.
fn max_of(xs: &[f32]) -> f32 {
    let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m.is_nan() || xs.iter().any(|x| x.is_nan()) {
        f32::NAN
    } else {
        m
    }
}

impl Partial {
    /// The partial of no tokens: `out` zero, `max` `-inf`, `sum` zero.
    pub fn empty(heads: usize, head_dim: usize) -> Self {
        Self {
            heads,
            head_dim,
            out: vec![0.0; heads * head_dim],
            max: vec![f32::NEG_INFINITY; heads],
            sum: vec![0.0; heads],
        }
    }

    /// The partial of `n` tokens with logits `[heads, n]` (see [`logits`]) and value rows
    /// `values` `[n, head_dim]`, where `n = logits.len() / heads`.
    ///
    /// A head whose logits are all `-inf` (masked) saw no token; a NaN logit makes its head's
    /// result NaN.
    pub fn from_logits(
        logits: &[f32],
        values: &[f32],
        heads: usize,
        head_dim: usize,
    ) -> Result<Partial> {
        if heads == 0 {
            return Err(AttentionError::Empty { what: "heads" });
        }
        if head_dim == 0 {
            return Err(AttentionError::Shape {
                what: "values",
                len: values.len(),
                row: 0,
            });
        }
        let n = rows("logits", logits.len(), heads)?;
        length("values", n * head_dim, values.len())?;
        let mut partial = Partial::empty(heads, head_dim);
        let mut block = vec![0.0f32; head_dim];
        for (h, row) in logits.chunks_exact(n.max(1)).enumerate().take(heads) {
            let m = max_of(row);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let out = &mut partial.out[h * head_dim..(h + 1) * head_dim];
            let mut sum = 0.0f32;
            for (block_logits, block_values) in row
                .chunks(BLOCK_TOKENS)
                .zip(values.chunks(BLOCK_TOKENS * head_dim))
            {
                block.fill(0.0);
                let mut block_sum = 0.0f32;
                for (s, v) in block_logits.iter().zip(block_values.chunks_exact(head_dim)) {
                    let w = (s - m).exp();
                    block_sum += w;
                    axpy(w, v, &mut block);
                }
                sum += block_sum;
                axpy(1.0, &block, out);
            }
            partial.max[h] = m;
            partial.sum[h] = sum;
        }
        Ok(partial)
    }

    /// An error unless the field lengths agree with `heads` and `head_dim`.
    fn check(&self) -> Result<()> {
        length("partial out", self.heads * self.head_dim, self.out.len())?;
        length("partial max", self.heads, self.max.len())?;
        length("partial sum", self.heads, self.sum.len())
    }

    /// The normalised output `[heads, head_dim]`: `out / sum` per head; zeros for a head that
    /// saw no token.
    pub fn finish(&self) -> Vec<f32> {
        let mut output = self.out.clone();
        for (row, &sum) in output.chunks_exact_mut(self.head_dim.max(1)).zip(&self.sum) {
            if sum == 0.0 {
                row.fill(0.0);
            } else {
                let inv = 1.0 / sum;
                row.iter_mut().for_each(|x| *x *= inv);
            }
        }
        output
    }

    /// Each token's share of its head's total attention mass, `exp(s - max) / sum`, for
    /// logits `[heads, n]` of tokens this partial covers (typically the merged, final one).
    /// Zero for a head that saw no token; `n = logits.len() / heads`, trailing floats ignored.
    pub fn probabilities(&self, logits: &[f32]) -> Vec<f32> {
        let n = logits.len().checked_div(self.heads).unwrap_or(0);
        let mut shares = vec![0.0f32; self.heads * n];
        if n == 0 {
            return shares;
        }
        let per_head = logits.chunks_exact(n).zip(&self.max).zip(&self.sum);
        for (((row, &max), &sum), shares) in per_head.zip(shares.chunks_exact_mut(n)) {
            if sum != 0.0 {
                let inv = 1.0 / sum;
                for (p, s) in shares.iter_mut().zip(row) {
                    *p = (s - max).exp() * inv;
                }
            }
        }
        shares
    }
}

/// The partial of the union of two disjoint token sets, exactly (log-sum-exp rescaling):
/// with `m = max(m_a, m_b)`, `out = e^(m_a - m) out_a + e^(m_b - m) out_b` and likewise `sum`.
///
/// Shapes must match. An empty head (no tokens) is an identity: the other side is copied, so
/// `-inf - -inf` never happens and two empty heads stay empty.
pub fn merge(a: &Partial, b: &Partial) -> Result<Partial> {
    a.check()?;
    b.check()?;
    if (a.heads, a.head_dim) != (b.heads, b.head_dim) {
        return Err(AttentionError::PartialMismatch {
            a_heads: a.heads,
            a_dim: a.head_dim,
            b_heads: b.heads,
            b_dim: b.head_dim,
        });
    }
    let d = a.head_dim;
    let mut merged = Partial::empty(a.heads, d);
    for h in 0..a.heads {
        let rows = h * d..(h + 1) * d;
        let (ma, mb) = (a.max[h], b.max[h]);
        let out = &mut merged.out[rows.clone()];
        if mb == f32::NEG_INFINITY {
            out.copy_from_slice(&a.out[rows]);
            merged.max[h] = ma;
            merged.sum[h] = a.sum[h];
        } else if ma == f32::NEG_INFINITY {
            out.copy_from_slice(&b.out[rows]);
            merged.max[h] = mb;
            merged.sum[h] = b.sum[h];
        } else {
            // NaN in either max propagates through the weights.
            let m = if ma.is_nan() || mb.is_nan() {
                f32::NAN
            } else {
                ma.max(mb)
            };
            let (wa, wb) = ((ma - m).exp(), (mb - m).exp());
            for ((o, x), y) in out.iter_mut().zip(&a.out[rows.clone()]).zip(&b.out[rows]) {
                *o = wa * x + wb * y;
            }
            merged.max[h] = m;
            merged.sum[h] = wa * a.sum[h] + wb * b.sum[h];
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tokens by hand: logits 0 and ln 3 give weights 1/4 and 3/4.
    #[test]
    fn two_tokens_by_hand() -> Result<()> {
        let p = Partial::from_logits(&[0.0, 3f32.ln()], &[4.0, 0.0, 0.0, 8.0], 1, 2)?;
        assert_eq!(p.max, vec![3f32.ln()]);
        let out = p.finish();
        assert!(
            (out[0] - 1.0).abs() < 1e-6 && (out[1] - 6.0).abs() < 1e-6,
            "{out:?}"
        );
        let shares = p.probabilities(&[0.0, 3f32.ln()]);
        assert!((shares[0] - 0.25).abs() < 1e-6 && (shares[1] - 0.75).abs() < 1e-6);
        Ok(())
    }

    /// Empty partials are identities; two empties stay empty without NaN.
    #[test]
    fn empty_is_identity() -> Result<()> {
        let p = Partial::from_logits(&[1.0, -2.0, 0.5, 0.25], &[1.0, 2.0, 3.0, 4.0], 2, 2)?;
        let e = Partial::empty(2, 2);
        assert_eq!(merge(&p, &e)?, p);
        assert_eq!(merge(&e, &p)?, p);
        let ee = merge(&e, &e)?;
        assert_eq!(ee, e);
        assert_eq!(ee.finish(), vec![0.0; 4]);
        assert_eq!(Partial::from_logits(&[], &[], 3, 2)?, Partial::empty(3, 2));
        // A masked head (all -inf) saw no token.
        let masked = Partial::from_logits(&[f32::NEG_INFINITY, 0.0], &[1.0], 2, 1)?;
        assert_eq!(masked.max[0], f32::NEG_INFINITY);
        assert_eq!(masked.finish(), vec![0.0, 1.0]);
        Ok(())
    }

    /// Shape mismatches are errors.
    #[test]
    fn shape_errors() {
        assert!(Partial::from_logits(&[0.0; 3], &[0.0; 3], 2, 1).is_err());
        assert!(Partial::from_logits(&[0.0; 2], &[0.0; 3], 1, 2).is_err());
        assert!(Partial::from_logits(&[0.0; 2], &[0.0; 4], 0, 2).is_err());
        assert!(Partial::from_logits(&[0.0; 2], &[], 1, 0).is_err());
        assert!(merge(&Partial::empty(2, 4), &Partial::empty(2, 3)).is_err());
        let mut broken = Partial::empty(2, 4);
        broken.out.pop();
        assert!(merge(&broken, &Partial::empty(2, 4)).is_err());
        assert!(logits(&[1.0; 4], &[1.0; 8], 0, 1.0).is_empty());
    }
}
