//! What an Xid means for the node, in one place: which Xids are the application's fault (ignored
//! by the health monitor and by the `XidErrors` check) and which one says the GPU is lost.
//! Reading Xids from the kernel log is [`crate::kmsg`]; counting them for validation is
//! [`crate::validate::XidLedger`]; turning NVML's events into the plugin's is the agent's.

/// Xids that are the application's fault, not the GPU's; ignored by default, as
/// NVIDIA's device plugin does. Reasons per NVIDIA's Xid catalog:
///
/// * 13, Graphics Engine Exception: the running program faulted (e.g. an
///   out-of-range access or illegal instruction in a kernel); restart the app.
/// * 31, GPU memory page fault: an MMU fault, almost always an illegal address
///   dereferenced by the application.
/// * 43, GPU stopped processing: the driver stopped the channel of an app that
///   hit a software-induced fault; the GPU itself stays usable.
/// * 45, Preemptive cleanup, due to previous errors: the driver tearing down the
///   channels of a killed or already-failed process; a consequence, not a cause.
/// * 68, video processor (NVDEC) exception: an error in a decode job, reported
///   against the application's context.
/// * 109, Context switch timeout: the catalog's resolution bucket for it is a GPU
///   reset (NVIDIA/k8s-device-plugin#1974 points out the disagreement); we keep it
///   ignored for parity with NVIDIA's plugin, and it is configurable.
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Xid 79, "GPU has fallen off the bus": the GPU no longer answers and needs a reset or reboot.
pub const GPU_LOST: u64 = 79;

/// Whether an Xid fails the `XidErrors` check: every Xid but those the health monitor ignores
/// as the application's fault ([`DEFAULT_IGNORED_XIDS`]).
pub fn is_fatal(xid: u64) -> bool {
    !DEFAULT_IGNORED_XIDS.contains(&xid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_faults_are_not_fatal() {
        for x in DEFAULT_IGNORED_XIDS {
            assert!(!is_fatal(x), "Xid {x}");
        }
        for x in [48, 63, 64, 74, 79, 92, 94, 95, 119, 120] {
            assert!(is_fatal(x), "Xid {x}");
        }
    }
}
