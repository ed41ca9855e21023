//! The estimate of unvisited buckets (RetroInfer's idea) is exact when a bucket's keys all
//! score like its centroid: here every key outside the dense part is zero, so each scores 0
//! against any query, and a single bucket with centroid 0 and the values' mean stands for them.

use kvdb_attention::reference::full_attention_f64;
use kvdb_attention::{attend, DenseKv, DensePolicy, Estimate, RetrievalQuery};
use kvdb_index::{Selection, UnvisitedBucket};
use kvdb_model::RopeStyle;
use kvdb_tests::{random_vec, seeded, test_rope};

#[test]
fn estimate_is_exact_for_keys_that_score_like_their_centroid() -> kvdb_attention::Result<()> {
    let (seed, mut rng) = seeded();
    let (n, d, heads) = (200, 16, 4);
    let rope = test_rope(RopeStyle::Halves, d);
    let policy = DensePolicy { sink: 2, window: 5 };
    let position = n - 1;
    let mut keys = random_vec(&mut rng, n * d);
    let dense = policy.dense_ranges(position);
    let mut members = 0u32;
    for id in 0..n {
        if !dense.iter().any(|r| r.contains(&(id as u32))) {
            keys[id * d..(id + 1) * d].fill(0.0);
            members += 1;
        }
    }
    let values = random_vec(&mut rng, n * d);
    let mut mean = vec![0f32; d];
    for id in (0..n).filter(|&id| !dense.iter().any(|r| r.contains(&(id as u32)))) {
        for (m, v) in mean.iter_mut().zip(&values[id * d..(id + 1) * d]) {
            *m += v / members as f32;
        }
    }
    let queries = random_vec(&mut rng, heads * d);
    let kv = DenseKv::new(keys.clone(), values.clone(), d)?;
    let scale = 0.5;
    let unvisited = [UnvisitedBucket {
        bucket: 0,
        size: members,
        logits: vec![0.0; heads],
    }];
    let estimate = Estimate::new(&unvisited, &mean, heads, d, scale)?;
    let selection = Selection::default();
    let query = |estimate| RetrievalQuery {
        queries: &queries,
        position,
        rope: &rope,
        scale,
        policy,
        selection: &selection,
        estimate,
    };
    let exact = full_attention_f64(&queries, &keys, &values, position, &rope, scale)?;
    let error = |out: &[f32]| -> f64 {
        let err: f64 = out
            .iter()
            .zip(&exact)
            .map(|(a, b)| (*a as f64 - b).powi(2))
            .sum();
        (err / exact.iter().map(|b| b * b).sum::<f64>()).sqrt()
    };
    let with = attend(&query(Some(&estimate)), &kv)?;
    let without = attend(&query(None), &kv)?;
    assert!(
        error(&with.output) < 1e-5,
        "seed {seed}: {}",
        error(&with.output)
    );
    assert!(
        error(&without.output) > 1e-2,
        "seed {seed}: the dense part alone is not exact"
    );
    Ok(())
}
