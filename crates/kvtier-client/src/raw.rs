//! Calls any gRPC method of a kvtier server with request bytes that are already encoded, and
//! returns the reply's bytes undecoded: for fuzzers (which send malformed messages no typed
//! client can build) and for looking at the wire.

use bytes::{Buf as _, BufMut as _, Bytes};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;

/// A codec that passes message bytes through unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// How a method takes and gives messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One request, one reply.
    Unary,
    /// One request, a stream of replies.
    ServerStream,
    /// A stream of requests, one reply.
    ClientStream,
    /// A stream of requests, a stream of replies.
    BidiStream,
}

/// Calls `path` (`/package.Service/Method`) on `channel` with `messages` (one for unary and
/// server-streaming methods, any number for client- and bidi-streaming ones). Returns the reply
/// messages, at most `max_replies` of a stream, or the call's status.
pub async fn call<T>(
    channel: T,
    path: &str,
    shape: Shape,
    messages: Vec<Bytes>,
    max_replies: usize,
) -> Result<Vec<Bytes>, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let path = PathAndQuery::try_from(path.to_string())
        .map_err(|e| Status::invalid_argument(format!("method path {path:?}: {e}")))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("connecting: {}", e.into())))?;
    match shape {
        Shape::Unary => {
            let one = messages.into_iter().next().unwrap_or_default();
            let r = grpc.unary(tonic::Request::new(one), path, RawCodec).await?;
            Ok(vec![r.into_inner()])
        }
        Shape::ServerStream => {
            let one = messages.into_iter().next().unwrap_or_default();
            let s = grpc
                .server_streaming(tonic::Request::new(one), path, RawCodec)
                .await?;
            first(s.into_inner(), max_replies).await
        }
        Shape::ClientStream => {
            let stream = tokio_stream::iter(messages);
            let r = grpc
                .client_streaming(tonic::Request::new(stream), path, RawCodec)
                .await?;
            Ok(vec![r.into_inner()])
        }
        Shape::BidiStream => {
            let stream = tokio_stream::iter(messages);
            let s = grpc
                .streaming(tonic::Request::new(stream), path, RawCodec)
                .await?;
            first(s.into_inner(), max_replies).await
        }
    }
}

/// The first `max` messages of a reply stream (fewer if it ends first).
async fn first(mut s: tonic::Streaming<Bytes>, max: usize) -> Result<Vec<Bytes>, Status> {
    let mut out = Vec::new();
    while out.len() < max {
        match s.message().await? {
            Some(m) => out.push(m),
            None => break,
        }
    }
    Ok(out)
}
