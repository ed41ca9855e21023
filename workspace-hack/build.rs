// Empty on purpose: Cargo resolves a crate's build-dependencies only when it has a build
// script, and those dependencies are this crate's whole job (see Cargo.toml).
fn main() {}
