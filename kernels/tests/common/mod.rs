//! What the GPU test files share: saying that a test skipped, and starting one on the device.

use std::io::Write;

/// Says that a test skipped, on stderr itself: libtest captures `eprintln!`, not this.
pub fn skip(test: &str, reason: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {reason}");
}

/// The device and a random generator with a fresh seed (printed, so that a failure can be
/// replayed), or `None` after saying why the test skips.
#[cfg(feature = "gpu")]
pub fn start(test: &str) -> Option<(kvdb_kernels::Gpu, rand::rngs::StdRng)> {
    use rand::{Rng, SeedableRng};
    match kvdb_kernels::Gpu::new(0) {
        Ok(gpu) => {
            let seed: u64 = rand::rng().random();
            println!("{test}: seed {seed}");
            Some((gpu, rand::rngs::StdRng::seed_from_u64(seed)))
        }
        Err(e) => {
            skip(test, &e.to_string());
            None
        }
    }
}
