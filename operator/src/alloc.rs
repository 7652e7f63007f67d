//! Keeping the operator's resident set close to its heap.
//!
//! The operator's heap rises while it decodes initial lists and the first reconcile of a large
//! pool, then falls back to what its caches hold. glibc's allocator keeps what was freed: each
//! thread that allocates may get an arena of its own (up to eight per core of the machine,
//! not of the pod's CPU limit), and free pages inside an arena's heap are not returned until
//! asked. So the resident set stays at the peak of the busiest moment, in as many arenas as
//! threads touched it. Two measures, both measured by the scale bench (README, "Operator at
//! scale"):
//!
//! - [`limit_arenas`] caps the arenas before the runtime starts its threads;
//! - [`trim`] hands free pages back to the kernel, called when the caches have synced and then
//!   every [`TRIM_INTERVAL`].
//!
//! Both are no-ops where the C library is not glibc.

use std::time::Duration;

/// Arenas kept when `MALLOC_ARENA_MAX` does not say otherwise: one for the main thread and one
/// the runtime's threads share. The operator's work is I/O-bound and its allocation is not
/// contended enough for more to pay.
pub const DEFAULT_ARENAS: i32 = 2;

/// How often [`trim`] runs in the background once the caches have synced.
pub const TRIM_INTERVAL: Duration = Duration::from_secs(30);

/// Caps glibc's malloc arenas at `MALLOC_ARENA_MAX` if set (glibc reads it itself), else at
/// [`DEFAULT_ARENAS`]. Call first thing in `main`, before any thread is spawned: arenas that
/// exist are kept.
pub fn limit_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; it is called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, DEFAULT_ARENAS);
    }
}

/// Returns the heap's free pages to the kernel (glibc's `malloc_trim`, which also releases
/// whole free pages in the middle of every arena). True if memory was released.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes no pointers and is safe to call from any thread.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    /// Many small blocks freed but for one that pins the arena's top, so free alone cannot
    /// shrink it: the pages stay resident until the trim gives them back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn trim_returns_freed_pages() {
        let mut blocks: Vec<Vec<u8>> = (0..64 * 1024).map(|_| vec![1u8; 1000]).collect();
        let pin: Vec<u8> = vec![2u8; 1000];
        drop(std::mem::take(&mut blocks));
        let freed = rss_kib();
        assert!(trim(), "malloc_trim released nothing");
        let after = rss_kib();
        assert_eq!(pin[0], 2);
        // 64 MiB were freed; other tests run beside this one, so ask for a quarter of it.
        assert!(
            freed.saturating_sub(after) > 16 * 1024,
            "RSS after free {freed} KiB, after trim {after} KiB"
        );
    }
}
