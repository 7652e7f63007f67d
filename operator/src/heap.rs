//! The operator's heap as the C library's allocator holds it, and keeping the resident set close
//! to what is in use.
//!
//! The heap rises while the operator decodes its initial lists and runs the first reconcile of a
//! large pool, then falls back to what its caches hold. glibc's allocator keeps what is freed:
//! each thread that allocates may get an arena of its own (up to eight per core of the machine,
//! not of the pod's CPU limit), and free pages inside an arena stay resident until they are
//! handed back. Without help the resident set stays at the busiest moment's peak.
//!
//! - [`fix_mmap_threshold`] keeps blocks above a fixed size (`--heap-mmap-threshold-kib`,
//!   128 KiB by default) in mappings of their own, which go back to the kernel when freed.
//!   glibc starts at that size but raises the threshold to the largest mapped block freed so
//!   far (up to 32 MiB), so after the first list page's body the pages of every later list
//!   (hundreds of KiB to MiBs of JSON) are carved from the arenas and leave free, resident
//!   holes there (measured: docs/benchmarks.md, "Heap and allocator");
//! - [`trim`] hands whole free pages back to the kernel, on an interval when `--heap-trim-secs`
//!   is set (off by default);
//! - [`HeapCollector`] exports what the allocator holds, in use and free, as
//!   `gpupool_operator_heap_bytes`, so the resident set can be told apart from the heap.
//!
//! Both do nothing where the C library is not glibc.

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use tracing::{debug, warn};

/// What the allocator holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapStats {
    /// Bytes in blocks handed out and not yet freed (including blocks mapped on their own).
    pub in_use: u64,
    /// Bytes freed but still held in the arenas: resident until trimmed or reused.
    pub free: u64,
}

/// The allocator's figures now (glibc's `mallinfo2`, which walks every arena). `None` where the
/// C library is not glibc.
pub fn stats() -> Option<HeapStats> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and returns a plain struct; glibc locks each
        // arena while it reads it, so it is safe beside other threads.
        let info = unsafe { libc::mallinfo2() };
        Some(HeapStats {
            in_use: (info.uordblks + info.hblkhd) as u64,
            free: info.fordblks as u64,
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Serves every block of `bytes` or more from a mapping of its own, and stops glibc from
/// raising that threshold as large blocks are freed (`mallopt(M_MMAP_THRESHOLD)`, which also
/// fixes the trim threshold at its default). True if the allocator took it; false where the C
/// library is not glibc or `bytes` does not fit the C `int` glibc takes.
pub fn fix_mmap_threshold(bytes: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let Ok(bytes) = libc::c_int::try_from(bytes) else {
            return false;
        };
        // SAFETY: mallopt takes two integers and locks the allocator itself.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        false
    }
}

/// Hands the arenas' whole free pages back to the kernel (glibc's `malloc_trim`, which also
/// releases free pages in the middle of an arena, not only at its top). True if any were.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes no pointers and locks each arena itself.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Trims the heap every `interval` for as long as the process runs. The first trim comes one
/// interval after the start, by when the initial lists (the largest transient) are decoded and
/// cut; later ones catch what a large reconcile freed.
pub async fn trim_every(interval: Duration) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let started = std::time::Instant::now();
        match tokio::task::spawn_blocking(trim).await {
            Ok(released) => debug!(released, took = ?started.elapsed(), "heap trimmed"),
            Err(e) => warn!(error = %e, "the heap trim task failed"),
        }
    }
}

/// Labels of the heap gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HeapLabels {
    /// `in_use` or `free`.
    state: &'static str,
}

/// Encodes `gpupool_operator_heap_bytes{state="in_use"|"free"}` at scrape time.
#[derive(Debug, Default)]
pub struct HeapCollector;

impl Collector for HeapCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(heap) = stats() else {
            return Ok(());
        };
        let mut family = encoder.encode_descriptor(
            "gpupool_operator_heap_bytes",
            "Bytes the operator's allocator holds: in use, and freed but not yet handed back to the kernel",
            None,
            MetricType::Gauge,
        )?;
        for (state, bytes) in [("in_use", heap.in_use), ("free", heap.free)] {
            let gauge = ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX));
            gauge.encode(family.encode_family(&HeapLabels { state })?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes in blocks that have mappings of their own.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn mapped() -> usize {
        // SAFETY: as in `stats`.
        unsafe { libc::mallinfo2() }.hblkhd
    }

    /// With glibc's dynamic threshold, freeing a 4 MiB mapped block raises the threshold to 4
    /// MiB, and a 2 MiB block after it comes from an arena; fixed, it is mapped again (and so
    /// goes back to the kernel when freed).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_fixed_threshold_keeps_large_blocks_mapped() {
        assert!(!fix_mmap_threshold(1 << 40), "above what an int holds");
        assert!(fix_mmap_threshold(128 * 1024));
        drop(std::hint::black_box(vec![1u8; 4 << 20]));
        let before = mapped();
        let block = std::hint::black_box(vec![1u8; 2 << 20]);
        let during = mapped();
        drop(block);
        // Other tests run beside this one; a 2 MiB rise is this block's.
        assert!(
            during >= before + (2 << 20),
            "mapped {before} → {during} bytes"
        );
    }

    fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    /// 64 MiB of small blocks, freed but for one allocated after them that pins the arena's
    /// top: free alone cannot shrink the arena, so the pages stay resident, the allocator counts
    /// them free, and the trim gives them back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_pages_are_counted_free_until_the_trim_returns_them() {
        let before = stats().unwrap();
        let mut blocks: Vec<Vec<u8>> = (0..64 * 1024).map(|_| vec![1u8; 1000]).collect();
        let pin: Vec<u8> = vec![2u8; 1000];
        let held = stats().unwrap();
        assert!(
            held.in_use >= before.in_use + 60 * 1024 * 1024,
            "{before:?} → {held:?}"
        );
        drop(std::mem::take(&mut blocks));
        let freed = stats().unwrap();
        // Other tests allocate beside this one; ask for most of the 64 MiB, not all of it.
        assert!(freed.free >= 48 * 1024 * 1024, "{freed:?}");
        let rss_freed = rss_kib();
        assert!(trim(), "malloc_trim released nothing");
        let rss_trimmed = rss_kib();
        assert_eq!(pin[0], 2);
        assert!(
            rss_freed.saturating_sub(rss_trimmed) > 16 * 1024,
            "RSS after free {rss_freed} KiB, after trim {rss_trimmed} KiB"
        );
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_collector_encodes_both_states() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(HeapCollector));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for state in ["in_use", "free"] {
            let line = text
                .lines()
                .find(|l| {
                    l.starts_with(&format!("gpupool_operator_heap_bytes{{state=\"{state}\"}}"))
                })
                .unwrap_or_else(|| panic!("no {state} line in:\n{text}"));
            let bytes: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            if state == "in_use" {
                assert!(bytes > 0, "{line}");
            }
        }
    }
}
