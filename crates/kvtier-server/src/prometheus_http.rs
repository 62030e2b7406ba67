//! The Prometheus text endpoint both kvtierd and kvtier-agent serve: `GET /metrics` answers
//! what `render` returns (rendered per scrape, so gauges are fresh), anything else is 404.
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

/// Serves `GET /metrics` on `listener` until `stop`, every connection under `cap`.
pub async fn serve(listener: TcpListener, render: Render, stop: CancellationToken, cap: Cap) {
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
        let render = render.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let body = (req.uri().path() == "/metrics").then(|| render());
                async move {
                    match body {
                        Some(text) => Response::builder()
                            .header("content-type", "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(text))),
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
