//! MPS: one CUDA MPS control daemon per GPU that the node's sharing puts under MPS, run from the
//! driver, supervised by the agent, and told the pool's per-client limits.
//!
//! Each GPU gets a directory under the MPS root (`/run/gpupool/mps/<GPU UUID>/`, host terms)
//! with the daemon's `pipe`, `log` and `shm`. The daemon runs in the foreground (`-f`), started
//! by the agent, with `CUDA_VISIBLE_DEVICES` set to its GPU, in a mount namespace of its
//! own where the GPU's `shm` directory is its `/dev/shm`, and (in a container) chrooted into
//! the host's `/`, so that the driver's own files, the MPS server binary included, are where
//! the driver expects them. Once its control pipe is up the agent sends it the default limits:
//! `set_default_active_thread_percentage <pct>` and `set_default_device_pinned_mem_limit 0
//! <MiB>M` (device 0: the only one the daemon sees). A client container is given the pipe
//! directory at `/run/gpupool/mps-pipe` (not MPS's default `/tmp/nvidia-mps`, a host path
//! anyone who can write the host's `/tmp` controls), the `shm` directory at `/dev/shm`, and the
//! same limits as environment variables. Both come only from directories the agent created
//! and owns ([`crate::trust::check_own_dir`]).
//!
//! A daemon that exits makes its GPU's replicas Unhealthy until a restart (with backoff, 2 s
//! doubling to 5 min) is up again.
//!
//! The daemons outlive the agent, so that an agent rollout, OOM kill or liveness restart leaves
//! every MPS client its server. A daemon runs in a session of its own, with its stderr in a
//! file of its log directory (`daemon.stderr`, emptied at each start and once it passes 1 MiB)
//! rather than a pipe to the agent: it never blocks on a full pipe nor dies of EPIPE when the
//! agent is gone, and its last 2 KiB make its exit reason. Its identity, the PID and the start
//! time the kernel gives it (`/proc/<pid>/stat`), is recorded in `daemon.pid` beside its
//! directories; it is moved, when configured, into a cgroup of its own (a container's cgroup
//! is killed whole when the container stops). The agent does not stop the daemons at its
//! shutdown: the next agent, when its GPU still wants MPS, takes the daemon over if the
//! recorded process is still there with that start time, runs the control program as `-f`,
//! and its control pipe is up; otherwise the record is dropped and a new daemon started. A
//! process that merely took the recorded PID is never signalled. A daemon the agent started
//! is signalled only through the task that owns its process (never by a PID that may have
//! been reaped and reused); one it took over only through a pidfd, which names that process
//! and no other, and whose readiness says when it exits (without one, `/proc` is polled and
//! the daemon is never signalled, only told `quit`).

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::io::{self, Read, Seek, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpupool_crds::node::GpuSharing;
use gpupool_crds::policy::MpsPolicy;
use tokio::io::AsyncWriteExt;
use tokio::io::unix::AsyncFd;
use tokio::process::Command;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::inventory::Inventory;
use crate::plugin::model::{HostMount, ShareClient};

/// The driver's MPS control program.
pub const CONTROL_BINARY: &str = "nvidia-cuda-mps-control";
/// Where the control program is looked for under the driver root.
const CONTROL_DIRS: [&str; 4] = ["usr/bin", "usr/local/bin", "bin", "usr/sbin"];
/// The pipe directory as a client container sees it (`CUDA_MPS_PIPE_DIRECTORY` says so). Not
/// MPS's default `/tmp/nvidia-mps`, which is where a hand-started daemon on the host would put
/// its pipe.
pub const CLIENT_PIPE_DIR: &str = "/run/gpupool/mps-pipe";
/// The MPS root on the host by default.
pub const DEFAULT_MPS_ROOT: &str = "/run/gpupool/mps";
/// The control pipe the daemon creates in its pipe directory once it listens.
const CONTROL_PIPE: &str = "control";
/// Longest wait for a started daemon's control pipe.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest wait for one control command (a daemon that died leaves its pipe without a reader).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a stopping daemon gets after `quit`.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_MIN: Duration = Duration::from_secs(2);
const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// How often a starting daemon is looked at.
const START_POLL: Duration = Duration::from_millis(100);
/// The record of a GPU's daemon, beside its directories: `<pid> <start time>`.
const RECORD: &str = "daemon.pid";
/// A daemon's stderr, in its log directory.
const STDERR_FILE: &str = "daemon.stderr";
/// A daemon's stderr file is emptied once it is larger than this.
const STDERR_FILE_MAX: u64 = 1 << 20;
/// How often a daemon taken over is looked for in `/proc` when the kernel gives no pidfd.
const ADOPTED_POLL: Duration = Duration::from_secs(1);
/// Most clients an MPS server takes per GPU.
pub const MAX_CLIENTS: u32 = 48;

/// What one GPU's daemon is to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    /// NVML index.
    pub index: u32,
    /// GPU UUID (the daemon's `CUDA_VISIBLE_DEVICES`, its directory's name).
    pub uuid: String,
    /// Clients (replicas) the GPU is advertised as.
    pub replicas: u32,
    /// Device memory each client may pin, MiB.
    pub memory_limit_mib: u64,
    /// Share of the GPU's threads each client may use, percent.
    pub active_thread_percentage: u32,
}

/// The daemons `mps` asks for on this node: one per whole (non-MIG) GPU it selects, with the
/// limits defaulted from the GPU (memory and threads divided by the replicas).
pub fn desired(inventory: &Inventory, mps: Option<&MpsPolicy>) -> Vec<DaemonSpec> {
    let Some(mps) = mps else {
        return Vec::new();
    };
    let replicas = mps.replicas.clamp(2, MAX_CLIENTS);
    inventory
        .gpus
        .iter()
        .filter(|g| !g.mig_enabled())
        .filter(|g| {
            mps.gpus
                .as_ref()
                .is_none_or(|s| s.contains(&g.device.index))
        })
        .map(|g| DaemonSpec {
            index: g.device.index,
            uuid: g.device.uuid.to_string(),
            replicas,
            memory_limit_mib: mps
                .memory_limit_mib()
                .unwrap_or(g.device.memory_mib / u64::from(replicas))
                .max(1),
            active_thread_percentage: mps
                .active_thread_percentage
                .unwrap_or(100 / replicas)
                .clamp(1, 100),
        })
        .collect()
}

/// The control commands that set `spec`'s default client limits.
pub fn control_commands(spec: &DaemonSpec) -> Vec<String> {
    vec![
        format!(
            "set_default_active_thread_percentage {}",
            spec.active_thread_percentage
        ),
        format!(
            "set_default_device_pinned_mem_limit 0 {}M",
            spec.memory_limit_mib
        ),
    ]
}

/// Where the MPS root is and how to reach the driver's files.
#[derive(Debug, Clone)]
pub struct MpsPaths {
    /// The MPS root, host terms (`/run/gpupool/mps`).
    pub root: PathBuf,
    /// Where the host's `/` is mounted here (`None`: it is ours).
    pub host_root: Option<PathBuf>,
    /// The driver root, host terms.
    pub driver_root: PathBuf,
    /// Give each daemon its GPU's `shm` directory as `/dev/shm` (a mount namespace of its own;
    /// needs CAP_SYS_ADMIN). Off only in tests run without it.
    pub private_shm: bool,
}

/// One GPU's directories, host terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDirs {
    /// The daemon's pipe directory.
    pub pipe: PathBuf,
    /// Its log directory.
    pub log: PathBuf,
    /// Its `/dev/shm`.
    pub shm: PathBuf,
}

impl MpsPaths {
    /// `path` (host terms) as this process reads it.
    pub fn local(&self, path: &Path) -> PathBuf {
        match &self.host_root {
            Some(h) => h.join(path.strip_prefix("/").unwrap_or(path)),
            None => path.to_path_buf(),
        }
    }

    /// The directories of the GPU `uuid`, host terms.
    pub fn gpu_dirs(&self, uuid: &str) -> GpuDirs {
        let base = self.root.join(uuid);
        GpuDirs {
            pipe: base.join("pipe"),
            log: base.join("log"),
            shm: base.join("shm"),
        }
    }

    /// The record of the GPU `uuid`'s daemon, host terms.
    fn record(&self, uuid: &str) -> PathBuf {
        self.root.join(uuid).join(RECORD)
    }

    /// The control program under the driver root, host terms, once it is found there and
    /// nobody but root can have written it ([`crate::trust::check_program`]): it runs as root.
    pub fn control_binary(&self) -> Result<PathBuf, String> {
        let program = CONTROL_DIRS
            .iter()
            .map(|d| self.driver_root.join(d).join(CONTROL_BINARY))
            .find(|p| self.local(p).is_file())
            .ok_or_else(|| {
                format!(
                    "{CONTROL_BINARY} not found under the driver root {} ({}): the driver's MPS tools are missing",
                    self.driver_root.display(),
                    CONTROL_DIRS.join(", ")
                )
            })?;
        crate::trust::check_program(&self.local(&self.driver_root), &self.local(&program))
            .map_err(|why| format!("{CONTROL_BINARY} refused: {why}"))?;
        Ok(program)
    }

    /// The environment a daemon of `spec` (and its control client) runs with.
    fn env(&self, spec: &DaemonSpec) -> Vec<(String, String)> {
        let dirs = self.gpu_dirs(&spec.uuid);
        let bin: Vec<String> = CONTROL_DIRS
            .iter()
            .map(|d| self.driver_root.join(d).display().to_string())
            .chain(["/usr/bin".into(), "/bin".into()])
            .collect();
        vec![
            ("PATH".into(), bin.join(":")),
            ("CUDA_VISIBLE_DEVICES".into(), spec.uuid.clone()),
            (
                "CUDA_MPS_PIPE_DIRECTORY".into(),
                dirs.pipe.display().to_string(),
            ),
            (
                "CUDA_MPS_LOG_DIRECTORY".into(),
                dirs.log.display().to_string(),
            ),
        ]
    }

    /// A command running the control program for `spec`: chrooted into the host's `/` when
    /// this process is in a container; for the `daemon`, in a session of its own (no signal
    /// meant for the agent's process group or terminal reaches it) and with the GPU's `shm` as
    /// `/dev/shm`.
    fn command(&self, spec: &DaemonSpec, daemon: bool) -> Result<Command, String> {
        let program = self.control_binary()?;
        let mut cmd = Command::new(&program);
        cmd.env_clear().envs(self.env(spec)).current_dir("/");
        let cstr = |p: &Path| {
            CString::new(p.as_os_str().as_bytes())
                .map_err(|_| format!("{} holds a NUL byte", p.display()))
        };
        let chroot = match &self.host_root {
            Some(h) => Some(cstr(h)?),
            None => None,
        };
        let bind = if daemon && self.private_shm {
            let from = cstr(&self.local(&self.gpu_dirs(&spec.uuid).shm))?;
            let onto = cstr(&self.local(Path::new("/dev/shm")))?;
            Some((from, onto))
        } else {
            None
        };
        let root = c"/";
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe system calls on strings prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if daemon && libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                if let Some((from, onto)) = &bind {
                    if libc::unshare(libc::CLONE_NEWNS) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    // Mounts made here stay here.
                    if libc::mount(
                        std::ptr::null(),
                        root.as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_SLAVE,
                        std::ptr::null(),
                    ) != 0
                    {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::mount(
                        from.as_ptr(),
                        onto.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    ) != 0
                    {
                        return Err(io::Error::last_os_error());
                    }
                }
                if let Some(dir) = &chroot
                    && (libc::chroot(dir.as_ptr()) != 0 || libc::chdir(root.as_ptr()) != 0)
                {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// What a container given a replica of `spec`'s GPU needs to reach its server.
    pub fn client(&self, spec: &DaemonSpec) -> ShareClient {
        let dirs = self.gpu_dirs(&spec.uuid);
        ShareClient {
            envs: BTreeMap::from([
                ("CUDA_MPS_PIPE_DIRECTORY".into(), CLIENT_PIPE_DIR.into()),
                (
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(),
                    spec.active_thread_percentage.to_string(),
                ),
                (
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(),
                    format!("0={}M", spec.memory_limit_mib),
                ),
            ]),
            mounts: vec![
                HostMount {
                    host_path: dirs.pipe.display().to_string(),
                    container_path: CLIENT_PIPE_DIR.into(),
                    read_only: false,
                },
                HostMount {
                    host_path: dirs.shm.display().to_string(),
                    container_path: "/dev/shm".into(),
                    read_only: false,
                },
            ],
        }
    }
}

/// How daemons are kept across agent restarts.
#[derive(Debug, Clone)]
pub struct Takeover {
    /// The procfs in which the agent sees the daemons' PIDs (its own `/proc`).
    pub proc_root: PathBuf,
    /// A cgroup (v2), host terms, that each daemon is moved into, so that the agent's
    /// container, whose cgroup is killed whole when it stops, does not take the daemons with
    /// it (`None`: they stay where they were started). Created if missing, beneath an existing
    /// cgroup; a daemon that cannot be moved still runs, and the failure is logged.
    pub cgroup: Option<PathBuf>,
}

impl Default for Takeover {
    fn default() -> Takeover {
        Takeover {
            proc_root: "/proc".into(),
            cgroup: None,
        }
    }
}

/// Where a daemon stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Started; its control pipe is not up yet.
    Starting {
        /// When it was started.
        since: Instant,
    },
    /// Up, with its limits set.
    Running,
    /// Down (never started, exited, or its limits could not be set); retried at `retry_at`.
    Failed {
        /// Why.
        reason: String,
        /// When the next start is due.
        retry_at: Instant,
    },
}

/// A daemon's process and the receiver that says when, and how, it ended.
type Watched = (Process, watch::Receiver<Option<String>>);

/// A daemon's process. The task that watches it owns the child (or, for a daemon taken over,
/// its pidfd); a stop goes through `kill`, so the signal reaches that process only: never a
/// PID that has since been reused (with hostPID, by any process of the host). Dropping it
/// leaves the daemon running.
#[derive(Debug)]
struct Process {
    pid: u32,
    kill: mpsc::Sender<()>,
}

struct Daemon {
    spec: DaemonSpec,
    phase: Phase,
    process: Option<Process>,
    /// Set by the waiter task when the process ends.
    exit: watch::Receiver<Option<String>>,
    failures: u32,
    /// Whether a daemon a previous agent left may still be taken over (until the first start).
    adopt: bool,
}

/// The MPS daemons of the node, keyed by GPU index.
pub struct MpsJob {
    paths: MpsPaths,
    daemons: BTreeMap<u32, Daemon>,
    /// Wakes the agent loop when a daemon exits.
    wake: Option<mpsc::Sender<()>>,
    takeover: Takeover,
}

impl MpsJob {
    /// No daemons yet.
    pub fn new(paths: MpsPaths) -> MpsJob {
        MpsJob {
            paths,
            daemons: BTreeMap::new(),
            wake: None,
            takeover: Takeover::default(),
        }
    }

    /// Where daemons' PIDs are looked up, and the cgroup they are moved into.
    pub fn set_takeover(&mut self, takeover: Takeover) {
        self.takeover = takeover;
    }

    /// Where the daemons' directories are.
    pub fn paths(&self) -> &MpsPaths {
        &self.paths
    }

    /// The driver root (host terms) the control program is run from: the GpuNode's, unless
    /// the agent's flag overrides it.
    pub fn set_driver_root(&mut self, driver_root: PathBuf) {
        self.paths.driver_root = driver_root;
    }

    /// Tells the agent loop through `wake` when a daemon exits.
    pub fn set_waker(&mut self, wake: mpsc::Sender<()>) {
        self.wake = Some(wake);
    }

    /// The daemon a previous agent left for `daemon`'s GPU, if it is still there and may be
    /// taken over (only before this job first starts one), else a new one.
    fn take_over_or_start(
        paths: &MpsPaths,
        takeover: &Takeover,
        wake: Option<mpsc::Sender<()>>,
        daemon: &mut Daemon,
    ) -> Result<Watched, String> {
        let index = daemon.spec.index;
        if std::mem::take(&mut daemon.adopt) {
            match adopt(paths, takeover, &daemon.spec, wake.clone()) {
                Ok(Some((process, exit))) => {
                    tracing::info!(
                        gpu = index,
                        pid = process.pid,
                        "MPS control daemon of a previous agent taken over"
                    );
                    move_to_cgroup(paths, takeover, index, process.pid);
                    return Ok((process, exit));
                }
                Ok(None) => {}
                Err(why) => {
                    tracing::info!(gpu = index, %why, "MPS daemon record not taken over; starting a new daemon");
                }
            }
        }
        let (process, exit) = start(paths, takeover, &daemon.spec, wake)?;
        tracing::info!(gpu = index, pid = process.pid, "MPS control daemon started");
        move_to_cgroup(paths, takeover, index, process.pid);
        Ok((process, exit))
    }

    /// Brings the daemons to `desired`: stops those no longer wanted, starts the missing ones
    /// (after their backoff), sets the limits of those that came up, and notes those that
    /// exited. Returns when it wants to look again.
    pub async fn sync(&mut self, desired: &[DaemonSpec], now: Instant) -> Option<Instant> {
        let wanted: BTreeMap<u32, &DaemonSpec> = desired.iter().map(|d| (d.index, d)).collect();
        let gone: Vec<u32> = self
            .daemons
            .iter()
            .filter(|(i, d)| wanted.get(i).is_none_or(|w| w.uuid != d.spec.uuid))
            .map(|(i, _)| *i)
            .collect();
        for index in gone {
            if let Some(d) = self.daemons.remove(&index) {
                self.stop(d).await;
            }
        }
        let mut wake: Option<Instant> = None;
        let mut at = |t: Instant| wake = Some(wake.map_or(t, |w| w.min(t)));
        for (index, spec) in wanted {
            let limits_changed = self
                .daemons
                .get(&index)
                .is_some_and(|d| d.spec != *spec && d.phase == Phase::Running);
            let daemon = match self.daemons.get_mut(&index) {
                Some(d) => d,
                None => {
                    let (_, exit) = watch::channel(None);
                    self.daemons.entry(index).or_insert(Daemon {
                        spec: spec.clone(),
                        phase: Phase::Failed {
                            reason: "not started yet".into(),
                            retry_at: now,
                        },
                        process: None,
                        exit,
                        failures: 0,
                        adopt: true,
                    })
                }
            };
            daemon.spec = spec.clone();
            if let Some(reason) = daemon.exit.borrow().clone()
                && daemon.process.is_some()
            {
                daemon.process = None;
                daemon.failures += 1;
                daemon.phase = Phase::Failed {
                    reason,
                    retry_at: now + backoff(daemon.failures),
                };
                tracing::warn!(gpu = index, phase = ?daemon.phase, "MPS control daemon exited");
            }
            match daemon.phase.clone() {
                Phase::Running if limits_changed => {
                    if let Err(e) = set_limits(&self.paths, &daemon.spec).await {
                        tracing::warn!(gpu = index, error = %e, "MPS limits not updated");
                    }
                }
                Phase::Running => trim_stderr(&self.paths, &daemon.spec),
                Phase::Failed { retry_at, .. } if retry_at > now => at(retry_at),
                Phase::Failed { .. } => match Self::take_over_or_start(
                    &self.paths,
                    &self.takeover,
                    self.wake.clone(),
                    daemon,
                ) {
                    Ok((process, exit)) => {
                        daemon.process = Some(process);
                        daemon.exit = exit;
                        daemon.phase = Phase::Starting { since: now };
                        at(now + START_POLL);
                    }
                    Err(reason) => {
                        daemon.failures += 1;
                        let retry_at = now + backoff(daemon.failures);
                        tracing::warn!(gpu = index, %reason, "MPS control daemon not started");
                        daemon.phase = Phase::Failed { reason, retry_at };
                        at(retry_at);
                    }
                },
                Phase::Starting { since } => {
                    let pipe = self
                        .paths
                        .local(&self.paths.gpu_dirs(&spec.uuid).pipe.join(CONTROL_PIPE));
                    if pipe.exists() {
                        match set_limits(&self.paths, &daemon.spec).await {
                            Ok(()) => {
                                daemon.phase = Phase::Running;
                                daemon.failures = 0;
                                tracing::info!(gpu = index, "MPS control daemon running");
                            }
                            Err(reason) => {
                                kill(daemon.process.take());
                                daemon.failures += 1;
                                let retry_at = now + backoff(daemon.failures);
                                daemon.phase = Phase::Failed { reason, retry_at };
                                at(retry_at);
                            }
                        }
                    } else if now.duration_since(since) > START_TIMEOUT {
                        kill(daemon.process.take());
                        daemon.failures += 1;
                        let retry_at = now + backoff(daemon.failures);
                        daemon.phase = Phase::Failed {
                            reason: format!(
                                "its control pipe did not appear within {}s",
                                START_TIMEOUT.as_secs()
                            ),
                            retry_at,
                        };
                        at(retry_at);
                    } else {
                        at(now + START_POLL);
                    }
                }
            }
        }
        wake
    }

    /// Each daemon's GPU and whether it serves clients: `Ok` when running, else why not.
    pub fn states(&self) -> BTreeMap<u32, Result<(), String>> {
        self.daemons
            .iter()
            .map(|(i, d)| {
                let state = match &d.phase {
                    Phase::Running => Ok(()),
                    Phase::Starting { .. } => Err("MPS control daemon starting".to_owned()),
                    Phase::Failed { reason, .. } => {
                        Err(format!("MPS control daemon not running: {reason}"))
                    }
                };
                (*i, state)
            })
            .collect()
    }

    /// Each configured GPU's client setup, for the advertisement.
    pub fn clients(&self) -> BTreeMap<u32, Arc<ShareClient>> {
        self.daemons
            .iter()
            .map(|(i, d)| (*i, Arc::new(self.paths.client(&d.spec))))
            .collect()
    }

    /// The GpuNode status sharing of each configured GPU.
    pub fn sharing(&self) -> BTreeMap<u32, GpuSharing> {
        self.daemons
            .iter()
            .map(|(i, d)| {
                let daemon = match &d.phase {
                    Phase::Running => "Running".to_owned(),
                    Phase::Starting { .. } => "Starting".to_owned(),
                    Phase::Failed { reason, .. } => format!("Failed: {reason}"),
                };
                (
                    *i,
                    GpuSharing {
                        mode: "MPS".into(),
                        replicas: d.spec.replicas,
                        isolation: gpupool_crds::node::MPS_ISOLATION.into(),
                        memory_limit_mib: Some(d.spec.memory_limit_mib),
                        active_thread_percentage: Some(d.spec.active_thread_percentage),
                        daemon: Some(daemon),
                    },
                )
            })
            .collect()
    }

    /// Leaves every daemon running, for the next agent to take over (agent shutdown): their
    /// clients keep their server.
    pub fn hand_over(&mut self) {
        for (index, d) in std::mem::take(&mut self.daemons) {
            if let Some(p) = &d.process {
                tracing::info!(
                    gpu = index,
                    pid = p.pid,
                    "MPS control daemon left running for the next agent"
                );
            }
        }
    }

    /// Stops every daemon recorded under the MPS root that is still the process its record
    /// names (an explicit cleanup, for uninstall: the agent's shutdown leaves them running):
    /// each is told `quit`, then killed through its pidfd if it lingers. Returns the GPU UUIDs
    /// whose daemon was stopped, and why others were not.
    pub async fn stop_recorded(&mut self) -> (Vec<String>, Vec<String>) {
        let root = self.paths.local(&self.paths.root);
        let mut uuids: Vec<String> = match std::fs::read_dir(&root) {
            Ok(entries) => entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return (Vec::new(), vec![format!("reading {}: {e}", root.display())]),
        };
        uuids.sort();
        let (mut stopped, mut not) = (Vec::new(), Vec::new());
        for (index, uuid) in (0u32..).zip(uuids) {
            let spec = DaemonSpec {
                index,
                uuid: uuid.clone(),
                replicas: 0,
                memory_limit_mib: 0,
                active_thread_percentage: 0,
            };
            match adopt(&self.paths, &self.takeover, &spec, None) {
                Ok(Some((process, exit))) => {
                    let daemon = Daemon {
                        spec,
                        phase: Phase::Running,
                        process: Some(process),
                        exit,
                        failures: 0,
                        adopt: false,
                    };
                    self.stop(daemon).await;
                    stopped.push(uuid);
                }
                Ok(None) => {}
                Err(why) => not.push(format!("{uuid}: {why}")),
            }
        }
        (stopped, not)
    }

    /// Stops every daemon (an explicit cleanup; not the agent's shutdown, see [`Self::hand_over`]).
    pub async fn stop_all(&mut self) {
        for (_, d) in std::mem::take(&mut self.daemons) {
            self.stop(d).await;
        }
    }

    async fn stop(&self, mut daemon: Daemon) {
        let Some(process) = daemon.process else {
            return;
        };
        if let Err(e) = control(&self.paths, &daemon.spec, &["quit".to_owned()]).await {
            tracing::debug!(gpu = daemon.spec.index, error = %e, "MPS quit");
        }
        let ended = tokio::time::timeout(STOP_TIMEOUT, daemon.exit.wait_for(Option::is_some));
        if !matches!(ended.await, Ok(Ok(_))) {
            kill(Some(process));
        }
        let record = self.paths.local(&self.paths.record(&daemon.spec.uuid));
        if let Err(e) = std::fs::remove_file(&record)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(gpu = daemon.spec.index, error = %e, path = %record.display(), "removing the MPS daemon record");
        }
        tracing::info!(gpu = daemon.spec.index, "MPS control daemon stopped");
    }
}

fn backoff(failures: u32) -> Duration {
    BACKOFF_MIN
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(BACKOFF_MAX)
}

/// Asks the daemon's waiter to kill it (a no-op once it has ended).
fn kill(process: Option<Process>) {
    if let Some(p) = process {
        let _ = p.kill.try_send(());
    }
}

/// The most of a daemon's stderr kept for its exit reason: its last words.
const STDERR_TAIL: usize = 2048;

/// The last [`STDERR_TAIL`] bytes of the daemon's stderr file.
fn stderr_tail(path: &Path) -> Vec<u8> {
    let read = || -> io::Result<Vec<u8>> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        let tail = u64::try_from(STDERR_TAIL).unwrap_or(u64::MAX);
        file.seek(io::SeekFrom::Start(len.saturating_sub(tail)))?;
        let mut buf = Vec::with_capacity(STDERR_TAIL);
        file.take(tail).read_to_end(&mut buf)?;
        Ok(buf)
    };
    read().unwrap_or_default()
}

/// Empties a running daemon's stderr file once it is larger than [`STDERR_FILE_MAX`] (the
/// daemon appends, so its next words land at the start).
fn trim_stderr(paths: &MpsPaths, spec: &DaemonSpec) {
    let path = paths.local(&paths.gpu_dirs(&spec.uuid).log.join(STDERR_FILE));
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > STDERR_FILE_MAX)
        && let Err(e) = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(0))
    {
        tracing::debug!(gpu = spec.index, error = %e, "emptying the MPS daemon's stderr file");
    }
}

/// Why the daemon ended: `what`, then its last words.
fn exit_reason(what: String, stderr: &Path) -> String {
    let tail = stderr_tail(stderr);
    let words = String::from_utf8_lossy(&tail);
    let words = words.trim();
    if words.is_empty() {
        what
    } else {
        format!("{what}: {words}")
    }
}

fn describe(status: io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => format!("the daemon exited ({s})"),
        Err(e) => format!("waiting for the daemon: {e}"),
    }
}

/// A process as the kernel knows it: its PID and its start time (clock ticks after boot,
/// field 22 of `/proc/<pid>/stat`), which a process that later takes the PID does not share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    pid: u32,
    start_time: u64,
}

impl Identity {
    /// The record's text.
    fn record(&self) -> String {
        format!("{} {}\n", self.pid, self.start_time)
    }

    /// A record's text, read back.
    fn parse_record(text: &str) -> Option<Identity> {
        let mut fields = text.split_whitespace();
        let pid = fields.next()?.parse().ok().filter(|p| *p > 0)?;
        let start_time = fields.next()?.parse().ok()?;
        fields
            .next()
            .is_none()
            .then_some(Identity { pid, start_time })
    }

    /// The process now at `pid` in `proc_root` (`None`: there is none, or it has exited).
    fn of(proc_root: &Path, pid: u32) -> Option<Identity> {
        let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
        let (state, start_time) = parse_stat(&stat)?;
        // A zombie has exited: whoever reaps it is not the daemon's client.
        (!matches!(state, 'Z' | 'X' | 'x')).then_some(Identity { pid, start_time })
    }

    /// Whether this process still runs.
    fn alive(&self, proc_root: &Path) -> bool {
        Identity::of(proc_root, self.pid) == Some(*self)
    }
}

/// The state letter and the start time in a `/proc/<pid>/stat` line. The command name (field
/// 2) is in parentheses and may itself hold spaces and parentheses: the fields after it are
/// counted from its last `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3, the state; field 22, the start time, is fields[19].
    let state = fields.first()?.chars().next()?;
    let start_time = fields.get(19)?.parse().ok()?;
    Some((state, start_time))
}

/// Whether a `/proc/<pid>/cmdline` is the control program running as the daemon (`-f`): run
/// directly, or (a script) as its interpreter's first argument.
fn is_control_daemon(cmdline: &[u8]) -> bool {
    let args: Vec<&[u8]> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .collect();
    let named = args
        .iter()
        .take(2)
        .any(|a| Path::new(OsStr::from_bytes(a)).file_name() == Some(OsStr::new(CONTROL_BINARY)));
    named && args.iter().skip(1).any(|a| *a == b"-f")
}

/// A pidfd for `pid` (Linux 5.3+): it names the process that has the PID now, and no other
/// later; it becomes readable when that process exits.
fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: pidfd_open takes a PID and flags, and returns a new descriptor or -1; no memory
    // is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned `fd`, open and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends SIGKILL to the process `pidfd` names (a no-op error once it has exited).
fn pidfd_kill(pidfd: &OwnedFd) -> io::Result<()> {
    // SAFETY: the descriptor is an open pidfd; a null siginfo asks the kernel to fill it in as
    // kill(2) would; flags must be 0.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Writes `identity` as the record of `spec`'s daemon: to a temporary file, then renamed, so
/// that a reader never sees half of one.
fn write_record(paths: &MpsPaths, spec: &DaemonSpec, identity: Identity) -> Result<(), String> {
    let record = paths.local(&paths.record(&spec.uuid));
    let tmp = record.with_extension("pid.tmp");
    let write = || -> io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(identity.record().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &record)
    };
    write().map_err(|e| format!("writing {}: {e}", record.display()))
}

/// Moves the daemon `pid` into the configured cgroup, if any. Best effort: a daemon left in
/// the agent's container's cgroup still serves, until that container stops.
fn move_to_cgroup(paths: &MpsPaths, takeover: &Takeover, gpu: u32, pid: u32) {
    let Some(cgroup) = &takeover.cgroup else {
        return;
    };
    let local = paths.local(cgroup);
    let run = || -> Result<(), String> {
        let parent = local.parent().unwrap_or(Path::new("/"));
        if !parent.join("cgroup.procs").is_file() {
            return Err(format!(
                "{} is not in a cgroup v2 hierarchy (no cgroup.procs beside it)",
                local.display()
            ));
        }
        std::fs::create_dir_all(&local)
            .map_err(|e| format!("creating the cgroup {}: {e}", local.display()))?;
        let procs = local.join("cgroup.procs");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&procs)
            .and_then(|mut f| f.write_all(pid.to_string().as_bytes()))
            .map_err(|e| format!("moving PID {pid} into {}: {e}", procs.display()))
    };
    match run() {
        Ok(()) => {
            tracing::debug!(gpu, pid, cgroup = %cgroup.display(), "MPS control daemon moved to its cgroup")
        }
        Err(why) => tracing::warn!(
            gpu,
            pid,
            %why,
            "MPS control daemon left in the agent's cgroup: it stops with the agent's container"
        ),
    }
}

/// The daemon a previous agent left for `spec`'s GPU, taken over: `Ok(None)` when there is no
/// record, `Err` when the record names no daemon that may be taken over (the record is then
/// removed). The recorded process must still run with its recorded start time, as the control
/// program's `-f`, with its control pipe up; it is watched through a pidfd opened, and its
/// identity checked again, before anything is sent to it.
fn adopt(
    paths: &MpsPaths,
    takeover: &Takeover,
    spec: &DaemonSpec,
    wake: Option<mpsc::Sender<()>>,
) -> Result<Option<Watched>, String> {
    let record = paths.local(&paths.record(&spec.uuid));
    let text = match std::fs::read_to_string(&record) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("reading {}: {e}", record.display())),
    };
    let checked = check_record(paths, takeover, spec, &text);
    if checked.is_err()
        && let Err(e) = std::fs::remove_file(&record)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, path = %record.display(), "removing a stale MPS daemon record");
    }
    let (identity, pidfd) = checked?;
    let stderr = paths.local(&paths.gpu_dirs(&spec.uuid).log.join(STDERR_FILE));
    let pidfd = pidfd.map(|fd| {
        // SAFETY: an OwnedFd is a valid open descriptor, always the same one, and stays open
        // as long as the AsyncFd that owns it.
        unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
    });
    let pidfd = match pidfd {
        Some(Ok(fd)) => Some(fd),
        Some(Err(e)) => {
            tracing::debug!(pid = identity.pid, error = %e, "watching a pidfd; polling /proc instead");
            None
        }
        None => None,
    };
    let (tx, rx) = watch::channel(None);
    let (kill_tx, mut kill_rx) = mpsc::channel::<()>(1);
    let proc_root = takeover.proc_root.clone();
    let pid = identity.pid;
    tokio::spawn(async move {
        let exited = async {
            if let Some(fd) = &pidfd
                && fd.readable().await.is_ok()
            {
                return;
            }
            while identity.alive(&proc_root) {
                tokio::time::sleep(ADOPTED_POLL).await;
            }
        };
        tokio::pin!(exited);
        let mut owned = true;
        loop {
            tokio::select! {
                () = &mut exited => break,
                asked = kill_rx.recv(), if owned => match asked {
                    Some(()) => match &pidfd {
                        Some(fd) => {
                            if let Err(e) = pidfd_kill(fd.get_ref()) {
                                tracing::debug!(pid, error = %e, "killing the MPS daemon");
                            }
                        }
                        None => tracing::warn!(pid, "MPS daemon not killed: no pidfd names it"),
                    },
                    // The job is gone (agent shutdown): the daemon is left running.
                    None => owned = false,
                },
            }
        }
        let why = exit_reason(
            "the daemon exited (taken over from a previous agent: its status went to its parent)"
                .to_owned(),
            &stderr,
        );
        let _ = tx.send(Some(why));
        if let Some(wake) = wake {
            let _ = wake.try_send(());
        }
    });
    Ok(Some((Process { pid, kill: kill_tx }, rx)))
}

/// The recorded daemon of `spec`'s GPU and a pidfd for it, if the record `text` names a
/// daemon that may be taken over; else why not.
fn check_record(
    paths: &MpsPaths,
    takeover: &Takeover,
    spec: &DaemonSpec,
    text: &str,
) -> Result<(Identity, Option<OwnedFd>), String> {
    let recorded = Identity::parse_record(text)
        .ok_or_else(|| format!("the record {:?} is not `<pid> <start time>`", text.trim()))?;
    let pid = recorded.pid;
    let now = Identity::of(&takeover.proc_root, pid);
    if now != Some(recorded) {
        return Err(format!(
            "PID {pid} is gone or is another process (started at {:?}, not {})",
            now.map(|i| i.start_time),
            recorded.start_time
        ));
    }
    let cmdline = std::fs::read(takeover.proc_root.join(pid.to_string()).join("cmdline"))
        .map_err(|e| format!("reading PID {pid}'s command line: {e}"))?;
    if !is_control_daemon(&cmdline) {
        return Err(format!("PID {pid} is not {CONTROL_BINARY} -f"));
    }
    let pipe = paths.local(&paths.gpu_dirs(&spec.uuid).pipe.join(CONTROL_PIPE));
    if !std::fs::metadata(&pipe).is_ok_and(|m| m.file_type().is_fifo()) {
        return Err(format!(
            "daemon {pid} has no control pipe {}",
            pipe.display()
        ));
    }
    let pidfd = match pidfd_open(pid) {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::debug!(pid, error = %e, "pidfd_open; the daemon is watched through /proc");
            None
        }
    };
    // The pidfd names whatever had the PID when it was opened: still the daemon, if the
    // daemon is still there now.
    if !recorded.alive(&takeover.proc_root) {
        return Err(format!("daemon {pid} exited while it was being taken over"));
    }
    Ok((recorded, pidfd))
}

/// Creates `spec`'s directories and starts its daemon; returns its PID and a receiver that says
/// when, and how, it ended.
fn start(
    paths: &MpsPaths,
    takeover: &Takeover,
    spec: &DaemonSpec,
    wake: Option<mpsc::Sender<()>>,
) -> Result<Watched, String> {
    let dirs = paths.gpu_dirs(&spec.uuid);
    for dir in [&dirs.pipe, &dirs.log, &dirs.shm] {
        let local = paths.local(dir);
        std::fs::create_dir_all(&local)
            .map_err(|e| format!("creating {}: {e}", local.display()))?;
    }
    // The pipe and shm are mounted into tenants' containers: only from directories of the
    // agent's own, none of them (nor the way to them from the MPS root) a symbolic link that
    // someone planted to point elsewhere on the host.
    let gpu_dir = paths.root.join(&spec.uuid);
    for dir in [&paths.root, &gpu_dir, &dirs.pipe, &dirs.log, &dirs.shm] {
        crate::trust::check_own_dir(&paths.local(dir))
            .map_err(|why| format!("MPS directory refused: {why}"))?;
    }
    // A control pipe left by a daemon that was killed would look like a live one.
    let pipe = paths.local(&dirs.pipe.join(CONTROL_PIPE));
    match std::fs::remove_file(&pipe) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("removing the stale {}: {e}", pipe.display())),
    }
    // Appended to, so that emptying it (trim_stderr) leaves no hole.
    let stderr_path = paths.local(&dirs.log.join(STDERR_FILE));
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&stderr_path)
        .and_then(|f| f.set_len(0).map(|()| f))
        .map_err(|e| format!("opening {}: {e}", stderr_path.display()))?;
    let mut child = paths
        .command(spec, true)?
        .arg("-f")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr))
        .spawn()
        .map_err(|e| format!("starting {CONTROL_BINARY}: {e}"))?;
    let pid = child.id().ok_or("the daemon exited at once")?;
    // The child is unreaped, so its PID is still its own.
    match Identity::of(&takeover.proc_root, pid)
        .ok_or_else(|| format!("PID {pid} not in {}", takeover.proc_root.display()))
        .and_then(|identity| write_record(paths, spec, identity))
    {
        Ok(()) => {}
        Err(why) => tracing::warn!(
            gpu = spec.index,
            pid,
            %why,
            "MPS daemon not recorded: the next agent will not take it over"
        ),
    }
    let (tx, rx) = watch::channel(None);
    let (kill_tx, mut kill_rx) = mpsc::channel::<()>(1);
    tokio::spawn(async move {
        let mut owned = true;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                asked = kill_rx.recv(), if owned => match asked {
                    // The child is still ours, unreaped, so the signal is too.
                    Some(()) => {
                        if let Err(e) = child.start_kill() {
                            tracing::debug!(pid, error = %e, "killing the MPS daemon");
                        }
                    }
                    // The job is gone (agent shutdown): the daemon is left running.
                    None => owned = false,
                },
            }
        };
        let _ = tx.send(Some(exit_reason(describe(status), &stderr_path)));
        if let Some(wake) = wake {
            let _ = wake.try_send(());
        }
    });
    Ok((Process { pid, kill: kill_tx }, rx))
}

/// Sends `spec`'s default limits to its daemon.
async fn set_limits(paths: &MpsPaths, spec: &DaemonSpec) -> Result<(), String> {
    control(paths, spec, &control_commands(spec)).await
}

/// Runs the control program as a client of `spec`'s daemon with `commands` on its input.
async fn control(paths: &MpsPaths, spec: &DaemonSpec, commands: &[String]) -> Result<(), String> {
    let mut child = paths
        .command(spec, false)?
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("running {CONTROL_BINARY}: {e}"))?;
    let mut input = String::new();
    for c in commands {
        input.push_str(c);
        input.push('\n');
    }
    let run = async {
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .await
                .map_err(|e| format!("writing to {CONTROL_BINARY}: {e}"))?;
        }
        let out = child
            .wait_with_output()
            .await
            .map_err(|e| format!("waiting for {CONTROL_BINARY}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{CONTROL_BINARY} {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    tokio::time::timeout(COMMAND_TIMEOUT, run)
        .await
        .map_err(|_| {
            format!(
                "{CONTROL_BINARY} did not answer within {}s",
                COMMAND_TIMEOUT.as_secs()
            )
        })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::testing::inventory;

    fn policy() -> MpsPolicy {
        MpsPolicy {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: true,
            placement: Default::default(),
            memory_limit: None,
            active_thread_percentage: None,
            gpus: None,
            models: None,
        }
    }

    #[test]
    fn each_selected_whole_gpu_gets_a_daemon_with_its_share_of_memory_and_threads() {
        let inv = inventory();
        // The A30 (GPU 0) is in MIG mode: MPS never shares it. The L4 gets a daemon.
        assert!(inv.gpus[0].mig_enabled() && !inv.gpus[1].mig_enabled());
        let all = desired(&inv, Some(&policy()));
        assert_eq!(all.len(), 1);
        let l4 = &inv.gpus[1].device;
        assert_eq!(
            (all[0].index, all[0].uuid.as_str()),
            (1, l4.uuid.to_string().as_str())
        );
        assert_eq!(all[0].memory_limit_mib, l4.memory_mib / 4);
        assert_eq!(all[0].active_thread_percentage, 25);
        let one = desired(
            &inv,
            Some(&MpsPolicy {
                gpus: Some(vec![1]),
                memory_limit: Some("2Gi".into()),
                active_thread_percentage: Some(40),
                ..policy()
            }),
        );
        assert_eq!(one.len(), 1);
        assert_eq!(
            (
                one[0].index,
                one[0].memory_limit_mib,
                one[0].active_thread_percentage
            ),
            (1, 2048, 40)
        );
        assert_eq!(
            control_commands(&one[0]),
            [
                "set_default_active_thread_percentage 40",
                "set_default_device_pinned_mem_limit 0 2048M"
            ]
        );
        assert!(desired(&inv, None).is_empty());
    }

    #[test]
    fn a_client_reaches_its_gpus_server_with_its_limits() {
        let paths = MpsPaths {
            root: DEFAULT_MPS_ROOT.into(),
            host_root: Some("/host".into()),
            driver_root: "/".into(),
            private_shm: true,
        };
        let spec = DaemonSpec {
            index: 0,
            uuid: "GPU-a".into(),
            replicas: 4,
            memory_limit_mib: 10240,
            active_thread_percentage: 25,
        };
        let c = paths.client(&spec);
        assert_eq!(c.envs["CUDA_MPS_PIPE_DIRECTORY"], "/run/gpupool/mps-pipe");
        assert_eq!(c.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M");
        assert_eq!(c.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        let mounts: Vec<(&str, &str)> = c
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
            .collect();
        assert_eq!(
            mounts,
            [
                ("/run/gpupool/mps/GPU-a/pipe", "/run/gpupool/mps-pipe"),
                ("/run/gpupool/mps/GPU-a/shm", "/dev/shm")
            ],
            "host paths, as the runtime mounts them"
        );
        assert_eq!(
            paths.local(&paths.gpu_dirs("GPU-a").pipe),
            Path::new("/host/run/gpupool/mps/GPU-a/pipe")
        );
    }

    /// Kills the daemon recorded for a GPU when the test ends, however it ends: the daemons
    /// outlive their job by design, and a failed test must not leave one behind.
    struct KillOnExit(MpsPaths, String);

    impl Drop for KillOnExit {
        fn drop(&mut self) {
            let record = self.0.local(&self.0.record(&self.1));
            let proc_root = Path::new("/proc");
            if let Some(id) = std::fs::read_to_string(record)
                .ok()
                .and_then(|t| Identity::parse_record(&t))
                && id.alive(proc_root)
                && let Ok(fd) = pidfd_open(id.pid)
                && id.alive(proc_root)
            {
                let _ = pidfd_kill(&fd);
            }
        }
    }

    /// Client loops, each the leader of its process group, killed with their groups when the
    /// test ends.
    struct Clients(Vec<std::process::Child>);

    impl Drop for Clients {
        fn drop(&mut self) {
            for client in &mut self.0 {
                if let Ok(pgid) = i32::try_from(client.id()) {
                    // SAFETY: kill(2) of a process group this test started, its leader unreaped.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                }
                let _ = client.wait();
            }
        }
    }

    /// Syncs until `done` holds for the job (each pass as the agent loop would, at most 30 s).
    async fn sync_until(
        job: &mut MpsJob,
        want: &[DaemonSpec],
        done: impl Fn(&MpsJob) -> bool,
    ) -> bool {
        for _ in 0..300 {
            job.sync(want, Instant::now()).await;
            if done(job) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    fn log_lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The fake daemon's record once it holds `n` lines: the client returns once its input is
    /// in the pipe, before the daemon has written it down (at most 10 s).
    async fn logged(path: &Path, n: usize) -> Vec<String> {
        for _ in 0..100 {
            let lines = log_lines(path);
            if lines.len() >= n {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        log_lines(path)
    }

    /// The real supervision path against the fake control program of the fake driver root:
    /// the exact commands it receives, its `/dev/shm`, a crash taking the GPU down until the
    /// restart is up, and `quit` when the GPU is no longer shared.
    #[tokio::test]
    async fn daemons_are_started_told_their_limits_restarted_and_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver");
        gpupool_sim::driver_root::build(&driver, "550.54.15", 1).unwrap();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let paths = MpsPaths {
            root: dir.path().join("mps"),
            host_root: None,
            driver_root: driver.clone(),
            private_shm: root,
        };
        let mut job = MpsJob::new(paths.clone());
        let (wake_tx, mut wake_rx) = mpsc::channel(4);
        job.set_waker(wake_tx);
        let spec = DaemonSpec {
            index: 0,
            uuid: "GPU-11111111-2222-3333-4444-555555555555".into(),
            replicas: 4,
            memory_limit_mib: 20480,
            active_thread_percentage: 25,
        };
        let want = [spec.clone()];
        let _reaper = KillOnExit(paths.clone(), spec.uuid.clone());
        let running = |j: &MpsJob| j.states().get(&0) == Some(&Ok(()));
        assert!(
            sync_until(&mut job, &want, running).await,
            "{:?}",
            job.states()
        );
        let dirs = paths.gpu_dirs(&spec.uuid);
        let log = dirs.log.join("control.log");
        assert_eq!(
            logged(&log, 3).await,
            [
                format!("start devices={}", spec.uuid),
                "set_default_active_thread_percentage 25".into(),
                "set_default_device_pinned_mem_limit 0 20480M".into(),
            ]
        );
        if root {
            assert!(
                dirs.shm.join("gpupool-fake-mps").exists(),
                "the daemon's /dev/shm is its GPU's shm directory"
            );
            assert!(!Path::new("/dev/shm/gpupool-fake-mps").exists());
        }
        let sharing = job.sharing();
        assert_eq!(sharing[&0].daemon.as_deref(), Some("Running"));
        assert_eq!(sharing[&0].isolation, "Memory (tenants trusted)");

        // A crash: the loop is woken, the GPU reports the daemon down, then it comes back.
        let pid = job.daemons[&0].process.as_ref().unwrap().pid;
        // SAFETY: kill(2) of the daemon this test started, still running.
        unsafe {
            libc::kill(i32::try_from(pid).unwrap(), libc::SIGKILL);
        }
        tokio::time::timeout(Duration::from_secs(10), wake_rx.recv())
            .await
            .expect("the loop is woken when the daemon exits");
        job.sync(&want, Instant::now()).await;
        let down = job.states()[&0].clone().unwrap_err();
        assert!(
            down.contains("not running") && down.contains("exited"),
            "{down}"
        );
        assert!(
            job.sharing()[&0]
                .daemon
                .as_deref()
                .unwrap()
                .starts_with("Failed")
        );
        assert!(
            sync_until(&mut job, &want, running).await,
            "{:?}",
            job.states()
        );
        let lines = logged(&log, 6).await;
        assert_eq!(lines.len(), 6, "{lines:?}");
        assert_eq!(lines[3], format!("start devices={}", spec.uuid));

        // New limits reach the running daemon without a restart.
        let tighter = [DaemonSpec {
            memory_limit_mib: 10240,
            ..spec.clone()
        }];
        job.sync(&tighter, Instant::now()).await;
        assert_eq!(
            logged(&log, 8).await[6..],
            [
                "set_default_active_thread_percentage 25",
                "set_default_device_pinned_mem_limit 0 10240M"
            ]
        );

        // No longer shared: told to quit.
        job.sync(&[], Instant::now()).await;
        assert!(job.states().is_empty());
        assert_eq!(
            logged(&log, 9).await.last().map(String::as_str),
            Some("quit")
        );
    }

    /// A daemon that writes more to stderr than a pipe holds before its control pipe is up:
    /// read as it arrives, it comes up; left unread, it would block on the write, and be killed
    /// at the start timeout, again and again. Its last words still make the exit reason.
    #[tokio::test]
    async fn a_daemon_that_floods_its_stderr_still_comes_up_and_its_last_words_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver");
        gpupool_sim::driver_root::build(&driver, "550.54.15", 1).unwrap();
        let bin = driver.join("usr/bin");
        std::fs::rename(
            bin.join(CONTROL_BINARY),
            bin.join("nvidia-cuda-mps-control.real"),
        )
        .unwrap();
        let wrapper = bin.join(CONTROL_BINARY);
        std::fs::write(
            &wrapper,
            "#!/bin/sh\nif [ \"${1:-}\" = -f ]; then\n    head -c 300000 /dev/zero | tr '\\0' e >&2\n    echo 'last words' >&2\nfi\nexec \"$0.real\" \"$@\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let paths = MpsPaths {
            root: dir.path().join("mps"),
            host_root: None,
            driver_root: driver.clone(),
            // The fake daemon marks its /dev/shm: the host's must stay unmarked for the other
            // test, which checks it.
            private_shm: root,
        };
        let mut job = MpsJob::new(paths.clone());
        let (wake_tx, mut wake_rx) = mpsc::channel(4);
        job.set_waker(wake_tx);
        let spec = DaemonSpec {
            index: 0,
            uuid: "GPU-11111111-2222-3333-4444-555555555555".into(),
            replicas: 2,
            memory_limit_mib: 1024,
            active_thread_percentage: 50,
        };
        let want = [spec.clone()];
        let _reaper = KillOnExit(paths.clone(), spec.uuid.clone());
        let running = |j: &MpsJob| j.states().get(&0) == Some(&Ok(()));
        assert!(
            sync_until(&mut job, &want, running).await,
            "{:?}",
            job.states()
        );
        // Killed from outside: the reason ends with what it last wrote, and no more of it.
        let pid = job.daemons[&0].process.as_ref().unwrap().pid;
        // SAFETY: kill(2) of the daemon this test started, still running.
        unsafe {
            libc::kill(i32::try_from(pid).unwrap(), libc::SIGKILL);
        }
        tokio::time::timeout(Duration::from_secs(10), wake_rx.recv())
            .await
            .expect("the loop is woken when the daemon exits");
        job.sync(&want, Instant::now()).await;
        let down = job.states()[&0].clone().unwrap_err();
        assert!(down.contains("last words"), "{down}");
        assert!(down.len() < STDERR_TAIL + 200, "{} bytes", down.len());
        job.stop_all().await;
    }

    #[test]
    fn a_process_is_known_by_its_start_time_and_a_daemon_by_its_command_line() {
        // Field 22 counted from the command name's last `)`, which may hold both.
        let stat =
            "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 120 0 0 0 1 2 0 0 20 0 1 0 987654 2 3";
        assert_eq!(parse_stat(stat), Some(('S', 987654)));
        assert_eq!(parse_stat("4242 (sh) Z 1 2 3"), None, "too short");
        assert_eq!(parse_stat("no parentheses"), None);
        let real = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_stat(&real).is_some(), "{real}");

        for (cmdline, daemon) in [
            (&b"/usr/bin/nvidia-cuda-mps-control\0-f\0"[..], true),
            (
                b"/bin/sh\0/driver/usr/bin/nvidia-cuda-mps-control\0-f\0",
                true,
            ),
            (b"nvidia-cuda-mps-control\0-d\0", false),
            (b"/usr/bin/nvidia-cuda-mps-control\0", false),
            (b"sleep\x00600\x00", false),
            (b"/bin/sh\0-c\0nvidia-cuda-mps-control -f\0", false),
            (b"/usr/bin/nvidia-cuda-mps-control.real\0-f\0", false),
            (b"", false),
        ] {
            assert_eq!(
                is_control_daemon(cmdline),
                daemon,
                "{}",
                String::from_utf8_lossy(cmdline)
            );
        }

        let id = Identity {
            pid: 4242,
            start_time: 987654,
        };
        assert_eq!(Identity::parse_record(&id.record()), Some(id));
        for bad in ["", "4242", "0 5", "4242 5 6", "x 5", "-1 5"] {
            assert_eq!(Identity::parse_record(bad), None, "{bad:?}");
        }
    }

    /// A fake driver root under `dir` and the paths of its MPS root; one GPU's spec.
    fn fake_node(dir: &Path) -> (MpsPaths, DaemonSpec) {
        let driver = dir.join("driver");
        gpupool_sim::driver_root::build(&driver, "550.54.15", 1).unwrap();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let paths = MpsPaths {
            root: dir.join("mps"),
            host_root: None,
            driver_root: driver,
            private_shm: root,
        };
        let spec = DaemonSpec {
            index: 0,
            uuid: "GPU-11111111-2222-3333-4444-555555555555".into(),
            replicas: 4,
            memory_limit_mib: 20480,
            active_thread_percentage: 25,
        };
        (paths, spec)
    }

    /// A control program someone other than root could have written (group-writable here) is
    /// never run: the GPU's MPS state says why, and no daemon starts. Made safe again, it runs.
    #[tokio::test]
    async fn a_writable_control_program_is_not_run() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (paths, spec) = fake_node(dir.path());
        let program = paths.control_binary().unwrap();
        let _kill = KillOnExit(paths.clone(), spec.uuid.clone());
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o777)).unwrap();
        let mut job = MpsJob::new(paths.clone());
        for _ in 0..3 {
            job.sync(std::slice::from_ref(&spec), Instant::now()).await;
        }
        let state = job.states().get(&0).cloned();
        let why = state.and_then(Result::err).unwrap_or_default();
        assert!(
            why.contains("nvidia-cuda-mps-control refused")
                && why.contains("writable by its group or others"),
            "{why}"
        );
        assert!(
            !paths.local(&paths.record(&spec.uuid)).exists(),
            "a daemon was started from a writable program"
        );
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            sync_until(&mut job, std::slice::from_ref(&spec), running).await,
            "{:?}",
            job.states()
        );
        job.stop_all().await;
    }

    /// A pipe directory someone replaced with a symbolic link (to the kubelet's pod directories,
    /// say) is never handed to a daemon nor mounted into its clients: the GPU's MPS state says
    /// why. Made a real directory again, the daemon starts.
    #[tokio::test]
    async fn a_symlinked_mps_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (paths, spec) = fake_node(dir.path());
        let _kill = KillOnExit(paths.clone(), spec.uuid.clone());
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let pipe = paths.local(&paths.gpu_dirs(&spec.uuid).pipe);
        std::fs::create_dir_all(pipe.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &pipe).unwrap();
        let mut job = MpsJob::new(paths.clone());
        for _ in 0..3 {
            job.sync(std::slice::from_ref(&spec), Instant::now()).await;
        }
        let why = job
            .states()
            .get(&0)
            .cloned()
            .and_then(Result::err)
            .unwrap_or_default();
        assert!(
            why.contains("MPS directory refused") && why.contains("is a symbolic link"),
            "{why}"
        );
        assert!(
            std::fs::read_dir(&elsewhere).unwrap().next().is_none(),
            "nothing was put where the link points"
        );
        std::fs::remove_file(&pipe).unwrap();
        assert!(
            sync_until(&mut job, std::slice::from_ref(&spec), running).await,
            "{:?}",
            job.states()
        );
        job.stop_all().await;
    }

    fn running(j: &MpsJob) -> bool {
        j.states().get(&0) == Some(&Ok(()))
    }

    fn daemon_pid(job: &MpsJob) -> u32 {
        job.daemons[&0].process.as_ref().unwrap().pid
    }

    /// Runs the control program as a client of `spec`'s daemon, `input` on its stdin.
    fn client_command(paths: &MpsPaths, spec: &DaemonSpec, script: &str) -> std::process::Command {
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .env("CTL", paths.control_binary().unwrap())
            .env("CUDA_MPS_PIPE_DIRECTORY", paths.gpu_dirs(&spec.uuid).pipe)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    fn count(lines: &[String], line: &str) -> usize {
        lines.iter().filter(|l| *l == line).count()
    }

    /// Waits (at most 10 s) until `line` is in the daemon's log more than `than` times.
    async fn logged_more(log: &Path, line: &str, than: usize) -> bool {
        for _ in 0..100 {
            if count(&log_lines(log), line) > than {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Issue #38: an agent restart (the job dropped without a stop, as a killed agent leaves
    /// it) leaves the daemon and its clients running, and the next agent takes the same
    /// daemon over: no second start, its pipe still answers, the clients still reach it.
    #[tokio::test]
    async fn an_agent_restart_leaves_the_daemon_and_its_clients_and_the_next_agent_takes_it_over() {
        let dir = tempfile::tempdir().unwrap();
        let (paths, spec) = fake_node(dir.path());
        // A stand-in for a cgroup v2 tree: the daemon's PID lands in its cgroup.procs.
        let cgroups = dir.path().join("cgroup");
        std::fs::create_dir_all(cgroups.join("gpupool-mps")).unwrap();
        std::fs::write(cgroups.join("cgroup.procs"), "").unwrap();
        std::fs::write(cgroups.join("gpupool-mps/cgroup.procs"), "").unwrap();
        let takeover = Takeover {
            proc_root: "/proc".into(),
            cgroup: Some(cgroups.join("gpupool-mps")),
        };
        let want = [spec.clone()];
        let _reaper = KillOnExit(paths.clone(), spec.uuid.clone());
        let log = paths.gpu_dirs(&spec.uuid).log.join("control.log");

        let mut first = MpsJob::new(paths.clone());
        first.set_takeover(takeover.clone());
        let (wake_tx, _wake_rx) = mpsc::channel(4);
        first.set_waker(wake_tx);
        assert!(
            sync_until(&mut first, &want, running).await,
            "{:?}",
            first.states()
        );
        let pid = daemon_pid(&first);
        assert_eq!(
            std::fs::read_to_string(cgroups.join("gpupool-mps/cgroup.procs")).unwrap(),
            pid.to_string()
        );

        // Two clients, each talking to the server through its pipe, over and over.
        let mut clients = Clients(
            (1..=2)
                .map(|n| {
                    use std::os::unix::process::CommandExt;
                    client_command(
                        &paths,
                        &spec,
                        &format!("while echo client-{n} | \"$CTL\"; do sleep 0.2; done"),
                    )
                    .process_group(0)
                    .spawn()
                    .unwrap()
                })
                .collect(),
        );
        for n in 1..=2 {
            assert!(logged_more(&log, &format!("client-{n}"), 0).await);
        }

        // The agent goes away without stopping anything.
        drop(first);

        let mut second = MpsJob::new(paths.clone());
        second.set_takeover(takeover);
        let (wake_tx, _wake_rx) = mpsc::channel(4);
        second.set_waker(wake_tx);
        assert!(
            sync_until(&mut second, &want, running).await,
            "{:?}",
            second.states()
        );
        assert_eq!(daemon_pid(&second), pid, "the same daemon");
        let lines = log_lines(&log);
        assert_eq!(
            lines.iter().filter(|l| l.starts_with("start ")).count(),
            1,
            "never started again: {lines:?}"
        );
        let out = client_command(&paths, &spec, "echo get_server_list | \"$CTL\"")
            .status()
            .unwrap();
        assert!(out.success(), "the pipe answers");
        assert!(logged_more(&log, "get_server_list", 0).await);
        let lines = log_lines(&log);
        for (n, client) in clients.0.iter_mut().enumerate() {
            let line = format!("client-{}", n + 1);
            assert!(client.try_wait().unwrap().is_none(), "{line} still runs");
            assert!(
                logged_more(&log, &line, count(&lines, &line)).await,
                "{line} still reaches its server"
            );
        }

        drop(clients);
        second.stop_all().await;
        assert_eq!(log_lines(&log).last().map(String::as_str), Some("quit"));
        assert!(!paths.local(&paths.record(&spec.uuid)).exists());
    }

    /// A record that names a process other than the daemon (a PID reused, or a start time that
    /// differs) is not taken over, and that process is never signalled.
    #[tokio::test]
    async fn a_stale_record_is_not_taken_over_and_its_process_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (paths, spec) = fake_node(dir.path());
        let want = [spec.clone()];
        let _reaper = KillOnExit(paths.clone(), spec.uuid.clone());
        let dirs = paths.gpu_dirs(&spec.uuid);
        for d in [&dirs.pipe, &dirs.log, &dirs.shm] {
            std::fs::create_dir_all(d).unwrap();
        }
        let fifo = CString::new(dirs.pipe.join(CONTROL_PIPE).as_os_str().as_bytes()).unwrap();
        // A process that took the recorded PID: right start time, not the daemon.
        let mut sleeper = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        // A process that runs as the control program's daemon, recorded with a start time
        // that is not its own. (It waits on its input, and never writes to the host's
        // /dev/shm, as the fake daemon would.)
        let other = dir.path().join("other");
        std::fs::create_dir_all(&other).unwrap();
        let decoy_bin = other.join(CONTROL_BINARY);
        std::fs::write(&decoy_bin, "#!/bin/sh\nread line\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&decoy_bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut decoy = std::process::Command::new(&decoy_bin)
            .arg("-f")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let decoy_cmdline = format!("/proc/{}/cmdline", decoy.id());
        for _ in 0..100 {
            if std::fs::read(&decoy_cmdline).is_ok_and(|c| is_control_daemon(&c)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(is_control_daemon(&std::fs::read(&decoy_cmdline).unwrap()));
        let proc_root = Path::new("/proc");
        let sleeping = Identity::of(proc_root, sleeper.id()).unwrap();
        let decoy_id = Identity::of(proc_root, decoy.id()).unwrap();
        let cases = [
            (sleeper.id(), sleeping.record()),
            (
                decoy.id(),
                Identity {
                    start_time: decoy_id.start_time + 1,
                    ..decoy_id
                }
                .record(),
            ),
        ];
        for (stale, record) in cases {
            // A control pipe as a live daemon leaves it, so that only the identity tells.
            // SAFETY: mkfifo(3) of a NUL-terminated path prepared above.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
            std::fs::write(paths.record(&spec.uuid), &record).unwrap();
            let mut job = MpsJob::new(paths.clone());
            assert!(
                sync_until(&mut job, &want, running).await,
                "{:?}",
                job.states()
            );
            let pid = daemon_pid(&job);
            assert_ne!(pid, stale, "{record} taken over");
            let now = std::fs::read_to_string(paths.record(&spec.uuid)).unwrap();
            assert_eq!(Identity::parse_record(&now).map(|i| i.pid), Some(pid));
            job.stop_all().await;
            assert!(sleeper.try_wait().unwrap().is_none(), "never signalled");
            assert!(decoy.try_wait().unwrap().is_none(), "never signalled");
        }
        for p in [&mut sleeper, &mut decoy] {
            p.kill().unwrap();
            p.wait().unwrap();
        }
    }

    /// The explicit cleanup for uninstall stops the daemons a previous agent left, and only
    /// those.
    #[tokio::test]
    async fn stop_recorded_stops_the_daemons_left_running() {
        let dir = tempfile::tempdir().unwrap();
        let (paths, spec) = fake_node(dir.path());
        let want = [spec.clone()];
        let _reaper = KillOnExit(paths.clone(), spec.uuid.clone());
        let log = paths.gpu_dirs(&spec.uuid).log.join("control.log");
        let mut agent = MpsJob::new(paths.clone());
        assert!(
            sync_until(&mut agent, &want, running).await,
            "{:?}",
            agent.states()
        );
        let pid = daemon_pid(&agent);
        agent.hand_over();
        drop(agent);
        let identity = Identity::of(Path::new("/proc"), pid).unwrap();

        let mut cleanup = MpsJob::new(paths.clone());
        let (stopped, not) = cleanup.stop_recorded().await;
        assert_eq!(
            (stopped, not),
            (vec![spec.uuid.clone()], Vec::<String>::new())
        );
        assert_eq!(log_lines(&log).last().map(String::as_str), Some("quit"));
        for _ in 0..100 {
            if !identity.alive(Path::new("/proc")) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!identity.alive(Path::new("/proc")), "the daemon is gone");
        assert_eq!(cleanup.stop_recorded().await, (Vec::new(), Vec::new()));
    }

    /// A daemon taken over is watched (through its pidfd): killed from outside, the loop is
    /// woken, its GPU reports it down, and a new one is started.
    #[tokio::test]
    async fn a_daemon_taken_over_and_killed_from_outside_is_noticed_and_restarted() {
        let dir = tempfile::tempdir().unwrap();
        let (paths, spec) = fake_node(dir.path());
        let want = [spec.clone()];
        let _reaper = KillOnExit(paths.clone(), spec.uuid.clone());
        let log = paths.gpu_dirs(&spec.uuid).log.join("control.log");
        let mut first = MpsJob::new(paths.clone());
        assert!(
            sync_until(&mut first, &want, running).await,
            "{:?}",
            first.states()
        );
        let pid = daemon_pid(&first);
        drop(first);

        let mut second = MpsJob::new(paths.clone());
        let (wake_tx, mut wake_rx) = mpsc::channel(4);
        second.set_waker(wake_tx);
        assert!(
            sync_until(&mut second, &want, running).await,
            "{:?}",
            second.states()
        );
        assert_eq!(daemon_pid(&second), pid);
        // SAFETY: kill(2) of the daemon this test started, still running (taken over above).
        unsafe {
            libc::kill(i32::try_from(pid).unwrap(), libc::SIGKILL);
        }
        tokio::time::timeout(Duration::from_secs(10), wake_rx.recv())
            .await
            .expect("the loop is woken when the daemon exits");
        second.sync(&want, Instant::now()).await;
        let down = second.states()[&0].clone().unwrap_err();
        assert!(down.contains("exited"), "{down}");
        assert!(
            sync_until(&mut second, &want, running).await,
            "{:?}",
            second.states()
        );
        assert_ne!(daemon_pid(&second), pid);
        let lines = log_lines(&log);
        assert_eq!(
            lines.iter().filter(|l| l.starts_with("start ")).count(),
            2,
            "{lines:?}"
        );
        second.stop_all().await;
    }
}
