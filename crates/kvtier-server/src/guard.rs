//! The layer on every gRPC server kvtierd and kvtier-agent run: it finds each call's method
//! in [`crate::doors::DOORS`], asks the server who the caller is, and lets the call through
//! only when the method has a row and the row admits the caller's role. So a service is
//! guarded by the same table whatever listener it is served on, and a method added to a proto
//! without a row is refused until one is written.
//!
//! Refusals: a caller without a token the server knows (over TCP, where one is needed) gets
//! `UNAUTHENTICATED` for every method but those its row opens to anyone (health), so it
//! learns not even which methods exist; counted in `kvtier_server_denied_calls_total`; a known caller whose role
//! the row does not admit gets `PERMISSION_DENIED` naming what would admit it, counted in
//! `kvtier_server_forbidden_calls_total{service}`; a method with no row gets `UNIMPLEMENTED`.
//! Each kind is logged at most every [`crate::conn::LOG_EVERY`].

use std::sync::Arc;

use tonic::codegen::http::{HeaderMap, Request, Response};

use crate::conn::{LOG_EVERY, Throttle};
use crate::doors::{self, Kind, Listener, Server, Who};
use crate::metrics::MetricRegistry;

/// How a server tells who a caller is, from what the connection and the call carry (the
/// connection's peer credentials are in the extensions; the bearer token in the headers).
pub type Resolve = Arc<dyn Fn(&tonic::codegen::http::Extensions, &HeaderMap) -> Who + Send + Sync>;

/// The refusal counters, declared once per process.
#[derive(Clone, Debug)]
pub struct GuardMetrics {
    forbidden: prometheus::IntCounterVec,
    denied: prometheus::IntCounter,
}

impl GuardMetrics {
    /// Declares the counters in `metrics`, with a series for each service `server` serves.
    pub fn new(metrics: &MetricRegistry, server: Server) -> prometheus::Result<Self> {
        let forbidden = metrics.counter_vec(
            "kvtier_server_forbidden_calls_total",
            "calls refused with PERMISSION_DENIED because the caller's role (operator, peer, tenant, default tenant) may not use the method (its row in the doors table)",
            &["service"],
        )?;
        for d in doors::DOORS
            .iter()
            .filter(|d| d.server == server && d.kind != Kind::Listener)
        {
            forbidden.with_label_values(&[&d.service_label()]);
        }
        let denied = metrics.counter(
            "kvtier_server_denied_calls_total",
            "calls over TCP refused for a missing or wrong bearer token",
        )?;
        Ok(Self { forbidden, denied })
    }
}

/// The layer; see the module docs.
#[derive(Clone)]
pub struct Guard {
    listener: Listener,
    resolve: Resolve,
    one_trust_domain: bool,
    metrics: GuardMetrics,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("listener", &self.listener)
            .field("one_trust_domain", &self.one_trust_domain)
            .finish()
    }
}

impl Guard {
    /// Guards the methods served on `listener`, resolving callers with `resolve`;
    /// `one_trust_domain` is whether the server names no tenants and no peer token (see
    /// [`doors::DefaultTenant::InOneTrustDomain`]).
    pub fn new(
        listener: Listener,
        resolve: Resolve,
        one_trust_domain: bool,
        metrics: &GuardMetrics,
    ) -> Self {
        Self {
            listener,
            resolve,
            one_trust_domain,
            metrics: metrics.clone(),
        }
    }

    /// `Ok` when the call may go on; else the status to answer with.
    fn check<B>(&self, req: &Request<B>) -> Result<(), tonic::Status> {
        static UNKNOWN: Throttle = Throttle::new(LOG_EVERY);
        static DENIED: Throttle = Throttle::new(LOG_EVERY);
        static FORBIDDEN: Throttle = Throttle::new(LOG_EVERY);
        let path = req.uri().path();
        let who = (self.resolve)(req.extensions(), req.headers());
        let door = doors::method_on(self.listener, path);
        // A caller without a token learns nothing, not even which methods exist.
        if who == Who::Unauthenticated
            && !door.is_some_and(|d| d.admits.admits(who, self.one_trust_domain))
        {
            self.metrics.denied.inc();
            if let Some(more) = DENIED.allow() {
                tracing::warn!(
                    path,
                    suppressed = more,
                    "refused a TCP call without a valid token"
                );
            }
            return Err(tonic::Status::unauthenticated(
                "calls over TCP need \"authorization: Bearer <server.token>\"",
            ));
        }
        let Some(door) = door else {
            if let Some(more) = UNKNOWN.allow() {
                tracing::warn!(
                    path,
                    suppressed = more,
                    "refused a call to a method with no row in the doors table"
                );
            }
            return Err(tonic::Status::unimplemented(format!(
                "{} serves no method {path} on {}",
                self.listener.key().0.name(),
                self.listener.name()
            )));
        };
        if door.admits.admits(who, self.one_trust_domain) {
            return Ok(());
        }
        self.metrics
            .forbidden
            .with_label_values(&[&door.service_label()])
            .inc();
        if let Some(more) = FORBIDDEN.allow() {
            tracing::warn!(
                path,
                role = who.describe(),
                suppressed = more,
                "refused a call: its role may not use this method"
            );
        }
        Err(tonic::Status::permission_denied(format!(
            "this caller is {}, and {path} is not for it: {}",
            who.describe(),
            door.admits.how()
        )))
    }
}

impl<S> tower::Layer<S> for Guard {
    type Service = Guarded<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Guarded {
            inner,
            guard: self.clone(),
        }
    }
}

/// A server's routes behind a [`Guard`].
#[derive(Clone, Debug)]
pub struct Guarded<S> {
    inner: S,
    guard: Guard,
}

impl<S, B> tower::Service<Request<B>> for Guarded<S>
where
    S: tower::Service<Request<B>, Response = Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        match self.guard.check(&req) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => Box::pin(std::future::ready(Ok(status.into_http()))),
        }
    }
}

/// The bearer token a call or scrape presents (`authorization: Bearer <token>`; the scheme
/// in any case, RFC 9110).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get("authorization")?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// The uid of a call's Unix-socket peer, when it came on one.
pub fn unix_uid(ext: &tonic::codegen::http::Extensions) -> Option<(u32, u32)> {
    ext.get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map(|c| (c.uid(), c.gid()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(who: Who, one: bool) -> Guard {
        let m = GuardMetrics::new(&MetricRegistry::new(), Server::Kvtierd).unwrap();
        Guard::new(Listener::ControlTcp, Arc::new(move |_, _| who), one, &m)
    }

    fn call(g: &Guard, path: &str) -> Option<tonic::Code> {
        let req = Request::builder().uri(path).body(()).unwrap();
        g.check(&req).err().map(|s| s.code())
    }

    #[test]
    fn each_role_meets_its_row() {
        use tonic::Code;
        let drain = "/kvtier.v1.Admin/Drain";
        let get = "/kvtier.v1.ObjectStorage/Exists";
        let health = "/grpc.health.v1.Health/Check";
        assert_eq!(call(&guard(Who::Operator, false), drain), None);
        assert_eq!(
            call(&guard(Who::Tenant, false), drain),
            Some(Code::PermissionDenied)
        );
        assert_eq!(call(&guard(Who::Peer, false), get), None);
        assert_eq!(
            call(&guard(Who::DefaultTenant, false), get),
            Some(Code::PermissionDenied)
        );
        assert_eq!(call(&guard(Who::DefaultTenant, true), get), None);
        assert_eq!(
            call(&guard(Who::Unauthenticated, false), get),
            Some(Code::Unauthenticated)
        );
        assert_eq!(call(&guard(Who::Unauthenticated, false), health), None);
        // Without a token, not even which methods exist.
        assert_eq!(
            call(
                &guard(Who::Unauthenticated, false),
                "/kvtier.v1.Admin/Format"
            ),
            Some(Code::Unauthenticated)
        );
        // A method with no row is refused to everyone, the operator too.
        assert_eq!(
            call(&guard(Who::Operator, true), "/kvtier.v1.Admin/Format"),
            Some(Code::Unimplemented)
        );
        assert_eq!(
            call(&guard(Who::Operator, true), "/kvtier.v1.Agent/Save"),
            Some(Code::Unimplemented)
        );
        let m = GuardMetrics::new(&MetricRegistry::new(), Server::Kvtierd).unwrap();
        let sglang = Guard::new(
            Listener::SglangGrpc,
            Arc::new(|_, _| Who::Operator),
            true,
            &m,
        );
        assert_eq!(call(&sglang, drain), Some(Code::Unimplemented));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert("authorization", "bearer abc".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h), None);
    }
}
