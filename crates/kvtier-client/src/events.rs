//! kvtierd's `WatchEvents` stream, read straight into domain events (`kvtier_core::events`)
//! by `kvtier_proto::events`, which owns the messages' encoding: no generated message is
//! built per event.

use bytes::Buf;
use kvtier_proto::v1;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Request, Status};

pub use kvtier_proto::events::EventBatch;

use crate::{AuthChannel, ClientError};

/// The call, by path.
const WATCH_EVENTS: &str = "/kvtier.v1.HostTier/WatchEvents";

/// The events of one `WatchEvents` call ([`crate::HostClient::watch_events`]).
pub struct EventStream(tonic::Streaming<Result<EventBatch, String>>);

impl EventStream {
    /// The next batch; `None` when kvtierd ended the stream. A malformed event is an error
    /// naming its field.
    pub async fn next(&mut self) -> Result<Option<EventBatch>, ClientError> {
        match self.0.message().await? {
            None => Ok(None),
            Some(Ok(b)) => Ok(Some(b)),
            Some(Err(why)) => Err(ClientError::Protocol(why)),
        }
    }
}

/// Calls WatchEvents on `channel`.
pub(crate) async fn watch(
    channel: AuthChannel,
    max_message: usize,
    request: v1::WatchEventsRequest,
) -> Result<EventStream, ClientError> {
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(max_message);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("kvtierd is not ready: {e}")))?;
    let mut req = Request::new(request);
    req.extensions_mut()
        .insert(tonic::GrpcMethod::new("kvtier.v1.HostTier", "WatchEvents"));
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(WATCH_EVENTS);
    let stream = grpc.server_streaming(req, path, Events).await?.into_inner();
    Ok(EventStream(stream))
}

/// WatchEvents' codec: the request encoded by prost, messages decoded into domain events.
struct Events;

impl Codec for Events {
    type Encode = v1::WatchEventsRequest;
    type Decode = Result<EventBatch, String>;
    type Encoder = WatchRequest;
    type Decoder = Batches;

    fn encoder(&mut self) -> WatchRequest {
        WatchRequest
    }

    fn decoder(&mut self) -> Batches {
        Batches
    }
}

struct WatchRequest;

impl Encoder for WatchRequest {
    type Item = v1::WatchEventsRequest;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

struct Batches;

impl Decoder for Batches {
    type Item = Result<EventBatch, String>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        // A message arrives whole, usually in one chunk: decoded in place, else copied once.
        let n = src.remaining();
        let batch = if src.chunk().len() == n {
            let b = kvtier_proto::events::decode_batch(src.chunk());
            src.advance(n);
            b
        } else {
            kvtier_proto::events::decode_batch(&src.copy_to_bytes(n))
        };
        Ok(Some(batch))
    }
}
