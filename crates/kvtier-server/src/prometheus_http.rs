//! The Prometheus text endpoint both kvtierd and kvtier-agent serve: `GET /metrics` answers
//! what `render` returns (rendered per scrape, so gauges are fresh), anything else is 404.
//! One task per connection; stops accepting when `stop` is cancelled.

use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Renders the metrics page.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves `GET /metrics` on `listener` until `stop`.
pub async fn serve(listener: TcpListener, render: Render, stop: CancellationToken) {
    let log = crate::conn::Throttle::new(crate::conn::LOG_EVERY);
    let mut backoff = std::time::Duration::ZERO;
    loop {
        let (stream, _) = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    if let Some(more) = log.allow() {
                        tracing::warn!(suppressed = more, "metrics accept failed: {e}");
                    }
                    // Out of descriptors, the listener stays readable: wait, never spin.
                    if crate::conn::is_exhaustion(&e) {
                        backoff = (backoff * 2).clamp(
                            std::time::Duration::from_millis(10),
                            std::time::Duration::from_secs(1),
                        );
                        tokio::time::sleep(backoff).await;
                    }
                    continue;
                }
            },
        };
        backoff = std::time::Duration::ZERO;
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
