//! k-means: k-means++ seeding, then Lloyd iterations, in squared L2.
//!
//! SAAP's buckets and ivf's lists both come from here, so that `ivfC,npP,norope,all` is
//! exactly SAAP's k-means baseline. faiss's own k-means seeds its centroids with random
//! points, which can leave a cluster without a centroid of its own; k-means++ seeding makes
//! that unlikely, and ivf hands these centroids to faiss as its trained quantizer.

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::error::{rows, IndexError, Result};
use kvdb_simd::dot;

/// k-means trains on at most this many points per centroid (faiss's default as well).
pub const MAX_POINTS_PER_CENTROID: usize = 256;

/// Points whose distances to every centroid one matrix product computes at a time.
const BLOCK_POINTS: usize = 1024;

/// Index of the nearest centroid (squared L2) of every row of `points`.
pub fn nearest(centroids: &[f32], points: &[f32], d: usize) -> Result<Vec<u32>> {
    let c = rows("centroids", centroids.len(), d)?;
    let n = rows("points", points.len(), d)?;
    if c == 0 {
        return Err(IndexError::Empty { what: "centroids" });
    }
    // |p - c|² = |p|² - 2 p·c + |c|²: |p|² is the same for every c, and a block of points'
    // p·c are one matrix product (k-means spends its time here).
    let norms: Vec<f32> = centroids.chunks_exact(d).map(|c| dot(c, c)).collect();
    let transposed = Tensor::from_slice(centroids, (c, d), &Device::Cpu)
        .and_then(|t| t.t())
        .map_err(matmul)?;
    let blocks = points
        .par_chunks(BLOCK_POINTS * d)
        .map(|block| -> Result<Vec<u32>> {
            let products = Tensor::from_slice(block, (block.len() / d, d), &Device::Cpu)
                .and_then(|p| p.matmul(&transposed))
                .and_then(|p| p.flatten_all())
                .and_then(|p| p.to_vec1::<f32>())
                .map_err(matmul)?;
            Ok(products
                .chunks_exact(c)
                .map(|row| {
                    let mut best = (f32::INFINITY, 0u32);
                    for (j, (product, norm)) in row.iter().zip(&norms).enumerate() {
                        let distance = norm - 2.0 * product;
                        if distance < best.0 {
                            best = (distance, j as u32);
                        }
                    }
                    best.1
                })
                .collect())
        })
        .collect::<Result<Vec<_>>>()?;
    let nearest: Vec<u32> = blocks.concat();
    debug_assert_eq!(nearest.len(), n);
    Ok(nearest)
}

fn matmul(e: candle_core::Error) -> IndexError {
    IndexError::Compute {
        what: "distances to the centroids",
        source: e,
    }
}

/// k-means with k-means++ seeding and `iterations` Lloyd steps on `points` `[n, d]`, on at
/// most [`MAX_POINTS_PER_CENTROID`] points per centroid drawn at random (as faiss does).
/// Returns `[min(c, n), d]` centroids; an empty cluster is re-seeded at a random point.
pub fn kmeans(
    points: &[f32],
    d: usize,
    c: usize,
    iterations: usize,
    seed: u64,
) -> Result<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = points.len() / d.max(1);
    let most = c.saturating_mul(MAX_POINTS_PER_CENTROID);
    let sampled: Vec<f32>;
    let points = if n > most {
        let mut picked = sample(&mut rng, n, most).into_vec();
        picked.sort_unstable();
        sampled = picked
            .iter()
            .flat_map(|&i| &points[i * d..(i + 1) * d])
            .copied()
            .collect();
        &sampled[..]
    } else {
        points
    };
    let n = points.len() / d.max(1);
    let c = c.min(n);
    if c == 0 {
        return Ok(Vec::new());
    }
    let row = |i: usize| &points[i * d..(i + 1) * d];
    // k-means++: each next centroid drawn with probability ∝ squared distance to the nearest
    // one chosen so far.
    let mut centroids = row(rng.random_range(0..n)).to_vec();
    let mut nearest2: Vec<f32> = (0..n).map(|i| squared(row(i), &centroids)).collect();
    while centroids.len() < c * d {
        let total: f64 = nearest2.iter().map(|&x| x as f64).sum();
        let pick = if total > 0.0 {
            let mut target = rng.random::<f64>() * total;
            nearest2
                .iter()
                .position(|&x| {
                    target -= x as f64;
                    target <= 0.0
                })
                .unwrap_or(n - 1)
        } else {
            rng.random_range(0..n)
        };
        let chosen = row(pick).to_vec();
        nearest2
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, m)| *m = m.min(squared(&points[i * d..(i + 1) * d], &chosen)));
        centroids.extend_from_slice(&chosen);
    }
    for _ in 0..iterations {
        let assigned = nearest(&centroids, points, d)?;
        let mut sums = vec![0f64; c * d];
        let mut counts = vec![0usize; c];
        for (i, &a) in assigned.iter().enumerate() {
            counts[a as usize] += 1;
            for (s, x) in sums[a as usize * d..(a as usize + 1) * d]
                .iter_mut()
                .zip(row(i))
            {
                *s += *x as f64;
            }
        }
        for j in 0..c {
            let target = &mut centroids[j * d..(j + 1) * d];
            if counts[j] == 0 {
                target.copy_from_slice(row(rng.random_range(0..n)));
            } else {
                for (t, s) in target.iter_mut().zip(&sums[j * d..(j + 1) * d]) {
                    *t = (*s / counts[j] as f64) as f32;
                }
            }
        }
    }
    Ok(centroids)
}

fn squared(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}
