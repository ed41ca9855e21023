//! The bench harness's measures, as plain functions over exact (f64) attention weights, so
//! each can be checked on cases with known answers.
//!
//! Weights are one head's softmax over every key it may attend to (`0..=position`); the
//! *eligible* keys are the ones an index chooses among (past the sink, before the recent
//! window); the *dense* part (sink + window) is attended by every method alike and is kept
//! out of the selection measures.

use std::ops::Range;

use rand::seq::index::sample;
use rand::Rng;

/// Softmax of `logits` in f64.
pub fn softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l));
    let exp: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

/// Share of the eligible keys' attention mass that `selection` covers (ids outside
/// `eligible` count for nothing). 1 when the eligible keys hold no mass at all.
pub fn mass_recall(weights: &[f64], eligible: Range<usize>, selection: &[u32]) -> f64 {
    let total: f64 = weights[eligible.clone()].iter().sum();
    if total <= 0.0 {
        return 1.0;
    }
    let covered: f64 = selection
        .iter()
        .map(|&i| i as usize)
        .filter(|i| eligible.contains(i))
        .map(|i| weights[i])
        .sum();
    covered / total
}

/// Share of the exact top-|selection| eligible keys that `selection` contains (1 for an
/// empty selection: nothing was asked for).
pub fn top_k_recall(weights: &[f64], eligible: Range<usize>, selection: &[u32]) -> f64 {
    let k = selection.len().min(eligible.len());
    if k == 0 {
        return 1.0;
    }
    let mut ranked: Vec<usize> = eligible.collect();
    ranked.select_nth_unstable_by(k - 1, |&a, &b| weights[b].total_cmp(&weights[a]));
    let mut top: Vec<usize> = ranked[..k].to_vec();
    top.sort_unstable();
    let hits = selection
        .iter()
        .filter(|&&i| top.binary_search(&(i as usize)).is_ok())
        .count();
    hits as f64 / k as f64
}

/// Attention output `[d]` of one head restricted to `keys` (ids into `weights` and the rows
/// of `values`), renormalised over them: what attending only those keys gives.
pub fn output_over(weights: &[f64], values: &[f32], d: usize, keys: &[usize]) -> Vec<f64> {
    let mut out = vec![0f64; d];
    let mut sum = 0f64;
    for &j in keys {
        let w = weights[j];
        sum += w;
        for (o, v) in out.iter_mut().zip(&values[j * d..(j + 1) * d]) {
            *o += w * *v as f64;
        }
    }
    if sum > 0.0 {
        out.iter_mut().for_each(|o| *o /= sum);
    }
    out
}

/// ‖actual − reference‖ / ‖reference‖ (0 when both are zero).
pub fn relative_l2(actual: &[f64], reference: &[f64]) -> f64 {
    let diff: f64 = actual
        .iter()
        .zip(reference)
        .map(|(a, r)| (a - r) * (a - r))
        .sum();
    let norm: f64 = reference.iter().map(|r| r * r).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// The keys a method attends: the dense ranges plus the selected ids (deduplicated, as the
/// engine does).
pub fn attended(dense: &[Range<u32>], selection: &[u32]) -> Vec<usize> {
    let mut keys: Vec<usize> = dense
        .iter()
        .flat_map(|r| r.clone())
        .chain(selection.iter().copied())
        .map(|i| i as usize)
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// `size` distinct ids drawn uniformly from `eligible` (all of them when it is smaller).
pub fn random_selection(eligible: Range<u32>, size: usize, rng: &mut impl Rng) -> Vec<u32> {
    let n = eligible.len();
    sample(rng, n, size.min(n))
        .into_iter()
        .map(|i| eligible.start + i as u32)
        .collect()
}

/// KL(p ‖ q) of the next-token distributions given by two rows of logits.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let lp = log_softmax(p_logits);
    let lq = log_softmax(q_logits);
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// −ln p(`target`) under a row of logits.
pub fn negative_log_likelihood(logits: &[f32], target: u32) -> f64 {
    -log_softmax(logits)[target as usize]
}

/// Index of the largest logit.
pub fn argmax(logits: &[f32]) -> usize {
    logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// The `q`-quantile (0..=1) of `values` by the nearest rank (0 for none).
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Arithmetic mean (0 for none).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_hand_built_distribution_gives_the_recalls_computed_by_hand() {
        // Keys 0 (sink) .. 5; eligible 1..5; weights chosen by hand.
        let w = [0.3, 0.05, 0.1, 0.2, 0.15, 0.2];
        let eligible = 1..5;
        // Eligible mass 0.5; {2, 3} holds 0.3 of it.
        assert!((mass_recall(&w, eligible.clone(), &[2, 3]) - 0.6).abs() < 1e-12);
        // The exact top 2 of 1..5 is {3, 4}: {2, 3} finds one of them.
        assert!((top_k_recall(&w, eligible.clone(), &[2, 3]) - 0.5).abs() < 1e-12);
        assert_eq!(top_k_recall(&w, eligible.clone(), &[4, 3]), 1.0);
        // Ids outside the eligible range count for nothing.
        assert!((mass_recall(&w, eligible.clone(), &[0, 5, 4]) - 0.3).abs() < 1e-12);
        assert_eq!(mass_recall(&w, eligible, &[]), 0.0);
    }

    #[test]
    fn attending_everything_reproduces_the_full_output() {
        let w = softmax(&[0.5, -1.0, 2.0, 0.0]);
        let values = [1.0, 0.0, 0.0, 1.0, 2.0, -1.0, 0.5, 0.5];
        let all = attended(&[0..1, 3..4], &[1, 2, 2]);
        assert_eq!(all, vec![0, 1, 2, 3]);
        let full = output_over(&w, &values, 2, &all);
        let by_hand: Vec<f64> = (0..2)
            .map(|c| (0..4).map(|j| w[j] * values[j * 2 + c] as f64).sum())
            .collect();
        assert!(relative_l2(&full, &by_hand) < 1e-12);
        // Dropping key 2 (the heaviest) changes the output.
        let part = output_over(&w, &values, 2, &[0, 1, 3]);
        assert!(relative_l2(&part, &full) > 0.1);
    }

    #[test]
    fn random_selections_cover_about_their_share_of_the_mass() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let logits: Vec<f64> = (0..4000).map(|_| rng.random_range(-2.0..2.0)).collect();
        let w = softmax(&logits);
        let recalls: Vec<f64> = (0..200)
            .map(|_| {
                let s = random_selection(100..4000, 390, &mut rng);
                assert_eq!(s.len(), 390);
                assert!(s.iter().all(|&i| (100..4000).contains(&i)));
                mass_recall(&w, 100..4000, &s)
            })
            .collect();
        // 390 of 3900 eligible keys: a tenth of the mass on average.
        assert!((mean(&recalls) - 0.1).abs() < 0.01, "{}", mean(&recalls));
    }

    #[test]
    fn kl_and_likelihood_match_closed_forms() {
        let p = [0.0f32, 0.0];
        let q = [(3f32).ln(), 0.0];
        // p = (1/2, 1/2), q = (3/4, 1/4): KL = ½ ln(2/3) + ½ ln 2.
        let expected = 0.5 * (2.0f64 / 3.0).ln() + 0.5 * 2f64.ln();
        assert!((kl_divergence(&p, &q) - expected).abs() < 1e-6);
        assert_eq!(kl_divergence(&q, &q), 0.0);
        assert!((negative_log_likelihood(&q, 1) - 4f64.ln()).abs() < 1e-6);
        assert_eq!(argmax(&q), 0);
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.5), 2.0);
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.99), 4.0);
    }
}
