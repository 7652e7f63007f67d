//! The `kubernetes` Service, reachable from pods on the real node.
//!
//! In-cluster clients (the chart's operator and agent pods) dial `KUBERNETES_SERVICE_HOST` and
//! `_PORT`: the ClusterIP and port of `default/kubernetes`. In a cluster, kube-proxy (or a CNI
//! that replaces it) maps that address to an API server. This test bed has no service proxy,
//! and its API server listens on 127.0.0.1 only, so [`ApiServiceRelay`] stands in for that one
//! Service: the ClusterIP becomes a local address of the pods' bridge (their gateway, see
//! `e2e/kubelet`), and a TCP relay in the test process carries each connection that arrives
//! there to the API server. TLS runs end to end: the API server's certificate names the
//! ClusterIP, so pods check it against their service account's CA as they would anywhere.

use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::config::Kubeconfig;

use crate::Cluster;

/// The bridge `e2e/kubelet` puts the containerd node's pods on.
pub const POD_BRIDGE: &str = "gpupool-e2e0";

/// The relay; dropping it stops it and removes the address.
#[derive(Debug)]
pub struct ApiServiceRelay {
    /// Where pods dial: the Service's ClusterIP and port.
    pub service: SocketAddr,
    /// The API server it forwards to.
    pub upstream: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl ApiServiceRelay {
    /// Starts relaying `default/kubernetes` to the cluster's API server.
    pub async fn start(cluster: &Cluster, client: &kube::Client) -> Result<ApiServiceRelay> {
        let svc = Api::<Service>::namespaced(client.clone(), "default")
            .get("kubernetes")
            .await
            .context("reading Service default/kubernetes")?;
        let spec = svc.spec.context("Service default/kubernetes has no spec")?;
        let ip: IpAddr = spec
            .cluster_ip
            .as_deref()
            .context("Service default/kubernetes has no ClusterIP")?
            .parse()
            .context("parsing the ClusterIP of default/kubernetes")?;
        let port = spec
            .ports
            .as_deref()
            .and_then(|p| p.first())
            .map(|p| p.port)
            .context("Service default/kubernetes has no port")?;
        let service = SocketAddr::new(ip, u16::try_from(port).context("Service port")?);
        let upstream = api_server_addr(cluster)?;

        ensure_bridge()?;
        let cidr = format!("{ip}/32");
        ip_cmd(&["addr", "replace", &cidr, "dev", POD_BRIDGE])?;
        let listener = match TcpListener::bind(service) {
            Ok(l) => l,
            Err(e) => {
                let _ = ip_cmd(&["addr", "del", &cidr, "dev", POD_BRIDGE]);
                return Err(e).with_context(|| format!("listening on {service}"));
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("api-service-relay".into())
                .spawn(move || accept_loop(&listener, upstream, &stop))
                .context("starting the relay thread")?
        };
        eprintln!("e2e: relaying {service} (Service default/kubernetes) to {upstream}");
        Ok(ApiServiceRelay {
            service,
            upstream,
            stop,
            accept: Some(accept),
        })
    }
}

impl Drop for ApiServiceRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = TcpStream::connect(self.service);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let _ = ip_cmd(&[
            "addr",
            "del",
            &format!("{}/32", self.service.ip()),
            "dev",
            POD_BRIDGE,
        ]);
    }
}

fn accept_loop(listener: &TcpListener, upstream: SocketAddr, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = conn else { continue };
        let _ = std::thread::Builder::new()
            .name("api-service-conn".into())
            .spawn(move || {
                if let Err(e) = relay(client, upstream) {
                    eprintln!("e2e: api service relay: {e}");
                }
            });
    }
}

/// Copies both ways until each side has closed its half.
fn relay(client: TcpStream, upstream: SocketAddr) -> io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    let (mut client_r, mut server_w) = (client.try_clone()?, server.try_clone()?);
    let up = std::thread::spawn(move || {
        let copied = io::copy(&mut client_r, &mut server_w);
        let _ = server_w.shutdown(Shutdown::Write);
        copied
    });
    let (mut server_r, mut client_w) = (server, client);
    let _ = io::copy(&mut server_r, &mut client_w);
    let _ = client_w.shutdown(Shutdown::Write);
    let _ = up.join();
    Ok(())
}

/// The API server's address, from the admin kubeconfig's `server` URL.
fn api_server_addr(cluster: &Cluster) -> Result<SocketAddr> {
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())
        .with_context(|| format!("reading {}", cluster.kubeconfig().display()))?;
    let server = kubeconfig
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.server.clone())
        .context("the kubeconfig names no server")?;
    let hostport = server
        .strip_prefix("https://")
        .with_context(|| format!("server {server} is not https://"))?
        .trim_end_matches('/');
    hostport
        .to_socket_addrs()
        .with_context(|| format!("resolving {hostport}"))?
        .next()
        .with_context(|| format!("{hostport} resolves to nothing"))
}

/// The pods' bridge, created if no pod has made it yet (the CNI bridge plugin adopts an
/// existing bridge of its name).
fn ensure_bridge() -> Result<()> {
    let exists = Command::new("ip")
        .args(["link", "show", POD_BRIDGE])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running ip")?
        .success();
    if !exists {
        ip_cmd(&["link", "add", POD_BRIDGE, "type", "bridge"])?;
    }
    ip_cmd(&["link", "set", POD_BRIDGE, "up"])
}

fn ip_cmd(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running ip")?;
    ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::bail;

    #[test]
    fn relay_copies_both_ways_and_closes() -> Result<()> {
        // An echo server stands in for the API server.
        let server = TcpListener::bind("127.0.0.1:0")?;
        let upstream = server.local_addr()?;
        let echo = std::thread::spawn(move || -> io::Result<()> {
            let (mut s, _) = server.accept()?;
            let mut r = s.try_clone()?;
            io::copy(&mut r, &mut s)?;
            s.shutdown(Shutdown::Write)
        });
        let front = TcpListener::bind("127.0.0.1:0")?;
        let front_addr = front.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let stop = stop.clone();
            std::thread::spawn(move || accept_loop(&front, upstream, &stop))
        };
        let mut c = TcpStream::connect(front_addr)?;
        io::Write::write_all(&mut c, b"hello relay")?;
        c.shutdown(Shutdown::Write)?;
        let mut back = String::new();
        io::Read::read_to_string(&mut c, &mut back)?;
        assert_eq!(back, "hello relay");
        stop.store(true, Ordering::SeqCst);
        TcpStream::connect(front_addr)?;
        match accept.join() {
            Ok(()) => {}
            Err(_) => bail!("the accept loop panicked"),
        }
        match echo.join() {
            Ok(r) => r?,
            Err(_) => bail!("the echo server panicked"),
        }
        Ok(())
    }
}
