// Feature `openblas` links the system OpenBLAS (Debian: libopenblas-dev), whose CBLAS
// interface `ops.rs` declares through cblas-sys.
fn main() {
    if std::env::var_os("CARGO_FEATURE_OPENBLAS").is_some() {
        println!("cargo:rustc-link-lib=openblas");
    }
}
