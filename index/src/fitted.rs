//! Bucket routing fitted on the corpus's own queries ([`FittedRouting`]): which buckets a
//! query's attention falls in, learned from the queries that met the keys at ingest.
//!
//! Routing by centroid ranks a bucket by `q · c`, the mean logit of its keys. Queries and keys
//! come from different distributions (RetrievalAttention's and SAAP's observation), and the
//! mean logit of a bucket says little about where a query's attention mass lies: on the
//! default model's layer 11, over the GPL, the two buckets of 128 with the best centroid score
//! held 0.15 of a query's mass, the two this routing ranks first 0.41
//! (kvdb/tests/real.rs prints both).
//!
//! The fit keeps routing linear (one vector and one bias per bucket, so that a GPU can route
//! as it does by centroid) and learns it from a [`QuerySample`]: for every sampled query and
//! query head, the share of its attention mass (over the keys before it, its last
//! [`QuerySample::recent`] left out as the engine attends those densely) that falls in each
//! bucket is measured exactly, with RoPE; then one ridge regression per bucket predicts the
//! log of that share from the pre-RoPE query. It is fitted as a correction to the centroid
//! score (`scale · q · c` plus what the regression adds), and the ridge pulls the correction
//! towards zero, so that a small or unrepresentative sample leaves routing by centroid.

use rayon::prelude::*;

use crate::flat::FlatIndex;
use crate::{GroupQuery, KeyIndex, QuerySample, Result};
use kvdb_simd::dot;

/// A bucket's share of the mass is fitted in log space with this floor, so that buckets with
/// no mass for a query do not dominate the fit with `ln 0`.
const SHARE_FLOOR: f64 = 1e-3;

/// The ridge on the correction, as a share of the mean diagonal of the queries' Gram matrix.
/// Measured on the default model's real keys (kvdb/tests/real.rs's layers, 128 and 256
/// buckets): 0.01 kept the gains of a near-free fit in layers 11 and 17 and, in layer 5 at
/// 256 buckets, where a near-free fit lost mass to the centroids, matched them.
const RIDGE: f64 = 0.01;

/// The most query-key products a fit computes: sampled queries beyond it are thinned evenly
/// (a fit of 128-dimensional routing needs a few thousand query heads, not more).
const MAX_FIT_PRODUCTS: usize = 1 << 31;

/// Sampled queries with fewer eligible keys before them are not used.
pub(crate) const MIN_KEYS: usize = 16;

/// One vector and one bias per bucket: a group's score for bucket `b` is the best over its
/// heads of `q · vectors[b]`, plus `bias[b]` (pre-RoPE queries).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct FittedRouting {
    /// `[buckets, head_dim]`.
    pub(crate) vectors: Vec<f32>,
    /// `[buckets]`.
    pub(crate) bias: Vec<f32>,
}

impl FittedRouting {
    /// Each bucket's score for a group of pre-RoPE queries `[heads, head_dim]`.
    pub(crate) fn scores(&self, queries: &[f32], d: usize) -> Vec<f32> {
        self.vectors
            .chunks_exact(d)
            .zip(&self.bias)
            .map(|(v, b)| {
                queries
                    .chunks_exact(d)
                    .map(|q| dot(q, v))
                    .fold(f32::NEG_INFINITY, f32::max)
                    + b
            })
            .collect()
    }

    /// Fits the routing of buckets with `centroids` `[buckets, d]` (pre-RoPE space), whose
    /// keys `rotated` (ids `0..`) belong to the buckets `assignments` (by id), on `sample`.
    /// Returns the routing and how many query heads it learned from; `None` when no sampled
    /// query had [`MIN_KEYS`] keys before it (or every sampled query is zero).
    pub(crate) fn fit(
        sample: &QuerySample<'_>,
        rotated: &FlatIndex,
        assignments: &[u32],
        centroids: &[f32],
    ) -> Result<Option<(Self, usize)>> {
        let d = rotated.head_dim();
        let buckets = centroids.len() / d;
        let group = sample.group(d)?;
        let used = used_samples(sample, rotated.len(), group, d);
        if used.is_empty() {
            return Ok(None);
        }
        let dim = d + 1;
        let zero = || (vec![0f64; dim * dim], vec![0f64; dim * buckets]);
        let (mut gram, mut rhs) = used
            .par_iter()
            .fold(zero, |(mut gram, mut rhs), &i| {
                let position = sample.positions[i] as usize;
                let queries = &sample.queries[i * group * d..(i + 1) * group * d];
                let rotated_queries = rotated.rotate_query(&GroupQuery { queries, position });
                let keys = &rotated.rows()[..sample.eligible(i, rotated.len()) * d];
                for (q, r) in queries.chunks_exact(d).zip(rotated_queries.chunks_exact(d)) {
                    let mut shares = vec![0f64; buckets];
                    for (w, &bucket) in attention_weights(r, keys, sample.scale)
                        .into_iter()
                        .zip(assignments)
                    {
                        shares[bucket as usize] += w;
                    }
                    let x: Vec<f64> = q.iter().map(|&v| v as f64).chain([1.0]).collect();
                    for a in 0..dim {
                        for b in 0..=a {
                            gram[a * dim + b] += x[a] * x[b];
                        }
                    }
                    for (bucket, share) in shares.iter().enumerate() {
                        let centroid = &centroids[bucket * d..(bucket + 1) * d];
                        let y =
                            (share + SHARE_FLOOR).ln() - (sample.scale * dot(q, centroid)) as f64;
                        for a in 0..dim {
                            rhs[a * buckets + bucket] += x[a] * y;
                        }
                    }
                }
                (gram, rhs)
            })
            .reduce(zero, |(mut g, mut r), (g2, r2)| {
                g.iter_mut().zip(g2).for_each(|(a, b)| *a += b);
                r.iter_mut().zip(r2).for_each(|(a, b)| *a += b);
                (g, r)
            });
        for a in 0..dim {
            for b in 0..a {
                gram[b * dim + a] = gram[a * dim + b];
            }
        }
        let mean_diagonal = (0..d).map(|a| gram[a * dim + a]).sum::<f64>() / d as f64;
        for a in 0..d {
            gram[a * dim + a] += RIDGE * mean_diagonal;
        }
        if solve_spd(&mut gram, dim, &mut rhs, buckets).is_none() {
            // Only queries that are all zero make the ridged matrix singular.
            return Ok(None);
        }
        let mut vectors = Vec::with_capacity(buckets * d);
        for (bucket, centroid) in centroids.chunks_exact(d).enumerate() {
            vectors.extend(
                centroid
                    .iter()
                    .enumerate()
                    .map(|(a, &c)| sample.scale * c + rhs[a * buckets + bucket] as f32),
            );
        }
        let bias = (0..buckets).map(|b| rhs[d * buckets + b] as f32).collect();
        let heads = used.len() * group;
        Ok(Some((Self { vectors, bias }, heads)))
    }
}

/// The sampled queries a fit reads (their numbers in `sample`): those with at least
/// [`MIN_KEYS`] of the `n` keys eligible before them, thinned evenly so that their products
/// with those keys (`group` heads of `d` dimensions) stay under [`MAX_FIT_PRODUCTS`].
pub(crate) fn used_samples(
    sample: &QuerySample<'_>,
    n: usize,
    group: usize,
    d: usize,
) -> Vec<usize> {
    let usable: Vec<usize> = (0..sample.positions.len())
        .filter(|&i| sample.eligible(i, n) >= MIN_KEYS)
        .collect();
    let products: usize = usable
        .iter()
        .map(|&i| sample.eligible(i, n) * group * d)
        .sum();
    let stride = products.div_ceil(MAX_FIT_PRODUCTS).max(1);
    usable.into_iter().step_by(stride).collect()
}

/// One rotated query's softmax attention weights over `keys` (rotated, `[keys, d]`, ids
/// `0..`), in f64, summing to one.
pub(crate) fn attention_weights(query: &[f32], keys: &[f32], scale: f32) -> Vec<f64> {
    let d = query.len();
    let logits: Vec<f32> = keys
        .chunks_exact(d)
        .map(|k| scale * dot(query, k))
        .collect();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut weights: Vec<f64> = logits.iter().map(|&z| ((z - max) as f64).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter_mut().for_each(|w| *w /= total);
    weights
}

/// Solves `a · x = b` in place for a symmetric positive definite `a` (`[n, n]`, row-major;
/// overwritten by its Cholesky factor) and `m` right-hand sides `b` (`[n, m]`, overwritten by
/// `x`). `None` when `a` is not positive definite.
fn solve_spd(a: &mut [f64], n: usize, b: &mut [f64], m: usize) -> Option<()> {
    for j in 0..n {
        let diagonal = a[j * n + j] - (0..j).map(|k| a[j * n + k].powi(2)).sum::<f64>();
        if diagonal.is_nan() || diagonal <= 0.0 {
            return None;
        }
        let l = diagonal.sqrt();
        a[j * n + j] = l;
        for i in j + 1..n {
            let s = a[i * n + j] - (0..j).map(|k| a[i * n + k] * a[j * n + k]).sum::<f64>();
            a[i * n + j] = s / l;
        }
    }
    for c in 0..m {
        for i in 0..n {
            let s = b[i * m + c] - (0..i).map(|k| a[i * n + k] * b[k * m + c]).sum::<f64>();
            b[i * m + c] = s / a[i * n + i];
        }
        for i in (0..n).rev() {
            let s = b[i * m + c] - (i + 1..n).map(|k| a[k * n + i] * b[k * m + c]).sum::<f64>();
            b[i * m + c] = s / a[i * n + i];
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solve_spd_solves_and_refuses_a_singular_matrix() {
        // [[4, 2], [2, 3]] x = [[2, 8], [1, 7]] (two right-hand sides as columns).
        let mut a = vec![4.0, 2.0, 2.0, 3.0];
        let mut b = vec![2.0, 8.0, 1.0, 7.0];
        solve_spd(&mut a, 2, &mut b, 2).unwrap();
        let expect = [0.5, 1.25, 0.0, 1.5];
        for (x, e) in b.iter().zip(expect) {
            assert!((x - e).abs() < 1e-12, "{b:?}");
        }
        let mut singular = vec![1.0, 1.0, 1.0, 1.0];
        assert!(solve_spd(&mut singular, 2, &mut [1.0, 1.0], 1).is_none());
    }
}
