//! `kvtier.v1.HostTier` as kvtierd serves it: the generated server, with `WatchEvents`
//! answered in front of it from messages encoded already.
//!
//! The generated server encodes each message a stream sends with prost. An event stream's
//! messages are built from entries encoded once per published batch, for every stream that
//! carries it (`wire::events`), so its call is answered here through a codec that writes
//! them as they are. Every other call goes on to the generated server. Callers see the same
//! service, messages and errors.

use bytes::{Buf, BufMut, Bytes};
use kvtier_proto::v1;
use kvtier_proto::v1::host_tier_server::HostTierServer;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{BoxFuture, Context, Poll, Service, StdError, http};
use tonic::server::NamedService;
use tonic::{Request, Status};

use super::HostService;

/// The call answered here.
const WATCH_EVENTS_PATH: &str = "/kvtier.v1.HostTier/WatchEvents";

/// The HostTier service, with WatchEvents' messages sent as encoded.
#[derive(Clone)]
pub struct HostTierRoutes {
    host: HostService,
    generated: HostTierServer<HostService>,
}

impl HostTierRoutes {
    /// Serves `host`.
    pub fn new(host: HostService) -> Self {
        Self {
            generated: HostTierServer::new(host.clone()),
            host,
        }
    }
}

impl NamedService for HostTierRoutes {
    const NAME: &'static str = <HostTierServer<HostService> as NamedService>::NAME;
}

impl<B> Service<http::Request<B>> for HostTierRoutes
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != WATCH_EVENTS_PATH {
            return self.generated.call(req);
        }
        let host = self.host.clone();
        Box::pin(async move {
            let call = tower::service_fn(move |r: Request<v1::WatchEventsRequest>| {
                let host = host.clone();
                async move { host.watch_events_call(r) }
            });
            Ok(tonic::server::Grpc::new(EncodedEvents)
                .server_streaming(call, req)
                .await)
        })
    }
}

/// WatchEvents' codec: requests decoded by prost, messages sent as they are.
struct EncodedEvents;

impl Codec for EncodedEvents {
    type Encode = Bytes;
    type Decode = v1::WatchEventsRequest;
    type Encoder = AsEncoded;
    type Decoder = WatchRequest;

    fn encoder(&mut self) -> AsEncoded {
        AsEncoded
    }

    fn decoder(&mut self) -> WatchRequest {
        WatchRequest
    }
}

struct AsEncoded;

impl Encoder for AsEncoded {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

struct WatchRequest;

impl Decoder for WatchRequest {
    type Item = v1::WatchEventsRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        // As prost's codec answers a message it cannot parse.
        let r = v1::WatchEventsRequest::decode(src.copy_to_bytes(src.remaining()))
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Some(r))
    }
}
