//! HostTier's calls for routers (docs/routing.md): `WatchEvents`, the stream of what L2 holds,
//! and `Locate`, how many leading pages of a prompt this node holds per tier. Both answer in
//! the caller's tenant's keys.

use std::time::Instant;

use kvtier_core::{LayoutFingerprint, Namespace, PageHasher, TenantScope, TenantTag};
use kvtier_proto::{ApiError, v1};
use tonic::{Request, Response, Status};

use super::{EncodedEventStream, HostService};

impl HostService {
    /// The tenant whose pages a caller may see (`None`: all of them).
    fn seen_tenant<T>(&self, request: &Request<T>) -> Option<TenantTag> {
        let role = self.roles.of(request);
        self.roles
            .only_tenant(&role)
            .map(|t| TenantScope::new(t).tag())
    }

    pub(super) fn watch_events_call(
        &self,
        request: Request<v1::WatchEventsRequest>,
    ) -> Result<Response<EncodedEventStream>, Status> {
        let tenant = self.seen_tenant(&request);
        let role = self.roles.of(&request);
        self.observe("watch_events", || {
            let slot = self
                .streams
                .open("watch_events", &role, unix_uid(&request))?;
            let r = request.get_ref();
            let stream = super::watch::watch(
                self.state.clone(),
                r.stream_id,
                r.after_seq,
                tenant,
                slot,
                &self.tasks,
            );
            Ok(Box::pin(stream) as EncodedEventStream)
        })
    }

    pub(super) async fn locate_call(
        &self,
        request: Request<v1::LocateRequest>,
    ) -> Result<Response<v1::LocateResponse>, Status> {
        let t = Instant::now();
        let tenant = self.caller_tenant(&request);
        let r = request.into_inner();
        let result = self.locate(&tenant, r).await;
        self.finish("locate", t, result)
    }

    async fn locate(
        &self,
        tenant: &str,
        r: v1::LocateRequest,
    ) -> Result<v1::LocateResponse, ApiError> {
        let fp = LayoutFingerprint::from_hex("layout", &r.layout)?;
        let mut keys = match (r.packed_keys.is_empty(), r.tokens.is_empty()) {
            (false, false) => {
                return Err(ApiError::invalid(
                    "tokens",
                    "give packed_keys or tokens, not both",
                ));
            }
            (false, true) => self.keys(&[], &r.packed_keys)?,
            (true, false) => {
                if r.page_size == 0 {
                    return Err(ApiError::invalid(
                        "page_size",
                        "required with tokens (the layout's tokens per page)",
                    ));
                }
                let pages = r.tokens.len() / r.page_size as usize;
                if pages > self.max_batch {
                    return Err(ApiError::invalid(
                        "tokens",
                        format!("{pages} pages; at most {} a call", self.max_batch),
                    ));
                }
                let ns = Namespace::try_from(r.namespace.unwrap_or_default())?;
                PageHasher::new(r.page_size as usize, &ns)?.keys(&r.tokens)
            }
            (true, true) => Vec::new(),
        };
        if self.tenants.any() {
            TenantScope::new(tenant).apply_all(&mut keys);
        }
        let (l2, in_l2, node) = {
            let st = self.state();
            let (n, mask) = st.locate(&fp, tenant, &keys);
            (n, mask, st.events().node().to_string())
        };
        let mut l3_pages = 0;
        if r.include_storage
            && l2 < keys.len()
            && let Some(l3) = self.l3.current()
        {
            let ctx = kvtier_storage::OpCtx::timeout(l3.timeout);
            match self
                .prefetcher
                .reachable(&l3, &ctx, fp, &keys[l2..], &in_l2[l2..])
                .await
            {
                Ok(m) => l3_pages = m as u32,
                Err(e) => tracing::debug!("l3 locate failed, reporting no storage pages: {e}"),
            }
        }
        Ok(v1::LocateResponse {
            l2_pages: l2 as u32,
            l3_pages,
            node,
        })
    }
}

/// The uid of a call's Unix-socket peer; `None` over TCP.
pub(super) fn unix_uid<T>(request: &Request<T>) -> Option<u32> {
    request
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map(|c| c.uid())
}
