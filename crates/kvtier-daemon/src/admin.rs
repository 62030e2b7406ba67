//! `kvtier.v1.Admin`: attach, detach and swap the storage tier while the daemon runs, show
//! the configuration it runs with, clear or flush a tier, and drain before a stop.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvtier_config::daemon::DaemonConfig;
use kvtier_proto::ApiError;
use kvtier_proto::v1;
use kvtier_proto::v1::admin_server::Admin;
use kvtier_proto::v1::host_tier_server::HostTierServer;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::l3::{L3Slot, wire_stats};
use crate::service::HostService;
use crate::state::DrainReport;
use crate::state::Shared;

/// `[l3]` keys an attach may not change: each pool's admission filter is made with it.
const START_ONLY: [&str; 2] = ["admission", "admission_window"];

/// How often a flush or drain looks at its progress.
const POLL: Duration = Duration::from_millis(20);
/// The longest a flush may be asked to wait.
const MAX_FLUSH_WAIT_MS: u32 = 3_600_000;

/// The admin service.
#[derive(Clone)]
pub struct AdminService {
    l3: Arc<L3Slot>,
    state: Arc<Shared>,
    health: HealthReporter,
    /// The configuration as it runs now (attach applies overrides on top of it).
    running: Arc<Mutex<DaemonConfig>>,
    /// The configuration kvtierd started with: the paths it names are the operator's.
    started: Arc<DaemonConfig>,
}

impl std::fmt::Debug for AdminService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminService").finish_non_exhaustive()
    }
}

/// Ends a flush when its call ends, however it ends (a client that hangs up included).
struct FlushGuard<'a>(&'a Shared);

impl Drop for FlushGuard<'_> {
    fn drop(&mut self) {
        self.0.lock().end_flush();
    }
}

impl AdminService {
    /// Administers `l3` and the L2 `state`, starting from configuration `cfg`; a drain
    /// flips the host tier's status in `health`.
    pub fn new(
        l3: Arc<L3Slot>,
        state: Arc<Shared>,
        health: HealthReporter,
        cfg: DaemonConfig,
    ) -> Self {
        Self {
            l3,
            state,
            health,
            started: Arc::new(cfg.clone()),
            running: Arc::new(Mutex::new(cfg)),
        }
    }

    /// Reports the host tier and the server as a whole (service ""), which readiness
    /// probes ask, as serving or not.
    async fn set_health(&self, status: ServingStatus) {
        self.health.set_service_status("", status).await;
        self.health
            .set_service_status(
                <HostTierServer<HostService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
    }

    /// Pages queued for or being written to L3.
    fn queued(&self) -> u64 {
        self.l3
            .current()
            .map_or(0, |l3| l3.counters.queued.load(Ordering::Relaxed))
    }

    fn drain_status(&self) -> v1::DrainResponse {
        let r = self.state.lock().drain_report();
        drain_response(&r, self.queued())
    }

    async fn clear_l3(&self) -> Result<v1::ClearResponse, Status> {
        let Some(l3) = self.l3.current() else {
            return Err(ApiError::FailedPrecondition("no L3 tier is attached".into()).into());
        };
        let removed =
            l3.store.store().clear().await.map_err(|e| {
                Status::from(ApiError::FailedPrecondition(format!("clearing L3: {e}")))
            })?;
        // After the objects are gone: whatever landed or was found before no longer counts.
        let rewrite = self.state.lock().forget_l3();
        tracing::warn!(
            backend = l3.store.store().kind(),
            removed,
            rewrite,
            "l3 cleared by admin request"
        );
        Ok(v1::ClearResponse {
            removed,
            rewrite,
            ..v1::ClearResponse::default()
        })
    }

    fn clear_l2(&self, dry_run: bool) -> v1::ClearResponse {
        // SGLang's objects are kvtierd's own L2 pages: cleared with the others.
        let c = self.state.lock().clear_l2(dry_run);
        if !dry_run {
            tracing::warn!(
                pages = c.pages,
                unwritten = c.unwritten,
                kept = c.kept,
                "l2 cleared by admin request"
            );
        }
        v1::ClearResponse {
            removed: c.pages,
            unwritten: c.unwritten,
            kept: c.kept,
            rewrite: 0,
        }
    }

    fn status(&self) -> v1::BackendStatusResponse {
        match self.l3.current() {
            Some(l3) => v1::BackendStatusResponse {
                attached: true,
                breaker_open: l3.breaker_open(),
                stats: Some(wire_stats(&l3, self.l3.write_policy())),
            },
            None => v1::BackendStatusResponse::default(),
        }
    }

    fn running(&self) -> DaemonConfig {
        self.running.lock().clone()
    }

    fn set_running(&self, cfg: DaemonConfig) {
        *self.running.lock() = cfg;
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn backend_status(
        &self,
        _request: Request<v1::BackendStatusRequest>,
    ) -> Result<Response<v1::BackendStatusResponse>, Status> {
        Ok(Response::new(self.status()))
    }

    async fn attach_backend(
        &self,
        request: Request<v1::AttachBackendRequest>,
    ) -> Result<Response<v1::BackendStatusResponse>, Status> {
        let mut sets = Vec::new();
        for (i, s) in request.get_ref().settings.iter().enumerate() {
            if !s.contains('=') {
                return Err(ApiError::invalid(
                    format!("settings[{i}]"),
                    format!("{s:?} is not KEY=VALUE"),
                )
                .into());
            }
            // Each pool's admission filter is made with the pool: what an attach said of it
            // would be shown and not done.
            let key = s.split('=').next().unwrap_or_default().trim();
            if START_ONLY.contains(&key) {
                return Err(ApiError::invalid(
                    format!("settings[{i}]"),
                    format!("l3.{key} is read at start only; restart kvtierd to change it"),
                )
                .into());
            }
            sets.push(format!("l3.{s}"));
        }
        let running = self.running();
        let cfg = running
            .with_overrides(&sets)
            .map_err(|e| Status::from(ApiError::invalid("settings", e.to_string())))?;
        check_attach_path(&self.started, &running, &cfg)?;
        self.l3.attach(&cfg).await.map_err(|e| {
            Status::from(ApiError::FailedPrecondition(format!(
                "opening the {} backend: {e}",
                cfg.l3.backend
            )))
        })?;
        tracing::info!(backend = %cfg.l3.backend, "storage tier changed by admin request");
        self.set_running(cfg);
        Ok(Response::new(self.status()))
    }

    async fn running_config(
        &self,
        _request: Request<v1::RunningConfigRequest>,
    ) -> Result<Response<v1::RunningConfigResponse>, Status> {
        let toml = self
            .running()
            .to_redacted_toml()
            .map_err(|e| Status::from(ApiError::Internal(e.to_string())))?;
        Ok(Response::new(v1::RunningConfigResponse { toml }))
    }

    async fn clear(
        &self,
        request: Request<v1::ClearRequest>,
    ) -> Result<Response<v1::ClearResponse>, Status> {
        let r = request.get_ref();
        let tier = v1::Tier::try_from(r.tier).unwrap_or(v1::Tier::Unspecified);
        let out = match (tier, r.dry_run) {
            (v1::Tier::Host, dry_run) => self.clear_l2(dry_run),
            (v1::Tier::Storage, false) => self.clear_l3().await?,
            (v1::Tier::Storage, true) => {
                return Err(ApiError::invalid(
                    "dry_run",
                    "a dry run counts L2 only (L3 backends are not enumerated to count them)",
                )
                .into());
            }
            (v1::Tier::Unspecified | v1::Tier::Device, _) => {
                return Err(ApiError::invalid(
                    "tier",
                    format!(
                        "{} is not a tier kvtierd holds; choose TIER_HOST (L2) or \
                         TIER_STORAGE (L3)",
                        r.tier
                    ),
                )
                .into());
            }
        };
        Ok(Response::new(out))
    }

    async fn flush(
        &self,
        request: Request<v1::FlushRequest>,
    ) -> Result<Response<v1::FlushResponse>, Status> {
        let wait_ms = request.get_ref().wait_ms;
        if !(1..=MAX_FLUSH_WAIT_MS).contains(&wait_ms) {
            return Err(ApiError::invalid(
                "wait_ms",
                format!("{wait_ms} is out of range 1..={MAX_FLUSH_WAIT_MS}"),
            )
            .into());
        }
        let Some(l3) = self.l3.current() else {
            return Err(ApiError::FailedPrecondition(
                "no L3 tier is attached: nothing to flush to".into(),
            )
            .into());
        };
        let deadline = Instant::now() + Duration::from_millis(u64::from(wait_ms));
        let mut wait = self.state.lock().begin_flush();
        let _guard = FlushGuard(&self.state);
        let pages = wait.left();
        let mut left = pages;
        while left > 0 && Instant::now() < deadline {
            tokio::time::sleep(POLL).await;
            left = self.state.lock().flush_left(&mut wait);
        }
        let reason = if left == 0 {
            String::new()
        } else if l3.breaker_open() {
            format!("l3 is down (circuit breaker open): {left} pages are not written")
        } else {
            format!("{left} pages were not written within {wait_ms} ms")
        };
        Ok(Response::new(v1::FlushResponse {
            done: left == 0,
            pages,
            left,
            reason,
        }))
    }

    async fn drain(
        &self,
        request: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        let action = request.get_ref().action;
        match v1::DrainAction::try_from(action).unwrap_or(v1::DrainAction::Unspecified) {
            v1::DrainAction::Start => {
                let was = {
                    let mut st = self.state.lock();
                    let was = st.draining();
                    st.set_draining(true);
                    was
                };
                if !was {
                    self.set_health(ServingStatus::NotServing).await;
                    tracing::warn!(
                        "draining by admin request: no new sessions, writes or prefetches"
                    );
                }
            }
            v1::DrainAction::Cancel => {
                self.state.lock().set_draining(false);
                self.set_health(ServingStatus::Serving).await;
                tracing::info!("drain cancelled by admin request: admitting again");
            }
            v1::DrainAction::Status => {}
            v1::DrainAction::Unspecified => {
                return Err(ApiError::invalid(
                    "action",
                    format!(
                        "{action} is not a drain action; choose DRAIN_ACTION_START, \
                         DRAIN_ACTION_STATUS or DRAIN_ACTION_CANCEL"
                    ),
                )
                .into());
            }
        }
        Ok(Response::new(self.drain_status()))
    }

    async fn detach_backend(
        &self,
        _request: Request<v1::DetachBackendRequest>,
    ) -> Result<Response<v1::BackendStatusResponse>, Status> {
        self.l3.detach().await;
        if let Ok(cfg) = self.running().with_overrides(&["l3.backend=none".into()]) {
            self.set_running(cfg);
        }
        Ok(Response::new(self.status()))
    }
}

/// The wire view of a drain: whether stopping now is safe, and if not, what waiting is for.
fn drain_response(r: &DrainReport, queued: u64) -> v1::DrainResponse {
    let (safe, reason) = if !r.draining {
        (
            false,
            "not draining: clients may still store pages".to_string(),
        )
    } else if r.writing > 0 {
        (
            false,
            format!("{} pages are being written by clients", r.writing),
        )
    } else if queued > 0 {
        (false, format!("{queued} pages are being written to L3"))
    } else if !r.l3_attached {
        let note = if r.unwritten > 0 {
            format!(
                "no L3 is attached: the {} pages in L2 go with the daemon",
                r.unwritten
            )
        } else {
            String::new()
        };
        (true, note)
    } else if r.unwritten > 0 && r.l3_down {
        (
            false,
            format!(
                "l3 is down (circuit breaker open): {} pages L3 lacks would be lost",
                r.unwritten
            ),
        )
    } else if r.unwritten > 0 {
        (
            false,
            format!("{} pages are still to be written to L3", r.unwritten),
        )
    } else {
        (true, String::new())
    };
    v1::DrainResponse {
        draining: r.draining,
        safe_to_stop: safe,
        unwritten_pages: r.unwritten,
        queued_writes: queued,
        writing_pages: r.writing,
        sessions: r.sessions,
        reason,
    }
}

/// Refuses an attach whose file or rocksdb directory lies outside `[server.admin]
/// attach_root` (`data_dir` when empty), unless kvtierd's own configuration (at start or
/// now) names that directory: an attach must not point the storage tier, its temp-file
/// cleanup and its clears at a directory of the caller's choosing.
fn check_attach_path(
    started: &DaemonConfig,
    running: &DaemonConfig,
    cfg: &DaemonConfig,
) -> Result<(), ApiError> {
    let backend = cfg.l3.backend;
    let (Some(key), Some(path)) = (backend.directory_key(), cfg.l3_directory(backend)) else {
        return Ok(());
    };
    if Some(&path) == started.l3_directory(backend).as_ref()
        || Some(&path) == running.l3_directory(backend).as_ref()
    {
        return Ok(());
    }
    let root =
        (started.server.admin.attach_root.clone()).unwrap_or_else(|| started.data_dir.clone());
    let inside = match (resolved(&root), resolved(&path)) {
        (Some(r), Some(p)) => p.starts_with(&r) && p != r,
        _ => false,
    };
    if inside {
        return Ok(());
    }
    Err(ApiError::invalid(
        key,
        format!(
            "{} is outside {} (server.admin.attach_root, or data_dir when that is unset): an \
             attached backend lives under it, or where kvtierd's own configuration says",
            path.display(),
            root.display()
        ),
    ))
}

/// `path` with its longest existing ancestor resolved (symlinks followed, `..` gone) and the
/// rest appended; `None` when the rest climbs with `..`.
fn resolved(path: &std::path::Path) -> Option<std::path::PathBuf> {
    let mut rest = Vec::new();
    let mut at = path;
    loop {
        if let Ok(mut real) = at.canonicalize() {
            real.extend(rest.iter().rev());
            return Some(real);
        }
        rest.push(at.file_name()?.to_owned());
        at = match at.parent()? {
            p if p.as_os_str().is_empty() => std::path::Path::new("."),
            p => p,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attached_paths_stay_under_the_root_whatever_their_spelling() {
        let dir = std::env::temp_dir().join(format!("kvtier-attach-{}", std::process::id()));
        let data = dir.join("data");
        std::fs::create_dir_all(&data).unwrap();
        std::os::unix::fs::symlink("/etc", data.join("link")).unwrap();
        let mut started = DaemonConfig {
            data_dir: data.clone(),
            ..DaemonConfig::default()
        };
        started.l3.file.path = Some("/srv/configured-l3".into());
        let attach = |backend: &str, path: &str| {
            let sets = [
                format!("l3.backend={backend}"),
                format!("l3.{backend}.path={path}"),
            ];
            let cfg = started.with_overrides(&sets).unwrap();
            check_attach_path(&started, &started, &cfg)
        };
        let d = data.display();
        assert!(attach("file", &format!("{d}/l3b")).is_ok());
        assert!(attach("rocksdb", &format!("{d}/new/db")).is_ok());
        assert!(
            attach("file", "/srv/configured-l3").is_ok(),
            "the operator's own path"
        );
        for bad in [
            format!("{}/elsewhere", dir.display()),
            format!("{d}/../elsewhere"),
            format!("{d}/link/kvtier"),
            format!("{d}"),
            "/etc".to_string(),
        ] {
            let e = attach("file", &bad).unwrap_err().to_string();
            assert!(
                e.contains("file.path") && e.contains("attach_root"),
                "{bad}: {e}"
            );
        }
        let e = attach("rocksdb", "/var/lib/x").unwrap_err().to_string();
        assert!(e.contains("rocksdb.path"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn report(unwritten: u64, writing: u64, l3_attached: bool, l3_down: bool) -> DrainReport {
        DrainReport {
            draining: true,
            unwritten,
            writing,
            sessions: 2,
            l3_attached,
            l3_down,
        }
    }

    #[test]
    fn a_stop_is_safe_only_once_nothing_waiting_would_save_is_left() {
        let not = DrainReport::default();
        assert!(!drain_response(&not, 0).safe_to_stop);
        let cases = [
            (report(0, 0, true, false), 0, true, ""),
            (
                report(0, 3, true, false),
                0,
                false,
                "3 pages are being written by clients",
            ),
            (
                report(0, 0, true, false),
                5,
                false,
                "5 pages are being written to L3",
            ),
            (
                report(7, 0, true, false),
                0,
                false,
                "7 pages are still to be written",
            ),
            (report(7, 0, true, true), 0, false, "l3 is down"),
            (
                report(7, 0, false, false),
                0,
                true,
                "the 7 pages in L2 go with the daemon",
            ),
        ];
        for (r, queued, safe, why) in cases {
            let w = drain_response(&r, queued);
            assert_eq!(w.safe_to_stop, safe, "{r:?} queued {queued}: {}", w.reason);
            assert!(
                w.reason.contains(why),
                "{r:?}: {:?} lacks {why:?}",
                w.reason
            );
            assert_eq!(w.reason.is_empty(), why.is_empty(), "{r:?}");
        }
    }
}
