//! Bytes that are not the method's protobuf message are the caller's mistake: tonic answers
//! them with `Internal` ("failed to decode Protobuf message: <message>.<field>: ..."), which
//! reads as a server fault. This layer, on every kvtier server, turns that answer into
//! `InvalidArgument` with the same text, which names the field.

use tonic::codegen::http::{HeaderValue, Response};

/// What tonic's decode refusal's `grpc-message` starts with (percent-encoded, as sent).
const DECODE_FAILURE: &[u8] = b"failed%20to%20decode%20Protobuf%20message";

/// The layer; see the module docs.
pub type MalformedIsInvalidArgument =
    tower::util::MapResponseLayer<fn(Response<tonic::body::Body>) -> Response<tonic::body::Body>>;

/// The layer every kvtier server carries.
pub fn layer() -> MalformedIsInvalidArgument {
    tower::util::MapResponseLayer::new(rewrite::<tonic::body::Body>)
}

/// Rewrites a trailers-only decode refusal (`grpc-status: 13` in the headers) to 3.
fn rewrite<B>(mut resp: Response<B>) -> Response<B> {
    let h = resp.headers();
    let decode_failure = h.get("grpc-status").is_some_and(|v| v.as_bytes() == b"13")
        && h.get("grpc-message")
            .is_some_and(|v| v.as_bytes().starts_with(DECODE_FAILURE));
    if decode_failure {
        resp.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("3"));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(status: &'static str, msg: &'static str) -> Response<()> {
        let mut r = Response::new(());
        r.headers_mut()
            .insert("grpc-status", HeaderValue::from_static(status));
        r.headers_mut()
            .insert("grpc-message", HeaderValue::from_static(msg));
        r
    }

    #[test]
    fn only_decode_refusals_change() {
        let code = |r: Response<()>| r.headers()["grpc-status"].as_bytes().to_vec();
        let decode = "failed%20to%20decode%20Protobuf%20message:%20LookupRequest.keys";
        assert_eq!(code(rewrite(resp("13", decode))), b"3");
        assert_eq!(code(rewrite(resp("13", "state%20lock%20poisoned"))), b"13");
        assert_eq!(code(rewrite(resp("5", decode))), b"5");
    }
}
