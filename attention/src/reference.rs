//! Exact attention in f64, the yardstick of the tests here and of the benches.
//!
//! Rotation happens in f32 with the same [`Rope`] as the code under test (so both see the
//! same rotated vectors); dot products, exponentials, sums and the output are f64.

use kvdb_model::Rope;

use crate::error::{length, rows, some_rows};
use crate::{AttentionError, Result};

/// Exact attention of one token's query heads over a set of tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Exact {
    /// Normalised output `[heads, head_dim]`.
    pub output: Vec<f64>,
    /// Softmax weights `[heads, tokens]`, in the order the tokens were given.
    pub weights: Vec<f64>,
}

/// Exact causal attention of one token at `position` over every token `0..=position`.
///
/// `queries` are pre-RoPE `[heads, head_dim]`; `keys` (pre-RoPE) and `values` hold at least
/// the rows of ids `0..=position` (later rows are ignored); `head_dim` is `rope.head_dim()`.
pub fn full_attention_f64(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    position: usize,
    rope: &Rope,
    scale: f32,
) -> Result<Vec<f64>> {
    let d = rope.head_dim();
    let held = rows("keys", keys.len(), d)?;
    let n = position.saturating_add(1);
    if held < n || position >= u32::MAX as usize {
        return Err(AttentionError::IdOutOfRange {
            id: u32::try_from(position).unwrap_or(u32::MAX),
            len: held,
        });
    }
    let ids: Vec<u32> = (0..n as u32).collect();
    let values = values.get(..n * d).ok_or(AttentionError::Length {
        what: "values",
        expected: n * d,
        found: values.len(),
    })?;
    Ok(attention_over_f64(queries, &keys[..n * d], values, &ids, position, rope, scale)?.output)
}

/// Exact attention of one token at `position` over the tokens `ids` (any order, any set),
/// whose pre-RoPE keys and values are the rows of `keys` and `values` `[ids.len(),
/// head_dim]`, in the same order. Keys rotate at their ids, queries at `position`.
pub fn attention_over_f64(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    ids: &[u32],
    position: usize,
    rope: &Rope,
    scale: f32,
) -> Result<Exact> {
    let d = rope.head_dim();
    let heads = some_rows("queries", queries.len(), d)?;
    let n = ids.len();
    length("keys", n * d, keys.len())?;
    length("values", n * d, values.len())?;
    let mut queries = queries.to_vec();
    rope.rotate(&mut queries, position);
    let mut keys = keys.to_vec();
    for (row, &id) in keys.chunks_exact_mut(d).zip(ids) {
        rope.rotate(row, id as usize);
    }

    let mut output = vec![0.0f64; heads * d];
    let mut weights = vec![0.0f64; heads * n];
    if n == 0 {
        return Ok(Exact { output, weights });
    }
    for (h, q) in queries.chunks_exact(d).enumerate() {
        let row = &mut weights[h * n..(h + 1) * n];
        for (w, k) in row.iter_mut().zip(keys.chunks_exact(d)) {
            let dot: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
            *w = scale as f64 * dot;
        }
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        row.iter_mut().for_each(|w| *w = (*w - max).exp());
        let total: f64 = row.iter().sum();
        row.iter_mut().for_each(|w| *w /= total);
        let out = &mut output[h * d..(h + 1) * d];
        for (w, v) in row.iter().zip(values.chunks_exact(d)) {
            for (o, x) in out.iter_mut().zip(v) {
                *o += w * *x as f64;
            }
        }
    }
    Ok(Exact { output, weights })
}
