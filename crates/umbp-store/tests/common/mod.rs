//! Shared by the integration tests that start their own Redis processes.

use std::process::{Command, Stdio};

/// Whether `redis-server` is on PATH. Without it a test skips (saying so), unless
/// `UMBP_REQUIRE_REDIS=1` (CI), where that is a failure.
pub fn have_redis() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("UMBP_REQUIRE_REDIS").as_deref() != Ok("1"),
            "redis-server is not on PATH (apt-get install redis-server)"
        );
        eprintln!("SKIP: redis-server is not on PATH (apt-get install redis-server)");
    }
    found
}
