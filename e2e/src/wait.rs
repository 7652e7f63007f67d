//! Polling with a deadline, for conditions that have no watch to await.

use std::future::Future;
use std::time::Duration;

use anyhow::{Result, bail};
use tokio::time::{Instant, sleep};

/// Calls `check` every `interval` until it returns `Some`, or fails after
/// `timeout` with `what` and the last error `check` reported.
pub async fn poll<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() >= deadline {
            match last_error {
                Some(e) => {
                    bail!("timed out after {timeout:?} waiting for {what}; last error: {e:#}")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_first_success() {
        let mut calls = 0;
        let got = poll(
            "three calls",
            Duration::from_secs(5),
            Duration::from_millis(100),
            || {
                calls += 1;
                let n = calls;
                async move { Ok((n == 3).then_some(n)) }
            },
        )
        .await
        .unwrap();
        assert_eq!(got, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn times_out_with_the_last_error() {
        let err = poll::<(), _, _>(
            "never",
            Duration::from_secs(1),
            Duration::from_millis(100),
            || async { bail!("still broken") },
        )
        .await
        .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("waiting for never") && msg.contains("still broken"),
            "{msg}"
        );
    }
}
