//! Whether the agent sees the host's processes: NVML lists only the GPU processes whose PIDs
//! the caller's PID namespace holds, so an agent outside the host's PID namespace (the chart's
//! `agent.hostPID: false`) sees every GPU empty. That must read as "cannot tell", never as
//! "idle" or "free" (issue #38): the check fails, activity is `Unknown`, MIG changes hold.
//!
//! The agent reads its own `status` in the host's procfs (`<host proc>/self/status`, the host's
//! `/proc` being `<host root>/proc` or `--host-proc-root`): its `NSpid` line lists the agent's
//! PID in that procfs's namespace and in every namespace nested below it down to the agent's
//! own, so one entry means the agent is in the host's PID namespace and more mean it is not.
//! (Comparing `/proc/self/ns/pid` with PID 1's link needs ptrace access to PID 1, which a
//! sandboxed host may refuse even to root; reading one's own status needs none.)

use std::path::{Path, PathBuf};

use gpupool_crds::node::{CheckName, CheckResult};

/// Where the agent's PID namespace stands against the host's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPidNamespace {
    /// The agent runs in the host's PID namespace.
    Shared,
    /// The agent runs in a PID namespace nested below the host's.
    Nested {
        /// The agent's PIDs from the host's namespace down to its own (`NSpid`).
        pids: String,
    },
    /// The host's procfs (or its `NSpid` line) could not be read, so nothing is known.
    Unreadable {
        /// The file read.
        path: PathBuf,
        /// Why.
        error: String,
    },
}

impl HostPidNamespace {
    /// Reads the agent's own `status` in the host's procfs at `host_proc`.
    pub fn read(host_proc: &Path) -> HostPidNamespace {
        let path = host_proc.join("self/status");
        match std::fs::read_to_string(&path) {
            Ok(text) => HostPidNamespace::from_status(&text).unwrap_or_else(|error| {
                HostPidNamespace::Unreadable {
                    path: path.clone(),
                    error,
                }
            }),
            Err(e) => HostPidNamespace::Unreadable {
                path,
                error: e.to_string(),
            },
        }
    }

    /// The verdict on a `/proc/<pid>/status` text read through the host's procfs.
    pub fn from_status(status: &str) -> Result<HostPidNamespace, String> {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .ok_or_else(|| "no NSpid line (a kernel older than 4.1?)".to_owned())?;
        let pids: Vec<&str> = line.split_whitespace().collect();
        match pids.len() {
            0 => Err("an empty NSpid line".to_owned()),
            1 => Ok(HostPidNamespace::Shared),
            _ => Ok(HostPidNamespace::Nested {
                pids: pids.join(" "),
            }),
        }
    }

    /// `Ok` when the process lists the agent reads are the host's; else why not.
    pub fn sees_host_processes(&self) -> Result<(), String> {
        match self {
            HostPidNamespace::Shared => Ok(()),
            HostPidNamespace::Nested { .. } => {
                Err("the agent is not in the host's PID namespace (agent.hostPID)".to_owned())
            }
            HostPidNamespace::Unreadable { path, .. } => Err(format!(
                "the host's PID namespace cannot be read at {}",
                path.display()
            )),
        }
    }

    /// The `HostPIDNamespace` check in GpuNode status.
    pub fn check(&self) -> CheckResult {
        let (passed, message) = match self {
            HostPidNamespace::Shared => (
                true,
                "the agent runs in the host's PID namespace and sees the GPU processes".to_owned(),
            ),
            HostPidNamespace::Nested { pids } => (
                false,
                format!(
                    "the agent runs in a PID namespace of its own, not the host's (its PIDs from the host's down: {pids}): it cannot see the GPU processes, so activity is Unknown and MIG and sharing changes hold; run the agent with hostPID (chart value agent.hostPID: true)"
                ),
            ),
            HostPidNamespace::Unreadable { path, error } => (
                false,
                format!(
                    "whether the agent is in the host's PID namespace cannot be told ({}: {error}): activity is Unknown and MIG and sharing changes hold; mount the host's / at --host-root (or its /proc at --host-proc-root)",
                    path.display()
                ),
            ),
        };
        CheckResult {
            name: CheckName::HostPidNamespace,
            passed,
            message,
        }
    }
}

/// The host's procfs by default: `proc` under the host's `/` (the agent's own `/proc`
/// when the host's `/` is its own).
pub fn default_host_proc(host_root: Option<&Path>) -> PathBuf {
    host_root.unwrap_or_else(|| Path::new("/")).join("proc")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_nspid_entry_is_the_host_namespace() {
        let status = |nspid: &str| format!("Name:\tgpupool\nPid:\t7\n{nspid}\nUid:\t0\n");
        // (NSpid line, sees the host's processes?)
        let cases = [
            ("NSpid:\t4242", Some(true)),
            ("NSpid:\t4242\t7", Some(false)),
            ("NSpid:\t4242\t17\t7", Some(false)),
            ("NSpid:", None),
            ("", None),
        ];
        for (line, sees) in cases {
            let found = HostPidNamespace::from_status(&status(line));
            assert_eq!(
                found.as_ref().ok().map(|f| f.sees_host_processes().is_ok()),
                sees,
                "{line:?}: {found:?}"
            );
        }
    }

    #[test]
    fn the_check_fails_unless_the_host_namespace_is_seen() {
        let tmp = tempfile::tempdir().unwrap();
        let proc = tmp.path();
        std::fs::create_dir(proc.join("self")).unwrap();
        let write = |nspid: &str| {
            std::fs::write(
                proc.join("self/status"),
                format!("Pid:\t7\nNSpid:\t{nspid}\n"),
            )
            .unwrap()
        };
        write("4242");
        let check = HostPidNamespace::read(proc).check();
        assert_eq!(check.name, CheckName::HostPidNamespace);
        assert!(check.passed, "{}", check.message);
        write("4242\t7");
        let check = HostPidNamespace::read(proc).check();
        assert!(!check.passed);
        assert!(check.message.contains("hostPID"), "{}", check.message);
        let missing = HostPidNamespace::read(&proc.join("nowhere"));
        assert!(matches!(missing, HostPidNamespace::Unreadable { .. }));
        assert!(!missing.check().passed);
        assert!(missing.sees_host_processes().is_err());
    }

    #[test]
    fn the_default_host_proc_is_under_the_host_root() {
        assert_eq!(
            default_host_proc(Some(Path::new("/host"))),
            PathBuf::from("/host/proc")
        );
        assert_eq!(default_host_proc(None), PathBuf::from("/proc"));
    }

    #[test]
    fn this_process_reads_its_own_namespace() {
        // Whatever the machine, reading our own procfs must give a verdict, not an error.
        assert!(!matches!(
            HostPidNamespace::read(Path::new("/proc")),
            HostPidNamespace::Unreadable { .. }
        ));
    }
}
