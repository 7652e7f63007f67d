//! Runs one plugin server per advertised resource and keeps each registered
//! with the kubelet across kubelet restarts and resource changes.
//!
//! Kubelet restarts are noticed by polling, every `watch_interval` (200 ms by
//! default), the identity (device, inode) of `kubelet.sock` and of our own
//! sockets. We poll rather than use inotify because the plugin directory is a
//! hostPath mount: an inotify watch silently goes stale if the directory itself
//! is replaced, events can overflow, and one `stat` per socket five times a
//! second costs nothing, while catching both signals the kubelet gives on
//! restart (our socket deleted, `kubelet.sock` recreated) within the one-second
//! budget, with no extra dependency.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::PluginError;
use super::allocate::{AllocateOptions, ResourceView};
use super::api::{DEFAULT_PLUGIN_DIR, KUBELET_SOCKET};
use super::metrics::PluginMetrics;
use super::model::{AdvertisedDevice, Advertisement, CdiKind, ResourceName, Topology};
use super::server::{self, DevicePluginService, FileIdentity, RunningServer, file_identity};

/// Where and how the plugin servers run.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The kubelet's device plugin directory (holds `kubelet.sock` and our sockets).
    pub plugin_dir: PathBuf,
    /// CDI kind used in `Allocate` responses.
    pub cdi_kind: CdiKind,
    /// Prefix of our socket file names and of the CDI annotation key.
    pub name_prefix: String,
    /// How often sockets are checked for a kubelet restart.
    pub watch_interval: Duration,
    /// How long a removed resource keeps advertising an empty list when the
    /// kubelet does not pick it up.
    pub removal_timeout: Duration,
    /// Timeout of each self-dial and `Register` call.
    pub rpc_timeout: Duration,
    /// First retry delay for a failed registration; doubles per failure.
    pub backoff_initial: Duration,
    /// Cap of the registration retry delay.
    pub backoff_max: Duration,
    /// How long a stopping server may take to close its streams.
    pub stop_grace: Duration,
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self {
            plugin_dir: PathBuf::from(DEFAULT_PLUGIN_DIR),
            cdi_kind: CdiKind::default(),
            name_prefix: "gpupool".to_owned(),
            watch_interval: Duration::from_millis(200),
            removal_timeout: Duration::from_secs(10),
            rpc_timeout: Duration::from_secs(5),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            stop_grace: Duration::from_secs(2),
        }
    }
}

impl PluginConfig {
    /// Defaults with another plugin directory (tests use a temp dir).
    pub fn with_plugin_dir(dir: impl Into<PathBuf>) -> Self {
        Self {
            plugin_dir: dir.into(),
            ..Self::default()
        }
    }

    /// Path of `kubelet.sock`.
    pub fn kubelet_socket(&self) -> PathBuf {
        self.plugin_dir.join(KUBELET_SOCKET)
    }

    /// Path of the socket serving `resource`.
    pub fn socket_path(&self, resource: &ResourceName) -> PathBuf {
        self.plugin_dir
            .join(resource.socket_file_name(&self.name_prefix))
    }
}

/// Serves `advertisement` to the kubelet until `cancel` fires, then stops every
/// server and removes its socket. Each change to the advertisement reaches the
/// `ListAndWatch` streams of the resources it touches; new resources get a server
/// and a registration; vanished ones advertise an empty list until the kubelet
/// has been sent it (or `removal_timeout`), then stop. Registrations and server
/// stops run as their own tasks, so a slow kubelet never delays device updates.
pub async fn run_plugins(
    config: PluginConfig,
    mut advertisement: watch::Receiver<Advertisement>,
    metrics: Arc<PluginMetrics>,
    cancel: CancellationToken,
) -> Result<(), PluginError> {
    let mut manager = Manager::new(config, metrics, cancel.clone());
    if manager.kubelet_identity.is_none() {
        tracing::warn!(
            socket = %manager.config.kubelet_socket().display(),
            "kubelet socket not found; will register once it appears"
        );
    }
    let initial = advertisement.borrow_and_update().clone();
    manager.reconcile(&initial);

    let mut tick = tokio::time::interval(manager.config.watch_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut advertisement_open = true;
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            changed = advertisement.changed(), if advertisement_open => {
                if changed.is_err() {
                    tracing::warn!("advertisement source closed; serving the last device set until shutdown");
                    advertisement_open = false;
                    continue;
                }
                // Read in place (reconcile neither awaits nor touches this channel): the
                // advertisement is not copied on each health change.
                let next = advertisement.borrow_and_update();
                manager.reconcile(&next);
            }
            Some(done) = manager.registrations.join_next() => match done {
                Ok(outcome) => manager.registration_done(outcome),
                Err(e) => tracing::error!(error = %e, "registration task failed"),
            },
            Some(done) = manager.retirements.join_next() => match done {
                Ok((resource, generation, seen)) => manager.finish_retirement(resource, generation, seen),
                Err(e) => tracing::error!(error = %e, "retirement task failed"),
            },
            Some(done) = manager.stopping.join_next() => {
                if let Err(e) = done {
                    tracing::error!(error = %e, "server stop task failed");
                }
            }
            _ = tick.tick() => manager.check_sockets(),
        }
    }
    manager.shutdown().await;
    Ok(())
}

enum Registration {
    Registered,
    /// Waiting to (re)try at `next`.
    Pending {
        attempt: u32,
        next: Instant,
    },
    /// A registration task is running; its outcome carries `token`.
    InFlight {
        attempt: u32,
        token: u64,
    },
}

struct Plugin {
    resource: ResourceName,
    socket_path: PathBuf,
    endpoint: String,
    view: watch::Sender<Arc<ResourceView>>,
    sent: Arc<watch::Sender<u64>>,
    server: Option<RunningServer>,
    registration: Registration,
    /// Set while winding down: the generation of the empty list to deliver.
    retiring: Option<u64>,
}

struct RegistrationOutcome {
    resource: ResourceName,
    token: u64,
    result: Result<(), String>,
}

struct Manager {
    config: PluginConfig,
    options: Arc<AllocateOptions>,
    metrics: Arc<PluginMetrics>,
    plugins: BTreeMap<ResourceName, Plugin>,
    kubelet_identity: Option<FileIdentity>,
    /// Source of view generations and registration tokens.
    generation: u64,
    registrations: JoinSet<RegistrationOutcome>,
    retirements: JoinSet<(ResourceName, u64, bool)>,
    stopping: JoinSet<()>,
    cancel: CancellationToken,
}

impl Manager {
    fn new(config: PluginConfig, metrics: Arc<PluginMetrics>, cancel: CancellationToken) -> Self {
        Self {
            options: Arc::new(AllocateOptions {
                cdi_kind: config.cdi_kind.clone(),
                annotation_plugin: config.name_prefix.clone(),
            }),
            kubelet_identity: file_identity(&config.kubelet_socket()),
            config,
            metrics,
            plugins: BTreeMap::new(),
            generation: 0,
            registrations: JoinSet::new(),
            retirements: JoinSet::new(),
            stopping: JoinSet::new(),
            cancel,
        }
    }

    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    fn reconcile(&mut self, advertisement: &Advertisement) {
        for (resource, devices) in &advertisement.resources {
            let generation = self.next_generation();
            if let Some(plugin) = self.plugins.get_mut(resource) {
                let revived = plugin.retiring.take().is_some();
                if revived {
                    tracing::info!(%resource, "resource is back; keeping its server");
                }
                let current = plugin.view.borrow().clone();
                if revived
                    || current.devices != *devices
                    || current.topology != advertisement.topology
                {
                    plugin.view.send_replace(Arc::new(ResourceView::new(
                        resource.clone(),
                        generation,
                        devices.clone(),
                        advertisement.topology.clone(),
                    )));
                }
                continue;
            }
            tracing::info!(%resource, devices = devices.len(), "new resource; starting its plugin server");
            let plugin = self.new_plugin(
                resource.clone(),
                generation,
                devices,
                &advertisement.topology,
            );
            self.plugins.insert(resource.clone(), plugin);
            self.start_registration(resource);
        }
        let vanished: Vec<ResourceName> = self
            .plugins
            .iter()
            .filter(|(r, p)| p.retiring.is_none() && !advertisement.resources.contains_key(*r))
            .map(|(r, _)| r.clone())
            .collect();
        for resource in vanished {
            self.retire(resource);
        }
    }

    fn new_plugin(
        &self,
        resource: ResourceName,
        generation: u64,
        devices: &[AdvertisedDevice],
        topology: &Arc<Topology>,
    ) -> Plugin {
        let view = watch::Sender::new(Arc::new(ResourceView::new(
            resource.clone(),
            generation,
            devices.to_vec(),
            topology.clone(),
        )));
        let socket_path = self.config.socket_path(&resource);
        let endpoint = resource.socket_file_name(&self.config.name_prefix);
        Plugin {
            resource,
            socket_path,
            endpoint,
            view,
            sent: Arc::new(watch::Sender::new(0)),
            server: None,
            registration: Registration::Pending {
                attempt: 0,
                next: Instant::now(),
            },
            retiring: None,
        }
    }

    /// Serve (if not yet), then self-dial and Register in a task; failures
    /// schedule a retry with backoff.
    fn start_registration(&mut self, resource: &ResourceName) {
        let kubelet_socket = self.config.kubelet_socket();
        let token = self.next_generation();
        let Some(plugin) = self.plugins.get_mut(resource) else {
            return;
        };
        let attempt = match plugin.registration {
            Registration::Pending { attempt, .. } | Registration::InFlight { attempt, .. } => {
                attempt
            }
            Registration::Registered => 0,
        };
        if !ensure_server(plugin, &self.options, &self.metrics) {
            fail_registration(
                plugin,
                attempt,
                "plugin server not running",
                &self.config,
                &self.metrics,
            );
            return;
        }
        if file_identity(&kubelet_socket).is_none() {
            let why = format!(
                "{} does not exist (kubelet not running?)",
                kubelet_socket.display()
            );
            fail_registration(plugin, attempt, &why, &self.config, &self.metrics);
            return;
        }
        plugin.registration = Registration::InFlight { attempt, token };
        let (socket, endpoint) = (plugin.socket_path.clone(), plugin.endpoint.clone());
        let (resource, timeout, cancel) = (
            resource.clone(),
            self.config.rpc_timeout,
            self.cancel.clone(),
        );
        self.registrations.spawn(async move {
            let steps = async {
                server::self_dial(&socket, timeout).await?;
                server::register(&kubelet_socket, &endpoint, resource.as_str(), timeout).await
            };
            let result = tokio::select! {
                () = cancel.cancelled() => Err("shutting down".to_owned()),
                r = steps => r.map_err(|e| e.to_string()),
            };
            RegistrationOutcome {
                resource,
                token,
                result,
            }
        });
    }

    fn registration_done(&mut self, outcome: RegistrationOutcome) {
        let RegistrationOutcome {
            resource,
            token,
            result,
        } = outcome;
        let Some(plugin) = self.plugins.get_mut(&resource) else {
            return;
        };
        let attempt = match plugin.registration {
            Registration::InFlight { attempt, token: t } if t == token => attempt,
            // Superseded (e.g. the kubelet restarted meanwhile): a newer attempt decides.
            _ => return,
        };
        match result {
            Ok(()) => {
                PluginMetrics::inc(&self.metrics.registrations);
                tracing::info!(%resource, endpoint = %plugin.endpoint, "registered with the kubelet");
                plugin.registration = Registration::Registered;
            }
            Err(why) => fail_registration(plugin, attempt, &why, &self.config, &self.metrics),
        }
    }

    /// Detects kubelet restarts and deleted sockets; starts due registrations.
    fn check_sockets(&mut self) {
        let now_identity = file_identity(&self.config.kubelet_socket());
        if now_identity != self.kubelet_identity {
            match (self.kubelet_identity, now_identity) {
                (_, None) => {
                    tracing::warn!("kubelet socket removed; waiting for the kubelet to come back")
                }
                (None, Some(_)) => tracing::info!("kubelet socket appeared; registering"),
                (Some(_), Some(_)) => {
                    PluginMetrics::inc(&self.metrics.kubelet_restarts);
                    tracing::info!(
                        "kubelet socket recreated (kubelet restarted); re-registering every resource"
                    );
                }
            }
            self.kubelet_identity = now_identity;
            if now_identity.is_some() {
                for plugin in self.plugins.values_mut().filter(|p| p.retiring.is_none()) {
                    plugin.registration = Registration::Pending {
                        attempt: 0,
                        next: Instant::now(),
                    };
                }
            }
        }
        let grace = self.config.stop_grace;
        for plugin in self.plugins.values_mut().filter(|p| p.retiring.is_none()) {
            let broken = plugin.server.as_ref().is_some_and(|s| !s.socket_intact());
            if let Some(old) = plugin.server.take_if(|_| broken) {
                tracing::info!(resource = %plugin.resource, socket = %plugin.socket_path.display(), "plugin socket deleted (kubelet restart?); restarting the server");
                self.stopping.spawn(old.stop(grace));
                plugin.registration = Registration::Pending {
                    attempt: 0,
                    next: Instant::now(),
                };
            }
        }
        let now = Instant::now();
        let due: Vec<ResourceName> = self
            .plugins
            .iter()
            .filter(|(_, p)| p.retiring.is_none())
            .filter(|(_, p)| matches!(p.registration, Registration::Pending { next, .. } if next <= now))
            .map(|(r, _)| r.clone())
            .collect();
        for resource in due {
            self.start_registration(&resource);
        }
    }

    /// Advertises an empty list, then stops the server once that list has been
    /// handed to a `ListAndWatch` stream (or after `removal_timeout`).
    fn retire(&mut self, resource: ResourceName) {
        let generation = self.next_generation();
        let Some(plugin) = self.plugins.get_mut(&resource) else {
            return;
        };
        tracing::info!(%resource, "resource removed; advertising an empty list before stopping");
        plugin.retiring = Some(generation);
        let topology = plugin.view.borrow().topology.clone();
        plugin.view.send_replace(Arc::new(ResourceView::new(
            resource.clone(),
            generation,
            Vec::new(),
            topology,
        )));
        let mut sent = plugin.sent.subscribe();
        let timeout = self.config.removal_timeout;
        self.retirements.spawn(async move {
            let seen = tokio::time::timeout(timeout, sent.wait_for(|g| *g >= generation))
                .await
                .is_ok_and(|r| r.is_ok());
            (resource, generation, seen)
        });
    }

    fn finish_retirement(&mut self, resource: ResourceName, generation: u64, seen: bool) {
        let still_retiring = self
            .plugins
            .get(&resource)
            .is_some_and(|p| p.retiring == Some(generation));
        if !still_retiring {
            return;
        }
        if seen {
            tracing::info!(%resource, "kubelet was sent the empty list; stopping the server");
        } else {
            tracing::warn!(%resource, "no ListAndWatch stream took the empty list in time; stopping anyway");
        }
        if let Some(server) = self.plugins.remove(&resource).and_then(|p| p.server) {
            self.stopping.spawn(server.stop(self.config.stop_grace));
        }
    }

    async fn shutdown(&mut self) {
        tracing::info!(servers = self.plugins.len(), "stopping plugin servers");
        self.registrations.abort_all();
        self.retirements.abort_all();
        let grace = self.config.stop_grace;
        for server in std::mem::take(&mut self.plugins)
            .into_values()
            .filter_map(|p| p.server)
        {
            self.stopping.spawn(server.stop(grace));
        }
        while let Some(done) = self.stopping.join_next().await {
            if let Err(e) = done {
                tracing::error!(error = %e, "server stop task failed");
            }
        }
    }
}

/// Starts the plugin's server if it has none. Returns false on failure.
fn ensure_server(
    plugin: &mut Plugin,
    options: &Arc<AllocateOptions>,
    metrics: &Arc<PluginMetrics>,
) -> bool {
    if plugin.server.is_some() {
        return true;
    }
    let service = DevicePluginService {
        view: plugin.view.subscribe(),
        sent: plugin.sent.clone(),
        options: options.clone(),
        metrics: metrics.clone(),
        stop: CancellationToken::new(),
    };
    match RunningServer::start(plugin.socket_path.clone(), service) {
        Ok(server) => {
            PluginMetrics::inc(&metrics.server_starts);
            tracing::debug!(resource = %plugin.resource, socket = %plugin.socket_path.display(), "serving");
            plugin.server = Some(server);
            true
        }
        Err(e) => {
            tracing::warn!(resource = %plugin.resource, error = %e, "cannot start plugin server");
            false
        }
    }
}

fn fail_registration(
    plugin: &mut Plugin,
    attempt: u32,
    why: &str,
    config: &PluginConfig,
    metrics: &PluginMetrics,
) {
    PluginMetrics::inc(&metrics.registration_failures);
    let delay = backoff(config, attempt);
    let retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    let resource = &plugin.resource;
    // Every failure is counted; the log says so on the first and every tenth.
    if attempt.is_multiple_of(10) {
        tracing::warn!(%resource, attempt, retry_in_ms, reason = %why, "registration failed; retrying");
    } else {
        tracing::debug!(%resource, attempt, retry_in_ms, reason = %why, "registration failed; retrying");
    }
    plugin.registration = Registration::Pending {
        attempt: attempt.saturating_add(1),
        next: Instant::now() + delay,
    };
}

/// Registration retry delay: `backoff_initial` doubling per failure, capped at `backoff_max`.
fn backoff(config: &PluginConfig, attempt: u32) -> Duration {
    let factor = 1u32.checked_shl(attempt.min(16)).unwrap_or(u32::MAX);
    config
        .backoff_initial
        .saturating_mul(factor)
        .min(config.backoff_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let config = PluginConfig::default();
        let ms = |a| backoff(&config, a).as_millis();
        assert_eq!(
            [ms(0), ms(1), ms(2), ms(5), ms(6), ms(40)],
            [100, 200, 400, 3200, 5000, 5000]
        );
    }

    #[test]
    fn socket_paths() {
        let config = PluginConfig::with_plugin_dir("/tmp/x");
        let r: ResourceName = "nvidia.com/mig-1g.10gb".parse().unwrap();
        assert_eq!(
            config.socket_path(&r),
            PathBuf::from("/tmp/x/gpupool-nvidia.com-mig-1g.10gb.sock")
        );
        assert_eq!(
            config.kubelet_socket(),
            PathBuf::from("/tmp/x/kubelet.sock")
        );
    }
}
