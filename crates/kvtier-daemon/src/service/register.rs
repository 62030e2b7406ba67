//! `Register`: a session's start. The layout is checked against what the client derived
//! from it, the client's page keys against the daemon's own hashing of the same tokens (the
//! hash self-test, docs/hash-spec.md), and its namespace against the caller's tenant.

use std::time::Instant;

use kvtier_core::{Layout, Namespace, PageHasher};
use kvtier_proto::{ApiError, page_keys, v1};

use super::HostService;

/// Most tokens a hash self-test may carry.
const MAX_SELF_TEST_TOKENS: usize = 1 << 16;

impl HostService {
    pub(super) fn register_inner(
        &self,
        req: v1::RegisterRequest,
        tenant: String,
    ) -> Result<v1::RegisterResponse, ApiError> {
        let layout = Layout::try_from(
            req.layout
                .ok_or_else(|| ApiError::invalid("layout", "required"))?,
        )
        .map_err(|e| e.within("layout"))?;
        if req.name.len() > 256 {
            return Err(ApiError::invalid("name", "longer than 256 bytes"));
        }
        let info = v1::LayoutInfo::from(&layout);
        if let Some(exp) = req.expected_layout {
            let checks = [
                ("fingerprint", exp.fingerprint != info.fingerprint),
                ("page_bytes", exp.page_bytes != info.page_bytes),
                ("slot_stride", exp.slot_stride != info.slot_stride),
                ("run_bytes", exp.run_bytes != info.run_bytes),
                ("runs_per_page", exp.runs_per_page != info.runs_per_page),
                ("format_version", exp.format_version != info.format_version),
            ];
            if let Some((field, _)) = checks.iter().find(|(_, differs)| *differs) {
                return Err(ApiError::FailedPrecondition(format!(
                    "layout mismatch: the client derived a different {field} from the same \
                     descriptor (client {exp:?}, daemon {info:?}); upgrade the older side"
                )));
            }
        }
        let ns = check_self_test(&layout, req.hash_self_test)?;
        if self.tenants.any() && !ns.tenant.is_empty() && ns.tenant != tenant {
            return Err(ApiError::PermissionDenied(format!(
                "hash_self_test.namespace.tenant is {:?}, but this caller is tenant {tenant:?} \
                 (by its peer uid or token, [tenants] in kvtierd's config)",
                ns.tenant
            )));
        }
        let name = if req.name.is_empty() {
            "unnamed".to_string()
        } else {
            req.name
        };
        let mut st = self.state();
        let reg = st.register(name.clone(), &tenant, &layout, Instant::now())?;
        let ttl = st.ttl();
        drop(st);
        tracing::info!(session = %reg.session_id, client = %name, tenant = %tenant, fingerprint = %layout.fingerprint(), "session registered");
        Ok(v1::RegisterResponse {
            session_id: reg.session_id.to_bytes().to_vec(),
            ttl_ms: ttl.as_millis() as u64,
            layout: Some(info),
            pool_path: reg.pool_path.display().to_string(),
            pool_slots: reg.slots,
            slot_stride: reg.stride as u64,
            tenant,
            pool_socket: self
                .pool_socket
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        })
    }
}

/// Recomputes the client's self-test keys; refuses a client whose hashing differs.
fn check_self_test(layout: &Layout, t: Option<v1::HashSelfTest>) -> Result<Namespace, ApiError> {
    let t = t.ok_or_else(|| {
        ApiError::invalid(
            "hash_self_test",
            "required: the keys the client computes for a few pages of tokens",
        )
    })?;
    if t.page_size as usize != layout.page_size() {
        return Err(ApiError::invalid(
            "hash_self_test.page_size",
            format!(
                "{} differs from layout.page_size {}",
                t.page_size,
                layout.page_size()
            ),
        ));
    }
    if t.tokens.len() > MAX_SELF_TEST_TOKENS {
        return Err(ApiError::invalid(
            "hash_self_test.tokens",
            format!("more than {MAX_SELF_TEST_TOKENS} tokens"),
        ));
    }
    if t.tokens.len() < layout.page_size() {
        return Err(ApiError::invalid(
            "hash_self_test.tokens",
            "fewer than one full page of tokens",
        ));
    }
    let ns = Namespace::try_from(t.namespace.unwrap_or_default())
        .map_err(|e| e.within("hash_self_test.namespace"))?;
    let theirs = page_keys("hash_self_test.keys", &t.keys)?;
    let ours = PageHasher::new(layout.page_size(), &ns)?.keys(&t.tokens);
    if theirs.len() != ours.len() {
        return Err(ApiError::FailedPrecondition(format!(
            "hash self-test failed: the client sent {} keys for {} tokens of page size {}, the \
             daemon computes {}",
            theirs.len(),
            t.tokens.len(),
            layout.page_size(),
            ours.len()
        )));
    }
    if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
        return Err(ApiError::FailedPrecondition(format!(
            "hash self-test failed at page {i}: client key {} but daemon key {}; the client \
             does not hash pages as docs/hash-spec.md specifies",
            theirs[i].to_hex(),
            ours[i].to_hex()
        )));
    }
    Ok(ns)
}
