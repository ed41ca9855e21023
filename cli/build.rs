//! Records the versions of the native libraries this binary links (from the workspace's
//! Cargo.lock) for `kvdb doctor`: RocksDB and faiss have no run-time version call.

use std::path::Path;

fn main() {
    // Read at run time, not with `env!`: Cargo shares one compiled build script between
    // checkouts that share a target directory, and a path baked in at compile time named
    // another checkout's lock file, which did not exist here, so the script ran on every
    // build (rebuilding this crate each time) and reported "unknown" versions.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
    let lock_path = Path::new(&manifest_dir).join("../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock_path.display());
    let lock = std::fs::read_to_string(&lock_path).unwrap_or_default();
    let version = |package: &str| {
        let mut lines = lock.lines();
        while let Some(line) = lines.next() {
            if line == format!("name = \"{package}\"") {
                if let Some(v) = lines.next().and_then(|l| l.strip_prefix("version = ")) {
                    return v.trim_matches('"').to_string();
                }
            }
        }
        "unknown".to_string()
    };
    let rocksdb_sys = version("librocksdb-sys");
    // librocksdb-sys spells the RocksDB it bundles as build metadata: 0.19.0+11.8.1.
    let rocksdb = rocksdb_sys.split_once('+').map_or("unknown", |(_, v)| v);
    println!("cargo:rustc-env=KVDB_LIBROCKSDB_SYS_VERSION={rocksdb_sys}");
    println!("cargo:rustc-env=KVDB_ROCKSDB_VERSION={rocksdb}");
    println!(
        "cargo:rustc-env=KVDB_FAISS_SYS_VERSION={}",
        version("faiss-sys")
    );
}
