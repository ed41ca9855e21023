//! The keys the corpus's own queries attended most ([`heavy_keys`]): what `ivf…,hot<N>`
//! scores at every search beside its probed lists.
//!
//! H2O's observation (and MInference's "vertical" lines) is that a small set of keys draws a
//! large share of the attention of most queries, wherever those queries sit. A partition
//! ranked by centroid or mean logit misses such a key whenever it sits in a list whose other
//! keys matter little to the query at hand; scoring it at every search costs a fixed few
//! products. Which keys they are is measured on the corpus's sampled queries (a
//! [`QuerySample`]): each sampled query head's exact attention over the keys before it (its
//! recent window left out, which decoding attends densely anyway) is added up per key, and the
//! keys with the largest totals are kept. On the Debian Reference at 16K and 32K tokens the
//! 1% kept this way raised top-k IVF from 81-83% to 88-89% of flat top-k's attention mass for
//! under one point more of the keys scored (docs/benchmarks.md, "Keys the corpus's queries
//! attended most").

use rayon::prelude::*;

use crate::common::top_indices;
use crate::fitted::{attention_weights, used_samples};
use crate::flat::FlatIndex;
use crate::{GroupQuery, KeyIndex, QuerySample, Result};

/// The `count` keys of `rotated` (ids `0..`, rotated at their ids) that `sample`'s queries
/// attended most in total, ascending by id; fewer when fewer keys were attended at all (a
/// sample with no usable query attends none).
pub(crate) fn heavy_keys(
    sample: &QuerySample<'_>,
    rotated: &FlatIndex,
    count: usize,
) -> Result<Vec<u32>> {
    let d = rotated.head_dim();
    let n = rotated.len();
    let group = sample.group(d)?;
    let used = used_samples(sample, n, group, d);
    let totals = used
        .par_iter()
        .fold(
            || vec![0f64; n],
            |mut totals, &i| {
                let queries = &sample.queries[i * group * d..(i + 1) * group * d];
                let position = sample.positions[i] as usize;
                let rotated_queries = rotated.rotate_query(&GroupQuery { queries, position });
                let keys = &rotated.rows()[..sample.eligible(i, n) * d];
                for query in rotated_queries.chunks_exact(d) {
                    for (total, w) in
                        totals
                            .iter_mut()
                            .zip(attention_weights(query, keys, sample.scale))
                    {
                        *total += w;
                    }
                }
                totals
            },
        )
        .reduce(
            || vec![0f64; n],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                a
            },
        );
    // Keys no query attended (NaN weights included) are never kept.
    let scores: Vec<f32> = totals
        .iter()
        .map(|&t| if t > 0.0 { t as f32 } else { f32::NEG_INFINITY })
        .collect();
    let attended = scores.iter().filter(|s| s.is_finite()).count();
    let mut heavy = top_indices(&scores, count.min(attended));
    heavy.sort_unstable();
    Ok(heavy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvdb_model::RopeStyle;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const D: usize = 8;

    /// `v` rotated back from `position`: `Rᵀ v`, whose `j`th entry is `(R e_j) · v`.
    fn unrotate(rope: &kvdb_model::Rope, v: &[f32], position: usize) -> Vec<f32> {
        (0..v.len())
            .map(|j| {
                let mut e = vec![0f32; v.len()];
                e[j] = 1.0;
                rope.rotate(&mut e, position);
                e.iter().zip(v).map(|(a, b)| a * b).sum()
            })
            .collect()
    }

    /// A key aligned, at its position, with every sampled query head is kept first; keys
    /// after every sample's eligible range are never kept; the count is capped by the keys
    /// attended, and the ids come ascending.
    #[test]
    fn the_key_every_query_attends_is_kept() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(7);
        let (n, hot, group) = (400, 123, 2);
        let positions: Vec<u32> = (0..20).map(|i| 200 + 10 * i).collect();
        let queries: Vec<f32> = (0..positions.len() * group * D)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let rope = kvdb_tests::test_rope(RopeStyle::Halves, D);
        // The sum of every sampled query head's rotated unit direction: its logit with each
        // of them is large where random keys' are small.
        let mut direction = vec![0f32; D];
        for (s, q) in queries.chunks_exact(group * D).enumerate() {
            let mut r = q.to_vec();
            rope.rotate(&mut r, positions[s] as usize);
            for head in r.chunks_exact(D) {
                let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
                direction
                    .iter_mut()
                    .zip(head)
                    .for_each(|(a, b)| *a += b / norm);
            }
        }
        let mut keys: Vec<f32> = (0..n * D).map(|_| rng.random_range(-0.1..0.1)).collect();
        keys[hot * D..(hot + 1) * D].copy_from_slice(&unrotate(&rope, &direction, hot));
        let mut rotated = FlatIndex::new(rope);
        rotated.add(&keys)?;
        let sample = QuerySample {
            queries: &queries,
            positions: &positions,
            scale: 1.0,
            recent: 16,
        };
        assert_eq!(heavy_keys(&sample, &rotated, 1)?, vec![hot as u32]);
        let every = heavy_keys(&sample, &rotated, 10 * n)?;
        // The last sample (position 390) attends the keys before 390 - 16 = 374.
        assert_eq!(every.len(), 374);
        assert!(every.windows(2).all(|w| w[0] < w[1]));
        assert!(heavy_keys(&sample, &rotated, 0)?.is_empty());
        Ok(())
    }
}
