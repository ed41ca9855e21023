//! SAAP's training (the index side, [`kvdb_index::saap`], only routes with what this
//! trains): k-means on a layer/KV head's de-roped keys, then the query classifier
//! `Linear(d, HIDDEN) → BatchNorm → ReLU → Linear(HIDDEN, C)`, trained with candle (Adam) to
//! minimise KL(target ‖ softmax(output)), where the target is the share of the query's
//! attention mass each bucket receives. Training queries are those whose best key (sink
//! excluded) lies at least [`MIN_TRAINING_DISTANCE`] tokens back: the queries retrieval
//! exists for. The mass is counted over the retrievable keys only (past the sink, before the
//! recent window), which the dense part does not cover anyway. The batch norm is folded into
//! the first layer after training, so a [`SaapHead`] routes with two matrix-vector products.
//!
//! [`train_head`] does both on one sequence. The two steps are also separate: [`partition`]
//! fits the centroids to any set of keys and [`train_classifier`] trains over a given
//! partition on several sequences, each prefilled on its own (the artifact trainer in the
//! parent module fits the partition to a text's keys and trains on windows of it with
//! retrieval drills planted).

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{BatchNormConfig, Module, ModuleT, Optimizer, VarBuilder, VarMap};
use kvdb_index::kmeans::{kmeans, nearest};
use kvdb_index::saap::{Epoch, SaapHead};
use kvdb_model::Rope;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::error::{Error, Result};

/// Recent tokens ignored when training (attended densely).
pub(crate) const TRAINING_WINDOW: usize = 256;
/// Sink tokens ignored when training (attended densely; they would dominate the targets).
pub(crate) const TRAINING_SINK: usize = 4;
/// Training queries have their best key at least this many tokens back.
pub(crate) const MIN_TRAINING_DISTANCE: usize = 1024;
/// Width of the classifier's hidden layer.
pub(crate) const HIDDEN: usize = 1024;
/// The keys and queries one layer/KV head is trained on.
#[derive(Debug, Clone, Copy)]
pub struct TrainingData<'a> {
    /// Pre-RoPE keys `[n, d]` (id = position).
    pub keys: &'a [f32],
    /// Pre-RoPE queries `[n, group, d]` of the KV head's query heads.
    pub queries: &'a [f32],
    /// Query heads per KV head.
    pub group: usize,
    /// The layer's RoPE (the attention targets are computed on rotated vectors).
    pub rope: &'a Rope,
    /// Attention logit scale.
    pub scale: f32,
}

/// Training options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainOptions {
    /// Buckets.
    pub centroids: usize,
    /// Lloyd iterations of k-means.
    pub kmeans_iterations: usize,
    /// At most this many training samples (query heads at eligible positions), drawn at random.
    pub max_samples: usize,
    /// Passes over the samples.
    pub epochs: usize,
    /// Samples per Adam step.
    pub batch: usize,
    /// Adam's learning rate.
    pub learning_rate: f64,
    /// Decoupled weight decay (AdamW); regularises a classifier trained on little text.
    pub weight_decay: f64,
    /// Seed of k-means, sampling, initialisation and shuffling.
    pub seed: u64,
    /// Add the centroid scores (× the attention scale) to the classifier's logits, in
    /// training and search: the MLP then learns a correction to k-means routing rather than
    /// routing from scratch (our addition to SAAP; off gives the paper's classifier).
    pub prior: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            centroids: 1024,
            kmeans_iterations: 20,
            max_samples: 16_384,
            epochs: 30,
            batch: 256,
            learning_rate: 1e-3,
            weight_decay: 0.0,
            seed: 0,
            prior: true,
        }
    }
}

/// Rows of `d` floats in `len`: training data of another shape is a bug of the caller.
fn rows(what: &str, len: usize, d: usize) -> Result<usize> {
    match len.checked_rem(d) {
        Some(0) => Ok(len / d),
        _ => Err(Error::Internal(format!(
            "saap training: {len} floats of {what} are not rows of {d}"
        ))),
    }
}

/// Trains one layer/KV head: k-means on its de-roped keys, then the classifier on its
/// queries' bucket masses. `on_epoch` sees every epoch's losses.
pub fn train_head(
    data: &TrainingData<'_>,
    options: &TrainOptions,
    on_epoch: &mut dyn FnMut(Epoch),
) -> Result<SaapHead> {
    let centroids = partition(data.keys, data.rope.head_dim(), options)?;
    train_classifier(std::slice::from_ref(data), centroids, options, on_epoch)
}

/// SAAP's key partition: `options.centroids` k-means centroids `[C, d]` of de-roped `keys`.
pub(crate) fn partition(keys: &[f32], d: usize, options: &TrainOptions) -> Result<Vec<f32>> {
    let n = rows("keys", keys.len(), d)?;
    let centroids = kmeans(
        keys,
        d,
        options.centroids,
        options.kmeans_iterations,
        options.seed,
    )?;
    if centroids.len() / d < 2 {
        return Err(Error::SaapTraining(format!(
            "{n} keys are too few to train buckets"
        )));
    }
    Ok(centroids)
}

/// Trains the query classifier of one layer/KV head over a given partition (`centroids`,
/// `[C, d]`) on one or more sequences (each prefilled on its own, positions from 0): the
/// target of a query is its attention mass per bucket of its sequence's keys.
pub(crate) fn train_classifier(
    sequences: &[TrainingData<'_>],
    centroids: Vec<f32>,
    options: &TrainOptions,
    on_epoch: &mut dyn FnMut(Epoch),
) -> Result<SaapHead> {
    let first = sequences
        .first()
        .ok_or_else(|| Error::SaapTraining("no training sequences".into()))?;
    let d = first.rope.head_dim();
    let c = rows("centroids", centroids.len(), d)?;
    if c < 2 {
        return Err(Error::SaapTraining(format!(
            "{c} bucket(s): a partition needs at least two"
        )));
    }
    let mut assigned = Vec::with_capacity(sequences.len());
    for data in sequences {
        let n = rows("keys", data.keys.len(), d)?;
        if data.rope.head_dim() != d || data.group == 0 || data.queries.len() != n * data.group * d
        {
            return Err(Error::Internal(format!(
                "saap training: {} query floats for {n} keys of {d} in groups of {}",
                data.queries.len(),
                data.group
            )));
        }
        assigned.push(nearest(&centroids, data.keys, d)?);
    }
    let (inputs, targets) = training_samples(sequences, &assigned, c, options)?;
    let m = inputs.len() / d;
    if m < 16 {
        return Err(Error::SaapTraining(format!(
            "only {m} training queries have their best key {MIN_TRAINING_DISTANCE}+ tokens back: \
             train on longer text"
        )));
    }
    let prior = if options.prior { first.scale } else { 0.0 };
    let (w1, b1, w2, b2) =
        fit_classifier(&inputs, &targets, &centroids, prior, d, options, on_epoch)?;
    Ok(SaapHead {
        head_dim: d,
        centroids,
        w1,
        b1,
        w2,
        b2,
        prior,
    })
}

/// Training candidates whose logits one matrix product computes: the keys before the
/// block's last position are read once for the block.
const SAMPLE_BLOCK: usize = 64;

/// A training sample: a de-roped query and its target bucket masses.
type Sample = (Vec<f32>, Vec<f32>);

/// De-roped queries and their target bucket masses `[m, C]`, drawn at random from every
/// sequence's query heads (`assigned`: each sequence's key buckets).
fn training_samples(
    sequences: &[TrainingData<'_>],
    assigned: &[Vec<u32>],
    c: usize,
    options: &TrainOptions,
) -> Result<(Vec<f32>, Vec<f32>)> {
    // Each sequence's rotated keys `[n, d]`, as a tensor the blocks' products read from.
    let rotated: Vec<Tensor> = sequences
        .iter()
        .map(|data| {
            let mut keys = data.keys.to_vec();
            data.rope.rotate_rows(&mut keys, 0);
            let n = keys.len() / data.rope.head_dim();
            Tensor::from_vec(keys, (n, data.rope.head_dim()), &Device::Cpu)
        })
        .collect::<candle_core::Result<_>>()?;
    let first = TRAINING_SINK + TRAINING_WINDOW + MIN_TRAINING_DISTANCE;
    // (sequence, position, query head)
    let mut samples: Vec<(usize, usize, usize)> = sequences
        .iter()
        .zip(assigned)
        .enumerate()
        .flat_map(|(s, (data, buckets))| {
            (first..buckets.len()).flat_map(move |p| (0..data.group).map(move |h| (s, p, h)))
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(options.seed ^ 0x5aa9);
    samples.shuffle(&mut rng);
    // Keep up to twice the budget of candidates: some fail the distance test.
    samples.truncate(options.max_samples.saturating_mul(2));
    // The candidates in blocks of one sequence and nearby positions. A candidate alone read
    // its sequence's keys up to its position from memory (up to 30 MB at 30K tokens, 256
    // wide): that was most of the training's time after the prefill.
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by_key(|&i| (samples[i].0, samples[i].1));
    let blocks: Vec<&[usize]> = order
        .chunk_by(|&i, &j| samples[i].0 == samples[j].0)
        .flat_map(|same_sequence| same_sequence.chunks(SAMPLE_BLOCK))
        .collect();
    let scored: Vec<Vec<(usize, Option<Sample>)>> = blocks
        .par_iter()
        .map(|block| -> Result<_> {
            let s = samples[block[0]].0;
            let (data, assigned) = (&sequences[s], &assigned[s]);
            let d = data.rope.head_dim();
            // Candidate `i`'s position and de-roped query.
            let query_of = |i: usize| {
                let (_, p, h) = samples[i];
                let at = (p * data.group + h) * d;
                (p, &data.queries[at..at + d])
            };
            let last = block.iter().map(|&i| samples[i].1).max().unwrap_or(0);
            let mut queries = Vec::with_capacity(block.len() * d);
            for &i in block.iter() {
                let (p, raw) = query_of(i);
                let mut q = raw.to_vec();
                data.rope.rotate(&mut q, p);
                queries.extend(q);
            }
            let queries = Tensor::from_vec(queries, (block.len(), d), &Device::Cpu)?;
            // [block, last + 1]: every candidate against the keys up to the block's last
            // position; each reads its own prefix of its row.
            let logits = (queries.matmul(&rotated[s].narrow(0, 0, last + 1)?.t()?)?
                * f64::from(data.scale))?
            .to_vec2::<f32>()?;
            Ok(block
                .iter()
                .zip(logits)
                .map(|(&i, logits)| {
                    let (p, raw) = query_of(i);
                    (
                        i,
                        target(&logits[..=p], p, assigned, c).map(|t| (raw.to_vec(), t)),
                    )
                })
                .collect())
        })
        .collect::<Result<_>>()?;
    let mut rows: Vec<Option<Sample>> = vec![None; samples.len()];
    for (i, row) in scored.into_iter().flatten() {
        rows[i] = row;
    }
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for (q, t) in rows.into_iter().flatten().take(options.max_samples) {
        inputs.extend(q);
        targets.extend(t);
    }
    Ok((inputs, targets))
}

/// The target of a query at position `p` with `logits` over the keys at `0..=p`: its
/// attention mass per bucket (`assigned`: each key's bucket, `c` buckets) over the
/// retrievable keys; `None` when its best key is fewer than [`MIN_TRAINING_DISTANCE`] back.
fn target(logits: &[f32], p: usize, assigned: &[u32], c: usize) -> Option<Vec<f32>> {
    let best = (TRAINING_SINK..=p).max_by(|&a, &b| logits[a].total_cmp(&logits[b]))?;
    if p - best < MIN_TRAINING_DISTANCE {
        return None;
    }
    let retrievable = TRAINING_SINK..p + 1 - TRAINING_WINDOW;
    let max = logits[retrievable.clone()]
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut mass = vec![0f32; c];
    let mut total = 0f32;
    for j in retrievable {
        let w = (logits[j] - max).exp();
        mass[assigned[j] as usize] += w;
        total += w;
    }
    mass.iter_mut().for_each(|x| *x /= total);
    Some(mass)
}

type Weights = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Adam on KL(target ‖ softmax(MLP(x))); returns the layers with the batch norm folded in.
fn fit_classifier(
    inputs: &[f32],
    targets: &[f32],
    centroids: &[f32],
    prior: f32,
    d: usize,
    options: &TrainOptions,
    on_epoch: &mut dyn FnMut(Epoch),
) -> candle_core::Result<Weights> {
    let device = Device::Cpu;
    let m = inputs.len() / d;
    let c = centroids.len() / d;
    let x = Tensor::from_slice(inputs, (m, d), &device)?;
    // The geometric prior of every sample, a constant: prior · X Cᵀ.
    let centroids = Tensor::from_slice(centroids, (c, d), &device)?;
    let prior = (x.matmul(&centroids.t()?)? * prior as f64)?;
    let t = Tensor::from_slice(targets, (m, c), &device)?;
    // KL(t ‖ p) = Σ t ln t − Σ t ln p; the first term is constant per sample.
    let t_ln_t = (t.clone() * (t.clone() + 1e-12)?.log()?)?.sum(1)?;
    let validation = (m / 10).max(1).min(m - 1);
    let train = m - validation;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let l1 = candle_nn::linear(d, HIDDEN, vb.pp("l1"))?;
    let bn = candle_nn::batch_norm(HIDDEN, BatchNormConfig::default(), vb.pp("bn"))?;
    let l2 = candle_nn::linear(HIDDEN, c, vb.pp("l2"))?;
    // candle's CPU generator cannot be seeded: draw the linear layers' starting weights
    // from our own seeded generator (uniform ±1/√fan_in, as candle-nn does), in name order.
    {
        let mut init = StdRng::seed_from_u64(options.seed ^ 0x1417);
        let vars = varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned var map".into()))?;
        let mut names: Vec<&String> = vars.keys().filter(|n| n.starts_with('l')).collect();
        names.sort();
        for name in names {
            let var = &vars[name];
            let fan_in = if name.starts_with("l1") { d } else { HIDDEN } as f32;
            let bound = 1.0 / fan_in.sqrt();
            let values: Vec<f32> = (0..var.elem_count())
                .map(|_| init.random_range(-bound..bound))
                .collect();
            var.set(&Tensor::from_vec(values, var.shape(), &device)?)?;
        }
    }
    let forward = |x: &Tensor, prior: &Tensor, training: bool| -> candle_core::Result<Tensor> {
        let h = bn.forward_t(&l1.forward(x)?, training)?.relu()?;
        l2.forward(&h)? + prior
    };
    let kl = |ids: Option<&Tensor>, training: bool| -> candle_core::Result<Tensor> {
        let pick = |t: &Tensor| match ids {
            Some(ids) => t.index_select(ids, 0),
            None => t.narrow(0, train, validation),
        };
        let logits = forward(&pick(&x)?, &pick(&prior)?, training)?;
        let log_p = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        (pick(&t_ln_t)? - (pick(&t)? * log_p)?.sum(1)?)?.mean(0)
    };
    let mut adam = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: options.learning_rate,
            weight_decay: options.weight_decay,
            ..Default::default()
        },
    )?;
    let mut rng = StdRng::seed_from_u64(options.seed ^ 0x0b5e);
    let mut order: Vec<u32> = (0..train as u32).collect();
    let mut best: Option<(f64, Vec<(String, Tensor)>)> = None;
    for epoch in 1..=options.epochs {
        order.shuffle(&mut rng);
        let (mut sum, mut batches) = (0f64, 0usize);
        for chunk in order.chunks(options.batch.max(2)) {
            if chunk.len() < 2 {
                continue; // batch norm needs two samples
            }
            let ids = Tensor::from_slice(chunk, chunk.len(), &device)?;
            let loss = kl(Some(&ids), true)?;
            adam.backward_step(&loss)?;
            sum += loss.to_scalar::<f32>()? as f64;
            batches += 1;
        }
        let validation = kl(None, false)?.to_scalar::<f32>()? as f64;
        // Keep the weights of the epoch that generalised best (early stopping): later
        // epochs only fit the training text closer.
        if best.as_ref().is_none_or(|(loss, _)| validation < *loss) {
            best = Some((validation, snapshot(&varmap)?));
        }
        on_epoch(Epoch {
            epoch,
            train: sum / batches.max(1) as f64,
            validation,
        });
    }
    if let Some((_, weights)) = best {
        restore(&varmap, &weights)?;
    }
    // Fold the batch norm (running statistics) into the first layer:
    // bn(z) = (z − μ) · γ / √(σ² + ε) + β, with z = W1 x + b1.
    let scale = match bn.weight_and_bias() {
        Some((gamma, _)) => (gamma / (bn.running_var() + bn.eps())?.sqrt()?)?,
        None => (bn.running_var() + bn.eps())?.sqrt()?.recip()?,
    };
    let shift = match bn.weight_and_bias() {
        Some((_, beta)) => beta.clone(),
        None => scale.zeros_like()?,
    };
    let w1 = l1.weight().broadcast_mul(&scale.unsqueeze(1)?)?;
    let b1_raw = l1.bias().cloned().unwrap_or(scale.zeros_like()?);
    let b1 = (((b1_raw - bn.running_mean())? * &scale)? + shift)?;
    let w2 = l2.weight().clone();
    let b2 = l2
        .bias()
        .cloned()
        .unwrap_or(Tensor::zeros(c, DType::F32, &device)?);
    Ok((
        w1.flatten_all()?.to_vec1()?,
        b1.to_vec1()?,
        w2.flatten_all()?.to_vec1()?,
        b2.to_vec1()?,
    ))
}

/// A copy of every variable (weights and batch-norm statistics).
fn snapshot(varmap: &VarMap) -> candle_core::Result<Vec<(String, Tensor)>> {
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("poisoned var map".into()))?;
    vars.iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
        .collect()
}

/// Sets the variables back to a [`snapshot`].
fn restore(varmap: &VarMap, weights: &[(String, Tensor)]) -> candle_core::Result<()> {
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("poisoned var map".into()))?;
    for (name, tensor) in weights {
        if let Some(var) = vars.get(name) {
            var.set(tensor)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvdb_model::{RopeConfig, RopeScaling, RopeStyle};

    /// The blocked products give every candidate the target its own logits give (each key's
    /// dot product with the rotated query in f64, one sample at a time): the same candidates
    /// pass the distance test, with the same masses up to float rounding.
    #[test]
    fn blocked_targets_match_each_sample_alone() -> Result<()> {
        let (d, group, n, c) = (16, 2, 1700, 8);
        let mut rng = StdRng::seed_from_u64(7);
        let mut random =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let keys = random(n * d);
        let queries = random(n * group * d);
        let assigned: Vec<u32> = random(n)
            .iter()
            .map(|x| ((x + 1.0) * 3.99) as u32)
            .collect();
        let rope = Rope::new(
            &RopeConfig {
                base: 10_000.0,
                style: RopeStyle::Halves,
                scaling: RopeScaling::None,
            },
            d,
            None,
        );
        let data = TrainingData {
            keys: &keys,
            queries: &queries,
            group,
            rope: &rope,
            scale: 0.7,
        };
        let options = TrainOptions {
            max_samples: 10_000,
            seed: 3,
            ..TrainOptions::default()
        };
        let (inputs, targets) = training_samples(
            std::slice::from_ref(&data),
            std::slice::from_ref(&assigned),
            c,
            &options,
        )?;

        let mut rotated = keys.clone();
        rope.rotate_rows(&mut rotated, 0);
        let first = TRAINING_SINK + TRAINING_WINDOW + MIN_TRAINING_DISTANCE;
        let mut expected = Vec::new();
        for p in first..n {
            for h in 0..group {
                let at = (p * group + h) * d;
                let mut q = queries[at..at + d].to_vec();
                rope.rotate(&mut q, p);
                let logits: Vec<f32> = rotated[..(p + 1) * d]
                    .chunks_exact(d)
                    .map(|k| {
                        let dot: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                        (0.7 * dot) as f32
                    })
                    .collect();
                if let Some(mass) = target(&logits, p, &assigned, c) {
                    expected.push((&queries[at..at + d], mass));
                }
            }
        }
        let got: Vec<(&[f32], &[f32])> = inputs
            .chunks_exact(d)
            .zip(targets.chunks_exact(c))
            .collect();
        assert!(expected.len() > 100, "{} samples pass", expected.len());
        assert_eq!(got.len(), expected.len());
        for (query, mass) in got {
            let (_, want) = expected
                .iter()
                .find(|(q, _)| *q == query)
                .expect("a sample that passes alone");
            let err = mass
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-4, "mass off by {err}");
        }
        Ok(())
    }
}
