//! The kubelet-facing side of the agent on a thread of its own: a single-threaded tokio runtime
//! that runs the plugin servers, the health monitor and the health event forwarder.
//!
//! Why its own thread: every step between an NVML health event and the `ListAndWatch` message,
//! and every step of an `Allocate`, is a task waking another task. On one thread those wakes
//! are queue pushes; spread over a multi-threaded runtime each can be a wake of another OS
//! thread, which on a busy node waits for a CPU. The agent's other work (API watches, status
//! reports, MIG changes, sampling) stays on the main runtime and cannot delay the kubelet.

use std::future::Future;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Name of the thread that runs the kubelet-facing tasks.
pub const THREAD_NAME: &str = "gpupool-kubelet";

/// A single-threaded runtime on its own thread. Tasks spawned on it run there until it is
/// dropped; dropping it stops the thread and cancels what is still running.
#[derive(Debug)]
pub struct PluginRuntime {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PluginRuntime {
    /// Starts the thread and its runtime.
    pub fn start() -> std::io::Result<PluginRuntime> {
        let runtime = Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(THREAD_NAME.to_owned())
            .spawn(move || {
                // Drives every task spawned through the handle until `stop` fires or is
                // dropped; dropping the runtime then cancels the tasks left.
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok(PluginRuntime {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `task` on the runtime's thread; its handle can be awaited from any runtime.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(task)
    }
}

impl Drop for PluginRuntime {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            // The thread only leaves `block_on` and drops its runtime: quick.
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tasks_run_on_the_plugin_thread() {
        let runtime = PluginRuntime::start().unwrap();
        let names = runtime.spawn(async {
            let first = std::thread::current().name().map(str::to_owned);
            // A task spawned from inside stays there too.
            let second = tokio::spawn(async { std::thread::current().name().map(str::to_owned) })
                .await
                .unwrap();
            (first, second)
        });
        let (first, second) = names.await.unwrap();
        assert_eq!(first.as_deref(), Some(THREAD_NAME));
        assert_eq!(second.as_deref(), Some(THREAD_NAME));
        assert_ne!(std::thread::current().name(), Some(THREAD_NAME));
    }

    #[tokio::test]
    async fn timers_and_sockets_work_there() {
        let runtime = PluginRuntime::start().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listen = path.clone();
        let echoed = runtime.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let listener = tokio::net::UnixListener::bind(&listen).unwrap();
            let client = tokio::spawn(async move {
                let mut s = tokio::net::UnixStream::connect(&listen).await.unwrap();
                s.write_all(b"ping").await.unwrap();
            });
            let (mut conn, _) = listener.accept().await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            let mut buf = [0u8; 4];
            conn.read_exact(&mut buf).await.unwrap();
            client.await.unwrap();
            buf
        });
        assert_eq!(&echoed.await.unwrap(), b"ping");
    }

    #[tokio::test]
    async fn dropping_it_stops_the_thread_and_cancels_tasks() {
        let runtime = PluginRuntime::start().unwrap();
        let (started_tx, started) = oneshot::channel();
        let pending = runtime.spawn(async move {
            let _ = started_tx.send(());
            std::future::pending::<()>().await;
        });
        started.await.unwrap();
        drop(runtime);
        let err = pending.await.unwrap_err();
        assert!(err.is_cancelled(), "{err}");
    }
}
