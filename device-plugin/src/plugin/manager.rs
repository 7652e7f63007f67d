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
/// has been sent it (or `removal_timeout`), then stop.
pub async fn run_plugins(
    config: PluginConfig,
    mut advertisement: watch::Receiver<Advertisement>,
    metrics: Arc<PluginMetrics>,
    cancel: CancellationToken,
) -> Result<(), PluginError> {
    let mut manager = Manager {
        options: Arc::new(AllocateOptions {
            cdi_kind: config.cdi_kind.clone(),
            annotation_plugin: config.name_prefix.clone(),
        }),
        kubelet_identity: file_identity(&config.kubelet_socket()),
        config,
        metrics,
        plugins: BTreeMap::new(),
        generation: 0,
        retirements: JoinSet::new(),
        cancel: cancel.clone(),
    };
    if manager.kubelet_identity.is_none() {
        tracing::warn!(
            socket = %manager.config.kubelet_socket().display(),
            "kubelet socket not found; will register once it appears"
        );
    }
    let initial = advertisement.borrow_and_update().clone();
    manager.reconcile(&initial).await;

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
                let next = advertisement.borrow_and_update().clone();
                manager.reconcile(&next).await;
            }
            Some(done) = manager.retirements.join_next() => match done {
                Ok((resource, generation, seen)) => manager.finish_retirement(resource, generation, seen).await,
                Err(e) => tracing::error!(error = %e, "retirement task failed"),
            },
            _ = tick.tick() => manager.check_sockets().await,
        }
    }
    manager.shutdown().await;
    Ok(())
}

enum Registration {
    Registered,
    Pending { attempt: u32, next: Instant },
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

struct Manager {
    config: PluginConfig,
    options: Arc<AllocateOptions>,
    metrics: Arc<PluginMetrics>,
    plugins: BTreeMap<ResourceName, Plugin>,
    kubelet_identity: Option<FileIdentity>,
    generation: u64,
    retirements: JoinSet<(ResourceName, u64, bool)>,
    cancel: CancellationToken,
}

impl Manager {
    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    async fn reconcile(&mut self, advertisement: &Advertisement) {
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
            self.attempt_registration(resource).await;
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

    /// Starts the plugin's server if it has none. Returns false on failure.
    fn ensure_server(&self, plugin: &mut Plugin) -> bool {
        if plugin.server.is_some() {
            return true;
        }
        let service = DevicePluginService {
            view: plugin.view.subscribe(),
            sent: plugin.sent.clone(),
            options: self.options.clone(),
            metrics: self.metrics.clone(),
            stop: CancellationToken::new(),
        };
        match RunningServer::start(plugin.socket_path.clone(), service) {
            Ok(server) => {
                PluginMetrics::inc(&self.metrics.server_starts);
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

    /// Serve, self-dial, then Register; on failure schedule a retry with backoff.
    async fn attempt_registration(&mut self, resource: &ResourceName) {
        let kubelet_socket = self.config.kubelet_socket();
        let Some(mut plugin) = self.plugins.remove(resource) else {
            return;
        };
        let attempt = match plugin.registration {
            Registration::Pending { attempt, .. } => attempt,
            Registration::Registered => 0,
        };
        let result = if !self.ensure_server(&mut plugin) {
            Err("plugin server not running".to_owned())
        } else if file_identity(&kubelet_socket).is_none() {
            Err(format!(
                "{} does not exist (kubelet not running?)",
                kubelet_socket.display()
            ))
        } else {
            let timeout = self.config.rpc_timeout;
            let steps = async {
                server::self_dial(&plugin.socket_path, timeout).await?;
                server::register(
                    &kubelet_socket,
                    &plugin.endpoint,
                    resource.as_str(),
                    timeout,
                )
                .await
            };
            tokio::select! {
                () = self.cancel.cancelled() => Err("shutting down".to_owned()),
                r = steps => r.map_err(|e| e.to_string()),
            }
        };
        match result {
            Ok(()) => {
                PluginMetrics::inc(&self.metrics.registrations);
                tracing::info!(%resource, endpoint = %plugin.endpoint, "registered with the kubelet");
                plugin.registration = Registration::Registered;
            }
            Err(why) => {
                PluginMetrics::inc(&self.metrics.registration_failures);
                let delay = self.backoff(attempt);
                if attempt % 10 == 0 {
                    tracing::warn!(%resource, attempt, retry_in_ms = delay.as_millis() as u64, reason = %why, "registration failed; retrying");
                } else {
                    tracing::debug!(%resource, attempt, retry_in_ms = delay.as_millis() as u64, reason = %why, "registration failed; retrying");
                }
                plugin.registration = Registration::Pending {
                    attempt: attempt.saturating_add(1),
                    next: Instant::now() + delay,
                };
            }
        }
        self.plugins.insert(resource.clone(), plugin);
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(16)).unwrap_or(u32::MAX);
        self.config
            .backoff_initial
            .saturating_mul(factor)
            .min(self.config.backoff_max)
    }

    /// Detects kubelet restarts and deleted sockets; retries due registrations.
    async fn check_sockets(&mut self) {
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
        for plugin in self.plugins.values_mut().filter(|p| p.retiring.is_none()) {
            let broken = plugin.server.as_ref().is_some_and(|s| !s.socket_intact());
            if broken {
                tracing::info!(resource = %plugin.resource, socket = %plugin.socket_path.display(), "plugin socket deleted (kubelet restart?); restarting the server");
                if let Some(old) = plugin.server.take() {
                    old.stop(self.config.stop_grace).await;
                }
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
            self.attempt_registration(&resource).await;
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

    async fn finish_retirement(&mut self, resource: ResourceName, generation: u64, seen: bool) {
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
            server.stop(self.config.stop_grace).await;
        }
    }

    async fn shutdown(&mut self) {
        tracing::info!(servers = self.plugins.len(), "stopping plugin servers");
        self.retirements.abort_all();
        let grace = self.config.stop_grace;
        let stops = std::mem::take(&mut self.plugins)
            .into_values()
            .filter_map(|p| p.server)
            .map(|s| s.stop(grace));
        futures::future::join_all(stops).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let manager = Manager {
            config: PluginConfig::default(),
            options: Arc::default(),
            metrics: Arc::default(),
            plugins: BTreeMap::new(),
            kubelet_identity: None,
            generation: 0,
            retirements: JoinSet::new(),
            cancel: CancellationToken::new(),
        };
        let ms = |a| manager.backoff(a).as_millis();
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
