//! Rotary position embeddings, applied to `[tokens, heads, head_dim]` tensors.
//!
//! Keys reach the attention backends before rotation (kvdb stores them that way), so RoPE is
//! a value the backends hold and apply when they score, not a step of the forward pass.

use std::ops::Range;
use std::sync::{Arc, RwLock};

use candle_core::{DType, Device, Tensor};

use crate::config::{RopeConfig, RopeScaling, RopeStyle};
use crate::error::Result;

/// The RoPE of one layer: its inverse frequencies, pairing style and a shared table of
/// `cos`/`sin` rows that grows on demand (layers with the same RoPE share one).
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    style: RopeStyle,
    table: Arc<RwLock<Option<Table>>>,
    /// The same numbers as plain `[positions, head_dim / 2]` rows for [`Rope::rotate`], grown
    /// on demand: computing `sin_cos` per vector dominated retrieval attention.
    rows: Arc<RwLock<RowTable>>,
}

/// `cos` and `sin` rows `[len, head_dim / 2]` in plain vectors.
#[derive(Debug, Default)]
struct RowTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// `cos` and `sin` for positions `0..len`, `[len, head_dim / 2]`.
#[derive(Debug)]
struct Table {
    cos: Tensor,
    sin: Tensor,
    len: usize,
}

impl Rope {
    /// Builds the RoPE of `config` for heads of `head_dim` dimensions. `Frequencies` scaling
    /// takes its divisors from `freq_factors` (one per pair of dimensions).
    pub fn new(config: &RopeConfig, head_dim: usize, freq_factors: Option<&[f32]>) -> Self {
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                let f = 1.0 / (config.base as f64).powf(2.0 * i as f64 / head_dim as f64);
                match (&config.scaling, freq_factors) {
                    (RopeScaling::Linear { factor }, _) => f / *factor as f64,
                    (RopeScaling::Frequencies(_), Some(factors)) => f / factors[i] as f64,
                    _ => f,
                }
            })
            .collect();
        Self {
            inv_freq,
            style: config.style,
            table: Arc::new(RwLock::new(None)),
            rows: Arc::new(RwLock::new(RowTable::default())),
        }
    }

    /// The inverse frequencies, one per pair of dimensions (`head_dim / 2`).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// The pairing of dimensions.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// `cos` and `sin` tables `[positions, head_dim / 2]` for consecutive positions.
    pub fn tables(&self, positions: Range<usize>, device: &Device) -> Result<(Tensor, Tensor)> {
        let slice = |t: &Table| -> Result<Option<(Tensor, Tensor)>> {
            if positions.end > t.len || !t.cos.device().same_device(device) {
                return Ok(None);
            }
            Ok(Some((
                t.cos.narrow(0, positions.start, positions.len())?,
                t.sin.narrow(0, positions.start, positions.len())?,
            )))
        };
        // A poisoned lock only means another thread panicked mid-update: recompute.
        if let Ok(guard) = self.table.read() {
            if let Some(found) = guard.as_ref().map(slice).transpose()?.flatten() {
                return Ok(found);
            }
        }
        let len = positions.end.next_power_of_two().max(1024);
        let (cos, sin) = self.compute(0..len, device)?;
        let table = Table { cos, sin, len };
        let found = slice(&table)?;
        if let Ok(mut guard) = self.table.write() {
            *guard = Some(table);
        }
        found.ok_or_else(|| candle_core::Error::Msg("rope table too short".into()).into())
    }

    /// Computes the tables; angles in f64 so that large positions keep their precision.
    fn compute(&self, positions: Range<usize>, device: &Device) -> Result<(Tensor, Tensor)> {
        let n = positions.len();
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in positions {
            for f in &self.inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, half), device)?,
            Tensor::from_vec(sin, (n, half), device)?,
        ))
    }

    /// Head dimension this RoPE rotates.
    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Rotates vectors of `head_dim` in place, all at `position` (`x` holds one or more whole
    /// vectors, e.g. the query heads of one token). Gives the same numbers as
    /// [`Rope::apply`]: angles in f64, `cos`/`sin` rounded to f32, products in f32.
    pub fn rotate(&self, x: &mut [f32], position: usize) {
        let half = self.inv_freq.len();
        let at = position * half..(position + 1) * half;
        if let Ok(rows) = self.rows.read() {
            if rows.cos.len() >= at.end {
                return self.rotate_with(x, &rows.cos[at.clone()], &rows.sin[at]);
            }
        }
        let mut rows = self.rows.write().unwrap_or_else(|p| p.into_inner());
        let len = (position + 1).next_power_of_two().max(1024);
        for p in rows.cos.len() / half.max(1)..len {
            for f in &self.inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                rows.cos.push(c as f32);
                rows.sin.push(s as f32);
            }
        }
        self.rotate_with(x, &rows.cos[at.clone()], &rows.sin[at]);
    }

    fn rotate_with(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.inv_freq.len();
        for v in x.chunks_exact_mut(2 * half) {
            for i in 0..half {
                let (a, b) = match self.style {
                    RopeStyle::Halves => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * cos[i] - x1 * sin[i];
                v[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }

    /// Rotates consecutive vectors of `head_dim` in place, vector `i` at `first_position + i`.
    pub fn rotate_rows(&self, rows: &mut [f32], first_position: usize) {
        for (i, v) in rows.chunks_exact_mut(self.head_dim()).enumerate() {
            self.rotate(v, first_position + i);
        }
    }

    /// Rotates `x` (`[tokens, heads, head_dim]`, f32) whose tokens sit at `positions`.
    pub fn apply(&self, x: &Tensor, positions: Range<usize>) -> Result<Tensor> {
        let (cos, sin) = self.tables(positions, x.device())?;
        self.apply_with(x, &cos, &sin)
    }

    /// Rotates `x` with tables from [`Rope::tables`] (so that queries and keys share them).
    pub fn apply_with(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?.contiguous()?.unsqueeze(0)?;
        let y = match self.style {
            RopeStyle::Halves => candle_nn::rotary_emb::rope_thd(&x, cos, sin)?,
            RopeStyle::Interleaved => {
                // candle's interleaved kernel wants [batch, heads, tokens, dim].
                let x = x.transpose(1, 2)?.contiguous()?;
                candle_nn::rotary_emb::rope_i(&x, cos, sin)?
                    .transpose(1, 2)?
                    .contiguous()?
            }
        };
        Ok(y.squeeze(0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slice rotation equals the tensor rotation, for both pairings and large positions.
    #[test]
    fn rotate_matches_apply() -> Result<()> {
        for style in [RopeStyle::Halves, RopeStyle::Interleaved] {
            let config = RopeConfig {
                base: 10_000.0,
                style,
                scaling: RopeScaling::None,
            };
            let (tokens, heads, dim) = (5, 3, 16);
            let rope = Rope::new(&config, dim, None);
            let data: Vec<f32> = (0..tokens * heads * dim)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let first = 30_000;
            let x = Tensor::from_vec(data.clone(), (tokens, heads, dim), &Device::Cpu)?;
            let expected: Vec<f32> = rope
                .apply(&x, first..first + tokens)?
                .flatten_all()?
                .to_vec1()?;
            let mut actual = data;
            for (t, token) in actual.chunks_exact_mut(heads * dim).enumerate() {
                rope.rotate(token, first + t);
            }
            for (a, e) in actual.iter().zip(&expected) {
                assert!(
                    (a - e).abs() <= 1e-5 * e.abs().max(1.0),
                    "{style:?}: {a} vs {e}"
                );
            }
        }
        Ok(())
    }
}
