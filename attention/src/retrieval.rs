//! [`attend`]: one query token, one KV head's GQA group, dense part + selection.

use kvdb_index::{Selection, UnvisitedBucket};
use kvdb_model::Rope;

use crate::error::{length, some_rows};
use crate::{logits, merge, AttentionError, DensePolicy, KvSource, Partial, Result};

/// One query token of one GQA group, and what it attends to.
#[derive(Debug, Clone, Copy)]
pub struct RetrievalQuery<'a> {
    /// Pre-RoPE queries `[group_heads, head_dim]` of the group's query heads.
    pub queries: &'a [f32],
    /// The token's position: queries rotate at it, and it is the last id attended.
    pub position: usize,
    /// The layer's RoPE (its `head_dim` is the head dimension).
    pub rope: &'a Rope,
    /// Logit scale, usually `1 / sqrt(head_dim)` (Gemma 3: its `query_pre_attn_scalar`).
    pub scale: f32,
    /// The dense part: sinks and recent window.
    pub policy: DensePolicy,
    /// Ids retrieved by an index; those after `position` or inside the dense part are dropped.
    pub selection: &'a Selection,
    /// The estimated contribution of the buckets a bucket index did not visit, if wanted.
    pub estimate: Option<&'a Estimate>,
}

/// The attention that unvisited buckets would have received, estimated RetroInfer-style:
/// bucket `b` stands for its `size_b` keys as if each scored `q · centroid_b`, so it adds
/// `size_b · exp(scale · q · centroid_b)` to the softmax denominator and that weight times
/// the bucket's mean value to the output. It is one more [`Partial`], merged like the others.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// `[heads, buckets]`: `scale · q_h · centroid_b + ln size_b`.
    logits: Vec<f32>,
    /// `[buckets, head_dim]`: each bucket's mean value.
    means: Vec<f32>,
}

impl Estimate {
    /// The estimate of `unvisited` buckets for a group of `heads` heads, given every
    /// bucket's mean value `bucket_means` `[buckets, head_dim]` (indexed by bucket number).
    pub fn new(
        unvisited: &[UnvisitedBucket],
        bucket_means: &[f32],
        heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Result<Self> {
        let buckets = bucket_means.len() / head_dim.max(1);
        let mut logits = vec![0f32; heads * unvisited.len()];
        let mut means = Vec::with_capacity(unvisited.len() * head_dim);
        for (i, b) in unvisited.iter().enumerate() {
            let at = b.bucket as usize;
            if at >= buckets || b.logits.len() != heads {
                return Err(AttentionError::Estimate(format!(
                    "bucket {at} with {} logits ({buckets} buckets, {heads} heads)",
                    b.logits.len()
                )));
            }
            for (h, l) in b.logits.iter().enumerate() {
                logits[h * unvisited.len() + i] = scale * l + (b.size.max(1) as f32).ln();
            }
            means.extend_from_slice(&bucket_means[at * head_dim..(at + 1) * head_dim]);
        }
        Ok(Self { logits, means })
    }
}

/// The result of [`attend`].
#[derive(Debug, Clone, PartialEq)]
pub struct Attended {
    /// Normalised attention output `[heads, head_dim]`.
    pub output: Vec<f32>,
    /// Every token attended, once: the dense part (ascending), then the retrieved ids
    /// (ascending).
    pub ids: Vec<u32>,
    /// Each token's share of each head's attention mass `[heads, ids.len()]` (rows sum to 1,
    /// less the share of an [`Estimate`]).
    pub weights: Vec<f32>,
}

/// Attention of one token's query group over the dense part of `query.policy` and the
/// retrieved ids of `query.selection`, with keys and values from `source`.
///
/// The queries rotate at `position` and every key at its id. The retrieved ids keep only
/// those `<= position` outside the dense part, so no token counts twice. Each of the two
/// sets gives a [`Partial`]; their [`merge`] is normalised. All heads of the group attend to
/// both sets. With every id `0..=position` selected the output equals full causal attention
/// to rounding.
pub fn attend(query: &RetrievalQuery<'_>, source: &dyn KvSource) -> Result<Attended> {
    let d = query.rope.head_dim();
    let heads = some_rows("queries", query.queries.len(), d)?;
    // Ids are u32 and the window's end is `position + 1`.
    u32::try_from(query.position)
        .ok()
        .filter(|&p| p < u32::MAX)
        .ok_or(AttentionError::Position {
            position: query.position,
        })?;
    let mut queries = query.queries.to_vec();
    query.rope.rotate(&mut queries, query.position);

    let dense_ranges = query.policy.dense_ranges(query.position);
    let dense: Vec<u32> = dense_ranges.iter().cloned().flatten().collect();
    let retrieved: Vec<u32> = query
        .policy
        .retrieved(query.position, query.selection.ids())
        .collect();

    let (dense_partial, dense_logits) = attend_ids(query, &queries, heads, &dense, source)?;
    let (retrieved_partial, retrieved_logits) =
        attend_ids(query, &queries, heads, &retrieved, source)?;
    let mut total = merge(&dense_partial, &retrieved_partial)?;
    if let Some(estimate) = query.estimate {
        let partial = Partial::from_logits(&estimate.logits, &estimate.means, heads, d)?;
        total = merge(&total, &partial)?;
    }

    let dense_shares = total.probabilities(&dense_logits);
    let retrieved_shares = total.probabilities(&retrieved_logits);
    let (nd, nr) = (dense.len(), retrieved.len());
    let mut weights = Vec::with_capacity(heads * (nd + nr));
    for h in 0..heads {
        weights.extend_from_slice(&dense_shares[h * nd..(h + 1) * nd]);
        weights.extend_from_slice(&retrieved_shares[h * nr..(h + 1) * nr]);
    }
    let mut ids = dense;
    ids.extend_from_slice(&retrieved);
    Ok(Attended {
        output: total.finish(),
        ids,
        weights,
    })
}

/// The partial of the rotated `queries` over `ids`, and its logits `[heads, ids.len()]`.
fn attend_ids(
    query: &RetrievalQuery<'_>,
    queries: &[f32],
    heads: usize,
    ids: &[u32],
    source: &dyn KvSource,
) -> Result<(Partial, Vec<f32>)> {
    let d = query.rope.head_dim();
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    source.gather(ids, &mut keys, &mut values)?;
    length("gathered keys", ids.len() * d, keys.len())?;
    length("gathered values", ids.len() * d, values.len())?;
    for (row, &id) in keys.chunks_exact_mut(d).zip(ids) {
        query.rope.rotate(row, id as usize);
    }
    let logits = logits(queries, &keys, d, query.scale);
    let partial = Partial::from_logits(&logits, &values, heads, d)?;
    Ok((partial, logits))
}
