//! Lets stock gRPC clients reach the SGLang socket: a relay in front of tonic that rewrites
//! each request's HTTP/2 `:authority` when it is not one HTTP accepts.
//!
//! Over a Unix socket, gRPC's C core (grpcio, so SGLang's Python client) sends the socket
//! path, percent-encoded, as `:authority` (`tmp%2Fkvtierd%2Fsglang-grpc.sock`). The `h2`
//! crate under tonic validates `:authority` as a URI authority, rejects that one and resets
//! the stream (`PROTOCOL_ERROR`) before any service sees it — every call fails. The server
//! has no use for the authority, so each connection goes through this relay: frames from
//! the client are copied to tonic over an in-process pipe, except header blocks, which are
//! decoded (HPACK, with the client's dynamic table), given `:authority: localhost` when
//! theirs is invalid, and encoded again (with a table of the relay's own, which h2's decoder
//! follows). Padding and priority fields of HEADERS frames are dropped (priority is
//! advisory). Frames from tonic go back unchanged.
//!
//! The relay also binds each connection to its peer, which SGLang's protocol has no field
//! for: every request's header block gets [`UID_HEADER`] with the peer's `SO_PEERCRED` uid
//! (read at accept) and, while tenancy is on (`[tenants]`), [`TENANT_HEADER`] with its
//! tenant; any such header the client sent is dropped, so no client can claim another's. The
//! storage service scopes object ids by the tenant and lets a transfer name only its own
//! uid's pools.
//!
//! Either direction ending ends both: a client that aborts mid-preface or breaks the framing
//! has its connection and tonic's side closed at once (no descriptor outlives it), and one
//! that stays silent is closed after `server.connections.handshake_timeout`.
//!
//! The payloads are small here — a transfer names offsets; the bytes move through the
//! registered memfd — so the extra copy costs little. A peer that breaks the framing loses
//! its connection, nothing else.

use std::io;

use std::sync::Arc;

use kvtier_config::tenants::Tenants;
use kvtier_server::peers::GatedListener;
use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;

use kvtier_server::tasks::Tasks;

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// HTTP/2's default SETTINGS_MAX_FRAME_SIZE, which the SGLang server keeps.
const MAX_FRAME: usize = 16 * 1024;
/// HTTP/2's default SETTINGS_HEADER_TABLE_SIZE, which the SGLang server keeps.
const TABLE: usize = 4096;
/// Largest header block accepted (h2's default header-list limit is 16 KiB).
const MAX_BLOCK: usize = 256 * 1024;
/// Buffer of the in-process pipe per direction.
const PIPE: usize = 256 * 1024;

fn bad(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// The request header naming the connection's tenant, set by the relay only.
pub(crate) const TENANT_HEADER: &str = "kvtier-peer-tenant";
/// The request header naming the connection's peer uid, set by the relay only.
pub(crate) const UID_HEADER: &str = "kvtier-peer-uid";

/// Who is at the other end of a relayed connection, read at accept.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// Its uid (`SO_PEERCRED`).
    pub(crate) uid: u32,
    /// Its tenant, while tenancy is on.
    pub(crate) tenant: Option<String>,
}

/// Drops any peer header the client sent and adds the relay's own to a request's header
/// block (one with `:path`; trailers get none): the uid always, the tenant while tenancy
/// is on.
pub(crate) fn bind_peer(headers: &mut Vec<(Vec<u8>, Vec<u8>)>, peer: &Peer) {
    headers.retain(|(n, _)| {
        !n.eq_ignore_ascii_case(TENANT_HEADER.as_bytes())
            && !n.eq_ignore_ascii_case(UID_HEADER.as_bytes())
    });
    if !headers.iter().any(|(n, _)| n.as_slice() == b":path") {
        return;
    }
    headers.push((
        UID_HEADER.as_bytes().to_vec(),
        peer.uid.to_string().into_bytes(),
    ));
    if let Some(t) = &peer.tenant {
        headers.push((TENANT_HEADER.as_bytes().to_vec(), t.as_bytes().to_vec()));
    }
}

/// The doors-table role of a relayed call, from the headers only the relay sets: a named
/// tenant's engine, or the default tenant's. (The relay adds its headers to every request;
/// one without them did not come through it, and is no one's.)
pub fn who(headers: &tonic::codegen::http::HeaderMap) -> kvtier_server::doors::Who {
    use kvtier_server::doors::Who;
    if headers.get(UID_HEADER).is_none() {
        return Who::Unauthenticated;
    }
    match headers.get(TENANT_HEADER) {
        Some(t) if !t.is_empty() => Who::Tenant,
        _ => Who::DefaultTenant,
    }
}

/// Whether HTTP would take `v` as an authority.
fn valid_authority(v: &[u8]) -> bool {
    tonic::codegen::http::uri::Authority::try_from(v).is_ok()
}

/// Rewrites one decoded header list; true when `:authority` was replaced.
pub(crate) fn fix_authority(headers: &mut [(Vec<u8>, Vec<u8>)]) -> bool {
    let mut fixed = false;
    for (name, value) in headers.iter_mut() {
        if name.as_slice() == b":authority" && !valid_authority(value) {
            *value = b"localhost".to_vec();
            fixed = true;
        }
    }
    fixed
}

/// Relays the client → server direction, header blocks rewritten.
async fn client_to_server<R, W>(mut from: R, mut to: W, peer: Peer) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    if &preface != PREFACE {
        // Not HTTP/2 with prior knowledge: let h2 answer it as it does.
        tokio::io::copy(&mut from, &mut to).await?;
        return to.shutdown().await;
    }
    let mut decoder = Decoder::new();
    decoder.set_max_allowed_table_size(TABLE);
    let mut encoder = Encoder::new();
    let mut head = [0u8; 9];
    loop {
        match from.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return to.shutdown().await,
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = [head[5], head[6], head[7], head[8]];
        match kind {
            HEADERS => {
                if len > MAX_BLOCK {
                    return Err(bad("a HEADERS frame over 256 KiB"));
                }
                let mut payload = vec![0u8; len];
                from.read_exact(&mut payload).await?;
                let mut block = header_fragment(&payload, flags)?.to_vec();
                let mut done = flags & END_HEADERS != 0;
                while !done {
                    from.read_exact(&mut head).await?;
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    if head[3] != CONTINUATION || head[5..9] != stream {
                        return Err(bad("a header block broken by another frame"));
                    }
                    if block.len() + len > MAX_BLOCK {
                        return Err(bad("a header block over 256 KiB"));
                    }
                    let at = block.len();
                    block.resize(at + len, 0);
                    from.read_exact(&mut block[at..]).await?;
                    done = head[4] & END_HEADERS != 0;
                }
                let mut headers = decoder
                    .decode(&block)
                    .map_err(|e| bad(format!("header block: {e:?}")))?;
                if fix_authority(&mut headers) {
                    tracing::trace!("sglang grpc: :authority rewritten to localhost");
                }
                bind_peer(&mut headers, &peer);
                let out = encoder.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
                write_block(&mut to, &out, flags & END_STREAM, stream).await?;
            }
            CONTINUATION => return Err(bad("a CONTINUATION frame without HEADERS")),
            _ => {
                to.write_all(&head).await?;
                let mut rest = (&mut from).take(len as u64);
                let copied = tokio::io::copy(&mut rest, &mut to).await?;
                if copied != len as u64 {
                    return Err(bad("the connection ended inside a frame"));
                }
            }
        }
    }
}

/// The header block fragment of a HEADERS payload (padding and priority removed).
fn header_fragment(payload: &[u8], flags: u8) -> io::Result<&[u8]> {
    let mut p = payload;
    let mut pad = 0usize;
    if flags & PADDED != 0 {
        let (&n, rest) = p.split_first().ok_or_else(|| bad("empty padded HEADERS"))?;
        pad = n as usize;
        p = rest;
    }
    if flags & PRIORITY != 0 {
        p = p
            .get(5..)
            .ok_or_else(|| bad("HEADERS too short for its priority"))?;
    }
    let keep = p
        .len()
        .checked_sub(pad)
        .ok_or_else(|| bad("HEADERS padding longer than the frame"))?;
    Ok(&p[..keep])
}

/// Writes `block` as a HEADERS frame and as many CONTINUATION frames as it needs.
async fn write_block<W: AsyncWrite + Unpin>(
    to: &mut W,
    block: &[u8],
    end_stream: u8,
    stream: [u8; 4],
) -> io::Result<()> {
    let mut chunks = block.chunks(MAX_FRAME).peekable();
    let mut kind = HEADERS;
    let mut flags = end_stream;
    if chunks.peek().is_none() {
        // An empty block is still one HEADERS frame.
        return to
            .write_all(&frame_head(0, HEADERS, end_stream | END_HEADERS, stream))
            .await;
    }
    while let Some(chunk) = chunks.next() {
        if chunks.peek().is_none() {
            flags |= END_HEADERS;
        }
        to.write_all(&frame_head(chunk.len(), kind, flags, stream))
            .await?;
        to.write_all(chunk).await?;
        kind = CONTINUATION;
        flags = 0;
    }
    Ok(())
}

fn frame_head(len: usize, kind: u8, flags: u8, stream: [u8; 4]) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    [
        l[1], l[2], l[3], kind, flags, stream[0], stream[1], stream[2], stream[3],
    ]
}

/// Accepts connections on `listener` until `tasks`' shutdown; each is relayed (a task on `tasks`) to the returned
/// receiver's pipe end (hand it to tonic's `serve_with_incoming_shutdown`), bound to its
/// peer's uid and (while `tenants` names any) tenant.
pub fn incoming(
    listener: GatedListener,
    tasks: &Tasks,
    tenants: Arc<Tenants>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<DuplexStream>> {
    let (tx, rx) = mpsc::channel(64);
    let (stop, relays) = (tasks.shutdown.clone(), tasks.clone());
    tasks.spawn(async move {
        loop {
            let (client, permit) = tokio::select! {
                () = stop.cancelled() => return,
                a = listener.accept() => a,
            };
            let peer = match client.peer_cred() {
                Ok(c) => Peer {
                    uid: c.uid(),
                    tenant: tenants
                        .any()
                        .then(|| tenants.of_peer(c.uid(), c.gid()).to_string()),
                },
                Err(e) => {
                    tracing::warn!("sglang grpc: no peer credentials, connection closed: {e}");
                    continue;
                }
            };
            // Closed if it has not sent its preface within the handshake timeout.
            let client = listener.cap().limit(client, permit);
            let (ours, theirs) = tokio::io::duplex(PIPE);
            if tx.send(Ok(theirs)).await.is_err() {
                return;
            }
            relays.spawn(relay(client, ours, peer));
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Relays one connection both ways until either side ends, then closes both.
async fn relay<C>(client: C, ours: DuplexStream, peer: Peer)
where
    C: AsyncRead + AsyncWrite + Send + 'static,
{
    let (cr, mut cw) = tokio::io::split(client);
    let (mut sr, sw) = tokio::io::split(ours);
    // Responses flow until tonic closes its end (which it does when the client goes, or
    // after its graceful drain at shutdown) ...
    // scoped: the relay (a tracked task) waits for it or aborts it.
    let mut down = tokio::spawn(async move {
        tokio::io::copy(&mut sr, &mut cw).await?;
        cw.shutdown().await
    });
    // ... and requests until the client stops sending or tonic has closed.
    tokio::select! {
        r = client_to_server(cr, sw, peer) => {
            if let Err(e) = r {
                // The client broke off: nothing more will be answered. Dropping the response
                // side closes the client's descriptor and tonic's end of the pipe.
                tracing::debug!("sglang grpc connection ended: {e}");
                down.abort();
            }
        }
        _ = &mut down => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anyone() -> Peer {
        Peer {
            uid: 0,
            tenant: None,
        }
    }

    #[test]
    fn the_relay_names_the_peer_and_drops_a_claimed_one() {
        let req = || {
            vec![
                (b":path".to_vec(), b"/x/Exist".to_vec()),
                (b"Kvtier-Peer-Tenant".to_vec(), b"acme".to_vec()),
                (b"KVTIER-PEER-UID".to_vec(), b"0".to_vec()),
            ]
        };
        let peer = |tenant: Option<&str>| Peer {
            uid: 1001,
            tenant: tenant.map(String::from),
        };
        let mut h = req();
        bind_peer(&mut h, &peer(Some("globex")));
        assert_eq!(
            h[1..],
            [
                (b"kvtier-peer-uid".to_vec(), b"1001".to_vec()),
                (b"kvtier-peer-tenant".to_vec(), b"globex".to_vec())
            ]
        );
        let mut h = req();
        bind_peer(&mut h, &peer(Some("")));
        assert_eq!(h[2..], [(b"kvtier-peer-tenant".to_vec(), b"".to_vec())]);
        let mut h = req();
        bind_peer(&mut h, &peer(None));
        assert_eq!(
            h[1..],
            [(b"kvtier-peer-uid".to_vec(), b"1001".to_vec())],
            "a claimed tenant and uid are dropped even with tenancy off"
        );
        let mut trailers = vec![(b"grpc-status".to_vec(), b"0".to_vec())];
        bind_peer(&mut trailers, &peer(Some("globex")));
        assert_eq!(trailers.len(), 1);
    }

    #[test]
    fn only_an_invalid_authority_is_replaced() {
        let mut h = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (
                b":authority".to_vec(),
                b"tmp%2Fx%2Fsglang-grpc.sock".to_vec(),
            ),
            (
                b":path".to_vec(),
                b"/sglang.runtime.hicache.StorageServer/Exist".to_vec(),
            ),
        ];
        assert!(fix_authority(&mut h));
        assert_eq!(h[1].1, b"localhost");
        assert_eq!(h[2].1, b"/sglang.runtime.hicache.StorageServer/Exist");
        let mut ok = vec![(b":authority".to_vec(), b"localhost:50051".to_vec())];
        assert!(!fix_authority(&mut ok));
        assert_eq!(ok[0].1, b"localhost:50051");
    }

    #[test]
    fn padding_and_priority_are_stripped_from_the_fragment() {
        // PADDED | PRIORITY: pad length 2, 5 bytes of priority, fragment "abc", 2 pad bytes.
        let p = [2u8, 0, 0, 0, 1, 16, b'a', b'b', b'c', 0, 0];
        assert_eq!(header_fragment(&p, PADDED | PRIORITY).unwrap(), b"abc");
        assert!(header_fragment(&[9u8, 1, 2], PADDED).is_err());
        assert!(header_fragment(&[1u8, 2], PRIORITY).is_err());
    }

    /// A whole exchange through the relay: a header block split over CONTINUATION frames,
    /// with an invalid authority, comes out as one block that decodes to the same headers
    /// but a valid authority; other frames pass byte for byte.
    #[tokio::test]
    async fn header_blocks_are_rewritten_and_other_frames_pass_unchanged() {
        let mut enc = Encoder::new();
        let long = vec![b'v'; 20_000];
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":authority", b"tmp%2Fsock"),
            (b"x-long", &long),
        ];
        let block = enc.encode(headers.clone());
        let mut input = PREFACE.to_vec();
        let sid = [0, 0, 0, 1];
        let (a, b) = block.split_at(10);
        input.extend_from_slice(&frame_head(a.len(), HEADERS, END_STREAM, sid));
        input.extend_from_slice(a);
        input.extend_from_slice(&frame_head(b.len(), CONTINUATION, END_HEADERS, sid));
        input.extend_from_slice(b);
        let data = frame_head(3, 0x0, 0, sid);
        input.extend_from_slice(&data);
        input.extend_from_slice(b"xyz");

        let mut out = Vec::new();
        client_to_server(&input[..], &mut out, anyone())
            .await
            .unwrap();
        assert_eq!(&out[..24], PREFACE);
        let mut rest = &out[24..];
        let mut block = Vec::new();
        let mut first = true;
        loop {
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            assert!(len <= MAX_FRAME);
            assert_eq!(rest[3], if first { HEADERS } else { CONTINUATION });
            if first {
                assert_eq!(rest[4] & END_STREAM, END_STREAM);
            }
            block.extend_from_slice(&rest[9..9 + len]);
            let end = rest[4] & END_HEADERS != 0;
            rest = &rest[9 + len..];
            first = false;
            if end {
                break;
            }
        }
        let got = Decoder::new().decode(&block).unwrap();
        assert_eq!(got[0], (b":method".to_vec(), b"POST".to_vec()));
        assert_eq!(got[1], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(got[2], (b"x-long".to_vec(), long));
        assert_eq!(rest, [&data[..], b"xyz"].concat());
    }

    #[tokio::test]
    async fn broken_framing_ends_the_connection_with_an_error() {
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(&frame_head(1, CONTINUATION, END_HEADERS, [0, 0, 0, 1]));
        input.push(0);
        let mut out = Vec::new();
        assert!(
            client_to_server(&input[..], &mut out, anyone())
                .await
                .is_err()
        );
        // A header block that does not decode.
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(&frame_head(1, HEADERS, END_HEADERS, [0, 0, 0, 1]));
        input.push(0xff);
        assert!(
            client_to_server(&input[..], &mut Vec::new(), anyone())
                .await
                .is_err()
        );
        // A HEADERS frame claiming 16 MiB is refused before anything is allocated for it.
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(&frame_head(
            (1 << 24) - 1,
            HEADERS,
            END_HEADERS,
            [0, 0, 0, 1],
        ));
        assert!(
            client_to_server(&input[..], &mut Vec::new(), anyone())
                .await
                .is_err()
        );
    }
}
