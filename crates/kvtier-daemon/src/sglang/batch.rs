//! How a BatchGet runs its transfers: each on its own task, so its copies into the engine's
//! memory spread over the runtime's workers (in one task they took turns on one core),
//! `sglang_rpc.concurrency` at a time, results in the request's order; and behind a
//! [`CopyGate`], so no copy touches the engine's memory once the call is over. (A BatchPut
//! stays in one task: its objects apply in the request's order, so a later put of an id
//! wins and the bounded memory keeps a batch's last objects.)

use parking_lot::RwLock;
use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;

/// Keeps a batch's copies from outliving its call. Every copy into the engine's memory runs
/// under the gate's read lock, and only while the gate is open; when the call ends, answered
/// or dropped (the engine gave up on it), the gate closes under the write lock. Once closed,
/// no copy is running and none starts: memory the engine has taken back is never written
/// behind its back.
#[derive(Debug, Default)]
pub(super) struct CopyGate {
    closed: RwLock<bool>,
}

impl CopyGate {
    /// Runs `copy` unless the gate is closed (then `None`), holding it open until done.
    pub(super) fn copy<R>(&self, copy: impl FnOnce() -> R) -> Option<R> {
        let closed = self.closed.read();
        (!*closed).then(copy)
    }

    /// Closes the gate, waiting for a copy under way (one transfer's memcpy) to finish.
    fn close(&self) {
        *self.closed.write() = true;
    }
}

/// Closes its gate when dropped.
struct Closes(Arc<CopyGate>);

impl Drop for Closes {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Aborts its task when dropped (a cancelled batch stops the transfers it started).
struct Aborts<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Aborts<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs `one` over `items`, each on its own task, at most `concurrency` at a time; the
/// results come in `items`' order. A task that panicked or was aborted answers `failed`.
pub(super) async fn run<T, F, Fut>(
    items: Vec<T>,
    concurrency: usize,
    failed: i32,
    one: F,
) -> Vec<i32>
where
    T: Send + 'static,
    F: Fn(T, Arc<CopyGate>) -> Fut,
    Fut: Future<Output = i32> + Send + 'static,
{
    let gate = Arc::new(CopyGate::default());
    let _closes = Closes(gate.clone());
    futures::stream::iter(items)
        .map(|t| {
            // scoped: the batch holds it and aborts it when dropped.
            let task = Aborts(tokio::spawn(one(t, gate.clone())));
            async move {
                let mut task = task;
                (&mut task.0).await.unwrap_or(failed)
            }
        })
        .buffered(concurrency.max(1))
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn results_keep_the_order_and_the_bound() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (r, m) = (running.clone(), most.clone());
        let got = run((0..40).collect(), 3, -1, move |i: i32, _gate| {
            let (r, m) = (r.clone(), m.clone());
            async move {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                // Later items finish first: the order must come from the request.
                tokio::time::sleep(Duration::from_millis(
                    u64::try_from(40 - i).unwrap_or(0) / 4,
                ))
                .await;
                r.fetch_sub(1, Ordering::SeqCst);
                i * 2
            }
        })
        .await;
        assert_eq!(got, (0..40).map(|i| i * 2).collect::<Vec<_>>());
        let most = most.load(Ordering::SeqCst);
        assert!(
            (1..=3).contains(&most),
            "{most} transfers ran at once; the bound is 3"
        );
    }

    // Three workers for two transfers at a time: one stays free to run the timer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 3)]
    async fn a_dropped_batch_copies_nothing_more() {
        let copied = Arc::new(AtomicUsize::new(0));
        let c = copied.clone();
        let gates: Arc<parking_lot::Mutex<Vec<Arc<CopyGate>>>> = Arc::default();
        let g = gates.clone();
        let batch = run((0..8).collect(), 2, -1, move |_: i32, gate| {
            let (c, g) = (c.clone(), g.clone());
            async move {
                g.lock().push(gate.clone());
                tokio::task::yield_now().await;
                // Busy without a yield (an abort cannot stop this part), as a transfer between
                // its read and its copy; the call goes away meanwhile.
                std::thread::sleep(Duration::from_millis(200));
                gate.copy(|| c.fetch_add(1, Ordering::SeqCst))
                    .map_or(-2, |_| 0)
            }
        });
        // The engine gives up on the call after 50 ms.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), batch)
                .await
                .is_err()
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            copied.load(Ordering::SeqCst),
            0,
            "a copy ran after the call ended"
        );
        let gates = gates.lock();
        assert!(!gates.is_empty(), "no transfer had started");
        assert!(
            gates.iter().all(|g| g.copy(|| ()).is_none()),
            "the gate stays closed"
        );
    }
}
