//! An ingest on the CPU keeps one position in `QUERY_SAMPLE_STRIDE` of every retrieval
//! layer's queries (none of a sliding-window layer's), committed with the corpus, and
//! `ivf…,fit` and `ivf…,hot<N>` indexes are built from them; a tiny random-weight gemma3 (one
//! global layer of five, two KV heads) on part of the GPL.

mod support;

use std::sync::Arc;

use anyhow::{ensure, Result};
use half::f16;
use kvdb::ingest;
use kvdb::store::{Access, ModelRecord, PrefillRecord, QueryKey, Store, QUERY_SAMPLE_STRIDE};
use kvdb::SourceDocument;
use kvdb_index::IndexSpec;
use kvdb_tests::gpl_text;
use support::tiny_gemma3;

#[test]
fn ingest_samples_queries_and_fit_indexes_use_them() -> Result<()> {
    let (_file, model) = tiny_gemma3()?;
    let text: String = gpl_text()?.chars().take(6000).collect();
    // Two documents, ingested one after the other, split at the first paragraph break past
    // the middle: the sample goes on across ingests.
    let middle = text.len() / 2;
    let split = middle + text[middle..].find("\n\n").unwrap_or(0) + 2;
    let (first, second) = text.split_at(split);
    let documents: Vec<SourceDocument> = [first, second]
        .iter()
        .enumerate()
        .map(|(i, text)| SourceDocument {
            path: format!("gpl/part{i}.txt").into(),
            title: format!("part{i}"),
            sha256: kvdb_model::fetch::sha256_hex(text.as_bytes()),
            bytes: text.len(),
            text: text.to_string(),
        })
        .collect();
    let dir = tempfile::tempdir()?;
    let store = Arc::new(Store::open(dir.path(), Access::Write)?);
    ingest(&store, "c", model.as_ref(), &documents[..1], &mut |_| {})?;
    ingest(&store, "c", model.as_ref(), &documents[1..], &mut |_| {})?;
    let manifest = store.manifest("c")?;
    let config = model.model.config();
    let (d, group) = (config.head_dim, config.n_heads / config.n_kv_heads);
    let expected: Vec<u32> = (QUERY_SAMPLE_STRIDE - 1..manifest.tokens)
        .step_by(QUERY_SAMPLE_STRIDE)
        .map(|p| p as u32)
        .collect();
    let retrieval = manifest.retrieval_layers();
    ensure!(!retrieval.is_empty() && retrieval.len() < manifest.layers.len());
    for layer in 0..manifest.layers.len() {
        let heads = (0..config.n_kv_heads)
            .map(|head| store.query_sample(&manifest, layer, head))
            .collect::<kvdb::Result<Vec<_>>>()?;
        if !retrieval.contains(&layer) {
            ensure!(
                heads.iter().all(|h| h.positions.is_empty()),
                "sliding layer {layer} keeps queries"
            );
            continue;
        }
        for sample in &heads {
            ensure!(
                sample.positions == expected,
                "layer {layer}: {:?}",
                sample.positions
            );
            ensure!(sample.queries.len() == expected.len() * group * d);
            ensure!(sample.queries.iter().all(|q| q.is_finite()));
        }
        // Each KV head's sample holds its own group's query heads.
        ensure!(
            heads[0].queries != heads[1].queries,
            "layer {layer}: the heads' samples agree"
        );
    }
    // The indexes that learn from the sample are built as asked (without one they would be
    // built without `fit` or `hot`, with a warning).
    let specs: Vec<IndexSpec> = [
        "ivf8,np2,norope,all,fit",
        "ivf8,np2,hot50,norope",
        "ivf8,np2,hot50,norope,all",
    ]
    .iter()
    .map(|s| s.parse())
    .collect::<Result<_, _>>()?;
    let infos = kvdb::update_indexes(&store, "c", model.as_ref(), &specs, None, &mut |_| {})?;
    for spec in &specs {
        let info = infos
            .iter()
            .find(|i| i.spec == spec.to_string())
            .ok_or_else(|| anyhow::anyhow!("no `{spec}` among {infos:?}"))?;
        ensure!(
            info.built == spec.to_string(),
            "built {} ({:?})",
            info.built,
            info.warnings
        );
    }
    Ok(())
}

/// Query rows reach the store as an SST file before the manifest that counts them commits,
/// as key and value blocks do: rows written past the committed tokens (an ingest that died
/// between the two) are not read, a row written again (the resumed ingest) replaces the
/// first, and they outlive the process without the write-ahead log.
#[test]
fn query_rows_past_the_manifest_are_not_read() -> Result<()> {
    let (heads, d) = (4, 8);
    let record = ModelRecord {
        sha256: "0".repeat(64),
        name: "rows".into(),
        architecture: "gemma3".into(),
        n_layers: 1,
        n_heads: heads,
        n_kv_heads: 2,
        head_dim: d,
        context_length: 4096,
    };
    let row = |x: f32| vec![f16::from_f32(x); heads * d];
    let dir = tempfile::tempdir()?;
    {
        let store = Store::open(dir.path(), Access::Write)?;
        let mut manifest =
            store.create_corpus("c", record, vec![], 64, PrefillRecord::default())?;
        manifest.tokens = 20;
        let mut batch = store.batch();
        batch.put_queries(QueryKey::new(manifest.id, 0, 15), &row(1.0));
        batch.put_manifest(&manifest)?;
        store.commit(batch)?;
        // The next chunk's rows, and position 15 again, with no manifest after them.
        let mut batch = store.batch();
        batch.put_queries(QueryKey::new(manifest.id, 0, 15), &row(2.0));
        batch.put_queries(QueryKey::new(manifest.id, 0, 31), &row(3.0));
        store.commit(batch)?;
    }
    let store = Store::open(dir.path(), Access::Read)?;
    let manifest = store.manifest("c")?;
    for head in 0..2 {
        let sample = store.query_sample(&manifest, 0, head)?;
        ensure!(sample.positions == [15], "{:?}", sample.positions);
        ensure!(sample.queries == vec![2.0; 2 * d], "{:?}", sample.queries);
    }
    Ok(())
}
