//! Reconcile triggers, at most one per key per interval, none ever held back for longer.
//!
//! A pool's reconcile is triggered by its Nodes and GpuNodes: at 5,000 nodes, agents' heartbeats
//! alone change a GpuNode every 12 ms. kube's controller debounce restarts its wait on every new
//! trigger, so under such a steady stream a pool is never reconciled at all (its status froze
//! in the scale bench while kwok's nodes flapped). [`throttle`] instead passes a key's first
//! trigger at once and folds later ones into a single trigger at the end of the interval: a
//! busy pool is reconciled about once per interval, and a change waits at most one interval.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::time::Instant;

/// The interval the operator throttles its pools' Node and GpuNode triggers to.
pub const POOL_TRIGGER_INTERVAL: Duration = Duration::from_secs(1);

struct State<S, K> {
    triggers: Pin<Box<S>>,
    every: Duration,
    /// When each key last went out (forgotten once an interval has passed).
    sent: HashMap<K, Instant>,
    /// Keys held back, by when they go out (a sequence number keeps equal times apart), and the
    /// same keys for lookup.
    due: BTreeMap<(Instant, u64), K>,
    held: HashSet<K>,
    seq: u64,
    ended: bool,
}

/// `triggers`, with each key passed at most once per `every`: a key not sent within the last
/// `every` goes out at once; one that was is held back and goes out once `every` has passed
/// since, however many more triggers of it arrive meanwhile. Keys are throttled independently.
/// The stream ends when `triggers` has ended and nothing is held back.
pub fn throttle<S, K>(triggers: S, every: Duration) -> impl Stream<Item = K> + Send
where
    S: Stream<Item = K> + Send + 'static,
    K: Clone + Eq + Hash + Send + 'static,
{
    let state: State<S, K> = State {
        triggers: Box::pin(triggers),
        every,
        sent: HashMap::new(),
        due: BTreeMap::new(),
        held: HashSet::new(),
        seq: 0,
        ended: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            let next_due = st.due.first_key_value().map(|((at, _), _)| *at);
            if st.ended && next_due.is_none() {
                return None;
            }
            tokio::select! {
                biased;
                () = sleep_until(next_due), if next_due.is_some() => {
                    if let Some((_, key)) = st.due.pop_first() {
                        st.held.remove(&key);
                        st.sent.insert(key.clone(), Instant::now());
                        return Some((key, st));
                    }
                }
                key = st.triggers.next(), if !st.ended => {
                    let Some(key) = key else {
                        st.ended = true;
                        continue;
                    };
                    if st.held.contains(&key) {
                        continue;
                    }
                    let now = Instant::now();
                    let every = st.every;
                    st.sent.retain(|_, at| now.duration_since(*at) < every);
                    match st.sent.get(&key) {
                        Some(at) => {
                            let slot = (*at + every, st.seq);
                            st.seq += 1;
                            st.held.insert(key.clone());
                            st.due.insert(slot, key);
                        }
                        None => {
                            st.sent.insert(key.clone(), now);
                            return Some((key, st));
                        }
                    }
                }
            }
        }
    })
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc;

    const EVERY: Duration = Duration::from_secs(1);

    /// Sends each key `after` the send before it, ends the triggers after the last, and returns
    /// what the throttle let out, each with when, from the start.
    async fn throttled(
        sends: impl IntoIterator<Item = (Duration, &'static str)>,
    ) -> Vec<(&'static str, Duration)> {
        let (tx, rx) = mpsc::unbounded();
        let start = Instant::now();
        let out = tokio::spawn(async move {
            throttle(rx, EVERY)
                .map(|k| (k, start.elapsed()))
                .collect::<Vec<_>>()
                .await
        });
        for (after, key) in sends {
            tokio::time::sleep(after).await;
            tx.unbounded_send(key).unwrap();
        }
        drop(tx);
        out.await.unwrap()
    }

    const MS_100: Duration = Duration::from_millis(100);

    #[tokio::test(start_paused = true)]
    async fn a_first_trigger_goes_out_at_once_and_a_burst_folds_into_one_at_the_interval() {
        let mut sends = vec![(Duration::ZERO, "pool-a")];
        sends.extend([(MS_100, "pool-a"); 5]);
        // Another key is not held back by the first.
        sends.push((Duration::ZERO, "pool-b"));
        assert_eq!(
            throttled(sends).await,
            vec![
                ("pool-a", Duration::ZERO),
                ("pool-b", Duration::from_millis(500)),
                ("pool-a", EVERY),
            ]
        );
    }

    /// kube's debounce restarts on every trigger, so a trigger every 100 ms never let it run;
    /// throttled, the key goes out once a second for as long as the triggers last.
    #[tokio::test(start_paused = true)]
    async fn a_steady_stream_of_triggers_never_starves_a_key() {
        let mut sends = vec![(Duration::ZERO, "pool-a")];
        sends.extend([(MS_100, "pool-a"); 49]);
        let times: Vec<Duration> = throttled(sends).await.into_iter().map(|(_, t)| t).collect();
        assert_eq!(
            times,
            (0..=5).map(Duration::from_secs).collect::<Vec<_>>(),
            "one trigger a second over the 5 s of triggers"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_key_goes_out_at_once_again() {
        let sends = [
            (Duration::ZERO, "pool-a"),
            (Duration::from_secs(3), "pool-a"),
        ];
        assert_eq!(
            throttled(sends).await,
            vec![
                ("pool-a", Duration::ZERO),
                ("pool-a", Duration::from_secs(3))
            ]
        );
    }
}
