//! The store's two readers of a layer's rows: `layer_kv` (f32, token-major, what the CPU
//! session and ingest take) and `layer_kv_f16` (f16 as stored, head-major, what a GPU upload
//! takes, in parts read in parallel) return the same numbers for any range, across block
//! boundaries and a partial last block, and a short or missing block is reported as
//! corruption by both.

use anyhow::{ensure, Result};
use half::f16;
use kvdb::store::{Access, BlockKey, Kv, ModelRecord, PrefillRecord, Store};
use kvdb::Error;

const KV_HEADS: usize = 3;
const D: usize = 8;
const BLOCK: usize = 4;
const TOKENS: usize = 10;

fn record() -> ModelRecord {
    ModelRecord {
        sha256: "0".repeat(64),
        name: "tiny".into(),
        architecture: "llama".into(),
        n_layers: 2,
        n_heads: 6,
        n_kv_heads: KV_HEADS,
        head_dim: D,
        context_length: 64,
    }
}

/// A distinct value for every (kv, layer, head, token, dimension), exact in f16.
fn value(kv: Kv, layer: usize, head: usize, token: usize, j: usize) -> f32 {
    let kv = if kv == Kv::Keys { 0.0 } else { 0.5 };
    (layer * 1000 + head * 100 + token * 8 + j) as f32 / 4.0 + kv
}

#[test]
fn both_readers_return_the_stored_rows() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path().join("s"), Access::Write)?;
    let mut manifest =
        store.create_corpus("c", record(), vec![], BLOCK, PrefillRecord::default())?;
    let mut batch = store.batch();
    for layer in 0..2 {
        for head in 0..KV_HEADS {
            for block in 0..TOKENS.div_ceil(BLOCK) {
                let rows = block * BLOCK..TOKENS.min((block + 1) * BLOCK);
                for kv in [Kv::Keys, Kv::Values] {
                    let data = rows
                        .clone()
                        .flat_map(|t| (0..D).map(move |j| value(kv, layer, head, t, j)))
                        .map(f16::from_f32)
                        .collect();
                    batch.put_block(kv, BlockKey::new(manifest.id, layer, head, block), data);
                }
            }
        }
    }
    manifest.tokens = TOKENS;
    batch.put_manifest(&manifest)?;
    store.commit(batch)?;

    // Read whole, and in parts of every size around the block's (as a long corpus is).
    let cases = [0..TOKENS, 3..9, 4..8, 9..10, 5..5]
        .into_iter()
        .flat_map(|range| [None, Some(1), Some(3), Some(4), Some(5)].map(|p| (range.clone(), p)));
    for (range, part) in cases {
        let (keys, values) = store.layer_kv(&manifest, 1, range.clone())?;
        let (keys16, values16) = match part {
            None => store.layer_kv_f16(&manifest, 1, range.clone())?,
            Some(rows) => store.layer_kv_f16_in_parts(&manifest, 1, range.clone(), rows)?,
        };
        for (kv, token_major, head_major) in
            [(Kv::Keys, &keys, &keys16), (Kv::Values, &values, &values16)]
        {
            let n = range.len();
            ensure!(token_major.len() == n * KV_HEADS * D && head_major.len() == n * KV_HEADS * D);
            for (i, t) in range.clone().enumerate() {
                for head in 0..KV_HEADS {
                    for j in 0..D {
                        let want = value(kv, 1, head, t, j);
                        let a = token_major[(i * KV_HEADS + head) * D + j];
                        let b = head_major[(head * n + i) * D + j].to_f32();
                        ensure!(
                            a == want && b == want,
                            "{kv:?} {range:?} token {t} head {head} dim {j}: {a} and {b}, want {want}"
                        );
                    }
                }
            }
        }
    }
    // Past the stored rows: both say which block is short or missing.
    for (range, says) in [
        (8..12, "block 2 of layer 0 head 0 is short"),
        (12..14, "block 3 of layer 0 head 0 is missing"),
    ] {
        for result in [
            store.layer_kv(&manifest, 0, range.clone()).map(|_| ()),
            store.layer_kv_f16(&manifest, 0, range.clone()).map(|_| ()),
            store
                .layer_kv_f16_in_parts(&manifest, 0, range.clone(), 1)
                .map(|_| ()),
        ] {
            ensure!(
                matches!(&result, Err(Error::Corrupt(m)) if m.contains(says)),
                "{range:?}: {result:?}"
            );
        }
    }
    Ok(())
}
