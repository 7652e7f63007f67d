//! What the test bed's own tests share.

/// Says why a test (or part of one) cannot run on this machine. Under `GPUPOOL_E2E_STRICT=1`
/// (CI, which installs everything the tests need and runs as root) that is a failure, not a
/// skip, so a test that never runs cannot pass unseen.
pub fn skip(why: &str) {
    assert!(
        std::env::var("GPUPOOL_E2E_STRICT").as_deref() != Ok("1"),
        "GPUPOOL_E2E_STRICT=1, so this must run, but: {why}"
    );
    eprintln!("skipped: {why}");
}
