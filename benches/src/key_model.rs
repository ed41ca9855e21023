//! [`KeyModel`]: a distribution fitted to the default model's real keys, values and queries,
//! from which the micro-benches draw corpora of any size.
//!
//! Each of the three is a [`LowRankGaussian`]: its mean, its top principal directions scaled
//! by their standard deviations, and an independent per-dimension residual that makes every
//! dimension's variance equal the real one. Queries are one vector per token for the whole
//! GQA group (`[group · head_dim]`), so the correlation between a group's heads is kept.
//!
//! The parameters are fitted once (`cargo run --release -p kvdb-benches --bin fit_keys`) and
//! committed in `benches/data/key-model.bin`, so the benches need neither the model nor its
//! capture. A smaller head dimension is derived by [`KeyModel::at_head_dim`]: keep every
//! `s`-th RoPE pair, whose frequencies are then exactly those of the smaller head's RoPE.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use kvdb_model::{Rope, RopeConfig, RopeScaling, RopeStyle};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Rows drawn from one seeded generator; row `i` depends only on the seed and `i`, so a
/// corpus of `n` keys is a prefix of every larger one drawn with the same seed.
const ROWS_PER_STREAM: usize = 4096;

/// Version of the data file's layout.
const FILE_VERSION: u32 = 1;

/// The committed fit.
pub fn committed_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/key-model.bin")
}

/// `x = mean + Σ_j z_j · factors_j + residual ⊙ e` with `z`, `e` standard normal: a Gaussian
/// whose covariance is `FᵀF + diag(residual²)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LowRankGaussian {
    /// Vector length.
    pub dim: usize,
    /// Mean `[dim]`.
    #[serde(with = "as_f16")]
    pub mean: Vec<f32>,
    /// Principal directions times their standard deviations, `[rank, dim]`.
    #[serde(with = "as_f16")]
    pub factors: Vec<f32>,
    /// Per-dimension standard deviation left after the factors `[dim]`.
    #[serde(with = "as_f16")]
    pub residual: Vec<f32>,
}

impl LowRankGaussian {
    /// Fits `rows` `[n, dim]` with `rank` principal directions (found by orthogonal iteration
    /// on the sample covariance, in f64).
    pub fn fit(rows: &[f32], dim: usize, rank: usize) -> Result<Self> {
        let n = rows.len() / dim.max(1);
        ensure!(
            dim > 0 && rows.len() == n * dim && n > rank,
            "{} floats are not enough rows of {dim} for rank {rank}",
            rows.len()
        );
        let mut mean = vec![0f64; dim];
        for row in rows.chunks_exact(dim) {
            mean.iter_mut().zip(row).for_each(|(m, &x)| *m += x as f64);
        }
        mean.iter_mut().for_each(|m| *m /= n as f64);
        let centred: Vec<f64> = rows
            .chunks_exact(dim)
            .flat_map(|row| row.iter().zip(&mean).map(|(&x, m)| x as f64 - m))
            .collect();
        // Covariance, one row per task: C[a][b] = Σ_i x_ia x_ib / (n - 1).
        let covariance: Vec<f64> = (0..dim)
            .into_par_iter()
            .flat_map_iter(|a| {
                let mut row = vec![0f64; dim];
                for x in centred.chunks_exact(dim) {
                    row.iter_mut().zip(x).for_each(|(c, &xb)| *c += x[a] * xb);
                }
                row.into_iter().map(move |c| c / (n - 1) as f64)
            })
            .collect();
        let directions = top_eigenvectors(&covariance, dim, rank);
        let mut factors = Vec::with_capacity(rank * dim);
        let mut explained = vec![0f64; dim];
        for q in directions.chunks_exact(dim) {
            let cq = mat_vec(&covariance, q);
            let std = dot(q, &cq).max(0.0).sqrt();
            for (e, &x) in explained.iter_mut().zip(q) {
                *e += (std * x).powi(2);
            }
            factors.extend(q.iter().map(|&x| (std * x) as f32));
        }
        let residual = (0..dim)
            .map(|i| (covariance[i * dim + i] - explained[i]).max(0.0).sqrt() as f32)
            .collect();
        Ok(Self {
            dim,
            mean: mean.iter().map(|&m| m as f32).collect(),
            factors,
            residual,
        })
    }

    /// Principal directions kept.
    pub fn rank(&self) -> usize {
        self.factors.len() / self.dim.max(1)
    }

    /// Share of the total variance the factors hold.
    pub fn explained_variance(&self) -> f64 {
        let square_sum = |v: &[f32]| v.iter().fold(0f64, |s, &x| s + (x as f64).powi(2));
        let (factored, rest) = (square_sum(&self.factors), square_sum(&self.residual));
        factored / (factored + rest)
    }

    /// The marginal distribution of the coordinates `dims` (exact for a Gaussian).
    fn select(&self, dims: &[usize]) -> Self {
        let pick = |v: &[f32]| dims.iter().map(|&i| v[i]).collect::<Vec<f32>>();
        Self {
            dim: dims.len(),
            mean: pick(&self.mean),
            factors: self.factors.chunks_exact(self.dim).flat_map(pick).collect(),
            residual: pick(&self.residual),
        }
    }

    /// `n` rows `[n, dim]` drawn with `seed` (in parallel; the same rows whatever `n`).
    pub fn sample(&self, n: usize, seed: u64) -> Vec<f32> {
        let mut out = vec![0f32; n * self.dim];
        out.par_chunks_mut(ROWS_PER_STREAM * self.dim.max(1))
            .enumerate()
            .for_each(|(stream, rows)| {
                let mut rng = StdRng::seed_from_u64(
                    seed ^ (stream as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                let mut z = vec![0f32; self.rank()];
                for row in rows.chunks_exact_mut(self.dim) {
                    z.iter_mut()
                        .for_each(|z| *z = StandardNormal.sample(&mut rng));
                    for ((x, m), r) in row.iter_mut().zip(&self.mean).zip(&self.residual) {
                        let e: f32 = StandardNormal.sample(&mut rng);
                        *x = m + r * e;
                    }
                    for (&z, f) in z.iter().zip(self.factors.chunks_exact(self.dim)) {
                        row.iter_mut().zip(f).for_each(|(x, f)| *x += z * f);
                    }
                }
            });
        out
    }
}

/// The fitted keys, values and queries of one layer's KV head and its query group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyModel {
    /// Layout version of the file.
    pub version: u32,
    /// What was fitted (model, layer, text, tokens).
    pub source: String,
    /// The layer's RoPE base (style: halves, no scaling).
    pub rope_base: f32,
    /// Head dimension.
    pub head_dim: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Pre-RoPE keys, `dim = head_dim`.
    pub keys: LowRankGaussian,
    /// Values, `dim = head_dim`.
    pub values: LowRankGaussian,
    /// Pre-RoPE queries of the whole group, `dim = group · head_dim`.
    pub queries: LowRankGaussian,
}

impl KeyModel {
    /// A model of `source` from its parts (version set to the current one).
    pub fn new(
        source: String,
        rope_base: f32,
        group: usize,
        keys: LowRankGaussian,
        values: LowRankGaussian,
        queries: LowRankGaussian,
    ) -> Self {
        Self {
            version: FILE_VERSION,
            source,
            rope_base,
            head_dim: keys.dim,
            group,
            keys,
            values,
            queries,
        }
    }

    /// The committed fit (`benches/data/key-model.bin`) and its bytes.
    pub fn committed() -> Result<(Self, Vec<u8>)> {
        let path = committed_path();
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let model: Self =
            postcard::from_bytes(&bytes).with_context(|| format!("decoding {}", path.display()))?;
        ensure!(
            model.version == FILE_VERSION,
            "{} has layout version {} (this build reads {FILE_VERSION}): run fit_keys",
            path.display(),
            model.version
        );
        Ok((model, bytes))
    }

    /// The bytes [`KeyModel::committed`] reads.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(postcard::to_allocvec(self)?)
    }

    /// The model for heads of `head_dim` dimensions, which must divide the fitted one into
    /// an even number of dimensions: the fit restricted to every `s`-th RoPE pair
    /// (`s = self.head_dim / head_dim`), i.e. dimensions `s·m` and `D/2 + s·m` for `m <
    /// head_dim / 2` in every head. Pair `s·m` of the fitted RoPE turns at `base^(-2sm/D)
    /// = base^(-2m/head_dim)`, exactly pair `m` of the smaller head's RoPE with the same
    /// base, so the derived keys rotate as real keys of that head would.
    pub fn at_head_dim(&self, head_dim: usize) -> Result<Self> {
        let full = self.head_dim;
        let stride = full / head_dim.max(1);
        ensure!(
            head_dim >= 2 && head_dim & 1 == 0 && stride * head_dim == full,
            "head dimension {head_dim} is not an even divisor of {full}"
        );
        let one_head: Vec<usize> = [0, full / 2]
            .iter()
            .flat_map(|&half| (0..head_dim / 2).map(move |m| half + stride * m))
            .collect();
        let group_dims: Vec<usize> = (0..self.group)
            .flat_map(|h| one_head.iter().map(move |&i| h * full + i))
            .collect();
        Ok(Self {
            head_dim,
            keys: self.keys.select(&one_head),
            values: self.values.select(&one_head),
            queries: self.queries.select(&group_dims),
            source: self.source.clone(),
            ..*self
        })
    }

    /// The RoPE of the fitted layer for this model's head dimension.
    pub fn rope(&self) -> Rope {
        let config = RopeConfig {
            base: self.rope_base,
            style: RopeStyle::Halves,
            scaling: RopeScaling::None,
        };
        Rope::new(&config, self.head_dim, None)
    }

    /// Attention logit scale: `1 / sqrt(head_dim)` (Gemma 3 270M's own at 256).
    pub fn scale(&self) -> f32 {
        (self.head_dim as f32).sqrt().recip()
    }

    /// Pre-RoPE keys `[n, head_dim]` of a corpus drawn with `seed`.
    pub fn draw_keys(&self, n: usize, seed: u64) -> Vec<f32> {
        self.keys.sample(n, seed ^ 0x6b65_7973)
    }

    /// Values `[n, head_dim]` of a corpus drawn with `seed`.
    pub fn draw_values(&self, n: usize, seed: u64) -> Vec<f32> {
        self.values.sample(n, seed ^ 0x7661_6c75)
    }

    /// Pre-RoPE group queries `[n, group, head_dim]` of `n` tokens drawn with `seed`.
    pub fn draw_queries(&self, n: usize, seed: u64) -> Vec<f32> {
        self.queries.sample(n, seed ^ 0x7175_6572)
    }
}

/// `v · w`.
fn dot(v: &[f64], w: &[f64]) -> f64 {
    v.iter().zip(w).map(|(a, b)| a * b).sum()
}

/// `M v` for a square row-major `M`.
fn mat_vec(m: &[f64], v: &[f64]) -> Vec<f64> {
    m.chunks_exact(v.len()).map(|row| dot(row, v)).collect()
}

/// Iterations of [`top_eigenvectors`]: the leading directions of key and query covariances
/// are well separated and converge in far fewer.
const ORTHOGONAL_ITERATIONS: usize = 300;

/// The `rank` leading eigenvectors `[rank, dim]` of a symmetric positive semi-definite
/// `matrix`, by orthogonal iteration (repeated `Q ← orth(M Q)`, modified Gram-Schmidt).
fn top_eigenvectors(matrix: &[f64], dim: usize, rank: usize) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(0);
    let mut q: Vec<f64> = (0..rank * dim)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    orthonormalise(&mut q, dim);
    for _ in 0..ORTHOGONAL_ITERATIONS {
        q = q
            .par_chunks_exact(dim)
            .flat_map_iter(|v| mat_vec(matrix, v))
            .collect();
        orthonormalise(&mut q, dim);
    }
    q
}

/// Modified Gram-Schmidt on the rows of `q` `[rows, dim]`.
fn orthonormalise(q: &mut [f64], dim: usize) {
    for i in 0..q.len() / dim {
        let (done, rest) = q.split_at_mut(i * dim);
        let row = &mut rest[..dim];
        for prior in done.chunks_exact(dim) {
            let p = dot(row, prior);
            row.iter_mut().zip(prior).for_each(|(x, y)| *x -= p * y);
        }
        let norm = dot(row, row).sqrt().max(f64::MIN_POSITIVE);
        row.iter_mut().for_each(|x| *x /= norm);
    }
}

/// Stores f32 vectors as f16 (the fit's 3 significant digits are plenty), halving the file.
mod as_f16 {
    use half::f16;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        let halves: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        halves.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        Ok(Vec::<f16>::deserialize(d)?
            .into_iter()
            .map(f16::to_f32)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Gaussian with mean `mean`, no factors and no spread.
    fn point(mean: Vec<f32>) -> LowRankGaussian {
        LowRankGaussian {
            dim: mean.len(),
            residual: vec![0.0; mean.len()],
            mean,
            factors: Vec::new(),
        }
    }

    /// The 128-d model's keys rotate like the kept dimensions of the 256-d keys.
    #[test]
    fn derived_head_dim_keeps_rope_frequencies() -> Result<()> {
        let key: Vec<f32> = (0..256).map(|i| (i as f32 * 0.731).sin()).collect();
        let queries = point((0..1024).map(|i| i as f32).collect());
        let full = KeyModel::new(
            "test".into(),
            1e6,
            4,
            point(key.clone()),
            point(key),
            queries,
        );
        let half = full.at_head_dim(128)?;
        for position in [0, 1, 777, 100_000] {
            let mut big = full.draw_keys(1, 0);
            full.rope().rotate(&mut big, position);
            let mut small = half.draw_keys(1, 0);
            half.rope().rotate(&mut small, position);
            let kept = (0..64).map(|m| 2 * m).chain((0..64).map(|m| 128 + 2 * m));
            let kept: Vec<f32> = kept.map(|i| big[i]).collect();
            for (a, b) in small.iter().zip(&kept) {
                assert!((a - b).abs() < 1e-4, "position {position}: {a} vs {b}");
            }
        }
        // Every head of the group keeps the same dimensions.
        let q = &half.queries.mean;
        assert_eq!(q.len(), 512);
        assert_eq!((q[0], q[64], q[128], q[192]), (0.0, 128.0, 256.0, 384.0));
        Ok(())
    }

    /// A fit of draws from a known model finds its mean and per-dimension variances.
    #[test]
    fn fit_recovers_a_known_distribution() -> Result<()> {
        let known = LowRankGaussian {
            dim: 4,
            mean: vec![1.0, -2.0, 0.5, 3.0],
            factors: vec![2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.5, -1.5],
            residual: vec![0.5, 0.5, 0.2, 1.0],
        };
        let fit = LowRankGaussian::fit(&known.sample(50_000, 7), 4, 2)?;
        let variances = |g: &LowRankGaussian| -> Vec<f32> {
            (0..g.dim)
                .map(|i| {
                    let f: f32 = g.factors.chunks_exact(g.dim).map(|r| r[i] * r[i]).sum();
                    f + g.residual[i] * g.residual[i]
                })
                .collect()
        };
        for ((m, fm), (v, fv)) in known
            .mean
            .iter()
            .zip(&fit.mean)
            .zip(variances(&known).iter().zip(&variances(&fit)))
        {
            assert!((m - fm).abs() < 0.05, "mean {fm}, expected {m}");
            assert!((v / fv - 1.0).abs() < 0.05, "variance {fv}, expected {v}");
        }
        assert!(fit.explained_variance() > 0.8);
        Ok(())
    }
}
