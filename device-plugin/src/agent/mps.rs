//! MPS: one CUDA MPS control daemon per GPU that the node's sharing puts under MPS, run from the
//! driver, supervised by the agent, and told the pool's per-client limits.
//!
//! Each GPU gets a directory under the MPS root (`/run/gpupool/mps/<GPU UUID>/`, host terms)
//! with the daemon's `pipe`, `log` and `shm`. The daemon runs in the foreground (`-f`), as a
//! child of the agent, with `CUDA_VISIBLE_DEVICES` set to its GPU, in a mount namespace of its
//! own where the GPU's `shm` directory is its `/dev/shm`, and (in a container) chrooted into
//! the host's `/`, so that the driver's own files, the MPS server binary included, are where
//! the driver expects them. Once its control pipe is up the agent sends it the default limits:
//! `set_default_active_thread_percentage <pct>` and `set_default_device_pinned_mem_limit 0
//! <MiB>M` (device 0: the only one the daemon sees). A client container is given the pipe
//! directory at `/run/gpupool/mps-pipe` (not MPS's default `/tmp/nvidia-mps`, where the CDI
//! spec mounts the driver root's own pipe directory and would hide ours), the `shm` directory at `/dev/shm`, and the same limits as
//! environment variables.
//!
//! A daemon that exits makes its GPU's replicas Unhealthy until a restart (with backoff, 2 s
//! doubling to 5 min) is up again. The daemons are the agent's children: an agent restart
//! restarts them, and the clients of a GPU lose their server with it. A daemon's stderr is read
//! as it arrives (its last 2 KiB kept for the exit reason), so a chatty daemon never blocks on a
//! full pipe; and it is signalled only through the task that owns its process, never by a raw
//! PID that may have been reaped and reused.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpupool_crds::node::GpuSharing;
use gpupool_crds::policy::MpsPolicy;
use tokio::io::AsyncWriteExt;
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
/// MPS's default `/tmp/nvidia-mps`: the CDI spec mounts the driver root's there, after (and so
/// over) the mounts `Allocate` asks for.
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

    /// The control program under the driver root, host terms.
    pub fn control_binary(&self) -> Result<PathBuf, String> {
        CONTROL_DIRS
            .iter()
            .map(|d| self.driver_root.join(d).join(CONTROL_BINARY))
            .find(|p| self.local(p).is_file())
            .ok_or_else(|| {
                format!(
                    "{CONTROL_BINARY} not found under the driver root {} ({}): the driver's MPS tools are missing",
                    self.driver_root.display(),
                    CONTROL_DIRS.join(", ")
                )
            })
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
    /// this process is in a container, and with the GPU's `shm` as `/dev/shm` when `shm`.
    fn command(&self, spec: &DaemonSpec, shm: bool) -> Result<Command, String> {
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
        let bind = if shm && self.private_shm {
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

/// A started daemon's process. The task that waits for it owns the child; a stop goes through
/// `kill`, so the signal is sent only while the child is unreaped: never to a PID that has
/// since been reused (with hostPID, by any process of the host).
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
}

/// The MPS daemons of the node, keyed by GPU index.
pub struct MpsJob {
    paths: MpsPaths,
    daemons: BTreeMap<u32, Daemon>,
    /// Wakes the agent loop when a daemon exits.
    wake: Option<mpsc::Sender<()>>,
}

impl MpsJob {
    /// No daemons yet.
    pub fn new(paths: MpsPaths) -> MpsJob {
        MpsJob {
            paths,
            daemons: BTreeMap::new(),
            wake: None,
        }
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
                Phase::Running => {}
                Phase::Failed { retry_at, .. } if retry_at > now => at(retry_at),
                Phase::Failed { .. } => match start(&self.paths, &daemon.spec, self.wake.clone()) {
                    Ok((process, exit)) => {
                        tracing::info!(
                            gpu = index,
                            pid = process.pid,
                            "MPS control daemon started"
                        );
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
                        isolation: "Memory".into(),
                        memory_limit_mib: Some(d.spec.memory_limit_mib),
                        active_thread_percentage: Some(d.spec.active_thread_percentage),
                        daemon: Some(daemon),
                    },
                )
            })
            .collect()
    }

    /// Stops every daemon (agent shutdown).
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

/// Reads `stderr` as it arrives, keeping its last [`STDERR_TAIL`] bytes: a daemon that writes
/// more than a pipe holds (64 KiB) would otherwise block on its next write, alive but deaf.
async fn stderr_tail(mut stderr: tokio::process::ChildStderr) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut tail = Vec::with_capacity(STDERR_TAIL);
    let mut buf = [0u8; 4096];
    loop {
        match stderr.read(&mut buf).await {
            Ok(0) | Err(_) => return tail,
            Ok(n) => {
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > STDERR_TAIL {
                    tail.drain(..tail.len() - STDERR_TAIL);
                }
            }
        }
    }
}

fn describe(status: io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => format!("the daemon exited ({s})"),
        Err(e) => format!("waiting for the daemon: {e}"),
    }
}

/// Creates `spec`'s directories and starts its daemon; returns its PID and a receiver that says
/// when, and how, it ended.
fn start(
    paths: &MpsPaths,
    spec: &DaemonSpec,
    wake: Option<mpsc::Sender<()>>,
) -> Result<(Process, watch::Receiver<Option<String>>), String> {
    let dirs = paths.gpu_dirs(&spec.uuid);
    for dir in [&dirs.pipe, &dirs.log, &dirs.shm] {
        let local = paths.local(dir);
        std::fs::create_dir_all(&local)
            .map_err(|e| format!("creating {}: {e}", local.display()))?;
    }
    // A control pipe left by a daemon that was killed would look like a live one.
    let pipe = paths.local(&dirs.pipe.join(CONTROL_PIPE));
    match std::fs::remove_file(&pipe) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("removing the stale {}: {e}", pipe.display())),
    }
    let mut child = paths
        .command(spec, true)?
        .arg("-f")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {CONTROL_BINARY}: {e}"))?;
    let pid = child.id().ok_or("the daemon exited at once")?;
    let (tx, rx) = watch::channel(None);
    let (kill_tx, mut kill_rx) = mpsc::channel::<()>(1);
    tokio::spawn(async move {
        let tail = child.stderr.take().map(|e| tokio::spawn(stderr_tail(e)));
        let status = tokio::select! {
            status = child.wait() => status,
            // Asked to, or its owner is gone: the child is still ours, so the signal is too.
            _ = kill_rx.recv() => {
                if let Err(e) = child.start_kill() {
                    tracing::debug!(pid, error = %e, "killing the MPS daemon");
                }
                child.wait().await
            }
        };
        let mut why = describe(status);
        // A process the daemon left behind may hold its stderr open: wait only briefly.
        if let Some(tail) = tail
            && let Ok(Ok(buf)) = tokio::time::timeout(Duration::from_secs(1), tail).await
            && !buf.is_empty()
        {
            why = format!("{why}: {}", String::from_utf8_lossy(&buf).trim());
        }
        let _ = tx.send(Some(why));
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
        assert_eq!(sharing[&0].isolation, "Memory");

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
}
