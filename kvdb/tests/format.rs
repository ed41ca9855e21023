//! Store format versions: a version 1 store (manifests without the prefill record, all
//! ingested on the CPU in chunks of 512 tokens) is read as such and upgraded by a writer; a
//! store of a future version is refused with a message.

use anyhow::{ensure, Result};
use kvdb::store::{Access, PrefillRecord, Store, FORMAT_VERSION};
use kvdb::Error;

/// Rewrites the store record's version, strips `prefill` from corpus `c`'s manifest and
/// drops the `queries` family, as a version 1 kvdb wrote them, through RocksDB directly.
fn rewrite_as(path: &std::path::Path, version: u32) -> Result<()> {
    let families = [
        "meta", "docs", "tokens", "keys", "values", "index", "queries",
    ];
    let mut db = rocksdb::DB::open_cf(&rocksdb::Options::default(), path, families)?;
    db.drop_cf("queries")?;
    let meta = db.cf_handle("meta").expect("the store has a meta family");
    let record: serde_json::Value =
        serde_json::from_slice(&db.get_cf(meta, b"store")?.expect("a record"))?;
    let mut record = record;
    record["format_version"] = version.into();
    db.put_cf(meta, b"store", serde_json::to_vec(&record)?)?;
    let key = b"corpus/c";
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&db.get_cf(meta, key)?.expect("a manifest"))?;
    manifest["format_version"] = version.into();
    manifest
        .as_object_mut()
        .expect("an object")
        .remove("prefill");
    db.put_cf(meta, key, serde_json::to_vec(&manifest)?)?;
    Ok(())
}

fn record() -> kvdb::store::ModelRecord {
    kvdb::store::ModelRecord {
        sha256: "0".repeat(64),
        name: "tiny".into(),
        architecture: "llama".into(),
        n_layers: 1,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 8,
        context_length: 64,
    }
}

#[test]
fn version_1_stores_are_read_and_upgraded() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("s");
    let chosen = PrefillRecord {
        device: "cuda".into(),
        chunk: 4096,
    };
    {
        let store = Store::open(&path, Access::Write)?;
        let m = store.create_corpus("c", record(), vec![], 64, chosen.clone())?;
        ensure!(m.prefill == chosen && m.format_version == FORMAT_VERSION);
    }
    ensure!(Store::open(&path, Access::Read)?.manifest("c")?.prefill == chosen);
    rewrite_as(&path, 1)?;
    // Read as it is: the prefill record defaults to what version 1 did, and there is no
    // query sample (nor its family, which a reader does not create).
    let reader = Store::open(&path, Access::Read)?;
    let read = reader.manifest("c")?;
    ensure!(reader.query_sample(&read, 0, 0)?.positions.is_empty());
    drop(reader);
    ensure!(
        read.prefill == PrefillRecord::default(),
        "{:?}",
        read.prefill
    );
    ensure!(read.prefill.device == "cpu" && read.prefill.chunk == 512);
    // A writer marks the store with the current version; the manifest still reads.
    drop(Store::open(&path, Access::Write)?);
    let store = Store::open(&path, Access::Read)?;
    ensure!(store.manifest("c")?.prefill == PrefillRecord::default());
    Ok(())
}

#[test]
fn stores_of_a_later_version_are_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("s");
    {
        let store = Store::open(&path, Access::Write)?;
        store.create_corpus("c", record(), vec![], 64, PrefillRecord::default())?;
    }
    rewrite_as(&path, FORMAT_VERSION + 1)?;
    for access in [Access::Read, Access::Write] {
        match Store::open(&path, access) {
            Err(e @ Error::FormatVersion { .. }) => {
                ensure!(
                    e.to_string()
                        .contains(&format!("format version {}", FORMAT_VERSION + 1)),
                    "{e}"
                )
            }
            other => anyhow::bail!("{access:?}: expected a format error, got {other:?}"),
        }
    }
    Ok(())
}
