//! The Prometheus text endpoint both kvtierd and kvtier-agent serve: `GET /metrics` answers
//! what `render` returns (rendered per scrape, so gauges are fresh), anything else is 404.
//! With a token ([`Auth`]), a request without `Authorization: Bearer <token>` gets 401
//! and is counted in `kvtier_metrics_unauthorized_total`.
//! One task per connection, each under the listener's [`Cap`] (per IP address and in all,
//! with the handshake deadline for its first bytes, and the same deadline for each request's
//! headers); stops accepting when `stop` is cancelled.

use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::conn::Cap;

/// Renders the metrics page.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Who may scrape: everyone who reaches the listener, or (with a token) those who present it.
#[derive(Clone)]
pub struct Auth {
    token: Option<Arc<str>>,
    refused: prometheus::IntCounter,
}

impl Auth {
    /// Scrapes must present `token` when given; declares
    /// `kvtier_metrics_unauthorized_total` in `metrics`.
    pub fn new(
        token: Option<String>,
        metrics: &crate::metrics::MetricRegistry,
    ) -> prometheus::Result<Self> {
        Ok(Self {
            token: token.map(Arc::from),
            refused: metrics.counter(
                "kvtier_metrics_unauthorized_total",
                "scrapes of the metrics endpoint refused (401) for want of metrics.token",
            )?,
        })
    }

    /// Whether `req` may have the page.
    fn admits<B>(&self, req: &Request<B>) -> bool {
        let Some(want) = &self.token else {
            return true;
        };
        let got = crate::guard::bearer(req.headers());
        let ok = got
            .is_some_and(|g| kvtier_config::tls::constant_time_eq(g.as_bytes(), want.as_bytes()));
        if !ok {
            self.refused.inc();
        }
        ok
    }
}

/// Serves `GET /metrics` on `listener` until `stop`, every connection under `cap`, to the
/// scrapes `auth` admits.
pub async fn serve(
    listener: TcpListener,
    render: Render,
    stop: CancellationToken,
    cap: Cap,
    auth: Auth,
) {
    let mut backoff = std::time::Duration::ZERO;
    loop {
        let (stream, addr) = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors, the listener stays readable: wait, never spin.
                    cap.accept_failed(&e, &mut backoff).await;
                    continue;
                }
            },
        };
        backoff = std::time::Duration::ZERO;
        let Some(permit) = cap.admit(crate::conn::ip_key(&addr)) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let stream = cap.limit(stream, permit);
        let headers_within = cap.handshake_timeout();
        let (render, auth) = (render.clone(), auth.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let page = req.uri().path() == "/metrics";
                let allowed = page && auth.admits(&req);
                let body = allowed.then(|| render());
                async move {
                    match body {
                        Some(text) => Response::builder()
                            .header("content-type", "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(text))),
                        None if page => Response::builder()
                            .status(StatusCode::UNAUTHORIZED)
                            .header("www-authenticate", "Bearer")
                            .body(Full::new(Bytes::from_static(b"metrics.token required\n"))),
                        None => Response::builder()
                            .status(StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"try /metrics\n"))),
                    }
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(headers_within)
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!("metrics connection: {e}");
            }
        });
    }
}

/// The address a listener is bound to, for logs and ready lines.
pub fn local(listener: &TcpListener) -> Option<SocketAddr> {
    listener.local_addr().ok()
}

/// Binds the metrics listener for the config key `metrics.listen` (`None` when it is unset).
pub async fn bind(listen: Option<&str>) -> std::io::Result<Option<TcpListener>> {
    match listen {
        None => Ok(None),
        Some(a) => TcpListener::bind(a).await.map(Some),
    }
}
