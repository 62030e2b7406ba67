//! The transport floor of a kvtier RPC: a gRPC server with kvtier's HTTP/2 settings on a Unix
//! socket whose one method does nothing but answer. A call sends a request of a given length
//! and gets a reply of a given length (the request's first 4 bytes name it), so a bench can
//! send exactly the bytes a real call sends and receive exactly the bytes it receives,
//! through the same h2 and tonic framing, without any of the handler's work. Bytes pass
//! through [`kvtier_client::raw::RawCodec`] undecoded (a kvtier handler's decode of a
//! `bytes` field is one copy). The next 4 bytes, when not zero, ask for the one piece of work
//! a server that is handed a prompt cannot skip: the page keys of the rest of the request
//! (packed tokens, that many to a page), computed in the handler before it answers.

use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use kvtier_client::raw::RawCodec;
use tonic::codegen::http;

/// The method's path.
const PATH: &str = "/kvtier.bench.Sink/Answer";
/// The longest reply it gives.
const MAX_REPLY: usize = 1 << 20;

/// One call: any request; replies with as many bytes as its first 4 (little-endian) say.
struct Answer(Bytes);

impl tonic::server::UnaryService<Bytes> for Answer {
    type Response = Bytes;
    type Future = std::future::Ready<Result<tonic::Response<Bytes>, tonic::Status>>;

    fn call(&mut self, req: tonic::Request<Bytes>) -> Self::Future {
        let body = req.into_inner();
        let word = |at: usize| {
            body.get(at..at + 4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        let (want, page_size) = (word(0), word(4));
        if page_size > 0
            && let Ok(hasher) = kvtier_core::PageHasher::new(page_size, &Default::default())
        {
            let mut keys = Vec::new();
            hasher.extend_ids(None, kvtier_core::TokenIds::Le(&body[8..]), &mut keys);
            std::hint::black_box(keys);
        }
        std::future::ready(Ok(tonic::Response::new(
            self.0.slice(..want.min(MAX_REPLY)),
        )))
    }
}

/// The service, as tonic's generated servers are: every call to [`PATH`] is answered.
#[derive(Clone)]
struct SinkService(Bytes);

impl tonic::server::NamedService for SinkService {
    const NAME: &'static str = "kvtier.bench.Sink";
}

impl<B> tower::Service<http::Request<B>> for SinkService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let zeros = self.0.clone();
        Box::pin(async move {
            if req.uri().path() != PATH {
                return Ok(tonic::Status::unimplemented(req.uri().path().to_string()).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(RawCodec);
            Ok(grpc.unary(Answer(zeros), req).await)
        })
    }
}

/// A sink server on its own runtime of `workers` threads (as [`crate::InProcessDaemon`]
/// runs kvtierd), on a fresh Unix socket; stopped by [`Sink::stop`].
pub struct Sink {
    /// Its socket.
    pub socket: PathBuf,
    stop: tokio_util::sync::CancellationToken,
    thread: std::thread::JoinHandle<()>,
}

impl Sink {
    /// Starts it and waits until it listens.
    pub fn start(name: &str, workers: usize) -> Self {
        let socket = std::env::temp_dir().join(format!(
            "kvtier-bench-sink-{name}-{}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&socket);
        let path = socket.clone();
        let (_, stop, thread) =
            crate::on_own_runtime("sink", workers, move |stop, tx| async move {
                let listener = tokio::net::UnixListener::bind(&path)?;
                let _ = tx.send(());
                let zeros = Bytes::from(vec![0u8; MAX_REPLY]);
                kvtier_server::serving::grpc_server()
                    .add_service(SinkService(zeros))
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::UnixListenerStream::new(listener),
                        stop.cancelled_owned(),
                    )
                    .await
                    .map_err(std::io::Error::other)
            });
        Self {
            socket,
            stop,
            thread,
        }
    }

    /// Stops it and removes its socket.
    pub fn stop(self) {
        self.stop.cancel();
        let _ = self.thread.join();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A client of a [`Sink`].
#[derive(Clone)]
pub struct SinkClient(tonic::transport::Channel);

impl SinkClient {
    /// Connects as kvtier's clients do (`kvtier_client::connect`).
    pub async fn connect(sink: &Sink) -> Self {
        let target = sink.socket.display().to_string();
        Self(
            kvtier_client::connect(&target)
                .await
                .unwrap_or_else(|e| panic!("connecting to the sink at {target}: {e}")),
        )
    }

    /// One call sending `request` bytes (at least 8) and receiving `reply` bytes.
    pub async fn call(&mut self, request: usize, reply: usize) {
        self.call_keying(request, reply, 0).await;
    }

    /// [`SinkClient::call`], the server also computing the page keys (`page_size` tokens to
    /// a page, SHA-256 chained) of the request's bytes after its 8-byte header.
    pub async fn call_keying(&mut self, request: usize, reply: usize, page_size: usize) {
        // Written bytes, as a real request's are: zeros fresh from the allocator can be
        // untouched pages that all read as the kernel's one cache-hot zero page.
        let mut body = vec![0xA5u8; request.max(8)];
        body[..4].copy_from_slice(&(reply as u32).to_le_bytes());
        body[4..8].copy_from_slice(&(page_size as u32).to_le_bytes());
        let got = kvtier_client::raw::call(
            self.0.clone(),
            PATH,
            kvtier_client::raw::Shape::Unary,
            vec![Bytes::from(body)],
            1,
        )
        .await
        .unwrap_or_else(|e| panic!("the sink's call failed: {e}"));
        assert_eq!(
            got.iter().map(Bytes::len).sum::<usize>(),
            reply.min(MAX_REPLY)
        );
    }
}
