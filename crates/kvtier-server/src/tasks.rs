//! Where a server's tasks run (kvtierd's and the agent's): every task is spawned on one
//! tracker, which the drain waits on (up to `server.drain_timeout`), and stops when the
//! shutdown token is cancelled. A part is handed a [`Tasks`]; it never calls `tokio::spawn`
//! itself (tests/architecture.rs).

use std::future::Future;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The shutdown token and the tracker of one server process.
#[derive(Debug, Clone)]
pub struct Tasks {
    /// Cancelled on SIGTERM / SIGINT.
    pub shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl Tasks {
    /// A new tracker under `shutdown`.
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            shutdown,
            tracker: TaskTracker::new(),
        }
    }

    /// Runs `task` on the tracker.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }

    /// No task is expected after this but those tasks already running spawn; `wait` then
    /// returns once all have ended.
    pub fn close(&self) {
        self.tracker.close();
    }

    /// Until every task has ended (after [`Tasks::close`]).
    pub async fn wait(&self) {
        self.tracker.wait().await;
    }
}
