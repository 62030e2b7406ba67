//! `kvtier.v1.Admin`: attach, detach and swap the storage tier while the daemon runs, and show
//! the configuration it runs with.

use std::sync::{Arc, Mutex};

use kvtier_config::daemon::DaemonConfig;
use kvtier_proto::ApiError;
use kvtier_proto::v1;
use kvtier_proto::v1::admin_server::Admin;
use tonic::{Request, Response, Status};

use crate::l3::{L3Slot, wire_stats};

/// The admin service.
#[derive(Debug, Clone)]
pub struct AdminService {
    l3: Arc<L3Slot>,
    /// The configuration as it runs now (attach applies overrides on top of it).
    running: Arc<Mutex<DaemonConfig>>,
}

impl AdminService {
    /// Administers `l3`, starting from configuration `cfg`.
    pub fn new(l3: Arc<L3Slot>, cfg: DaemonConfig) -> Self {
        Self {
            l3,
            running: Arc::new(Mutex::new(cfg)),
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
        match self.running.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set_running(&self, cfg: DaemonConfig) {
        match self.running.lock() {
            Ok(mut g) => *g = cfg,
            Err(p) => *p.into_inner() = cfg,
        }
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
            sets.push(format!("l3.{s}"));
        }
        let cfg = self
            .running()
            .with_overrides(&sets)
            .map_err(|e| Status::from(ApiError::invalid("settings", e.to_string())))?;
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

/// Checks `authorization: Bearer <token>` on admin calls over TCP.
pub fn require_token(token: String) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let ok = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes()));
        if ok {
            Ok(req)
        } else {
            Err(Status::unauthenticated(
                "admin calls over TCP need the server.admin_token",
            ))
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
